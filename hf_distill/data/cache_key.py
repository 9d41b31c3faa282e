"""What a teacher-output cache is keyed by (`hf_distill.data.cache`): the teacher's weights, class and config
(`teacher_fingerprint`, memoised per module), the values of the dataset columns its forward reads, the settings
(collators and functions described by their code and the values they read) and the versions and autocast state
the outputs depend on. Split from `cache`, which writes and reads the outputs under this key."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import weakref
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch import nn

from ..base.optimizer_steps import StepWatch
from ..compat import dataset_indices, tensor_version
from ..features.taps import unwrap

__all__ = ["teacher_fingerprint"]


def teacher_fingerprint(model: nn.Module) -> str:
    """blake2b of the class, config and every state_dict tensor (name, dtype, shape, bytes).

    Hashing raw bytes runs at memory speed (about 0.1 s for MiniLM-L6's 22.7 M parameters, seconds for a
    billion-parameter teacher), and any changed weight, buffer, dtype or head changes the result. The result is
    memoised per module: it is reused while every tensor keeps its storage (`data_ptr`) and in-place version
    counter (`_version`, bumped by in-place ops under `no_grad`, `load_state_dict`, `nn.init`) and no optimizer
    has stepped in this process (fused optimizers write without bumping `_version`). Edits that bypass both,
    through `.data` in place (`p.data.mul_(2)`) or a NumPy view, are not seen: replace the tensor instead, or
    `teacher_fingerprint.memo.clear()`.
    """
    inner = unwrap(model)
    header = _teacher_header(inner)
    state = inner.state_dict()
    signature = _state_signature(header, state)
    memo = teacher_fingerprint.memo.get(inner) if signature is not None else None
    if memo is not None and memo[0] == signature and not memo[2].stepped():
        return memo[1]
    digest = _hash_state(header, state)
    if signature is not None:
        teacher_fingerprint.memo[inner] = (signature, digest, StepWatch())
    return digest


# module -> (signature, digest, watch): any optimizer step in this process since invalidates the memoised digest
teacher_fingerprint.memo = weakref.WeakKeyDictionary()


def _teacher_header(inner: nn.Module) -> str:
    config = getattr(inner, "config", None)
    cfg = {}
    if config is not None and hasattr(config, "to_dict"):
        cfg = {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    return f"{type(inner).__module__}.{type(inner).__qualname__}|" + json.dumps(cfg, sort_keys=True, default=str)


def _state_signature(header: str, state: dict[str, torch.Tensor]) -> tuple | None:
    """What must stay equal for a memoised fingerprint to hold; None when a tensor has no plain storage."""
    try:
        tensors = tuple((name, t.data_ptr(), tensor_version(t), str(t.dtype), tuple(t.shape), tuple(t.stride()),
                         t.storage_offset(), str(t.device)) for name, t in sorted(state.items()))
    except (RuntimeError, NotImplementedError):  # e.g. sharded or meta tensors: hash every time
        return None
    return header, tensors


def _hash_state(header: str, state: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(header.encode())
    for name, tensor in sorted(state.items()):
        t = tensor.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(memoryview(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


_SIMPLE = (str, int, float, bool, type(None))


def _describe(obj: Any, _path: frozenset[int] = frozenset()) -> Any:
    """A stable, JSON-able description of a collator (or `key`): what it is and every setting it holds.

    Functions are described by their code (bytecode and constants), defaults, closure cells and the simple
    module-level values they read; `functools.partial` by its function, args and keywords; objects by their
    class and attributes (`__dict__` and `__slots__`, private ones included); tensors and arrays by a hash of
    their bytes. Never an address, so equal settings give equal descriptions across processes.
    """
    if isinstance(obj, _SIMPLE):
        return obj if not isinstance(obj, float) or obj == obj else "nan"
    if id(obj) in _path:
        return "<cycle>"
    path = _path | {id(obj)}
    if isinstance(obj, list | tuple):
        return [_describe(v, path) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted((_describe(v, path) for v in obj), key=lambda v: json.dumps(v, sort_keys=True, default=str))
    if isinstance(obj, dict):
        return {str(k): _describe(v, path) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, torch.dtype | torch.device):
        return str(obj)
    if isinstance(obj, torch.Tensor | np.ndarray):
        array = obj.detach().cpu().contiguous().numpy() if isinstance(obj, torch.Tensor) else np.ascontiguousarray(obj)
        return {"array": str(array.dtype), "shape": list(array.shape),
                "bytes": hashlib.blake2b(array.tobytes(), digest_size=16).hexdigest()}
    if isinstance(obj, functools.partial):
        return {"partial": _describe(obj.func, path), "args": _describe(obj.args, path),
                "keywords": _describe(obj.keywords, path)}
    if inspect.ismethod(obj):
        return {"method": _describe(obj.__func__, path), "self": _describe(obj.__self__, path)}
    if inspect.isfunction(obj):
        return _describe_function(obj, path)
    if inspect.isbuiltin(obj) or inspect.isclass(obj) or inspect.ismodule(obj):
        return f"{getattr(obj, '__module__', None) or ''}.{getattr(obj, '__qualname__', obj.__name__)}"
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if hasattr(obj, "name_or_path") and hasattr(obj, "padding_side"):  # a tokenizer
        return {"tokenizer": name, **{k: _describe(getattr(obj, k, None), path) for k in (
            "name_or_path", "padding_side", "truncation_side", "model_max_length", "vocab_size", "pad_token_id")}}
    state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in [slots] if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                state[slot] = getattr(obj, slot)
    return {"class": name, **{k: _describe(v, path) for k, v in sorted(state.items()) if not k.startswith("__")}}


def _describe_function(fn: Any, path: frozenset[int]) -> dict[str, Any]:
    code = fn.__code__
    cells = dict(zip(code.co_freevars, fn.__closure__ or (), strict=True))
    used_globals = {}
    for g in sorted(_code_names(code)):
        value = fn.__globals__.get(g)
        if isinstance(value, _SIMPLE) and g in fn.__globals__:
            used_globals[g] = value
        elif inspect.isfunction(value) and value.__module__ == fn.__module__ and id(value) not in path:
            used_globals[g] = _describe_function(value, path | {id(value)})  # a helper in the same file
    return {"function": f"{fn.__module__}.{fn.__qualname__}", "code": _code_digest(code),
            "defaults": _describe(fn.__defaults__, path), "kwdefaults": _describe(fn.__kwdefaults__, path),
            "closure": {k: _describe(c.cell_contents, path) if _cell_filled(c) else "<empty>"
                        for k, c in cells.items()},
            "globals": used_globals}


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _code_digest(code: Any) -> str:
    h = hashlib.blake2b(code.co_code, digest_size=12)
    for const in code.co_consts:
        if inspect.iscode(const):
            h.update(_code_digest(const).encode())
        elif isinstance(const, frozenset):
            h.update(repr(sorted(map(repr, const))).encode())  # set order depends on the hash seed
        else:
            h.update(repr(const).encode())
    h.update(repr(code.co_names).encode())
    return h.hexdigest()


def _autocast_state(device_type: str) -> str | None:
    """The autocast dtype the teacher's forward runs under here (None when autocast is off for its device)."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return str(torch.get_autocast_dtype(device_type))


