"""MobileBERT's progressive knowledge transfer as stages of one Trainer run.

Sun et al. 2020, "MobileBERT: a Compact Task-Agnostic BERT for Resource-Limited Devices" (§3.3-3.5): a
student as deep as its teacher, with blocks as wide (between blocks) as the teacher's, learns one block
per stage: stage k trains block k on feature-map transfer (MSE between the two models' block-k outputs)
plus attention transfer (KL between their block-k per-head attention distributions), with the blocks below
frozen (the paper's choice; optional in the official TF2 code, hence `freeze_lower`). Pre-training
distillation and fine-tuning follow as ordinary runs.

In this library's terms: one `hidden_mse` term (`hidden_k`) and one `relation_kl` term with MiniLM's `qk`
relation over the models' own heads (`attention_k`: exactly softmax(QK^T/sqrt(d)) per head, KL summed over
keys and averaged over heads and queries) per block, and one `callbacks.Stage` per block that weights its
two terms 1 and every other term 0 and freezes what lies below. Stages resume through `StageSwitchCallback`.
Differences from the paper: the stages share one optimizer schedule per stage (`reset_optimizer`, warm-up
and linear decay within each stage) rather than separate runs, and stage 1 also trains the embeddings.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..callbacks import Stage, StageSwitchCallback
from ..features.families import REGISTER_HINT
from ..features.taps import model_info, unwrap


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def block_names(model: nn.Module) -> tuple[str, list[str]]:
    """The dotted names (as in `model.named_parameters()`) of the embeddings module and of each block."""
    inner = unwrap(model)
    info = model_info(inner)
    if info.family is None:
        raise ValueError(f"progressive transfer: model_type {info.model_type!r} is not registered. {REGISTER_HINT}")
    base = getattr(inner, "base_model", inner)
    blocks = base.get_submodule(info.family.layers)
    embeddings = next((base.get_submodule(e) for e in info.family.embeddings if hasattr(base, e.split(".")[0])),
                      None)
    if embeddings is None:
        raise ValueError(f"progressive transfer: none of {info.family.embeddings} exists in {type(base).__name__}")
    return _module_name(inner, embeddings), [_module_name(inner, b) for b in blocks]


def progressive_stages(
    student: nn.Module,
    teacher: nn.Module,
    *,
    epochs_per_stage: float,
    learning_rate: float,
    freeze_lower: bool = True,
    warmup_ratio: float = 0.1,
    hidden_weight: float = 1.0,
    attention_weight: float = 1.0,
) -> tuple[list[dict[str, Any]], StageSwitchCallback]:
    """The `distill_terms` to declare and the `StageSwitchCallback` that runs the stages, one per block, each
    with its own warm-up and linear decay to 0 from `learning_rate` and a fresh optimizer state; train for
    `num_layers * epochs_per_stage` epochs."""
    s_info, t_info = model_info(student), model_info(teacher)
    if s_info.num_layers != t_info.num_layers:
        raise ValueError(f"progressive transfer maps block k onto teacher block k: the student has "
                         f"{s_info.num_layers} blocks, the teacher {t_info.num_layers}")
    if s_info.num_heads != t_info.num_heads:
        raise ValueError(f"attention transfer compares heads one to one: the student has {s_info.num_heads} "
                         f"heads, the teacher {t_info.num_heads}")
    if epochs_per_stage <= 0:
        raise ValueError(f"epochs_per_stage must be > 0, got {epochs_per_stage}")
    embeddings, blocks = block_names(student)
    terms = []
    for k in range(1, len(blocks) + 1):
        terms.append({"loss": "hidden_mse", "layers": [[k, k]], "weight": 0.0, "name": f"hidden_{k}"})
        terms.append({"loss": "relation_kl", "layers": [[k, k]], "relations": ["qk"], "weight": 0.0,
                      "name": f"attention_{k}"})
    stages = []
    for k in range(1, len(blocks) + 1):
        weights = {t["name"]: 0.0 for t in terms}
        weights.update({f"hidden_{k}": hidden_weight, f"attention_{k}": attention_weight})
        frozen = [embeddings, *blocks[: k - 1]] if freeze_lower and k > 1 else []
        stages.append(Stage(
            until_epoch=k * epochs_per_stage if k < len(blocks) else None, term_weights=weights,
            kd_weight=0.0, task_weight=0.0, learning_rate=learning_rate, lr_scheduler_type="linear",
            warmup_ratio=warmup_ratio, reset_optimizer=k > 1, frozen=frozen, name=f"block {k}"))
    terms[0]["weight"], terms[1]["weight"] = hidden_weight, attention_weight  # the first stage's values
    return terms, StageSwitchCallback(stages)
