"""The registry of logit KD objectives (`kd_loss` kinds): one :class:`Divergence` entry per kind, and every list of
kinds the package shows or checks derived from it.

Why one registry: a divergence is used by the whole-logits losses (:mod:`.divergences`), the loss heads' row math
(:mod:`.kd_head`, :mod:`.sparse_head`), the CUDA kernels (:mod:`.triton_head`), the arguments' allowed values and help
(:mod:`hf_distill.arguments`) and the model card's wording (:mod:`hf_distill.publish`). Each reads the kind's entry
here, so a new divergence is one :func:`register` call (the built-in ones: :mod:`.kinds`), and a kind no entry names,
or an entry that lacks what a path needs (row math, a kernel code), is refused with one error naming the kind: it
never falls back to another divergence.

An entry's row math works on rows of log-probabilities at T (float32, `(..., C)`): ``log_q`` the student's, ``log_p``
the teacher's, and ``w`` the value of its mixture parameter (None without one):

- ``rows(log_q, log_p, w) -> (value, stat)``: per row the divergence (without the temperature factor) and the
  statistic ``sum_v Q_v dL/dQ_v`` its logit gradient needs (it takes every column, so the loss heads keep it from
  their forward pass);
- ``grad(la, lb, stat, w) -> g``: the closed-form ``dL/d(student logits / T)`` of a block of columns, from the row's
  ``stat`` (``(n, 1)``): ``Q_v (dL/dQ_v - stat)`` by the chain rule through the softmax.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

# re-exported by hf_distill.losses; `kinds()` and the views stay here (`hf_distill.losses.kinds` is the module of the
# built-in entries)
__all__ = ["Divergence", "Mixture", "UnknownDivergence", "get_divergence", "register", "unregister"]

RowsFn = Callable[[torch.Tensor, torch.Tensor, "float | None"], tuple[torch.Tensor, torch.Tensor]]
GradFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], torch.Tensor]


class UnknownDivergence(KeyError, ValueError):
    """A `kd_loss` kind no registry entry names, or an entry without what a path needs. A `KeyError` (a failed
    lookup) and a `ValueError` (a bad setting), so callers catching either see it; its message is one line."""

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Mixture:
    """A divergence's mixture parameter: the keyword the losses take it by (`beta` or `alpha`, as
    :func:`hf_distill.losses.logit_kd_loss` and :func:`hf_distill.losses.chunked.dense_kd`), the
    `DistillationArguments` field that sets it, and what the model card says it mixes."""

    name: str
    argument: str
    meaning: str = ""


@dataclass(frozen=True)
class Divergence:
    """One `kd_loss` kind: its name, row math, whole-logits function, kernel code, temperature factor and mixture.

    - ``rows`` / ``grad``: the row math the loss heads run (module docstring); None for an objective that is not
      a divergence of softmax distributions (``mse``), which the loss heads refuse.
    - ``dense``: the public whole-logits function (:func:`hf_distill.losses.kl_div`, ...), called as
      ``dense(student, teacher, temperature, mask)`` (with its mixture by keyword; without temperature when
      ``temperature_power`` is None); None: the whole-logits loss is ``rows`` over the teacher's support, averaged
      over positions, times the temperature factor (autograd through ``rows``).
    - ``triton_code``: the branch of :mod:`hf_distill.losses.triton_head`'s kernels that computes this kind; None:
      the CUDA kernel path refuses it (``HF_DISTILL_TRITON=0`` runs the same row math compiled by PyTorch).
    - ``temperature_power``: the factor ``T**power`` in front of the divergence (2: Hinton et al., so gradient
      magnitudes do not shrink as T grows; 0: none, TinyBERT's soft CE); None: the objective takes no temperature.
    - ``mixture``: its mixture parameter (:class:`Mixture`), None without one.
    - ``label`` / ``help`` / ``method``: what the model card's loss table calls it, the `kd_loss` help text's
      description, and the card's method tag (None: plain logit KD).
    - ``multi_label``: the per-label (sigmoid) form for multi-label heads; None: refused for them.
    - ``shift_grad``: ``grad`` against a teacher given as ``log P = log Q + shift`` (the sparse head), called as
      ``shift_grad(la, shift, stat, weight)``; None: ``grad(la, la + shift, ...)``. Needed by a gradient that jumps
      where P = Q (TVD's sign): in float32 ``la + shift`` rounds a shift below ``la``'s last bit away, and the jump
      must be read from the shift itself.
    """

    name: str
    label: str
    rows: RowsFn | None = None
    grad: GradFn | None = None
    dense: Callable[..., torch.Tensor] | None = None
    triton_code: int | None = None
    temperature_power: int | None = 2
    mixture: Mixture | None = None
    help: str = ""
    method: str | None = None
    multi_label: Callable[..., torch.Tensor] | None = field(default=None, compare=False)
    shift_grad: GradFn | None = field(default=None, compare=False)

    @property
    def softmax(self) -> bool:
        """Whether it compares softmax distributions (and so has row math): every kind but logit MSE."""
        return self.rows is not None

    def factor(self, temperature: float) -> float:
        """The constant in front of the divergence at `temperature`: ``T**temperature_power`` (1 without one)."""
        return temperature**self.temperature_power if self.temperature_power else 1.0

    def weight(self, beta: float, alpha: float) -> float | None:
        """The value of its mixture parameter among the losses' keywords (`beta`, `alpha`); None without one."""
        if self.mixture is None:
            return None
        return {"beta": beta, "alpha": alpha}[self.mixture.name]

    def card_label(self, value: float | None = None) -> str:
        """The model card's name for it, with its mixture's value when given and its temperature factor."""
        mix = f" ({self.mixture.name} = {value:g})" if self.mixture is not None and value is not None else ""
        power = f" x T^{self.temperature_power}" if self.temperature_power else ""
        return f"{self.label}{mix}{power}"


_REGISTRY: dict[str, Divergence] = {}


def register(entry: Divergence) -> Divergence:
    """Add a `kd_loss` kind. Refused when its name is taken (unregister it first) or its kernel code is another
    kind's, and when it has only half of the row math (``rows`` without ``grad`` or the reverse)."""
    if not isinstance(entry, Divergence):
        raise TypeError(f"register() takes a hf_distill.losses.registry.Divergence, got {type(entry).__name__}")
    if entry.name in _REGISTRY:
        raise ValueError(f"kd_loss kind {entry.name!r} is already registered; unregister({entry.name!r}) first")
    if (entry.rows is None) != (entry.grad is None):
        raise ValueError(f"kd_loss kind {entry.name!r}: give both rows and grad (the loss heads need both), or neither")
    if entry.triton_code is not None:
        if entry.rows is None:
            raise ValueError(f"kd_loss kind {entry.name!r}: a Triton kernel code needs the row math (rows, grad)")
        taken = [e.name for e in _REGISTRY.values() if e.triton_code == entry.triton_code]
        if taken:
            raise ValueError(f"kd_loss kind {entry.name!r}: Triton kernel code {entry.triton_code} is {taken[0]!r}'s")
    _REGISTRY[entry.name] = entry
    return entry


def unregister(name: str) -> Divergence:
    """Remove a kind (a test's, or one to replace); returns its entry."""
    if name not in _REGISTRY:
        raise UnknownDivergence(f"kd_loss kind {name!r} is not registered")
    return _REGISTRY.pop(name)


def kinds(softmax: bool | None = None, mixture: str | None = None) -> tuple[str, ...]:
    """The registered kinds in registration order; `softmax=True`: the divergences of softmax distributions (those
    with row math, which the loss heads compute), `False`: the others (`mse`); `mixture`: those whose mixture
    parameter the `DistillationArguments` field of that name sets (`"jsd_beta"`, `"skew_alpha"`)."""
    return tuple(e.name for e in _REGISTRY.values() if (softmax is None or e.softmax == softmax)
                 and (mixture is None or (e.mixture is not None and e.mixture.argument == mixture)))


def get_divergence(kind: str, needs: str | None = None) -> Divergence:
    """The entry of `kind`; refused (:class:`UnknownDivergence`) when no entry names it, or, with `needs="rows"`
    (the loss heads' row math), when the entry has none."""
    entry = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if entry is None:
        raise UnknownDivergence(f"unknown logit KD kind {kind!r}; known kinds: {', '.join(sorted(kinds()))}")
    if needs == "rows" and entry.rows is None:
        raise UnknownDivergence(f"kd_loss={kind!r} is not a divergence of softmax distributions, so it has no row "
                                f"math for the loss heads; divergences: {', '.join(kinds(softmax=True))}")
    return entry


class KindNames(Sequence[str]):
    """A live tuple-like view of the registered kinds (filtered as :func:`kinds`): the lists of kinds other modules
    name (`hf_distill.losses.DIVERGENCE_KINDS`, `hf_distill.arguments.KD_LOSS_KINDS`, ...) stay true when a kind is
    registered later."""

    def __init__(self, softmax: bool | None = None, mixture: str | None = None) -> None:
        self._filter = (softmax, mixture)

    def __getitem__(self, i):
        return kinds(*self._filter)[i]

    def __len__(self) -> int:
        return len(kinds(*self._filter))

    def __iter__(self) -> Iterator[str]:
        return iter(kinds(*self._filter))

    def __contains__(self, name: object) -> bool:
        return name in kinds(*self._filter)

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, Sequence) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(kinds(*self._filter))


class KindMap(Mapping[str, object]):
    """A live read-only mapping kind -> `attribute` of its entry, over the entries where that is not None
    (`hf_distill.losses.KD_LOSSES`: the whole-logits functions; `triton_head.KIND_CODES`: the kernel codes)."""

    def __init__(self, attribute: str) -> None:
        self._attribute = attribute

    def _items(self) -> dict[str, object]:
        return {k: v for k, e in _REGISTRY.items() if (v := getattr(e, self._attribute)) is not None}

    def __getitem__(self, kind: str):
        items = self._items()
        if kind not in items:
            raise UnknownDivergence(f"no kd_loss kind {kind!r} with a {self._attribute}; known: {', '.join(items)}")
        return items[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())

    def __repr__(self) -> str:
        return repr(self._items())
