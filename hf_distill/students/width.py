"""Width pruning: a student keeping the teacher's most important attention heads, MLP channels and hidden channels.

Minitron's activation-based importance (Muralidharan et al. 2024, "Compact Language Models via Pruning and
Knowledge Distillation", sec. 2.2; Sreenivas et al. 2024, "LLM Pruning and Distillation in Practice: The Minitron
Approach"): one forward pass over calibration batches, no gradients, and every unit is ranked by the magnitude of
what it produces:

* a head by its attention output (the input of the attention's output projection, per head),
* an MLP channel by its intermediate activation (the input of the MLP's output projection, after the
  activation and, in a gated MLP, the gate),
* a hidden (embedding) channel by the outputs of the block's LayerNorm/RMSNorm modules, summed over them.

Aggregation, as NVIDIA ModelOpt's Minitron implements it (the paper's best (batch, sequence) pair): per channel,
the mean of ``|activation|`` over a row's real tokens (``attention_mask != 0``), then the L2 norm of those means
over the calibration rows. A head scores the L2 norm of its channels' scores; under grouped-query attention a K/V
head and the query heads it serves are kept or removed together (their group scores the L2 norm of its heads').
Width and depth combine: ``num_layers`` drops blocks by ShortGPT's Block Influence (:func:`prune_depth`'s rule),
measured in the same pass.

The student is a plain transformers model of the teacher's class: its config states the new shape
(``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``hidden_size``; ``head_dim`` kept
explicit where the family has the field) and it reloads with ``from_pretrained``. Kept weights are copied exactly,
rows and columns selected; a tied LM head stays tied. Families whose head size is ``hidden_size /
num_attention_heads`` (BERT, RoBERTa, ELECTRA, DistilBERT, GPT-2) keep the teacher's head size, so their hidden
size and head count move together (``hidden_size = num_attention_heads * head_size``). Pruning hidden channels
changes what a norm averages over (and Gemma's ``sqrt(hidden_size)`` embedding scale): the student starts near
the teacher, not equal to it, and distillation recovers the rest (Minitron's recipe).

The registry (:mod:`hf_distill.features.families`) says where each family keeps the modules read and sliced
(``attention_output``, ``mlp_input``, ``mlp_output``, ``norms``, the Q/K/V projections); encoder-decoder models
and MobileBERT's bottleneck blocks are refused.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from ..base.recorded_names import recorded_name
from ..compat import model_from_config
from ..features.families import Family
from ..features.families_audio import frame_mask
from .build import encoder_layers, from_teacher, get_family
from .prune import _block_importance

__all__ = ["WidthImportance", "WidthPruning", "prune_width", "width_importance"]


@dataclass(frozen=True)
class WidthImportance:
    """What :func:`width_importance` measured on a model (float64 scores, higher is more important).

    ``heads``: ``(num_layers, num_attention_heads)``; ``neurons``: ``(num_layers, intermediate_size)``;
    ``hidden``: ``(hidden_size,)``; ``blocks``: each block's Block Influence (for depth pruning);
    ``num_tokens``: the real tokens the scores ran over. Measure once, prune to many shapes:
    ``prune_width(teacher, importance=imp, ...)``.
    """

    heads: torch.Tensor
    neurons: torch.Tensor
    hidden: torch.Tensor
    blocks: list[float]
    num_tokens: int


@dataclass(frozen=True)
class WidthPruning:
    """What :func:`prune_width` kept, as teacher indices (sorted): ``layers`` the blocks, and per kept block
    ``heads`` (query heads), ``kv_heads`` and ``neurons`` (MLP channels); ``hidden`` the hidden channels."""

    importance: WidthImportance
    layers: list[int]
    heads: list[list[int]]
    kv_heads: list[list[int]]
    neurons: list[list[int]]
    hidden: list[int]


@dataclass(frozen=True)
class _Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    explicit_head_dim: bool  # the family has a head_dim field; else head size = hidden_size / num_attention_heads


def _axes(module: nn.Module, path: str) -> tuple[int, int]:
    """(output axis, input axis) of the module's weight: Linear stores (out, in), GPT-2's Conv1D (in, out)."""
    if isinstance(module, nn.Linear):
        return 0, 1
    if isinstance(module, Conv1D):
        return 1, 0
    raise ValueError(
        f"width pruning: {path!r} is a {type(module).__name__}, not a Linear or Conv1D, so its rows and columns "
        "cannot be selected; fix the family's width layout with register_family(..., overwrite=True)."
    )


def _width_family(model: PreTrainedModel) -> Family:
    family = get_family(model.config)
    model_type = model.config.model_type
    if family.stacks:
        raise ValueError(
            f"prune_width works on encoder-only and decoder-only models; {model_type!r} is an encoder-decoder "
            "model. Drop its blocks with students.from_teacher(teacher, decoder_layers=[...]) or build a narrower "
            "one with students.shrink."
        )
    if family.refuse_width:
        raise ValueError(f"prune_width does not prune {model_type!r}: {family.refuse_width}")
    if family.attention_size_field:
        raise ValueError(
            f"prune_width does not prune {model_type!r}: its attention runs at a bottleneck width "
            f"({family.attention_size_field}) apart from the hidden size. Use students.prune_depth or shrink."
        )
    block = encoder_layers(model)[0]
    for field, paths in _layout_paths(family).items():
        for path in paths:
            try:
                module = block.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"prune_width: the blocks of {model_type!r} have no module {path!r} (the family's {field}). "
                    f"Register its width layout: register_family({model_type!r}, ..., {field}=..., overwrite=True), "
                    "paths relative to one block (see hf_distill.features.families)."
                ) from None
            if field != "norms":
                _axes(module, path)
    return family


def _qkv_paths(family: Family) -> tuple[str, ...]:
    if family.qkv:
        return (family.qkv,)
    return family.projections or (family.query, family.key, family.value)


def _layout_paths(family: Family) -> dict[str, tuple[str, ...]]:
    return {
        "qkv" if family.qkv else "projections": _qkv_paths(family),
        "attention_output": (family.attention_output,),
        "mlp_input": family.mlp_input,
        "mlp_output": (family.mlp_output,),
        "norms": family.norms,
    }


def _shape(model: PreTrainedModel, family: Family) -> _Shape:
    config = model.config
    blocks = encoder_layers(model)
    hidden = getattr(config, family.hidden_size_field)
    heads = getattr(config, family.num_heads_field)
    kv_field = family.num_kv_heads_field
    kv_heads = (getattr(config, kv_field, None) if kv_field else None) or heads
    # A family with a head_dim field reads it (falling back to hidden / heads when unset): set, it frees the
    # head size from the hidden size.
    explicit = family.head_dim_field is not None
    head_dim = (getattr(config, family.head_dim_field, None) if explicit else None) or hidden // heads
    out = blocks[0].get_submodule(family.attention_output)
    _, in_axis = _axes(out, family.attention_output)
    width = out.weight.shape[in_axis]
    if width != heads * head_dim:
        raise ValueError(
            f"prune_width: {family.attention_output!r} reads {width} channels, not num_attention_heads * head_dim = "
            f"{heads} * {head_dim}; the config does not describe the model's attention."
        )
    down = blocks[0].get_submodule(family.mlp_output)
    intermediate = down.weight.shape[_axes(down, family.mlp_output)[1]]
    return _Shape(len(blocks), hidden, heads, kv_heads, head_dim, intermediate, explicit)


def width_importance(model: PreTrainedModel, calibration_batches: Iterable[Mapping[str, Any]]) -> WidthImportance:
    """Minitron's activation importance of every head, MLP channel and hidden channel (see the module docstring),
    plus each block's Block Influence, from one pass over ``calibration_batches`` (dicts of model inputs; the model
    runs in eval mode without gradients, its mode restored)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}.")
    family = _width_family(model)
    shape = _shape(model, family)
    blocks = encoder_layers(model)
    n = shape.layers
    heads_sq = torch.zeros(n, shape.heads * shape.head_dim, dtype=torch.float64)
    neurons_sq = torch.zeros(n, shape.intermediate, dtype=torch.float64)
    norms_sq = torch.zeros(n, len(family.norms), shape.hidden, dtype=torch.float64)
    current: dict[str, torch.Tensor | None] = {"mask": None}

    def remember_mask(_module, _args, kwargs):
        mask = kwargs.get("attention_mask")
        current["mask"] = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def accumulate(target: torch.Tensor, x: torch.Tensor) -> None:
        x = x.detach().float().abs()
        mask = frame_mask(model, current["mask"], x.shape[1])  # a waveform's samples -> its frames
        if mask is not None and tuple(mask.shape) == tuple(x.shape[:2]):
            m = mask.to(x.dtype).unsqueeze(-1)
            per_row = (x * m).sum(1) / m.sum(1).clamp_min(1.0)  # mean over a row's real tokens
        else:
            per_row = x.mean(1)
        target += per_row.double().pow(2).sum(0).cpu()  # squared L2 over rows; the root is taken at the end

    def pre_hook(target: torch.Tensor):
        def hook(_module, args):
            accumulate(target, args[0])

        return hook

    def post_hook(target: torch.Tensor):
        def hook(_module, _args, output):
            accumulate(target, output[0] if isinstance(output, tuple) else output)

        return hook

    handles = [model.register_forward_pre_hook(remember_mask, with_kwargs=True)]
    try:
        for i, block in enumerate(blocks):
            handles.append(block.get_submodule(family.attention_output).register_forward_pre_hook(pre_hook(heads_sq[i])))
            handles.append(block.get_submodule(family.mlp_output).register_forward_pre_hook(pre_hook(neurons_sq[i])))
            for j, path in enumerate(family.norms):
                handles.append(block.get_submodule(path).register_forward_hook(post_hook(norms_sq[i, j])))
        scores, num_tokens = _block_importance(model, calibration_batches)
    finally:
        for handle in handles:
            handle.remove()
    heads = heads_sq.sqrt().view(n, shape.heads, shape.head_dim).norm(dim=-1)
    hidden = norms_sq.sqrt().sum(dim=(0, 1))
    return WidthImportance(heads=heads, neurons=neurons_sq.sqrt(), hidden=hidden, blocks=scores, num_tokens=num_tokens)


