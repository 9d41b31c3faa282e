"""Students with DeiT's distillation token, built from a ViT or DeiT teacher (issue #43 item 4).

The student is transformers' own `DeiTForImageClassificationWithTeacher` (class head + distillation head, their
average at inference), so it saves and reloads as a plain transformers model and `pipeline("image-classification")`
serves it. `from_teacher(..., distillation_token=True)` keeps some of the teacher's blocks and copies every weight it
has: patch and position embeddings, class token, blocks, final norm; the distillation token and its position start
as copies of the class token's (DeiT initialises it apart; a copy starts the two heads equal, and the distinct losses
pull them apart), and both heads as copies of the teacher's classifier. `shrink(..., distillation_token=True)` builds a
random one of the teacher's image size, patch size and label set.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DeiTConfig, DeiTForImageClassificationWithTeacher, PreTrainedConfig, PreTrainedModel

from ..base.recorded_names import recorded_name

TEACHER_TYPES = ("vit", "deit")
"""The teachers whose blocks a distillation-token student can copy (same block layout and config fields)."""


def _check(config: PreTrainedConfig) -> None:
    if config.model_type not in TEACHER_TYPES:
        raise ValueError(
            f"distillation_token=True builds a DeiT student from a ViT or DeiT teacher (model_type vit|deit); this "
            f"teacher is {config.model_type!r}. Build a DeiT student with shrink(DeiTConfig(...), ..., "
            "distillation_token=True) and distil from this teacher's logits."
        )


def deit_config(config: PreTrainedConfig, **sizes: Any) -> DeiTConfig:
    """A DeiT config with the teacher's fields (image and patch size, labels, activation, ...) and `sizes` changed."""
    _check(config)
    skip = ("model_type", "architectures", "transformers_version")
    values = {k: v for k, v in config.to_dict().items() if k not in skip}
    values.update(sizes)
    values["architectures"] = ["DeiTForImageClassificationWithTeacher"]
    return DeiTConfig(**values)


def token_student_from_teacher(teacher: PreTrainedModel,
                               layers: Sequence[int]) -> DeiTForImageClassificationWithTeacher:
    """`from_teacher(teacher, layers, distillation_token=True)`: see the module's docstring."""
    _check(teacher.config)
    base = teacher.base_model
    blocks = base.get_submodule("layers")
    layers = list(layers)
    if not layers or layers != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < len(blocks):
        raise ValueError(f"layers must be strictly increasing indices of the teacher's {len(blocks)} blocks, got "
                         f"{layers}.")
    config = deit_config(teacher.config, num_hidden_layers=len(layers))
    config.distillation = {"init": "from_teacher", "teacher_layers": layers, "distillation_token": True,
                           "teacher_name_or_path": recorded_name(teacher.config.name_or_path),
                           "teacher_num_layers": len(blocks)}
    config.name_or_path = ""
    student = DeiTForImageClassificationWithTeacher(config).to(teacher.dtype)
    emb, t_emb = student.deit.embeddings, base.embeddings
    with torch.no_grad():
        emb.patch_embeddings.load_state_dict(t_emb.patch_embeddings.state_dict())
        emb.cls_token.copy_(t_emb.cls_token)
        t_dist = getattr(t_emb, "distillation_token", None)
        emb.distillation_token.copy_(t_dist if t_dist is not None else t_emb.cls_token)
        t_pos = t_emb.position_embeddings
        if t_pos.shape[1] == emb.position_embeddings.shape[1]:  # a DeiT teacher: class, distillation, patches
            emb.position_embeddings.copy_(t_pos)
        else:  # a ViT teacher: class, patches; the distillation position starts as the class token's
            emb.position_embeddings.copy_(torch.cat([t_pos[:, :1], t_pos[:, :1], t_pos[:, 1:]], dim=1))
        for new, old in enumerate(layers):
            student.deit.layers[new].load_state_dict(blocks[old].state_dict())
        student.deit.layernorm.load_state_dict(base.layernorm.state_dict())
        head = _classifier(teacher)
        for name in ("cls_classifier", "distillation_classifier"):
            getattr(student, name).load_state_dict(head.state_dict())
    student.to(teacher.device)
    student.train(teacher.training)
    return student


def _classifier(teacher: PreTrainedModel) -> torch.nn.Module:
    for name in ("classifier", "cls_classifier"):
        head = getattr(teacher, name, None)
        if isinstance(head, torch.nn.Linear):
            return head
    raise ValueError(f"{type(teacher).__name__} has no linear `classifier` to copy into the student's two heads: give "
                     "an image classification teacher (ViTForImageClassification, DeiTForImageClassification...).")


def token_student_shrink(config: PreTrainedConfig, seed: int | None = None,
                         **sizes: Any) -> DeiTForImageClassificationWithTeacher:
    """`shrink(teacher, ..., distillation_token=True)`: a random DeiT student with two heads."""
    student_config = deit_config(copy.deepcopy(config), **sizes)
    student_config.distillation = {"init": "shrink", "distillation_token": True,
                                   "teacher_name_or_path": recorded_name(config.name_or_path)}
    if seed is None:
        return DeiTForImageClassificationWithTeacher(student_config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DeiTForImageClassificationWithTeacher(student_config)


__all__ = ["TEACHER_TYPES", "deit_config", "token_student_from_teacher", "token_student_shrink"]
