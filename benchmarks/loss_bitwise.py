"""Bit-for-bit regression grid of the logit losses on the CPU, for refactors that must not change a bit (issue #40:
"the loss heads stay bitwise identical on CPU").

    python benchmarks/loss_bitwise.py save /tmp/before.pt      # on the commit before the refactor
    python benchmarks/loss_bitwise.py compare /tmp/before.pt   # after it: exit 1 and the differing cases if any

1,712 cases with fixed seeds, each its losses and gradients: the whole-logits losses (`logit_kd_loss`, every kind,
dense / top-k / top-k + tail teachers, T 1 and 2, with and without a mask, logits of size 3 and 120), the row math
(`divergence_rows`, `row_gradient`, including zero-mass classes and log-ratios beyond the fast range), the loss head
(`chunked_kd_and_ce`: direct and module routes, with and without CE, T 1 and 2.5, plain and soft-capped + scaled
heads, chunks of 3 and 16, teacher LM head and cached logits) and the sparse head (the same grid, k 6 and the whole
vocabulary). Compared bit for bit (a NaN equals the same NaN). About 8 minutes on 2 busy cores.
"""
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_distill import losses  # noqa: E402
from hf_distill.losses import chunked  # noqa: E402

KINDS = ["kl", "soft_ce", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd"]
MIX = {"jsd": [(0.3, 0.1), (0.0, 0.1), (1.0, 0.1), (0.5, 0.1)], "skew_kl": [(0.5, 0.1), (0.5, 0.25)],
       "skew_reverse_kl": [(0.5, 0.1), (0.5, 0.25)]}
out = {}


def rec(name, *ts):
    assert name not in out, name
    out[name] = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in ts]


def dense_cases():
    g = torch.Generator().manual_seed(1)
    b, t, c = 2, 5, 40
    for kind in [*KINDS, "mse"]:
        for beta, alpha in MIX.get(kind, [(0.5, 0.1)]):
            for form in (["dense"] if kind == "mse" else ["dense", "topk", "tail", "tail_full"]):
                for T, masked, scale in itertools.product([1.0, 2.0], [False, True], [3.0, 120.0]):
                    s = (torch.randn(b, t, c, generator=g) * scale).requires_grad_(True)
                    tl = torch.randn(b, t, c, generator=g) * scale
                    mask = torch.ones(b, t, dtype=torch.long)
                    if masked:
                        mask[1, 3:] = 0
                    if form == "dense":
                        teacher = tl
                    elif form == "topk":
                        teacher = tuple(tl.topk(7, -1))
                    else:
                        teacher = losses.topk_with_tail(tl, c if form == "tail_full" else 7, T)
                    v = losses.logit_kd_loss(kind, s, teacher, T, mask=mask if masked else None, beta=beta,
                                             alpha=alpha)
                    v.backward()
                    rec(f"dense/{kind}/{beta}/{alpha}/{form}/{T}/{masked}/{scale}", v, s.grad)


def rows_cases():
    g = torch.Generator().manual_seed(2)
    for kind in KINDS:
        for beta, alpha in MIX.get(kind, [(0.5, 0.1)]):
            for scale, zero in itertools.product([2.0, 150.0], [False, True]):
                a = torch.randn(6, 30, generator=g) * scale
                b = torch.randn(6, 30, generator=g) * scale
                if zero:
                    b[0, :5] = float("-inf")
                la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
                if kind == "jsd" and beta in (0.0, 1.0):
                    continue  # remapped by dense_kd before the loss head
                v, st = losses.divergence_rows(kind, la, lb, beta, alpha)
                gr = chunked.row_gradient(kind, la, lb, st[:, None], beta, alpha)
                rec(f"rows/{kind}/{beta}/{alpha}/{scale}/{zero}", v, st, gr)


