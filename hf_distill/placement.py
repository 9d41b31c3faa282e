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
`reshard_after_forward`, ZeRO-3 partitioning), so a teacher larger than one device's memory fits. It takes the
student's engine settings (offload, mixed precision, prefetch, mesh; ZeRO-3 buckets sized by its own width).
FSDP needs GPUs (accelerate runs it as DDP on a CPU, which `check_engine` refuses); ZeRO-3 also runs on CPUs.

A teacher its loader already placed (loaded with `device_map`, so `hf_device_map` is set, or quantised to 4/8
bits) stays where it is: `.to()` raises on a quantised model and would undo a dispatch. The trainer feeds it
inputs on its first device (`teacher_input_device`) and brings its outputs back to the student's.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch
from accelerate.utils import DistributedType
from torch import nn

from .compat import no_split_modules
from .features.families import get_family
from .features.taps import unwrap

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
            return _shard_fsdp2_like_student(teacher, accelerator)
        return _wrap_fsdp1(teacher, accelerator)
    if mode == ZERO3_SHARDED:
        return _zero3_engine(teacher, accelerator)
    return teacher.to(accelerator.device)


def check_engine(args: Any, accelerator: Any) -> None:
    """Refuse an FSDP or DeepSpeed request that the accelerator did not honour.

    accelerate turns FSDP on only on GPUs and other accelerators: on a CPU (`use_cpu=True`, or no GPU) a
    Trainer given `fsdp=...` silently trains as DDP, every rank holding the whole student and teacher."""
    kind = accelerator.distributed_type
    wants_fsdp = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if wants_fsdp and kind != DistributedType.FSDP:
        raise ValueError(
            f"fsdp={args.fsdp!r} (or ACCELERATE_USE_FSDP) was requested, but accelerate runs this job as "
            f"{kind.value} on {accelerator.device}: it enables FSDP only on GPUs and other accelerators, so on a CPU "
            "(use_cpu=True or no GPU found) the run would silently train as DDP with a full copy of the student "
            "and the teacher per process. Run on GPUs, drop `fsdp`, or use DeepSpeed ZeRO-3 (which runs on CPUs)."
        )
    wants_deepspeed = bool(getattr(args, "deepspeed", None))
    if wants_deepspeed and kind != DistributedType.DEEPSPEED:
        raise ValueError(
            f"deepspeed={args.deepspeed!r} was requested, but accelerate runs this job as {kind.value}: the "
            "DeepSpeed config would be ignored. Launch with a DeepSpeed-enabled accelerate config or drop `deepspeed`."
        )


