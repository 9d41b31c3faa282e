"""The architecture registry: where each model family keeps its blocks, embeddings and Q/K/V.

One entry per `config.model_type` serves both the feature taps (hooks on the embedding output, block
outputs and Q/K/V projections) and the student builders (which layers to copy, which config fields hold
the sizes). Paths are dotted, relative to `model.base_model` for `layers`/`embeddings`/`rotary`/`final_norm` and
to one block for `query`/`key`/`value`/`qkv`, so one entry covers the base model and every task head.
Another family takes one call:

    from hf_distill.features.families import register_family
    register_family("my-encoder", layers="blocks", embeddings=("embed",), query="attn.q", key="attn.k",
                    value="attn.v", num_layers_field="n_layer", hidden_size_field="d_model",
                    num_heads_field="n_head", intermediate_size_field="d_ff")

A decoder with a fused Q|K|V projection, grouped-query attention and rotary positions:

    register_family("my-decoder", layers="layers", embeddings=("embed_tokens",), qkv="self_attn.Wqkv",
                    num_kv_heads_field="num_key_value_heads", head_dim_field="head_dim", rotary="rotary_emb",
                    final_norm="norm", causal=True)

An encoder-decoder model registers each stack (terms name one with `stack=encoder|decoder`):

    register_encoder_decoder("my-seq2seq", encoder={"layers": "encoder.layers", "num_layers_field": "encoder_layers"},
                             decoder={"layers": "decoder.layers", "num_layers_field": "decoder_layers"},
                             query="self_attn.q_proj", key="self_attn.k_proj", value="self_attn.v_proj",
                             hidden_size_field="d_model", embeddings=(), embeddings_from_block_input=True)
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
    # Decoders. `qkv`: one fused projection whose output is Q|K|V concatenated (GPT-2 `c_attn`, Phi-3
    # `qkv_proj`), split into num_heads*head_dim, num_kv_heads*head_dim, num_kv_heads*head_dim; when set,
    # `query`/`key`/`value` are ignored. `rotary`: the module (relative to model.base_model) whose output is
    # the rotary (cos, sin) applied to Q and K after the projections. `final_norm`: the module whose output is
    # the last entry of `output_hidden_states` (transformers 5 returns it after the final norm). `causal`: a
    # query never attends to a later key, so attention/relation terms mask future keys.
    qkv: str | None = None
    num_kv_heads_field: str | None = None
    head_dim_field: str | None = None
    # The config field holding the attention's total width (all heads) when it is not the hidden size:
    # MobileBERT's `true_hidden_size`, the bottleneck width its Q/K/V project to.
    attention_size_field: str | None = None
    rotary: str | None = None
    final_norm: str | None = None
    causal: bool = False
    # Encoder-decoder models. `stacks`: ("encoder", Family), ("decoder", Family), each with its own block list, Q/K/V
    # paths (self-attention only) and config fields, paths relative to model.base_model; a distill term names its
    # stack (`stack=encoder|decoder`). The entry's own fields describe its encoder (see register_encoder_decoder).
    # `embeddings_from_block_input`: hidden_states[0] is the first block's input (read with a forward pre-hook),
    # because the stack scales, normalises or drops out its embeddings in its own forward, outside any module
    # whose output would be that tensor. `first_block_only`: parameters (paths relative to a block) that only the
    # first block holds and the whole stack uses (T5's relative position bias): a student copied from other blocks
    # takes them from the teacher's first block. `score_bias`: the attention adds a bias that Q and K do not carry
    # and does not scale by 1/sqrt(head_dim) (T5), so its pre-softmax scores cannot be rebuilt from Q and K.
    stacks: tuple[tuple[str, Family], ...] = ()
    embeddings_from_block_input: bool = False
    first_block_only: tuple[str, ...] = ()
    score_bias: bool = False

    def stack(self, name: str) -> Family | None:
        """The family of one stack of an encoder-decoder model (None when it has no such stack)."""
        return dict(self.stacks).get(name)


STACKS = ("encoder", "decoder")
"""The stacks of an encoder-decoder model a distill term can name."""

FAMILIES: dict[str, Family] = {}

REGISTER_HINT = (
    "Register the family with hf_distill.features.families.register_family(model_type, layers=..., embeddings=(...,), "
    "query=..., key=..., value=...) (or qkv=... for a fused projection), giving paths relative to "
    "model.base_model (see that module's docstring)."
)


def register_family(model_type: str, layers: str, *, overwrite: bool = False, **spec: Any) -> Family:
    """Add `model_type` to the registry. Re-registering an identical entry is a no-op; changing an
    existing one needs `overwrite=True`, so a typo cannot silently break a built-in family."""
    known = {f.name for f in fields(Family)} - {"layers"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"register_family: unknown field(s) {unknown}. Known: {', '.join(sorted(known))}.")
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    if isinstance(spec.get("stacks"), dict):
        spec["stacks"] = tuple(spec["stacks"].items())
    bad = [name for name, _ in spec.get("stacks", ()) if name not in STACKS]
    if bad:
        raise ValueError(f"register_family: unknown stack(s) {bad}. Known: {', '.join(STACKS)}.")
    family = Family(layers=layers, **spec)
    existing = FAMILIES.get(model_type)
    if existing is not None and existing != family and not overwrite:
        raise ValueError(
            f"model_type {model_type!r} is already registered as {existing}; "
            "pass overwrite=True to register_family to replace it."
        )
    FAMILIES[model_type] = family
    return family


def register_encoder_decoder(
    model_type: str, encoder: dict[str, Any], decoder: dict[str, Any], *, overwrite: bool = False, **common: Any
) -> Family:
    """Add an encoder-decoder family: `encoder` and `decoder` are the `register_family` fields of each stack (its
    `layers`, config fields, ...), `common` the fields both share (Q/K/V paths, hidden size field). The decoder
    stack is causal. The entry itself describes the encoder, so code that knows one stack only sees that one."""
    stacks = {
        "encoder": Family(**{**common, **encoder}),
        "decoder": Family(**{"causal": True, **common, **decoder}),
    }
    return register_family(model_type, overwrite=overwrite, stacks=stacks, **{**common, **encoder})


def get_family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type) if model_type else None


for _model_type in ("bert", "roberta", "xlm-roberta", "camembert"):
    register_family(_model_type, "encoder.layer")
register_family(
    "electra", "encoder.layer", embeddings=("embeddings_project", "embeddings"), follows_hidden_size=("embedding_size",)
)
# MobileBERT (Sun et al. 2020): blocks and hidden states at the inter-block width (`hidden_size`); Q and K read
# the block's bottleneck, V its input, and all three project to the bottleneck width `true_hidden_size`.
register_family("mobilebert", "encoder.layer", attention_size_field="true_hidden_size")
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

# Decoder-only causal LMs (transformers 5 layout: model.layers, model.embed_tokens, model.norm, model.rotary_emb).
# The embedding module's output is hidden_states[0] (Gemma's sqrt(hidden) scaling lives inside its
# `embed_tokens` in transformers 5); the last hidden state is the final norm's output, as `output_hidden_states`.
_DECODER = {
    "embeddings": ("embed_tokens",),
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "num_kv_heads_field": "num_key_value_heads",
    "head_dim_field": "head_dim",
    "rotary": "rotary_emb",
    "final_norm": "norm",
    "causal": True,
}
for _model_type in ("llama", "mistral", "qwen2", "gemma", "gemma2"):
    register_family(_model_type, "layers", **_DECODER)
# Qwen3 normalises Q and K per head (q_norm/k_norm) before the rotary embedding: those are its real Q and K.
register_family("qwen3", "layers", **{**_DECODER, "query": "self_attn.q_norm", "key": "self_attn.k_norm"})
register_family("phi3", "layers", **{**_DECODER, "qkv": "self_attn.qkv_proj"})
# GPT-2: learned absolute positions (no rotary), added in the model forward: hidden_states[0] is `drop`'s output.
register_family(
    "gpt2",
    "h",
    embeddings=("drop",),
    qkv="attn.c_attn",
    num_layers_field="n_layer",
    hidden_size_field="n_embd",
    num_heads_field="n_head",
    intermediate_size_field="n_inner",
    final_norm="ln_f",
    causal=True,
)

# Encoder-decoder models (T5, mT5; BART, mBART, Marian, Pegasus). Each stack applies dropout (T5) or a scale, a norm
# and dropout (BART-like) to its embeddings inside its own forward, so hidden_states[0] is read at the first block's
# input; the last entry is the stack's final norm where it has one (T5 `final_layer_norm`, mBART/Pegasus
# `layer_norm`). Only self-attention is tapped: cross-attention Q/K/V are not features a term can name.
_T5 = {
    "query": "layer.0.SelfAttention.q",
    "key": "layer.0.SelfAttention.k",
    "value": "layer.0.SelfAttention.v",
    "hidden_size_field": "d_model",
    "num_heads_field": "num_heads",
    "intermediate_size_field": "d_ff",
    "head_dim_field": "d_kv",
    "embeddings": (),
    "embeddings_from_block_input": True,
    "first_block_only": ("layer.0.SelfAttention.relative_attention_bias.weight",),
    "score_bias": True,
}
for _model_type in ("t5", "mt5"):
    register_encoder_decoder(
        _model_type,
        encoder={"layers": "encoder.block", "num_layers_field": "num_layers", "final_norm": "encoder.final_layer_norm"},
        decoder={
            "layers": "decoder.block",
            "num_layers_field": "num_decoder_layers",
            "final_norm": "decoder.final_layer_norm",
        },
        **_T5,
    )
_BART = {
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "hidden_size_field": "d_model",
    "embeddings": (),
    "embeddings_from_block_input": True,
}
for _model_type, _norm in (("bart", None), ("marian", None), ("mbart", "layer_norm"), ("pegasus", "layer_norm")):
    register_encoder_decoder(
        _model_type,
        encoder={
            "layers": "encoder.layers",
            "num_layers_field": "encoder_layers",
            "num_heads_field": "encoder_attention_heads",
            "intermediate_size_field": "encoder_ffn_dim",
            "final_norm": f"encoder.{_norm}" if _norm else None,
        },
        decoder={
            "layers": "decoder.layers",
            "num_layers_field": "decoder_layers",
            "num_heads_field": "decoder_attention_heads",
            "intermediate_size_field": "decoder_ffn_dim",
            "final_norm": f"decoder.{_norm}" if _norm else None,
        },
        **_BART,
    )