def _count(name: str, value: int | None, teacher: int, unit: str) -> int:
    if value is None:
        return teacher
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None (keep the teacher's), got {value!r}.")
    if not 1 <= value <= teacher:
        raise ValueError(
            f"{name}={value}: pruning only removes {unit}, and the teacher has {teacher}; choose {name} between 1 "
            f"and {teacher} (None keeps them all)."
        )
    return value


def _targets(
    model_type: str, shape: _Shape, heads: int | None, intermediate: int | None, hidden: int | None
) -> tuple[int, int, int, int]:
    """(heads, kv_heads, intermediate, hidden) of the student, checked against what the family can represent."""
    new_heads = _count("num_attention_heads", heads, shape.heads, "whole heads")
    new_hidden = _count("hidden_size", hidden, shape.hidden, "hidden channels")
    new_inter = _count("intermediate_size", intermediate, shape.intermediate, "MLP channels")
    if not shape.explicit_head_dim:
        hd = shape.head_dim
        rule = (
            f"{model_type} computes its head size as hidden_size / num_attention_heads, and pruning keeps whole "
            f"heads of the teacher's size {hd}, so hidden_size must be num_attention_heads * {hd}"
        )
        if heads is not None and hidden is None:
            new_hidden = new_heads * hd
        elif hidden is not None and heads is None:
            if new_hidden % hd:
                raise ValueError(
                    f"hidden_size={new_hidden} is not divisible by the head size {hd}: {rule}; pass hidden_size= a "
                    f"multiple of {hd} (e.g. {max(hd, new_hidden - new_hidden % hd)})."
                )
            new_heads = new_hidden // hd
        elif new_hidden != new_heads * hd:
            raise ValueError(
                f"hidden_size={new_hidden} does not fit num_attention_heads={new_heads}: {rule}; pass "
                f"hidden_size={new_heads * hd}, or leave one of the two as None and it follows the other."
            )
    group = shape.heads // shape.kv_heads
    if new_heads % group:
        lower = max(group, new_heads - new_heads % group)
        raise ValueError(
            f"num_attention_heads={new_heads} is not a whole number of grouped-query groups: each of the teacher's "
            f"{shape.kv_heads} key/value heads serves {group} query heads, and pruning keeps or removes a group "
            f"whole; use a multiple of {group} (e.g. num_attention_heads={lower})."
        )
    return new_heads, new_heads // group, new_inter, new_hidden


def _top(scores: torch.Tensor, k: int) -> list[int]:
    """The k highest scores' indices, in index order; ties keep the earlier index."""
    order = torch.sort(-scores, stable=True).indices
    return sorted(order[:k].tolist())


def _channels(units: list[int], size: int, offset: int = 0) -> torch.Tensor:
    """The channels of whole units (heads of `size` channels), shifted by `offset`."""
    index = torch.tensor(units, dtype=torch.long).view(-1, 1)
    return (offset + index * size + torch.arange(size)).flatten()


def _check_importance(importance: WidthImportance, shape: _Shape) -> None:
    if not isinstance(importance, WidthImportance):
        raise TypeError(
            f"importance must be a WidthImportance (from width_importance), got {type(importance).__name__}."
        )
    want = {
        "heads": (shape.layers, shape.heads),
        "neurons": (shape.layers, shape.intermediate),
        "hidden": (shape.hidden,),
    }
    for name, expected in want.items():
        got = tuple(getattr(importance, name).shape)
        if got != expected:
            raise ValueError(
                f"importance.{name} has shape {got}, but this teacher needs {expected}: the importance was measured "
                "on another model. Measure it on this teacher with width_importance(teacher, calibration_batches)."
            )
    if len(importance.blocks) != shape.layers:
        raise ValueError(f"importance.blocks scores {len(importance.blocks)} blocks; the teacher has {shape.layers}.")


def prune_width(
    teacher: PreTrainedModel,
    calibration_batches: Iterable[Mapping[str, Any]] | None = None,
    *,
    num_attention_heads: int | None = None,
    intermediate_size: int | None = None,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    importance: WidthImportance | None = None,
) -> tuple[PreTrainedModel, WidthPruning]:
    """A student of the teacher's class with fewer heads, MLP channels, hidden channels and (``num_layers``)
    blocks, keeping the most important ones by Minitron's activation importance (module docstring).

    Each target is the student's size (``None`` keeps the teacher's), the same in every block: heads per block,
    MLP channels per block, hidden channels, blocks. Under grouped-query attention ``num_attention_heads`` is a
    multiple of the query heads per K/V head, and ``num_key_value_heads`` follows. Where the head size is
    ``hidden_size / num_attention_heads`` (BERT-like, DistilBERT, GPT-2) one of ``hidden_size`` and
    ``num_attention_heads`` may be left ``None`` and follows the other. Give ``calibration_batches`` (dicts of
    model inputs; real text, padding masked) or an ``importance`` measured once by :func:`width_importance`
    (a search over shapes measures once and calls this per candidate).

    Returns the student (on the teacher's device, in its dtype and mode, nothing shared) and a
    :class:`WidthPruning` with the kept teacher indices; ``student.config.distillation`` records the teacher's
    shape and the method for the model card. Pruning nothing returns a copy that computes what the teacher does.
    """
    if not isinstance(teacher, PreTrainedModel):
        raise TypeError(f"teacher must be a transformers PreTrainedModel, got {type(teacher).__name__}.")
    family = _width_family(teacher)
    shape = _shape(teacher, family)
    model_type = teacher.config.model_type
    narrower = hidden_size not in (None, shape.hidden) or num_attention_heads not in (None, shape.heads)
    if family.fixed_hidden and narrower:
        raise ValueError(
            f"prune_width keeps the hidden size of {model_type!r}: {family.fixed_hidden}; and its head size is "
            "hidden_size / num_attention_heads, so its heads stay too. Prune intermediate_size and num_layers, or "
            "build a narrower student with students.shrink."
        )
    heads, kv_heads, inter, hidden = _targets(model_type, shape, num_attention_heads, intermediate_size, hidden_size)
    depth = _count("num_layers", num_layers, shape.layers, "blocks")
    if importance is None:
        if calibration_batches is None:
            raise TypeError(
                "prune_width needs calibration_batches (an iterable of model-input dicts) to rank the units, or "
                "importance=width_importance(teacher, calibration_batches) measured before."
            )
        importance = width_importance(teacher, calibration_batches)
    elif calibration_batches is not None:
        raise ValueError("Give calibration_batches or importance, not both: the importance already holds the ranking.")
    else:
        _check_importance(importance, shape)

    layers = _top(torch.tensor(importance.blocks, dtype=torch.float64), depth)
    base = teacher if depth == shape.layers else from_teacher(teacher, layers)
    group = shape.heads // shape.kv_heads
    kept_kv = [_top(importance.heads[i].view(shape.kv_heads, group).norm(dim=-1), kv_heads) for i in layers]
    kept_heads = [[g * group + j for g in groups for j in range(group)] for groups in kept_kv]
    kept_neurons = [_top(importance.neurons[i], inter) for i in layers]
    kept_hidden = _top(importance.hidden, hidden)

    config = copy.deepcopy(base.config)
    setattr(config, family.num_heads_field, heads)
    if family.num_kv_heads_field and hasattr(config, family.num_kv_heads_field):
        setattr(config, family.num_kv_heads_field, kv_heads)
    if shape.explicit_head_dim:
        setattr(config, family.head_dim_field, shape.head_dim)
    setattr(config, family.intermediate_size_field, inter)
    setattr(config, family.hidden_size_field, hidden)
    for field in family.follows_hidden_size:
        if getattr(config, field, None) == shape.hidden:
            setattr(config, field, hidden)
    record = dict(getattr(base.config, "distillation", None) or {}) if base is not teacher else {}
    record.update(
        {
            "init": "prune_width",
            "teacher_name_or_path": recorded_name(teacher.config.name_or_path),
            "importance": "activation (Minitron)",
            "calibration_tokens": importance.num_tokens,
            "teacher_shape": {
                "num_layers": shape.layers,
                "num_attention_heads": shape.heads,
                "num_key_value_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "intermediate_size": shape.intermediate,
                "hidden_size": shape.hidden,
            },
        }
    )
    if base is not teacher:
        record["block_importance"] = list(importance.blocks)
    config.distillation = record
    config.name_or_path = ""  # the student is not the teacher checkpoint (see from_teacher)
    config.validate()

    student = model_from_config(type(base), config, dtype=base.dtype)
    student.load_state_dict(_sliced_state(base, student, family, shape, kept_heads, kept_kv, kept_neurons,
                                          kept_hidden), strict=True)
    student.to(base.device)
    student.train(teacher.training)
    if student.can_generate() and getattr(teacher, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(teacher.generation_config)  # generate as the teacher does
    report = WidthPruning(importance=importance, layers=layers, heads=kept_heads, kv_heads=kept_kv,
                          neurons=kept_neurons, hidden=kept_hidden)
    return student, report


def _sliced_state(
    base: PreTrainedModel,
    student: PreTrainedModel,
    family: Family,
    shape: _Shape,
    heads: list[list[int]],
    kv_heads: list[list[int]],
    neurons: list[list[int]],
    hidden: list[int],
) -> dict[str, torch.Tensor]:
    """The base model's state dict cut to the student's shapes: the registered modules of each block by their
    unit (head, K/V head, MLP channel) along one axis and by hidden channel along the other; every other tensor
    by hidden channel along each axis whose size changed."""
    blocks = encoder_layers(base)
    prefix = next(name for name, module in base.named_modules() if module is blocks) + "."
    hd, inter = shape.head_dim, shape.intermediate
    q_width, kv_width = shape.heads * hd, shape.kv_heads * hd
    keep_hidden = torch.tensor(hidden, dtype=torch.long)
    roles: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}  # module -> (output rows, input columns, out axis)
    for i, block in enumerate(blocks):
        q, kv = _channels(heads[i], hd), _channels(kv_heads[i], hd)
        units = {family.attention_output: (keep_hidden, q)}
        if family.qkv:
            units[family.qkv] = (torch.cat([q, q_width + kv, q_width + kv_width + kv]), keep_hidden)
        else:
            q_path, k_path, v_path = _qkv_paths(family)
            units.update({q_path: (q, keep_hidden), k_path: (kv, keep_hidden), v_path: (kv, keep_hidden)})
        mlp = torch.cat([_channels(neurons[i], 1, c * inter) for c in range(family.mlp_input_chunks)])
        units.update({path: (mlp, keep_hidden) for path in family.mlp_input})
        units[family.mlp_output] = (keep_hidden, _channels(neurons[i], 1))
        for path, (rows, cols) in units.items():
            out_axis, _ = _axes(block.get_submodule(path), path)
            roles[f"{prefix}{i}.{path}"] = (rows, cols, out_axis)

    target = student.state_dict()
    state = {}
    for key, tensor in base.state_dict().items():
        module, _, _ = key.rpartition(".")
        want = target[key].shape
        if module in roles and tensor.dim() in (1, 2):
            rows, cols, out_axis = roles[module]
            if tensor.dim() == 1:
                tensor = tensor.index_select(0, rows.to(tensor.device))
            else:
                tensor = tensor.index_select(out_axis, rows.to(tensor.device))
                tensor = tensor.index_select(1 - out_axis, cols.to(tensor.device))
        else:
            for axis, (old, new) in enumerate(zip(tensor.shape, want)):
                if old != new:
                    if old != shape.hidden:
                        raise ValueError(
                            f"prune_width: {key} changes size along axis {axis} ({old} -> {new}), which is not the "
                            f"hidden size {shape.hidden}; the family's width layout misses the module holding it "
                            "(register_family(..., attention_output=..., mlp_input=..., overwrite=True))."
                        )
                    tensor = tensor.index_select(axis, keep_hidden.to(tensor.device))
        if tensor.shape != want:
            raise ValueError(
                f"prune_width: {key} is {tuple(tensor.shape)} after pruning, but the student needs {tuple(want)}; "
                "the family's width layout does not describe this model."
            )
        state[key] = tensor.clone()
    return state