def _carved_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """What accelerate's FSDP2 preparation shards as units of their own after the auto-wrap: the input and output
    embeddings and the base model's last direct child that is a norm."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    norms = [m for _, m in base.named_children() if "Norm" in type(m).__name__]
    carved = [getattr(model, "get_input_embeddings", lambda: None)(),
              getattr(model, "get_output_embeddings", lambda: None)(), norms[-1] if norms else None]
    names = {id(m): n for n, m in model.named_modules()}
    return [(names[id(m)], m) for m in carved if m is not None and id(m) in names]


def check_fsdp2_wrap(model: nn.Module, accelerator: Any) -> None:
    """Refuse an FSDP2 auto-wrap that accelerate cannot prepare, before training starts.

    accelerate (1.15) first shards every module its wrap policy selects, then shards the embeddings and the final
    norm as units of their own. When a selected module contains one of them (BERT's `_no_split_modules` names
    `BertEmbeddings`, the parent of the word embeddings), those weights are already sharded and torch fails deep in
    `fully_shard` with "Invariant encountered: value was None" (benchmarks/results/distributed_gpu.json)."""
    fsdp2 = getattr(accelerator, "is_fsdp2", False)
    if getattr(accelerator, "distributed_type", None) != DistributedType.FSDP or not fsdp2:
        return
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)  # the very policy accelerate will apply
    if policy is None:
        return
    modules = dict(model.named_modules())
    clashes = {}
    for name, module in _carved_modules(model):
        if policy(module):
            continue  # wrapped whole by the policy: accelerate skips it
        parts = name.split(".")
        for i in range(1, len(parts)):  # proper ancestors, the root excluded (accelerate never auto-wraps it)
            ancestor = modules[".".join(parts[:i])]
            if policy(ancestor):
                clashes[name] = type(ancestor).__name__
    if clashes:
        classes = list(plugin.transformer_cls_names_to_wrap or no_split_modules(model) or [])
        keep = [c for c in classes if c not in set(clashes.values())]
        held = ", ".join(f"{n} (inside {c})" for n, c in clashes.items())
        raise ValueError(
            f"FSDP2 auto-wrap would shard {held} twice: accelerate wraps the policy's modules first and then shards "
            "the embeddings and final norm on their own, which torch's fully_shard rejects (\"Invariant encountered: "
            "value was None\"). Leave the containing class out of the wrap, e.g. fsdp_config={'version': 2, "
            f"'transformer_layer_cls_to_wrap': {keep}}}: accelerate still shards those modules as units of their own."
        )


def shard_fsdp2(teacher: nn.Module, mesh: Any = None, **fully_shard_kwargs: Any) -> nn.Module:
    """FSDP2 (`fully_shard`) on every block, then on the whole teacher, parameters resharded after forward.

    Blocks come from the family registry; a family it does not know is sharded as one unit (still 1/N of the
    memory at rest, but the whole teacher is gathered during its forward). `fully_shard_kwargs` (offload and
    mixed-precision policies) come from the student's FSDP plugin."""
    from torch.distributed.fsdp import fully_shard

    inner = unwrap(teacher)
    family = get_family(getattr(getattr(inner, "config", None), "model_type", None))
    if family is not None:
        for block in getattr(inner, "base_model", inner).get_submodule(family.layers):
            fully_shard(block, mesh=mesh, reshard_after_forward=True, **fully_shard_kwargs)
    fully_shard(teacher, mesh=mesh, reshard_after_forward=True, **fully_shard_kwargs)
    return teacher


def _fsdp_mesh(accelerator: Any) -> Any:
    """The FSDP sub-mesh accelerate shards the student over (None: the default process group)."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    config = getattr(accelerator, "parallelism_config", None)
    if mesh is None or config is None:
        return None
    return mesh[tuple(config.fsdp_dim_names)]


def _shard_fsdp2_like_student(teacher: nn.Module, accelerator: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = accelerator.state.fsdp_plugin
    kwargs = {"mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy()}
    if plugin.cpu_offload is not None:
        kwargs["offload_policy"] = plugin.cpu_offload
    return shard_fsdp2(teacher, mesh=_fsdp_mesh(accelerator), **kwargs)


def _wrap_fsdp1(teacher: nn.Module, accelerator: Any) -> nn.Module:
    """FSDP1-wrap the teacher with the student's settings, from a copy of the plugin: `set_auto_wrap_policy`
    binds the policy to the model's layer classes in place, which would wrap the student with the teacher's."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    plugin = copy.copy(accelerator.state.fsdp_plugin)
    plugin.set_auto_wrap_policy(teacher)
    kwargs = {
        "sharding_strategy": plugin.sharding_strategy or plugin.reshard_after_forward,
        "cpu_offload": plugin.cpu_offload,
        "auto_wrap_policy": plugin.auto_wrap_policy,
        "mixed_precision": plugin.mixed_precision_policy,
        "forward_prefetch": plugin.forward_prefetch,
        "limit_all_gathers": plugin.limit_all_gathers,
        "device_id": accelerator.device,
        "use_orig_params": True,
    }
    mesh = _fsdp_mesh(accelerator)
    if mesh is not None:
        kwargs["device_mesh"] = mesh
    return FSDP(teacher, **kwargs)


