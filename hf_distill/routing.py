"""Routing per row (issue #42 item 6): `teacher_model={"big": "http://host:8000/v1", "local": model}` names several
teachers (models, folders, URLs, offline signals: hf_distill.routed_signal), and each row's `teacher_id` column says
which one it is distilled from.

Each row's KD term is against its own teacher only, and a teacher runs (or a server is asked) only for the rows routed
to it. One batch is split into one sub-batch per teacher (rows kept in their width); each sub-batch runs the
single-teacher loss of its teacher (its own teacher side and KD path: the loss head, the sparse head for a served
teacher), as a share of the optimizer step's mean (hf_distill.losses.normalise): so the KD loss of a batch is the mean
over all its counted tokens, whatever teacher each came from, and a batch whose rows all go to one teacher is exactly
(bitwise) that teacher's single-teacher loss. A dict of one teacher is the single-teacher path itself.

What routing does not combine with is refused before training (:func:`check_routing`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from .base.batch_keys import ROUTE_COLUMN, TEACHER_PREFIX
from .tracking import ComponentTracker


def named_teachers(teacher_model: Any) -> dict[str, Any] | None:
    """The named teachers of a `teacher_model` dict (None for any other value), their names checked."""
    if not isinstance(teacher_model, Mapping):
        return None
    if not teacher_model:
        raise ValueError("teacher_model={} names no teacher: give {name: model, folder or URL}, or one teacher.")
    bad = [n for n in teacher_model if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"teacher_model's keys name the teachers of the {ROUTE_COLUMN!r} column and must be "
                         f"non-empty strings: {bad!r}.")
    empty = [n for n, t in teacher_model.items() if t is None]
    if empty:
        raise ValueError(f"teacher_model names {empty} without a teacher (None): give each name a model, folder, URL "
                         "or offline signal (load_teacher_signal(path)); cached teacher_* columns are not routed.")
    return dict(teacher_model)


def check_routing(names: list[str] | None, args: Any, dataset: Any, which: str = "train") -> None:
    """Refuse, before any model loads, what routing per row cannot honour: a column without named teachers (or the
    reverse), an id that names no teacher, and the options that combine teachers or need one shared teacher."""
    columns = list(getattr(dataset, "column_names", None) or [])
    if names is None:
        if ROUTE_COLUMN in columns:
            raise ValueError(f"The {which} dataset has a {ROUTE_COLUMN!r} column but teacher_model names no teachers: "
                             "give teacher_model={name: model or URL, ...} to route rows, or drop the column.")
        return
    import datasets

    if not isinstance(dataset, datasets.Dataset):  # streamed or plain rows: each batch is checked (Router.index)
        return
    if ROUTE_COLUMN not in columns and (which == "train" or args.eval_with_teacher):
        raise ValueError(f"teacher_model names teachers ({', '.join(names)}) but the {which} dataset has no "
                         f"{ROUTE_COLUMN!r} column saying which one each row is distilled from: add it.")
    # (Arrow's unique: no Python list of every row's id)
    unknown = sorted({str(v) for v in dataset.unique(ROUTE_COLUMN)} - set(names)) if ROUTE_COLUMN in columns else []
    if unknown:
        raise ValueError(f"The {which} dataset's {ROUTE_COLUMN!r} column names {unknown[:5]}, which teacher_model "
                         f"does not ({', '.join(names)}): fix the column or add those teachers.")
    if which == "train" and args.generates:
        raise ValueError(f"lmbda/seq_kd with teachers named in a dict ({ROUTE_COLUMN!r}): on-policy generation is not "
                         "done for routed teachers. Remove lmbda/seq_kd, or give one teacher (not a dict).")
    if which != "train" or len(names) < 2:
        return
    cached = [c for c in columns if c.startswith(TEACHER_PREFIX) and c != ROUTE_COLUMN]
    refused = {
        "multi_teacher": (args.multi_teacher is not None, "each row has one teacher, nothing is averaged or summed"),
        "teacher_weights": (args.teacher_weights is not None, "each row has one teacher, nothing is weighed"),
        "distill_terms": (bool(args.distill_terms), "intermediate terms would compare teachers of different shapes"),
        "cross_tokenizer": (bool(args.cross_tokenizer), "not done for routed teachers"),
        f"cached columns {cached}": (bool(cached), "cached outputs are not routed: give the signal as a named "
                                    "teacher, teacher_model={name: load_teacher_signal(path), ...}"),
    }
    for option, (given, why) in refused.items():
        if given:
            raise ValueError(f"{option} with teachers routed per row ({ROUTE_COLUMN!r}): {why}. Remove it, or give "
                             "one teacher.")


class Router:
    """The teachers of a Distiller by name: per teacher its own teacher side and KD paths (as a single-teacher
    Distiller builds them), the rows routed to each while training, and each one's KD loss (:meth:`log_values`)."""

    def __init__(self, distiller: Any, names: list[str], sides: list[Any], paths: list[Any],
                 signals: dict[int, Any] | None = None) -> None:
        self.distiller, self.names, self.sides, self.paths = distiller, names, sides, paths
        self.signals = signals or {}  # place -> SignalTeacher (hf_distill.routed_signal): its rows looked up per batch
        self.rows = collections.Counter({name: 0 for name in names})
        self.active = False
        # the outputs of the last split batch that are one per sub-batch (name: type), left out of its predictions:
        # refused by refuse_unmerged where the Trainer would keep them, never where it leaves them out (loss only)
        self.unmerged: dict[str, str] = {}
        # each teacher's KD since the last log: the sum of its sub-batch means times their counted tokens, the tokens
        self._kd = torch.zeros(2, len(names), dtype=torch.float64)

    def index(self, ids: Any) -> list[int]:
        """Each row's teacher, by its place in `names`; an id naming no teacher is refused."""
        ids = [str(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
        unknown = sorted(set(ids) - set(self.names))
        if unknown:
            raise ValueError(f"This batch's {ROUTE_COLUMN!r} names {unknown[:5]}, which teacher_model does not "
                             f"({', '.join(self.names)}).")
        return [self.names.index(i) for i in ids]

    def batches_for(self, place: int, batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows of these micro-batches routed to teacher `place` (what its server is asked for)."""
        out = []
        for batch in batches:
            rows = [r for r, i in enumerate(self.index(batch[ROUTE_COLUMN])) if i == place]
            if rows:
                out.append(_rows(batch, rows))
        return out

    @contextlib.contextmanager
    def use(self, place: int, model: Any):
        """The Distiller as the single-teacher Distiller of teacher `place` for one call."""
        d = self.distiller
        state = d._student_state(model)
        saved = d.teacher_side, d.paths, state.paths
        own = state.__dict__.setdefault("routed_paths", {0: state.paths})
        d.teacher_side, d.paths, state.paths = self.sides[place], self.paths[place], own.setdefault(place, {})
        self.active = True
        try:
            yield
        finally:
            d.teacher_side, d.paths, state.paths = saved
            self.active = False

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any):
        """`Distiller.compute_loss` of a batch whose rows name their teachers: one teacher's rows are its
        single-teacher loss as it is; several are split (:meth:`_split`)."""
        d = self.distiller
        distill = model.training or d.args.eval_with_teacher
        if ROUTE_COLUMN not in inputs and not distill:  # evaluation without the teacher: no row needs one
            with self.use(0, model):
                return d.compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if ROUTE_COLUMN not in inputs:
            raise ValueError(f"teacher_model names teachers ({', '.join(self.names)}) but this batch has no "
                             f"{ROUTE_COLUMN!r}: keep the column in the rows (and through the collator).")
        places = self.index(inputs.pop(ROUTE_COLUMN))
        groups: dict[int, list[int]] = {}
        for row, place in enumerate(places):
            groups.setdefault(place, []).append(row)
        if model.training:
            for place, rows in groups.items():
                self.rows[self.names[place]] += len(rows)
        if len(groups) == 1 or not distill:  # one teacher (or none running): its single-teacher loss, unchanged
            place = next(iter(groups))
            if distill:
                inputs = self._with_signal(place, inputs)
            with self.use(place, model):
                out = d.compute_loss(model, inputs, return_outputs, num_items_in_batch)
            self._log(place, model, inputs)
            return out
        return self._split(model, inputs, groups, return_outputs, num_items_in_batch)

    def _split(self, model, inputs, groups, return_outputs, num_items_in_batch):
        """Several teachers in one batch: each sub-batch's loss as its share of the step's mean (training, token-level
        heads), of the batch's KD-counted tokens (evaluation with eval_with_teacher), or of its rows (sequence-level
        heads, whose losses are means over rows)."""
        from .features.heads import TOKEN_LEVEL
        from .losses.normalise import COUNT_KINDS

        d = self.distiller
        share, token_level = None, d._head in TOKEN_LEVEL
        if not token_level:
            size = sum(len(rows) for rows in groups.values())
            share = [len(rows) / size for rows in groups.values()]
        elif not model.training:
            counts = [float(d._counts(_rows(inputs, rows))[COUNT_KINDS.index("kd")]) for rows in groups.values()]
            share = [c / max(sum(counts), 1.0) for c in counts]
        elif not d._step.take():  # a loop without start_step: this batch is its own step
            d._step.start(d._counts(inputs), 1, 1)
            d._step.take()
        stepped = model.training and token_level
        if model.training and not token_level and d._step.take():  # the sub-batches share this micro-batch's step
            stepped = True
        total, outs, order, parts, tracker = None, [], [], [], d.tracker
        # DDP: one forward through the wrapper per micro-batch, on every process alike (its buffer broadcast and its
        # reducer's set-up are collectives; processes split into different numbers of teachers would hang); the
        # other sub-batches run the module it wraps, whose gradients the micro-batch's one backward all-reduces.
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        for n, (place, rows) in enumerate(groups.items()):
            if stepped:
                d._step._left += 1  # each sub-batch is a share of this micro-batch's (already taken) step mean
            sub = self._with_signal(place, _rows(inputs, rows))
            d.tracker = ComponentTracker()  # the sub-batch's components: logged as one micro-batch's (below)
            try:
                with self.use(place, model):
                    got = d.compute_loss(model if n == 0 else inner, sub, return_outputs, num_items_in_batch)
            finally:
                parts.append((d.tracker, share[n] if share is not None else 1.0))
                d.tracker = tracker
            self._log(place, model, sub)
            loss = got[0] if return_outputs else got
            loss = loss * share[n] if share is not None else loss
            total = loss if total is None else total + loss
            if return_outputs:
                outs.append(got[1])
                order.extend(rows)
        tracker.fold(parts)
        if not return_outputs:
            return total
        back = torch.argsort(torch.tensor(order))
        sizes = [len(rows) for rows in groups.values()]
        merged = {k: _merge([o.get(k) for o in outs], sizes, back) for k in outs[0]}
        self.unmerged = {k: type(outs[0][k]).__name__ for k, v in merged.items() if v is _NOT_PER_ROW}
        return total, {k: v for k, v in merged.items() if v is not _NOT_PER_ROW}

    def _with_signal(self, place: int, inputs: dict[str, Any]) -> dict[str, Any]:
        """A batch of rows routed to teacher `place` with their offline signal's columns when it is one."""
        signal = self.signals.get(place)
        if signal is None:
            return inputs
        return {**inputs, **signal.columns_for(inputs, self.distiller._token_labels)}

    def check_signals(self, dataset: Any, which: str) -> None:
        """Every row of `dataset` routed to an offline signal is one of its rows (hf_distill.routed_signal)."""
        for signal in self.signals.values():
            signal.check_rows(dataset, which)

    def _log(self, place: int, model: Any, inputs: dict[str, Any]) -> None:
        kd = getattr(self.distiller, "last_kd", None)
        if model.training and kd is not None:
            from .losses.normalise import COUNT_KINDS

            tokens = float(self.distiller._counts(inputs)[COUNT_KINDS.index("kd")]) or 1.0  # sequence level: a row
            self._kd[:, place] += torch.tensor([float(kd) * tokens, tokens], dtype=torch.float64)

    def refuse_unmerged(self, ignore_keys: list[str]) -> None:
        """Refuse a left-out output (:attr:`unmerged`) that a prediction step keeps (not in `ignore_keys`): its
        predictions would silently lack it."""
        kept = [(k, kind) for k, kind in self.unmerged.items() if k not in ignore_keys]
        if kept:
            key, kind = kept[0]
            raise ValueError(
                f"The student's output {key!r} ({kind}) is one per sub-batch, not one per row: the rows of this batch "
                f"routed to different teachers ({ROUTE_COLUMN!r}) ran as separate sub-batches, so it cannot be put "
                f"back in the batch's order as a prediction. Leave it out (predict/evaluate(ignore_keys=[{key!r}]) or "
                "the student config's keys_to_ignore_at_inference), or have the student not return it."
            )

    def reset(self) -> None:
        """Forget the rows counted and the KD logged so far (a training starts: hand calls before it are not its)."""
        self.rows = collections.Counter({name: 0 for name in self.names})
        self._kd = torch.zeros_like(self._kd)

    def log_values(self, accelerator: Any = None) -> dict[str, float]:
        """`loss_kd/<name>`: each teacher's KD mean over the tokens routed to it since the last call (summed over
        processes, every process calling: one fixed-size reduce); teachers that saw no row are left out."""
        sums = self._kd
        if accelerator is not None and accelerator.num_processes > 1:
            sums = accelerator.reduce(sums.to(accelerator.device), "sum").cpu()
        self._kd = torch.zeros_like(self._kd)
        return {f"loss_kd/{name}": float(sums[0, i] / sums[1, i]) for i, name in enumerate(self.names)
                if sums[1, i] > 0}

    def describe(self) -> dict[str, dict[str, Any]]:
        """Every teacher's name, what it is (a model's name or folder, a server's model name) and its rows."""
        d, out, local = self.distiller, {}, 0
        for place, name in enumerate(self.names):
            if place in d.served:
                what = f"{d.served[place].name} (served)"
            elif place in self.signals:
                what = self.signals[place].describe()
            else:
                teacher = d.teachers[local]
                local += 1
                what = getattr(getattr(teacher, "config", None), "name_or_path", "") or type(teacher).__name__
            out[name] = {"teacher": what, "rows": int(self.rows[name])}
        return out


_NOT_PER_ROW = object()  # what _merge gives an output it cannot put back in row order


def _merge(values: list[Any], sizes: list[int], back: torch.Tensor) -> Any:
    """One output of the sub-batches put back together in the batch's row order: tensors of one row per row
    concatenated, tuples and lists (hidden states, attentions) element by element, None kept; anything else (a KV
    cache, a 0-d auxiliary loss, a (tokens, experts) router logit) is one per sub-batch: `_NOT_PER_ROW`."""
    first = values[0]
    if all(v is None for v in values):
        return None
    if all(isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n for v, n in zip(values, sizes, strict=True)):
        return torch.cat(values)[back.to(first.device)]
    if isinstance(first, tuple | list) and all(type(v) is type(first) and len(v) == len(first) for v in values):
        parts = [_merge(list(part), sizes, back) for part in zip(*values, strict=True)]
        return _NOT_PER_ROW if any(p is _NOT_PER_ROW for p in parts) else type(first)(parts)
    return _NOT_PER_ROW


def _rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """These rows of a batch: tensors and lists of one entry per row sliced, the rest kept."""
    size = len(batch[ROUTE_COLUMN]) if ROUTE_COLUMN in batch else next(
        v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim())
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == size:
            out[key] = value[torch.tensor(rows, device=value.device)]
        elif isinstance(value, list | tuple) and len(value) == size:
            out[key] = [value[r] for r in rows]
        else:
            out[key] = value
    return out


__all__ = ["ROUTE_COLUMN", "Router", "check_routing", "named_teachers"]
