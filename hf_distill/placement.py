"""Where the teacher lives under each distributed mode of the Trainer.

The teacher is never trained, so it never needs a gradient wrapper; what it needs is to fit. The choice is
made from the Trainer's accelerator state, never by the user:

| mode (accelerate)          | where the teacher lives                          | teacher memory per rank |
| -------------------------- | ------------------------------------------------ | ----------------------- |
| single process / DDP       | a frozen replica on each rank's device           | all of it               |
| FSDP (v1 or v2)            | sharded across ranks like the student, frozen    | 1 / world size          |
| DeepSpeed ZeRO-3           | a ZeRO-3 inference engine, parameters sharded    | 1 / world size          |
| DeepSpeed ZeRO-0/1/2       | a frozen replica on each rank's device           | all of it               |

A sharded teacher gathers each block's parameters for its forward and frees them afterwards (FSDP
`reshard_after_forward`, ZeRO-3 partitioning), so a teacher larger than one device's memory fits.

A teacher its loader already placed (loaded with `device_map`, so `hf_device_map` is set, or quantised to 4/8
bits) stays where it is: `.to()` raises on a quantised model and would undo a dispatch. The trainer feeds it
inputs on its first device (`teacher_input_device`) and brings its outputs back to the student's.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn

from .families import get_family
from .taps import unwrap

REPLICA, FSDP_SHARDED, ZERO3_SHARDED = "replica", "fsdp_sharded", "zero3_sharded"


def teacher_mode(accelerator: Any) -> str:
    """Which row of the table applies to this accelerator."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        return FSDP_SHARDED
    if kind == DistributedType.DEEPSPEED:
        return ZERO3_SHARDED if _zero_stage(accelerator) == 3 else REPLICA
    return REPLICA


def place_teacher(teacher: nn.Module, accelerator: Any) -> nn.Module:
    """Freeze the teacher and put it where the table says (on a replica: the student's device).

    A dispatched or quantised teacher (`is_placed_by_loader`) is frozen but not moved."""
    teacher.requires_grad_(False)
    teacher.eval()
    mode = teacher_mode(accelerator)
    if is_placed_by_loader(teacher):
        if mode != REPLICA:
            raise ValueError(
                f"The teacher was loaded with a device_map or quantised ({_loader_placement(teacher)}), which "
                f"cannot be sharded under {mode} (FSDP / DeepSpeed ZeRO-3 shard the teacher themselves). Load the "
                "teacher without device_map and quantisation, or train without FSDP / ZeRO-3."
            )
        return teacher
    if mode == FSDP_SHARDED:
        if getattr(accelerator, "is_fsdp2", False):
            return shard_fsdp2(teacher)
        return _wrap_fsdp1(teacher, accelerator)
    if mode == ZERO3_SHARDED:
        return _zero3_engine(teacher, accelerator)
    return teacher.to(accelerator.device)


def shard_fsdp2(teacher: nn.Module, mesh: Any = None) -> nn.Module:
    """FSDP2 (`fully_shard`) on every block, then on the whole teacher, parameters resharded after forward.

    Blocks come from the family registry; a family it does not know is sharded as one unit (still 1/N of the
    memory at rest, but the whole teacher is gathered during its forward)."""
    from torch.distributed.fsdp import fully_shard

    inner = unwrap(teacher)
    family = get_family(getattr(getattr(inner, "config", None), "model_type", None))
    if family is not None:
        for block in getattr(inner, "base_model", inner).get_submodule(family.layers):
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True)
    return teacher


def _wrap_fsdp1(teacher: nn.Module, accelerator: Any) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(teacher)
    return FSDP(
        teacher,
        sharding_strategy=plugin.sharding_strategy,
        auto_wrap_policy=plugin.auto_wrap_policy,
        mixed_precision=plugin.mixed_precision_policy,
        device_id=accelerator.device,
        use_orig_params=True,
    )


def _zero_stage(accelerator: Any) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    return config.get("zero_optimization", {}).get("stage")


def zero3_inference_config(train_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config of a frozen ZeRO-3 teacher, derived from the student's: same precision, batch
    sizes and stage-3 partitioning, no optimizer or scheduler (nothing is trained), no offload of gradients."""
    config = copy.deepcopy(train_config)
    for key in ("optimizer", "scheduler", "gradient_clipping"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = 3
    zero.pop("offload_optimizer", None)
    config["zero_optimization"] = zero
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) == "auto":
            config.pop(key)
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    return config


def _zero3_engine(teacher: nn.Module, accelerator: Any) -> nn.Module:
    import deepspeed

    config = zero3_inference_config(accelerator.state.deepspeed_plugin.deepspeed_config)
    engine, *_ = deepspeed.initialize(model=teacher, config=config)
    engine.eval()
    return engine


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank actually holds (a shard for DTensor parameters)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def send_teacher_outputs(outputs: tuple[Any, Any], device: torch.device) -> tuple[Any, Any]:
    """(model output, captured features) of a loader-placed teacher, moved to the student's `device`: the
    layers of a dispatched teacher may each sit on another device."""
    from accelerate.utils import send_to_device

    out, feats = outputs
    if feats is not None:
        moved = {f.name: send_to_device(getattr(feats, f.name), device) for f in dataclasses.fields(feats)}
        feats = dataclasses.replace(feats, **moved)
    return send_to_device(out, device), feats


def _loader_placement(model: nn.Module) -> str:
    """What says that the loader placed the model ("" when nothing does)."""
    inner = unwrap(model)
    found = [name for name in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized") if getattr(inner, name, False)]
    if getattr(inner, "hf_device_map", None):
        found.insert(0, f"hf_device_map={inner.hf_device_map}")
    return ", ".join(found)


def is_placed_by_loader(model: nn.Module) -> bool:
    """True for a model dispatched with `device_map` (`hf_device_map` set) or quantised to 4/8 bits."""
    return bool(_loader_placement(model))


def teacher_input_device(teacher: nn.Module) -> torch.device | None:
    """The device a loader-placed teacher takes its inputs on: the first device of its `hf_device_map` that
    is not "disk", else that of its first parameter; None for a teacher placed on the student's device."""
    if not is_placed_by_loader(teacher):
        return None
    device_map = getattr(unwrap(teacher), "hf_device_map", None) or {}
    for device in device_map.values():
        if device != "disk":
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return next(teacher.parameters()).device


__all__ = [
    "FSDP_SHARDED",
    "REPLICA",
    "ZERO3_SHARDED",
    "is_placed_by_loader",
    "local_parameter_bytes",
    "place_teacher",
    "send_teacher_outputs",
    "shard_fsdp2",
    "teacher_input_device",
    "teacher_mode",
    "zero3_inference_config",
]
