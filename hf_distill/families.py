"""The architecture registry: where each model family keeps its blocks, embeddings and Q/K/V.

One entry per `config.model_type` serves both the feature taps (hooks on the embedding output, block
outputs and Q/K/V projections) and the student builders (which layers to copy, which config fields hold
the sizes). Paths are dotted, relative to `model.base_model` for `layers`/`embeddings` and to one block for
`query`/`key`/`value`, so one entry covers the base model and every task head. Another family takes one call:

    from hf_distill.families import register_family
    register_family("my-encoder", layers="blocks", embeddings=("embed",), query="attn.q", key="attn.k",
                    value="attn.v", num_layers_field="n_layer", hidden_size_field="d_model",
                    num_heads_field="n_head", intermediate_size_field="d_ff")
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Config lists with one entry per layer (transformers 5): they must shrink with the layer stack.
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types")


@dataclass(frozen=True)
class Family:
    """Where an architecture keeps things, and what its config calls the sizes.

    `embeddings` lists candidate modules whose output is `hidden_states[0]`; the first that exists wins
    (ELECTRA projects narrow embeddings up with `embeddings_project`). `follows_hidden_size` names config
    fields that `students.shrink` moves with the hidden size when the teacher had them equal to it.
    """

    layers: str
    embeddings: tuple[str, ...] = ("embeddings",)
    query: str = "attention.self.query"
    key: str = "attention.self.key"
    value: str = "attention.self.value"
    num_layers_field: str = "num_hidden_layers"
    hidden_size_field: str = "hidden_size"
    num_heads_field: str = "num_attention_heads"
    intermediate_size_field: str = "intermediate_size"
    per_layer_fields: tuple[str, ...] = PER_LAYER_FIELDS
    follows_hidden_size: tuple[str, ...] = ()


FAMILIES: dict[str, Family] = {}

REGISTER_HINT = (
    "Register the family with hf_distill.families.register_family(model_type, layers=..., embeddings=(...,), "
    "query=..., key=..., value=...), giving paths relative to model.base_model (see that module's docstring)."
)


def register_family(model_type: str, layers: str, *, overwrite: bool = False, **spec: Any) -> Family:
    """Add `model_type` to the registry. Re-registering an identical entry is a no-op; changing an
    existing one needs `overwrite=True`, so a typo cannot silently break a built-in family."""
    known = {f.name for f in fields(Family)} - {"layers"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"register_family: unknown field(s) {unknown}. Known: {', '.join(sorted(known))}.")
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    family = Family(layers=layers, **spec)
    existing = FAMILIES.get(model_type)
    if existing is not None and existing != family and not overwrite:
        raise ValueError(
            f"model_type {model_type!r} is already registered as {existing}; "
            "pass overwrite=True to register_family to replace it."
        )
    FAMILIES[model_type] = family
    return family


def get_family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type) if model_type else None


for _model_type in ("bert", "roberta", "xlm-roberta", "camembert"):
    register_family(_model_type, "encoder.layer")
register_family(
    "electra", "encoder.layer", embeddings=("embeddings_project", "embeddings"), follows_hidden_size=("embedding_size",)
)
register_family(
    "distilbert",
    "transformer.layer",
    query="attention.q_lin",
    key="attention.k_lin",
    value="attention.v_lin",
    num_layers_field="n_layers",
    hidden_size_field="dim",
    num_heads_field="n_heads",
    intermediate_size_field="hidden_dim",
)