def _teacher_inputs(teacher: nn.Module, dataset: datasets.Dataset) -> tuple[set[str], list[str]]:
    """The parameters the teacher's forward takes (labels excepted) and the dataset columns among them."""
    accepted = set(inspect.signature(unwrap(teacher).forward).parameters) - {"labels"}
    inputs = [c for c in dataset.column_names if c in accepted]
    if "input_ids" not in inputs:
        raise ValueError(f"The dataset has no `input_ids` column (columns: {dataset.column_names}): tokenise first.")
    return accepted, inputs


def _dataset_digest(dataset: datasets.Dataset, columns: list[str]) -> str:
    """blake2b of the values of `columns` only, row by row (after any select/shuffle), so a changed label or
    an added id column keeps the cache while a changed input recomputes it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({c: str(dataset.features[c]) for c in columns}, sort_keys=True).encode())
    table = dataset.data.table.select(columns)
    indices = dataset_indices(dataset)
    indices = indices.column(0) if indices is not None else None  # after select/shuffle
    for start in range(0, len(dataset), 50_000):
        part = table.slice(start, 50_000) if indices is None else table.take(indices.slice(start, 50_000))
        for c in columns:
            _hash_arrow(h, part.column(c).combine_chunks())
    return h.hexdigest()


def _hash_arrow(h: Any, array: pa.Array) -> None:
    """Logical values, not buffers (a sliced array shares its parent's buffers): list lengths, then items."""
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        lengths = pc.list_value_length(array).fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        h.update(lengths.tobytes())
        _hash_arrow(h, pc.list_flatten(array))
    elif pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        if array.null_count:
            h.update(array.is_null().to_numpy(zero_copy_only=False).tobytes())
            array = array.fill_null(0)
        h.update(array.to_numpy(zero_copy_only=False).tobytes())
    else:
        h.update(json.dumps(array.to_pylist(), default=str).encode())


def _fingerprint(teacher_fp: str, dataset_fp: str, rows: int, settings: dict[str, Any]) -> str:
    import transformers

    payload = json.dumps({"teacher": teacher_fp, "dataset": dataset_fp, "rows": rows, "settings": settings,
                          "versions": {"transformers": transformers.__version__, "torch": torch.__version__}},
                         sort_keys=True, default=str)
    return hashlib.blake2b(payload.encode(), digest_size=12).hexdigest()
