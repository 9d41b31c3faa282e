"""The vision families (issue #43): ViT, DeiT, BEiT (a stack of same-width blocks, like BERT) and Swin, ConvNeXt,
ResNet (stages of blocks whose width and resolution change from one stage to the next).

ViT-like models keep their blocks in `layers` with `attention.q_proj/k_proj/v_proj/o_proj`, `mlp.fc1/fc2` and
`layernorm_before/after` (transformers 5); hidden states are (B, 1 [+1 distillation token] + patches, D), so every
hidden-state, attention and relation term, layer map and projection works on them, and students are built by depth
and width as for BERT. BEiT adds a learned relative position bias to its scores (not rebuilt from Q and K: its
attention-score term is refused, relations work) and per-block layer-scale vectors (width pruning refused).

Stage models: `layers` are the stages, so hidden state i is stage i's output, as `output_hidden_states` returns it
(Swin's after its patch merging; ConvNeXt's and ResNet's (B, C, H, W) maps read as (B, H*W, C) positions). A
hidden-state term compares a student stage with a teacher stage of the same width and resolution (`stage_width`
says each width; projections do not apply across stage widths). Swin's windowed, shifted attention is not a (T, T)
score matrix of the stage, and CNNs have none: their Q/K/V terms are refused. Their blocks are grouped by stage, so
students are built with the config's `depths` (a smaller model of the family) rather than by copying blocks.
"""

from __future__ import annotations

from typing import Any

from .families import register_family

_VIT = dict(
    embeddings=("embeddings",),
    query="attention.q_proj",
    key="attention.k_proj",
    value="attention.v_proj",
    attention_output="attention.o_proj",
    mlp_input=("mlp.fc1",),
    mlp_output="mlp.fc2",
    norms=("layernorm_before", "layernorm_after"),
)
for _model_type in ("vit", "deit"):
    register_family(_model_type, "layers", **_VIT)
register_family(
    "beit", "layers", **_VIT, score_bias=True,
    refuse_width="its blocks scale their outputs by layer-scale vectors (lambda_1, lambda_2) and its relative position "
    "bias tables are per head, which prune_width does not slice. Use students.prune_depth, from_teacher or shrink.",
)

_STAGES = (
    "its blocks are grouped in stages whose width and resolution change, so blocks cannot be kept or dropped across "
    "them. Build a smaller model of the family from its config instead (fewer `depths` per stage, narrower "
    "`hidden_sizes`/`embed_dim`), e.g. type(teacher.config)(**{**teacher.config.to_dict(), 'depths': [...]}), and "
    "distil it from the teacher's logits and stage features."
)
register_family(
    "swin", "encoder.layers", embeddings=("embeddings",), num_layers_field="depths", refuse_pruning=_STAGES,
    refuse_width=_STAGES,
    refuse_attention="Swin attends within shifted windows block by block, so a stage has no (T, T) attention map.",
)
for _model_type, _embeddings in (("convnext", ("embeddings",)), ("resnet", ("embedder",))):
    register_family(
        _model_type, "encoder.stages", embeddings=_embeddings, num_layers_field="depths", channels_first=True,
        refuse_pruning=_STAGES, refuse_width=_STAGES,
        refuse_attention="a convolutional network has no attention and no Q/K/V.",
    )

STAGE_MODELS = ("swin", "convnext", "resnet")


def stage_width(config: Any, index: int) -> int | None:
    """The width of hidden state `index` (0: the embeddings, i: stage i) of a stage model, None for other models."""
    model_type = getattr(config, "model_type", None)
    if model_type == "swin":
        stages = len(config.depths)
        return int(config.embed_dim * 2 ** min(index, stages - 1))
    if model_type in ("convnext", "resnet"):
        if index == 0:
            return int(config.hidden_sizes[0] if model_type == "convnext" else config.embedding_size)
        return int(config.hidden_sizes[index - 1])
    return None


def check_stage_pairs(student: Any, teacher: Any, pairs: list[tuple[int, int]], what: str) -> None:
    """Refuse a hidden-state pair of stage models whose widths differ (a projection maps one width for all pairs)."""
    for s, t in pairs:
        ws, wt = stage_width(student, s), stage_width(teacher, t)
        if (ws is not None or wt is not None) and ws != wt:
            raise ValueError(
                f"{what}: student hidden state {s} is {ws} wide and teacher hidden state {t} {wt}: stage features are "
                "compared at equal widths (no projection across stages). Pair stages of equal width (layers=...), or "
                "give the student the teacher's stage widths (hidden_sizes / embed_dim)."
            )


__all__ = ["STAGE_MODELS", "check_stage_pairs", "stage_width"]