def _zero_stage(accelerator: Any) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None) or {}
    return config.get("zero_optimization", {}).get("stage")


def model_hidden_size(model: nn.Module) -> int | None:
    """The width HF's DeepSpeed integration sizes ZeRO-3 buckets by (`hidden_size`, or the largest of
    `hidden_sizes`, also under `text_config`)."""
    config = getattr(unwrap(model), "config", None)
    for cfg in (config, getattr(config, "text_config", None)):
        if getattr(cfg, "hidden_size", None):
            return int(cfg.hidden_size)
        if getattr(cfg, "hidden_sizes", None):
            return int(max(cfg.hidden_sizes))
    return None


_HIDDEN_SIZED = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _drop_auto(config: dict[str, Any]) -> dict[str, Any]:
    """The config without its remaining "auto" values (DeepSpeed then uses its defaults)."""
    return {k: _drop_auto(v) if isinstance(v, dict) else v for k, v in config.items() if v != "auto"}


def zero3_inference_config(
    train_config: dict[str, Any], hidden_size: int | None = None, mixed_precision: str = "no"
) -> dict[str, Any]:
    """The DeepSpeed config of a frozen ZeRO-3 teacher, derived from the student's: same precision, batch
    sizes and stage-3 partitioning, no optimizer or scheduler (nothing is trained), no offload of gradients.

    The teacher's engine is built in the trainer's `__init__`, before the Trainer fills the model-dependent
    "auto" values (in `train()`, from the student), so the three sized by the hidden width are filled here from
    the TEACHER's `hidden_size` as HF does; `fp16`/`bf16` "auto" follow `mixed_precision`; any other "auto" is
    dropped (DeepSpeed's default): deepspeed.initialize would get the string."""
    config = copy.deepcopy(train_config)
    for key in ("optimizer", "scheduler", "gradient_clipping"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization", {}))
    zero["stage"] = 3
    zero.pop("offload_optimizer", None)
    for key, size in _HIDDEN_SIZED.items():
        if zero.get(key) == "auto":
            if hidden_size is None:
                raise ValueError(
                    f"zero_optimization.{key} is 'auto' in the DeepSpeed config, which is sized by the teacher's "
                    "hidden_size, but the teacher's config has neither hidden_size nor hidden_sizes. Set it to a "
                    "number in the DeepSpeed config."
                )
            zero[key] = size(hidden_size)
    config["zero_optimization"] = zero
    for key, enabled in (("fp16", mixed_precision == "fp16"), ("bf16", mixed_precision == "bf16")):
        if isinstance(config.get(key), dict) and config[key].get("enabled") == "auto":
            config[key] = {**config[key], "enabled": enabled}
    config = _drop_auto(config)
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.pop("train_batch_size", None)  # must equal micro batch x accumulation x world size; derived instead
    return config


def _zero3_engine(teacher: nn.Module, accelerator: Any) -> nn.Module:
    import deepspeed

    config = zero3_inference_config(
        accelerator.state.deepspeed_plugin.deepspeed_config,
        model_hidden_size(teacher),
        str(getattr(accelerator, "mixed_precision", "no")),
    )
    engine, *_ = deepspeed.initialize(model=teacher, config=config)
    engine.eval()
    return engine


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank owns: a DTensor's local shard (FSDP2), a flat parameter's shard
    (FSDP1), a ZeRO-3 parameter's partition (`ds_tensor`), else the whole tensor."""
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):
            local = p.ds_tensor
        else:
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
    "check_engine",
    "check_fsdp2_wrap",
    "REPLICA",
    "ZERO3_SHARDED",
    "is_placed_by_loader",
    "local_parameter_bytes",
    "model_hidden_size",
    "place_teacher",
    "send_teacher_outputs",
    "shard_fsdp2",
    "teacher_input_device",
    "teacher_mode",
    "zero3_inference_config",
]
