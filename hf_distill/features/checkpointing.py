"""Activation (gradient) checkpointing and the feature taps: reentrant checkpointing is refused where a tap reads.

Why: the taps (hf_distill.features.taps) read features with forward hooks during the student's forward. Under
*reentrant* checkpointing (`torch.utils.checkpoint(..., use_reentrant=True)`, or no `use_reentrant` given, which
torch reads as True) a checkpointed block runs its forward under `torch.no_grad()` and is re-run with gradients
only in the backward pass, after the hooks are gone. A hidden state or Q/K/V captured inside such a block is then a
tensor without a graph: the term's value is right but none of its gradient reaches the student, a silently wrong
run. Non-reentrant checkpointing (transformers' default, `use_reentrant=False`) keeps the graph and is exact. Block
*outputs* that leave the checkpointed region carry their graph in both modes, so logit distillation and the loss
head are unaffected; only taps inside a checkpointed module are refused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from ..compat import checkpoint_function

__all__ = ["check_planned_checkpointing", "check_tapped_checkpointing", "is_reentrant", "tapped_regions"]

FIX = ("Set gradient_checkpointing_kwargs={'use_reentrant': False} (transformers' default; exact with taps), or "
       "turn gradient_checkpointing off")


def is_reentrant(func: Any) -> bool:
    """Whether a checkpoint function (transformers' `_gradient_checkpointing_func`) runs the reentrant variant:
    only an explicit `use_reentrant=False` is not (torch reads a missing `use_reentrant` as True)."""
    keywords = func.keywords if isinstance(func, functools.partial) else {}
    return keywords.get("use_reentrant", True) is not False


def tapped_regions(model: nn.Module, targets: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules of `model` that transformers would checkpoint around a target (name, the module carrying the
    `gradient_checkpointing` flag): a `GradientCheckpointingLayer` checkpoints its own call (its forward hooks
    included); a model without such layers (older or remote code) checkpoints the calls of the children of the module
    carrying the flag. The model's structure alone, so a caller may keep it; whether each is checkpointed reentrantly
    is read at every forward (checkpointing may be turned on after)."""
    wanted = {id(t) for t in targets}
    found = []
    for name, module in model.named_modules():
        if not hasattr(module, "gradient_checkpointing"):
            continue
        if isinstance(module, GradientCheckpointingLayer):
            regions = [module]
        elif any(isinstance(m, GradientCheckpointingLayer) for m in module.modules()):
            continue  # a flag holder (the base model): its layers are the regions
        else:
            regions = list(module.children())
        if any(id(m) in wanted for region in regions for m in region.modules()):
            found.append((name or type(module).__name__, module))
    return found


def _refusal(role: str, where: list[str], how: str) -> ValueError:
    shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
    return ValueError(
        f"Reentrant activation checkpointing ({how}) would silently drop the gradient of the intermediate "
        f"distillation terms: the {role}'s features are tapped inside the checkpointed {shown}, whose forward then "
        f"runs without gradients. {FIX}."
    )


def check_tapped_checkpointing(model: nn.Module, targets: Iterable[nn.Module], role: str = "student",
                               regions: list[tuple[str, nn.Module]] | None = None) -> None:
    """Refuse a training forward whose tapped modules sit inside a module checkpointed reentrantly (whoever turned
    checkpointing on: the Trainer's `gradient_checkpointing`, TRL's defaults, or the user's own call). `regions`:
    `tapped_regions(model, targets)` kept by the caller (FeatureTaps), so that a step does not walk the model."""
    if not (model.training and torch.is_grad_enabled()):
        return
    regions = tapped_regions(model, targets) if regions is None else regions
    where = [name for name, m in regions if m.gradient_checkpointing is True and is_reentrant(checkpoint_function(m))]
    if where:
        raise _refusal(role, where, "use_reentrant=True or not given")


def check_planned_checkpointing(args: Any, model: nn.Module, targets: Iterable[nn.Module]) -> None:
    """The same refusal when the trainer is built, from the arguments: `gradient_checkpointing=True` with
    `gradient_checkpointing_kwargs` that make transformers checkpoint reentrantly (it passes them to torch as they
    are; None or {} become {'use_reentrant': False})."""
    new = hasattr(args, "activation_checkpointing")  # what the Trainer reads (the old names are aliases of it)
    enabled = args.activation_checkpointing if new else getattr(args, "gradient_checkpointing", False)
    kwargs = args.activation_checkpointing_kwargs if new else getattr(args, "gradient_checkpointing_kwargs", None)
    kwargs = {k: v for k, v in (kwargs or {}).items() if k not in ("every_n_layers", "offload")}
    if not enabled or not kwargs or kwargs.get("use_reentrant", True) is False:
        return
    where = [name for name, _ in tapped_regions(model, targets)]
    if where:
        raise _refusal("student", where, f"gradient_checkpointing_kwargs={kwargs}")