def head_cases():
    g = torch.Generator().manual_seed(3)
    B, T_, H, V = 2, 7, 8, 50
    for kind in KINDS:
        for beta, alpha in MIX.get(kind, [(0.5, 0.1)])[:2]:
            for route, ce, T, post, chunk, src in itertools.product(["direct", "module"], [False, True], [1.0, 2.5],
                                                                    ["plain", "cap"], [3, 16], ["head", "cached"]):
                s_lin = torch.nn.Linear(H, V, bias=post == "cap")
                t_lin = torch.nn.Linear(H, V, bias=False)
                with torch.no_grad():
                    s_lin.weight.copy_(torch.randn(V, H, generator=g))
                    t_lin.weight.copy_(s_lin.weight + 0.3 * torch.randn(V, H, generator=g))
                    if post == "cap":
                        s_lin.bias.copy_(torch.randn(V, generator=g))
                s_head = chunked.LogitsHead(s_lin, 0.5, 4.0) if post == "cap" else chunked.LogitsHead(s_lin)
                t_head = chunked.LogitsHead(t_lin, 0.5, 4.0) if post == "cap" else chunked.LogitsHead(t_lin)
                hs = torch.randn(B, T_, H, generator=g).requires_grad_(True)
                ht = torch.randn(B, T_, H, generator=g)
                kd_mask = torch.ones(B, T_ - 1, dtype=torch.bool)
                kd_mask[1, 4:] = False
                labels = torch.randint(0, V, (B, T_ - 1), generator=g) if ce else None
                if labels is not None:
                    labels[0, :2] = -100
                if src == "head":
                    teacher, t_hidden = t_head, ht
                else:
                    with torch.no_grad():
                        teacher, t_hidden = t_head(ht[:, :-1]), None
                spec = chunked.dense_kd(kind, T, beta, alpha)
                kd, c = chunked.chunked_kd_and_ce(hs, s_head, teacher, t_hidden, kd_mask, labels, spec, chunk,
                                                  route=route)
                loss = kd + (c if c is not None else 0)
                loss.backward()
                grads = [hs.grad, s_lin.weight.grad] + ([s_lin.bias.grad] if s_lin.bias is not None else [])
                rec(f"head/{kind}/{beta}/{alpha}/{route}/{ce}/{T}/{post}/{chunk}/{src}", kd, c, *grads)


def sparse_cases():
    g = torch.Generator().manual_seed(4)
    B, T_, H, V = 2, 7, 8, 50
    for kind in KINDS:
        for beta, alpha in MIX.get(kind, [(0.5, 0.1)])[:2]:
            for route, ce, T, post, chunk, k in itertools.product(["direct", "module"], [False, True], [1.0, 2.5],
                                                                  ["plain", "cap"], [3, 16], [6, V]):
                s_lin = torch.nn.Linear(H, V, bias=False)
                with torch.no_grad():
                    s_lin.weight.copy_(torch.randn(V, H, generator=g))
                s_head = chunked.LogitsHead(s_lin, 0.5, 4.0) if post == "cap" else chunked.LogitsHead(s_lin)
                hs = torch.randn(B, T_, H, generator=g).requires_grad_(True)
                zt = torch.randn(B, T_ - 1, V, generator=g) * 3
                teacher = losses.topk_with_tail(zt, k, T)
                kd_mask = torch.ones(B, T_ - 1, dtype=torch.bool)
                kd_mask[1, 4:] = False
                labels = torch.randint(0, V, (B, T_ - 1), generator=g) if ce else None
                spec = chunked.dense_kd(kind, T, beta, alpha)
                kd, c = chunked.chunked_kd_and_ce(hs, s_head, teacher, None, kd_mask, labels, spec, chunk,
                                                  route=route)
                (kd + (c if c is not None else 0)).backward()
                rec(f"sparse/{kind}/{beta}/{alpha}/{route}/{ce}/{T}/{post}/{chunk}/{k}", kd, c, hs.grad,
                    s_lin.weight.grad)


def main() -> None:
    torch.manual_seed(0)
    dense_cases()
    rows_cases()
    head_cases()
    sparse_cases()
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "save":
        torch.save(out, path)
        print(f"saved {len(out)} cases")
    else:
        ref = torch.load(path)
        assert set(ref) == set(out), set(ref) ^ set(out)
        def same(a, b):  # bit for bit (a NaN equals the same NaN; torch.equal would call any NaN different)
            if a is None or b is None:
                return a is None and b is None
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.dtype == torch.float32:
                return torch.equal(a.view(torch.int32), b.view(torch.int32))
            if a.dtype in (torch.bfloat16, torch.float16):
                return torch.equal(a.view(torch.int16), b.view(torch.int16))
            return torch.equal(a, b)
        bad = [k for k in ref if len(ref[k]) != len(out[k]) or not all(same(a, b) for a, b in zip(ref[k], out[k]))]
        print(f"{len(ref)} cases, {len(bad)} differ", bad[:10])
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
