"""The loss head's module route with LM heads that are not an `nn.Linear` (issue #39 case 13): a custom head's or a
quantised head's matrix product gives float32 logits too, so their KD gradients stay as close to float64 as a linear
head's; a head whose product cannot be widened is named in a warning with the precision it costs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_distill import losses
from hf_distill.losses import chunked, head_common

VOCAB, HIDDEN, ROWS = 1000, 32, 64


class MatmulHead(nn.Module):
    """A custom LM head: its own weight, its logits by a matrix product (`@`, `torch.matmul` or `Tensor.mm`)."""

    def __init__(self, weight: torch.Tensor, op: str):
        super().__init__()
        self.weight, self.op = nn.Parameter(weight.clone()), op

    def forward(self, h):
        if self.op == "@":
            return h @ self.weight.T
        if self.op == "matmul":
            return torch.matmul(h, self.weight.t())
        return h.reshape(-1, h.shape[-1]).mm(self.weight.t()).reshape(*h.shape[:-1], -1)


class QuantisedHead(nn.Module):
    """A frozen int8 head (as a quantised teacher's): weights dequantised in the activations' dtype, then `h @ W^T`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features = weight.shape[0]
        scale = weight.float().abs().amax(1, keepdim=True) / 127
        self.register_buffer("qweight", torch.round(weight.float() / scale).to(torch.int8))
        self.register_buffer("scale", scale)

    def dequantised(self) -> torch.Tensor:
        return self.qweight.float() * self.scale

    def forward(self, h):
        return h @ (self.qweight.to(h.dtype) * self.scale.to(h.dtype)).T


class EinsumHead(MatmulHead):
    """A product the loss head does not widen (`torch.einsum`): its logits come out rounded."""

    def forward(self, h):
        return torch.einsum("...h,vh->...v", h, self.weight)


def _agreement(seed: int = 0):
    """bf16-representable states and weights (so the float64 reference reads exactly the GEMM's operands), the
    student = teacher + 2% noise (near agreement, where a bf16-rounded logit is as large as the KD gradient)."""
    g = torch.Generator().manual_seed(seed)
    h_t = torch.randn(ROWS + 1, HIDDEN, generator=g)
    w_t = torch.randn(VOCAB, HIDDEN, generator=g) * 16 / HIDDEN**0.5
    h_s = h_t + 0.02 * torch.randn(ROWS + 1, HIDDEN, generator=g)
    w_s = w_t + 0.02 * torch.randn(VOCAB, HIDDEN, generator=g) * 16 / HIDDEN**0.5
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    return *(x.bfloat16().float() for x in (h_s, w_s, h_t, w_t)), labels


def _float64(h_s, w_s, z_t, labels, kind):
    """The loss (0.7 KD at T = 2 + 0.3 CE) and its gradients in float64 from the same operands."""
    h = h_s.double().requires_grad_(True)
    w = w_s.double().requires_grad_(True)
    zs = h[:-1] @ w.T
    log_q, log_p = torch.log_softmax(zs / 2.0, -1), torch.log_softmax(z_t.double() / 2.0, -1)
    value, _ = losses.divergence_rows(kind, log_q, log_p, beta=0.4, alpha=0.1)
    kd = value.mean() * 4.0
    (0.7 * kd + 0.3 * F.cross_entropy(zs, labels)).backward()
    return kd.detach(), h.grad, w.grad


def _relative(got, want):
    return float((got.double() - want).norm() / want.norm())


def _head_loss(s_module, t_module, h_s, h_t, labels, kind, autocast):
    x = h_s[None].clone().requires_grad_(True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        kd, ce = chunked.chunked_kd_and_ce(x, chunked.LogitsHead(s_module), chunked.LogitsHead(t_module),
                                           h_t[None], None, labels[None], chunked.dense_kd(kind, 2.0, 0.4, 0.1),
                                           chunk_size=16)
    (0.7 * kd + 0.3 * ce).backward()
    return kd, x.grad[0]


@pytest.mark.parametrize(("op", "precision", "kind"), [("@", "autocast", "jsd"), ("@", "bf16 weights", "kl"),
                                                       ("matmul", "bf16 weights", "jsd"), ("mm", "autocast", "kl")])
def test_a_custom_head_takes_the_module_route_with_float32_logits(op, precision, kind):
    """A custom student head and an int8 teacher head (neither an nn.Linear: the module route) in bf16, under
    autocast (float32 weights) or with bf16 weights: KD + CE gradients within 0.5% of float64, as a linear head's.
    Rounded to bf16 by their GEMMs (before issue #39 case 13), the hidden-state gradient was 2.4-6.6% off here."""
    h_s, w_s, h_t, w_t, labels = _agreement()
    s_head, t_head = MatmulHead(w_s, op), QuantisedHead(w_t)
    z_t = h_t[:-1].double() @ t_head.dequantised().bfloat16().double().T  # autocast's bf16 operand
    autocast = precision == "autocast"
    if not autocast:
        s_head, t_head, h_s, h_t = s_head.bfloat16(), t_head.bfloat16(), h_s.bfloat16(), h_t.bfloat16()
        z_t = h_t[:-1].double() @ (t_head.qweight.bfloat16() * t_head.scale).double().T  # its bf16 dequantisation
    assert not chunked.LogitsHead(s_head).direct and not chunked.LogitsHead(t_head).direct
    want_kd, want_h, want_w = _float64(h_s, s_head.weight.detach(), z_t, labels, kind)
    kd, grad_h = _head_loss(s_head, t_head, h_s, h_t, labels, kind, autocast)
    assert _relative(grad_h, want_h) < 5e-3
    assert _relative(s_head.weight.grad, want_w) < 5e-3
    assert float(kd.detach()) == pytest.approx(float(want_kd), rel=1e-3, abs=1e-6)


def test_float32_products_are_left_as_they_are():
    """Outside low precision the mode changes nothing: a float32 product is the operation itself, bit for bit."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 5, 8, generator=g), torch.randn(8, 7, generator=g)
    with head_common.float32_logits():
        got = [a @ b, torch.matmul(a, b), a[0].mm(b)]
    assert all(torch.equal(x, y) for x, y in zip(got, [a @ b, torch.matmul(a, b), a[0].mm(b)]))


def test_a_head_whose_product_cannot_be_widened_is_named_in_a_warning(caplog):
    """An op outside `F.linear` / matmul (here `torch.einsum`) still returns bf16 logits: the head upcasts them, and
    a warning (once) names the head and the precision it costs."""
    h_s, w_s, h_t, w_t, labels = _agreement()
    s_head, t_head = EinsumHead(w_s, "einsum").bfloat16(), nn.Linear(HIDDEN, VOCAB, bias=False).bfloat16()
    head_common._warn_rounded_logits.cache_clear()
    with caplog.at_level("WARNING"):
        _head_loss(s_head, t_head, h_s.bfloat16(), h_t.bfloat16(), labels, "kl", False)
        _head_loss(s_head, t_head, h_s.bfloat16(), h_t.bfloat16(), labels, "kl", False)
    warned = [r.getMessage() for r in caplog.records if "EinsumHead" in r.getMessage()]
    assert len(warned) == 1 and "bfloat16 logits" in warned[0] and "float64" in warned[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_mm_f32_into_writes_the_float32_product_in_place(device):
    """The fused mode's first write of its accumulator and its row blocks: bf16 operands, the float32 product
    written into the given tensor (its old contents, NaN here, neither read nor kept), as :func:`mm_f32` computes it
    (on CUDA: the GEMM's float32 output, where this torch has `mm(..., out_dtype=, out=)`, as it has `addmm`'s)."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*shape, generator=g).bfloat16().to(device) for shape in ((33, 70), (70, 48)))
    acc = torch.full((40, 48), float("nan"), device=device)
    out = head_common.mm_f32_into(acc[3:36], a, b)
    assert out.data_ptr() == acc[3:36].data_ptr() and torch.equal(acc[3:36], head_common.mm_f32(a, b))
    assert acc[:3].isnan().all() and acc[36:].isnan().all()
    whole = torch.full((70, 48), float("nan"), device=device)  # a transposed operand, as the weight's `G^T H`
    torch.testing.assert_close(head_common.mm_f32_into(whole, a.t(), a.new_ones(33, 48)),
                               head_common.mm_f32(a.t(), a.new_ones(33, 48)), rtol=0, atol=0)
    if device == "cuda":
        assert head_common._cuda_mm_out_dtype_into() == head_common._cuda_addmm_out_dtype()
