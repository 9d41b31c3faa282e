"""Property-based checks of hf_distill.losses: sign, zero at agreement, padding, symmetry, stability."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_distill.losses import (
    attention_score_mse,
    cosine_loss,
    generalized_jsd,
    hidden_mse,
    kl_div,
    logit_mse,
    pkd_loss,
    relation_kl,
    reverse_kl,
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
    Spec("reverse_kl", "logits", lambda s, t, m, temp: reverse_kl(s, t, temp, m)),
    Spec("reverse_kl_topk", "logits", lambda s, t, m, temp: reverse_kl(s, _topk(t), temp, m)),
    # beta = 0.5 is the (scaled) Jensen-Shannon divergence: symmetric in student and teacher
    Spec("jsd", "logits", lambda s, t, m, temp: generalized_jsd(s, t, 0.5, temp, m), symmetric=True),
    Spec("jsd_0.2", "logits", lambda s, t, m, temp: generalized_jsd(s, t, 0.2, temp, m)),
    Spec("jsd_topk", "logits", lambda s, t, m, temp: generalized_jsd(s, _topk(t), 0.7, temp, m)),
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


LOGIT_DIVERGENCES = [spec for spec in SPECS if spec.kind == "logits" and spec.zero_at_agreement]


def _logits(case: Case, offset: int, length: int | None = None, scale: float | None = None) -> torch.Tensor:
    return make(SPECS[0], case, offset, length, scale)


@settings(max_examples=40, deadline=None)
@given(cases(), st.floats(0.0, 1.0), st.booleans(), st.booleans())
def test_jsd_nonnegative_and_zero_at_agreement_for_any_beta(case, beta, sparse, use_mask):
    mask = case.mask() if use_mask else None
    s, t = _logits(case, 0).requires_grad_(True), _logits(case, 1)
    teacher = _topk(t) if sparse else t
    loss = generalized_jsd(s, teacher, beta, case.temperature, mask)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() >= -SLACK * max(1.0, case.temperature**2), loss.item()
    (grad,) = torch.autograd.grad(loss, s)
    assert torch.isfinite(grad).all()
    same = generalized_jsd(t.clone(), teacher, beta, case.temperature, mask)
    assert abs(same.item()) < 1e-6, same.item()


def _chi_squared(s: torch.Tensor, teacher, temperature: float, mask: torch.Tensor | None):
    """Mean over real items of chi^2(P || Q) and chi^2(Q || P) in float64, on the teacher's (top-k) support."""
    if isinstance(teacher, tuple):
        t, s = teacher[0].double(), s.double().gather(-1, teacher[1])
    else:
        t, s = teacher.double(), s.double()
    log_p, log_q = torch.log_softmax(t / temperature, -1), torch.log_softmax(s / temperature, -1)
    pq = (2 * log_p - log_q).exp().sum(-1) - 1
    qp = (2 * log_q - log_p).exp().sum(-1) - 1
    real = torch.ones(pq.shape, dtype=torch.bool) if mask is None else mask != 0
    if not real.any():
        return 0.0, 0.0
    return pq[real].mean().item(), qp[real].mean().item()


@settings(max_examples=40, deadline=None)
@given(cases(max_scale=0), st.booleans(), st.booleans())
def test_jsd_small_beta_limits_are_forward_and_reverse_kl(case, sparse, use_mask):
    """JSD(beta) / beta -> KL(P || Q) as beta -> 0 and JSD(beta) / (1 - beta) -> KL(Q || P) as beta -> 1.

    The endpoints themselves are kl_div and reverse_kl exactly (TRL's convention). For the interior,
    ``-beta * chi2(P || Q) <= JSD(beta) / beta - KL(P || Q) <= beta * chi2(P || Q) - log(1 - beta)`` (from
    ``x / (1 + x) <= log(1 + x) <= x``), and the mirror image with ``chi2(Q || P)`` near 1; both are checked
    at beta = 1e-3 with float32 rounding on top.
    """
    mask = case.mask() if use_mask else None
    s, t = _logits(case, 0), _logits(case, 1)
    teacher = _topk(t) if sparse else t
    temp = case.temperature
    forward, reverse = kl_div(s, teacher, temp, mask), reverse_kl(s, teacher, temp, mask)
    assert torch.equal(generalized_jsd(s, teacher, 0.0, temp, mask), forward)
    assert torch.equal(generalized_jsd(s, teacher, 1.0, temp, mask), reverse)
    eps = 1e-3
    chi2_pq, chi2_qp = _chi_squared(s, teacher, temp, mask)
    rounding = 1e-4  # 10x the largest float32 error seen in 300 examples
    near_zero = generalized_jsd(s, teacher, eps, temp, mask).item() / eps
    near_one = generalized_jsd(s, teacher, 1 - eps, temp, mask).item() / eps
    for near, limit, chi2 in ((near_zero, forward.item(), chi2_pq), (near_one, reverse.item(), chi2_qp)):
        low = limit - temp**2 * (eps * chi2 + rounding)
        high = limit + temp**2 * (eps * chi2 - math.log1p(-eps) + rounding)
        assert low <= near <= high, (near, limit, chi2)


@settings(max_examples=40, deadline=None)
@given(cases(), st.booleans())
def test_bf16_inputs_give_float32_results(case, use_mask):
    """bf16 logits are upcast first: the result is float32 and equals the loss of the upcast inputs."""
    mask = case.mask() if use_mask else None
    for i, spec in enumerate(LOGIT_DIVERGENCES):
        s = _logits(case, 2 * i).to(torch.bfloat16)
        t = _logits(case, 2 * i + 1).to(torch.bfloat16)
        low = evaluate(spec, case, s, t, mask)
        assert low.dtype == torch.float32, spec.name
        torch.testing.assert_close(low, evaluate(spec, case, s.float(), t.float(), mask), rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(1, 3), st.sampled_from([1e4, float("inf"), float("nan")]))
def test_padding_affects_neither_value_nor_gradient_of_logit_divergences(case, extra, garbage):
    longer = case.length + extra
    for i, spec in enumerate(LOGIT_DIVERGENCES):
        s, t = _logits(case, 2 * i), _logits(case, 2 * i + 1)
        s_long = torch.full((case.batch, longer, case.classes), garbage)
        t_long = torch.full((case.batch, longer, case.classes), -garbage)
        s_long[:, : case.length], t_long[:, : case.length] = s, t
        pad = case.mask(longer) == 0
        s_long[pad], t_long[pad] = garbage, -garbage  # padded positions inside the original length too
        s_ref = torch.where(pad[:, : case.length, None], 0.0, s).requires_grad_(True)
        s_long.requires_grad_(True)
        loss = evaluate(spec, case, s_long, t_long, case.mask(longer))
        base = evaluate(spec, case, s_ref, torch.where(pad[:, : case.length, None], 0.0, t), case.mask())
        assert_close(loss, base, spec.name)
        (grad,) = torch.autograd.grad(loss, s_long)
        (grad_ref,) = torch.autograd.grad(base, s_ref)
        assert (grad[pad] == 0).all(), spec.name
        assert_close(grad[:, : case.length], grad_ref, spec.name)
