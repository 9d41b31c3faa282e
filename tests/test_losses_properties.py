"""Property-based checks of hf_distill.losses: sign, zero at agreement, padding, symmetry, stability."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_distill.losses import (
    attention_score_mse,
    cosine_loss,
    hidden_mse,
    kl_div,
    logit_mse,
    pkd_loss,
    relation_kl,
    soft_cross_entropy,
)

SLACK = 1e-6
HEADS = 2  # attention heads for scores, relation heads for relation_kl; divides D in {4, 8}


@dataclass(frozen=True)
class Case:
    seed: int
    batch: int
    length: int
    classes: int
    dim: int
    scale: float
    temperature: float
    lengths: tuple[int, ...]
    mask_dtype: torch.dtype

    def mask(self, length: int | None = None) -> torch.Tensor:
        length = self.length if length is None else length
        real = torch.arange(length)[None, :] < torch.tensor(self.lengths)[:, None]
        return real.to(self.mask_dtype)


@st.composite
def cases(draw, min_scale: int = -3, max_scale: int = 4) -> Case:
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 5))
    return Case(
        seed=draw(st.integers(0, 2**31 - 1)),
        batch=batch,
        length=length,
        classes=draw(st.integers(2, 6)),
        dim=draw(st.sampled_from([4, 8])),
        scale=10.0 ** draw(st.integers(min_scale, max_scale)),
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0, 5.0, 20.0])),
        lengths=tuple(draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))),
        mask_dtype=draw(st.sampled_from([torch.bool, torch.long, torch.float32])),
    )


@dataclass(frozen=True)
class Spec:
    """One loss seen as f(student, teacher, mask, temperature) on a single tensor per side."""

    name: str
    kind: str  # which shape family: logits | hidden | scores | relation | cls
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]
    zero_at_agreement: bool = True
    symmetric: bool = False

    @property
    def masked(self) -> bool:
        return self.kind != "cls"


def _topk(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, indices = t.topk(min(3, t.shape[-1]), dim=-1)
    return values, indices


SPECS = [
    Spec("kl_div", "logits", lambda s, t, m, temp: kl_div(s, t, temp, m)),
    # top-k: both sides renormalised over the teacher's k ids, so a true divergence, 0 at agreement
    Spec("kl_div_topk", "logits", lambda s, t, m, temp: kl_div(s, _topk(t), temp, m)),
    # soft CE is the teacher's entropy at agreement, checked separately
    Spec(
        "soft_cross_entropy",
        "logits",
        lambda s, t, m, temp: soft_cross_entropy(s, t, temp, m),
        zero_at_agreement=False,
    ),
    Spec("logit_mse", "logits", lambda s, t, m, temp: logit_mse(s, t, m), symmetric=True),
    Spec("hidden_mse", "hidden", lambda s, t, m, temp: hidden_mse(s, t, m), symmetric=True),
    Spec("cosine_loss", "hidden", lambda s, t, m, temp: cosine_loss(s, t, m), symmetric=True),
    Spec("attention_score_mse", "scores", lambda s, t, m, temp: attention_score_mse(s, t, m), symmetric=True),
    Spec("relation_kl", "relation", lambda s, t, m, temp: relation_kl(s[0], s[1], t[0], t[1], HEADS, m)),
    Spec("pkd_loss", "cls", lambda s, t, m, temp: pkd_loss(s, t), symmetric=True),
]


def shape(spec: Spec, case: Case, length: int) -> tuple[int, ...]:
    b, c, d = case.batch, case.classes, case.dim
    return {
        "logits": (b, length, c),
        "hidden": (b, length, d),
        "scores": (b, HEADS, length, length),
        "relation": (2, b, length, d),  # (a, b) pair stacked in front
        "cls": (b, d),
    }[spec.kind]


def make(spec: Spec, case: Case, offset: int, length: int | None = None, scale: float | None = None):
    gen = torch.Generator().manual_seed(case.seed + offset)
    length = case.length if length is None else length
    scale = case.scale if scale is None else scale
    return torch.randn(shape(spec, case, length), generator=gen) * scale


def pad(spec: Spec, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """Place ``x`` in the leading corner of the longer ``extra`` (time dims), keeping extra's values."""
    out = extra.clone()
    if spec.kind == "scores":
        out[:, :, : x.shape[2], : x.shape[3]] = x
    elif spec.kind == "relation":
        out[:, :, : x.shape[2]] = x
    else:
        out[:, : x.shape[1]] = x
    return out


def evaluate(spec: Spec, case: Case, s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None):
    return spec.fn(s, t, mask if spec.masked else None, case.temperature)


