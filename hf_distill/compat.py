"""Every use of a private name of transformers, TRL, DeepSpeed, torch or datasets, in one room.

A private name (an underscore attribute, a private field of a library's object) may change in any release of its
library without notice. Each one hf_distill needs is used here only, behind a function saying why, and listed in
`PRIVATE`; tests/test_compat.py checks every entry against the installed versions, and that no other module uses a
private name of those libraries. A library upgrade that renames one fails there, naming it, instead of somewhere in
a training run. The private Trainer methods the trainers override (not call) are listed in
`hf_distill.trainer.PRIVATE_OVERRIDES` and checked by tests/test_trainer_overrides.py.

On the ground floor: it imports nothing from hf_distill (the libraries it wraps are imported where they are used, so
importing it costs nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

__all__ = ["PRIVATE", "PRIVATE_CALLS", "Private"]


class Private(NamedTuple):
    """One private name: where it lives (`owner`, a dotted path to a module or class), its `name`, what it is
    (`kind`: "method" a callable attribute of the class, "field" an attribute of its instances, "module attribute"),
    which function here uses it, and why nothing public does the job."""

    owner: str
    name: str
    kind: str
    used_by: str
    why: str


PRIVATE: tuple[Private, ...] = (
    # transformers: Trainer methods called (not overridden) and fields read
    Private("transformers.Trainer", "_get_num_items_in_batch", "method", "num_items_in_batch",
            "the step's label count after on-policy generation replaced the labels (no public way to recount)"),
    Private("transformers.Trainer", "_prepare_inputs", "method", "prepare_inputs",
            "moves a batch to the device as the training loop does (teacher evaluation, measuring, seq2seq loss)"),
    Private("transformers.Trainer", "_remove_unused_columns", "method", "remove_unused_columns",
            "the Trainer's own column filter, so a model card measures on the batches training saw"),
    Private("transformers.Trainer", "_get_output_dir", "method", "checkpoint_parent",
            "the folder the Trainer writes checkpoints to (hyperparameter search trials included)"),
    Private("transformers.Trainer", "_finish_current_push", "method", "finish_current_push",
            "waits for the Trainer's background push before ours pushes the same repo"),
    Private("transformers.Trainer", "_signature_columns", "field", "signature_columns, add_signature_columns",
            "the columns the Trainer keeps; the overrides add the teacher's inputs and cached teacher columns"),
    Private("transformers.PreTrainedModel", "_keys_to_ignore_on_save", "field", "load_renamed_checkpoint",
            "the weights save_pretrained leaves out on purpose (Marian's sinusoids), absent from every checkpoint"),
    Private("transformers.PreTrainedConfig", "_attn_implementation", "field", "attn_implementation",
            "a student built from the teacher's config keeps the attention kernel the teacher was loaded with"),
    Private("transformers.PreTrainedModel", "_from_config", "method", "model_from_config",
            "builds a model of the teacher's class with its dtype and attention kernel (what from_pretrained does)"),
    Private("transformers.PreTrainedModel", "_no_split_modules", "field", "no_split_modules",
            "the block classes FSDP wraps, named in the error that says which to wrap"),
    Private("transformers.PreTrainedModel", "_gradient_checkpointing_func", "field", "checkpoint_function",
            "the checkpoint function a block runs under (reentrant or not: taps inside reentrant blocks are refused)"),
    # TRL: SFTTrainer's metric fields, which DistillationSFTTrainer.compute_loss fills as SFTTrainer's does
    Private("trl.SFTTrainer", "_metrics", "field", "sft_metrics", "the metrics SFTTrainer logs (num_tokens, ...)"),
    Private("trl.SFTTrainer", "_total_train_tokens", "field", "count_sft_train_tokens, sft_train_tokens",
            "the running token count SFTTrainer logs as num_tokens"),
    Private("trl.SFTTrainer", "_tp_size", "field", "count_sft_train_tokens",
            "tensor-parallel processes count a token once each (SFTTrainer divides by it)"),
    # DeepSpeed ZeRO-3: the engine's module hooks, set aside while generate runs on gathered parameters
    Private("deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload", "_register_deepspeed_module", "method",
            "zero3_gathered_without_hooks", "registers the engine's module hooks again after generation"),
    Private("deepspeed.runtime.zero.partitioned_param_coordinator.PartitionedParameterCoordinator",
            "_invalidate_trace", "method", "zero3_gathered_without_hooks",
            "drops the prefetch trace recorded before generation (a stale one fails the next step)"),
    # torch
    Private("torch.nn.Module", "_modules", "field", "children_dict",
            "the live dict of submodules: attaches and detaches the projections without getattr forwarding (PEFT)"),
    Private("torch._dynamo.eval_frame.OptimizedModule", "_orig_mod", "field", "compiled_inner",
            "the module torch.compile wrapped, where model-bound facts (head, hooks) are read"),
    Private("torch.Tensor", "_version", "field", "tensor_version",
            "in-place writes bump it: a memoised teacher fingerprint stays valid while it holds"),
    Private("torch.optim.lr_scheduler.LRScheduler", "_last_lr", "field", "set_last_lr",
            "what get_last_lr() (the logged learning rate) returns after a stage changes the rates mid-step"),
    Private("torch", "_dynamo", "module attribute", "recompile_limit",
            "dynamo's settings: the loss head's compiled function needs a higher recompile limit (no public setting)"),
    Private("torch._dynamo.config", "recompile_limit", "module attribute", "recompile_limit",
            "the setting's name (raised around the loss head's compiled function)"),
    Private("torch.cpu", "_is_avx512_bf16_supported", "module attribute", "cpu_bf16_supported",
            "whether this CPU runs bfloat16 natively (the demo's default precision); absent: False"),
    # datasets
    Private("datasets.Dataset", "_indices", "field", "dataset_indices",
            "the row order after select/shuffle, so a cache key hashes the rows in the order they are read"),
    Private("datasets.Dataset", "_fingerprint", "field", "dataset_fingerprint",
            "the dataset's content fingerprint, which keys the augmentation caches"),
)

#: Private Trainer methods hf_distill calls, with the parameters it passes (checked against the installed
#: transformers by tests/test_trainer_overrides.py, and each named on the design page).
PRIVATE_CALLS = {
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_prepare_inputs": ("inputs",),
    "_remove_unused_columns": ("dataset", "description"),
    "_get_output_dir": ("trial",),
    "_finish_current_push": (),
}


# ---------------------------------------------------------------------- transformers


def num_items_in_batch(trainer: Any, batch_samples: list, device: Any) -> Any:
    return trainer._get_num_items_in_batch(batch_samples, device)


def prepare_inputs(trainer: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    return trainer._prepare_inputs(inputs)


def remove_unused_columns(trainer: Any, dataset: Any, description: str | None = None) -> Any:
    return trainer._remove_unused_columns(dataset, description=description)


def checkpoint_parent(trainer: Any, trial: Any) -> str:
    return trainer._get_output_dir(trial)


def finish_current_push(trainer: Any) -> None:
    trainer._finish_current_push()


def signature_columns(trainer: Any) -> list[str] | None:
    return trainer._signature_columns


def add_signature_columns(trainer: Any, names: list[str]) -> None:
    """Append `names` (in order, those not kept already) to the columns the Trainer keeps."""
    kept = trainer._signature_columns
    kept += [n for n in names if n not in kept]  # in place, as the Trainer's own list
    trainer._signature_columns = kept


def attn_implementation(config: Any) -> str | None:
    return config._attn_implementation


def model_from_config(model_class: Any, config: Any, **kwargs: Any) -> Any:
    return model_class._from_config(config, **kwargs)


def no_split_modules(model: Any) -> list[str] | None:
    return getattr(model, "_no_split_modules", None)


def checkpoint_function(module: Any) -> Any:
    """The function an activation-checkpointed transformers module wraps its forward in (a `functools.partial` of
    `torch.utils.checkpoint.checkpoint` with the run's keywords), or None where checkpointing was never set up."""
    return getattr(module, "_gradient_checkpointing_func", None)


def load_renamed_checkpoint(model: Any, folder: str) -> bool:
    """Load a Trainer checkpoint whose weight names are not the model's own, exactly; False when they are.

    transformers 5 renames some families' weights on load and back on save (ViT/DeiT: `vit.encoder.layer.0.
    attention.attention.query` <-> `vit.layers.0.attention.q_proj`), while the Trainer's resume and
    `load_best_model_at_end` call `load_state_dict(strict=False)` on the saved names: every renamed weight is then
    silently left as it was (a resumed ViT continued from its step-0 encoder). The saved names are found by
    transformers' own save-side conversion, each matched to the model's tensor it was made from; a family whose
    weights are converted (fused MoE experts) is loaded through from_pretrained into a copy."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel):
        return False
    single, index = os.path.join(folder, "model.safetensors"), os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted({os.path.join(folder, v) for v in json.load(f)["weight_map"].values()})
    else:
        return False
    saved: set[str] = set()
    for path in files:
        with safe_open(path, "pt") as f:
            saved.update(f.keys())
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())  # never saved (Marian's sinusoids)
    own = {k: v for k, v in model.state_dict().items() if k not in ignored}
    aliases: dict[tuple, set[str]] = {}  # tied weights: one tensor, several names, saved under one
    for name, t in own.items():
        aliases.setdefault((t.data_ptr(), tuple(t.shape)), set()).add(name)
    if all(names & saved for names in aliases.values()):
        return False  # every tensor is saved under one of its own names: the Trainer's own load is exact
    made_from = {(t.data_ptr(), tuple(t.shape)): name for name, t in own.items()}
    names = {}
    for saved_name, tensor in revert_weight_conversion(model, dict(own)).items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in made_from:  # converted, not only renamed (MoE experts saved one by one): load it as
            # from_pretrained does, into a copy (CPU memory for a second model, for this load only)
            dtype = next(model.parameters()).dtype
            loaded = type(model).from_pretrained(folder, config=model.config, dtype=dtype).state_dict()
            model.load_state_dict({k: loaded[k] for k in own}, strict=True)
            return True
        names[saved_name] = made_from[key]
    state = {names[k]: v for path in files for k, v in load_file(path, device="cpu").items() if k in names}
    missing = set(own) - set(state)
    tied = {made_from[(t.data_ptr(), tuple(t.shape))] for t in own.values()}
    if missing - (set(own) - tied) or set(state) - set(own):  # only aliases of a loaded tensor may be absent
        raise ValueError(f"{folder} lacks the weights {sorted(missing)[:5]} of {type(model).__name__}.")
    model.load_state_dict(state, strict=False)
    return True


# ---------------------------------------------------------------------- TRL


def sft_metrics(trainer: Any, mode: str) -> dict[str, list]:
    return trainer._metrics[mode]


def count_sft_train_tokens(trainer: Any, tokens: int) -> None:
    """Add a step's gathered token count as SFTTrainer does."""
    trainer._total_train_tokens += tokens // trainer._tp_size


def sft_train_tokens(trainer: Any) -> int:
    return trainer._total_train_tokens


# ---------------------------------------------------------------------- DeepSpeed


@contextlib.contextmanager
def zero3_gathered_without_hooks(engine: Any) -> Iterator[None]:
    """The engine's parameters gathered whole, with its ZeRO-3 module hooks removed until the exit.

    `generate` makes one forward per token. With the hooks on, each forward also runs the engine's fetch and
    release, and from the second step on its coordinator prefetches along the training step's trace, so parameters
    are still being gathered (ZeroParamStatus.INFLIGHT) when GatheredParameters repartitions them, which DeepSpeed
    refuses ("Cannot partition a param in flight"). The hooks are registered again on exit and the recorded trace
    is dropped, so the next forward records a fresh one (DeepSpeed releases without deepspeedai/DeepSpeed#8043
    kept the stale trace: "pop from an empty deque" at the next step)."""
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", None) or engine.optimizer  # training / inference engine
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        for p in params:  # no module call is in progress: none holds a parameter
            p.ds_active_sub_modules.clear()
        for hook in (*offload.forward_hooks, *offload.backward_hooks):
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload._register_deepspeed_module(offload.module)
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()


# ---------------------------------------------------------------------- torch


def children_dict(module: Any) -> dict[str, Any]:
    """The module's own dict of submodules (live: popping from it detaches one); {} for a non-module."""
    return getattr(module, "_modules", {})


def compiled_inner(module: Any) -> Any:
    """The module `torch.compile` wrapped in `module` (an OptimizedModule), else None."""
    return children_dict(module).get("_orig_mod")


def tensor_version(tensor: Any) -> int:
    return tensor._version


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    scheduler._last_lr = lrs


def recompile_limit(limit: int) -> Any:
    """A context in which torch.compile'd functions may keep up to `limit` graphs each."""
    import torch

    return torch._dynamo.config.patch(recompile_limit=limit)


def cpu_bf16_supported() -> bool:
    import torch

    native = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(native and native())


# ---------------------------------------------------------------------- datasets


def dataset_indices(dataset: Any) -> Any:
    """The indices table of a dataset after select/shuffle (None when its rows are in storage order)."""
    return dataset._indices


def dataset_fingerprint(dataset: Any, default: Any) -> Any:
    return getattr(dataset, "_fingerprint", default)