def assert_close(a: torch.Tensor, b: torch.Tensor, name: str) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_finite_and_nonnegative_with_finite_grads(case, use_mask):
    for i, spec in enumerate(SPECS):
        s = make(spec, case, 2 * i).requires_grad_(True)
        t = make(spec, case, 2 * i + 1)
        loss = evaluate(spec, case, s, t, case.mask() if use_mask else None)
        assert loss.dtype == torch.float32 and loss.dim() == 0, spec.name
        assert torch.isfinite(loss), spec.name
        # kl_div carries a T**2 factor, which scales float32 rounding around 0 with it.
        assert loss.item() >= -SLACK * max(1.0, case.temperature**2), (spec.name, loss.item())
        (grad,) = torch.autograd.grad(loss, s)
        assert torch.isfinite(grad).all(), spec.name


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_zero_when_student_equals_teacher(case, use_mask):
    mask = case.mask() if use_mask else None
    for i, spec in enumerate(SPECS):
        if not spec.zero_at_agreement:
            continue
        x = make(spec, case, i)
        loss = evaluate(spec, case, x, x.clone(), mask)
        assert abs(loss.item()) <= 1e-5, (spec.name, loss.item())


@settings(max_examples=40, deadline=None)
@given(cases(max_scale=2), st.booleans())
def test_soft_cross_entropy_is_minimal_at_agreement(case, use_mask):
    spec = next(s for s in SPECS if s.name == "soft_cross_entropy")
    mask = case.mask() if use_mask else None
    s, t = make(spec, case, 0), make(spec, case, 1)
    at_teacher = soft_cross_entropy(t, t, case.temperature, mask)
    # value at agreement is the mean entropy of the tempered teacher distribution
    log_p = torch.log_softmax(t.double() / case.temperature, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    real = torch.ones(entropy.shape, dtype=torch.bool) if mask is None else mask != 0
    expected = entropy[real].mean() if real.any() else torch.zeros((), dtype=torch.float64)
    torch.testing.assert_close(at_teacher.double(), expected, rtol=1e-5, atol=1e-5)
    # Gibbs: any other student pays at least that much
    other = soft_cross_entropy(s, t, case.temperature, mask)
    assert other.item() >= at_teacher.item() - 1e-5 * (1 + abs(at_teacher.item()))


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(1, 3), st.integers(-3, 4))
def test_invariant_to_extra_padding(case, extra, garbage_exponent):
    longer = case.length + extra
    for i, spec in enumerate(SPECS):
        if not spec.masked:
            continue  # pkd_loss takes one vector per example: no padding to add
        s, t = make(spec, case, 2 * i), make(spec, case, 2 * i + 1)
        garbage = 10.0**garbage_exponent
        s_long = pad(spec, s, make(spec, case, 100 + 2 * i, longer, garbage))
        t_long = pad(spec, t, make(spec, case, 101 + 2 * i, longer, garbage))
        base = evaluate(spec, case, s, t, case.mask())
        padded = evaluate(spec, case, s_long, t_long, case.mask(longer))
        assert_close(padded, base, spec.name)


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_symmetric_losses(case, use_mask):
    mask = case.mask() if use_mask else None
    for i, spec in enumerate(SPECS):
        if not spec.symmetric:
            continue
        a, b = make(spec, case, 2 * i), make(spec, case, 2 * i + 1)
        assert_close(evaluate(spec, case, a, b, mask), evaluate(spec, case, b, a, mask), spec.name)


@settings(max_examples=40, deadline=None)
@given(cases(min_scale=4, max_scale=4), st.booleans())
def test_stable_for_extreme_values(case, use_mask):
    """Values of magnitude 1e4 in float32, including exact +-1e4 entries, stay finite with finite grads."""
    mask = case.mask() if use_mask else None
    for i, spec in enumerate(SPECS):
        s = make(spec, case, 2 * i)
        s = torch.where(s.abs() > case.scale, s.sign() * 1e4, s).requires_grad_(True)
        t = make(spec, case, 2 * i + 1).clamp(-1e4, 1e4)
        loss = evaluate(spec, case, s, t, mask)
        assert torch.isfinite(loss) and loss.item() >= -SLACK, (spec.name, loss.item())
        (grad,) = torch.autograd.grad(loss, s)
        assert torch.isfinite(grad).all(), spec.name


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_relation_kl_with_different_hidden_sizes(case, use_mask):
    """Student D and teacher 2*D: each model uses its own head dim; the KL stays finite and >= 0."""
    gen = torch.Generator().manual_seed(case.seed)
    s = torch.randn(2, case.batch, case.length, case.dim, generator=gen) * case.scale
    t = torch.randn(2, case.batch, case.length, 2 * case.dim, generator=gen) * case.scale
    loss = relation_kl(s[0], s[1], t[0], t[1], HEADS, case.mask() if use_mask else None)
    assert torch.isfinite(loss) and loss.item() >= -SLACK
