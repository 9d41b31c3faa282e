"""Precision of causal-LM KD gradients in low precision against float64 (issue #29), on the CPU and on CUDA.

    python benchmarks/kd_precision.py                   # CPU: 64 tokens x hidden 32 x vocab 1,000, bf16 and fp16
    python benchmarks/kd_precision.py --device cuda     # 4,096 x 2,048 x 65,536 in bf16, Liger and TRL when installed

The agreement regime every KD run reaches: the teacher's hidden states and LM head at random, the student's = the
teacher's + 2% noise, logits of size ~`scale` (4 and 16). For each variant, the loss and its gradients with respect
to the student's hidden states (`dh`) and LM-head weight (`dW`) on the low-precision inputs, against a float64
computation of the same loss on the same inputs: relative Frobenius error `|g - g64| / |g64|`.

Variants: hf_distill's loss head (`hf_distill.losses.chunked`, the direct route and the module route that engines use),
whole logits with the GEMM in the input dtype (rounded logits, float32 loss math: what a model's own head under
autocast gives), whole logits with a float32-output GEMM, Liger-Kernel's `LigerFusedLinearJSD` and TRL's
`ChunkedDivergenceFunction` (JSD beta 0.5 and, for TRL, forward KL). Every KD term at temperature 1, mean over
tokens; `ce` is the student's cross-entropy alone. Writes benchmarks/results/kd_precision.{json,md} (one section per
device; the other device's section is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hf_distill import losses  # noqa: E402
from hf_distill.losses import chunked  # noqa: E402

KINDS = ["kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl", "tvd", "soft_ce", "ce"]
SHAPES = {"cpu": (64, 32, 1000), "cuda": (4096, 2048, 65536)}
BOUND = 5e-3


def inputs(device: str, dtype: torch.dtype, scale: float, shape: tuple[int, int, int], seed: int = 0) -> dict:
    n, hidden, vocab = shape
    g = torch.Generator(device=device).manual_seed(seed)
    h_t = torch.randn(n, hidden, device=device, generator=g)
    w_t = torch.randn(vocab, hidden, device=device, generator=g) * scale / hidden**0.5
    h_s = h_t + 0.02 * torch.randn(n, hidden, device=device, generator=g)
    w_s = w_t + 0.02 * torch.randn(vocab, hidden, device=device, generator=g) * scale / hidden**0.5
    labels = torch.randint(0, vocab, (n,), device=device, generator=g)
    return {"h_s": h_s.to(dtype), "w_s": w_s.to(dtype), "h_t": h_t.to(dtype), "w_t": w_t.to(dtype), "labels": labels}


def _divergence(kind: str, zs: torch.Tensor, zt: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if kind == "ce":
        return F.cross_entropy(zs, labels)
    value, _ = losses.divergence_rows(kind, torch.log_softmax(zs, -1), torch.log_softmax(zt, -1), beta=0.5)
    return value.mean()


def whole(x: dict, kind: str, gemm: str) -> torch.Tensor:
    """Whole logits; `gemm`: "float64" (the reference), "float32" (float32 output) or "input" (rounded)."""
    if gemm == "float64":
        zs, zt = x["h_s"] @ x["w_s"].T, x["h_t"].double() @ x["w_t"].double().T
    elif gemm == "float32":  # the operands upcast: the same numbers as a float32-output GEMM, differentiable
        zs, zt = x["h_s"].float() @ x["w_s"].float().T, x["h_t"].float() @ x["w_t"].float().T
    else:
        zs, zt = (x["h_s"] @ x["w_s"].T).float(), (x["h_t"] @ x["w_t"].T).float()
    return _divergence(kind, zs, zt, x["labels"])


def head(x: dict, kind: str, route: str) -> torch.Tensor:
    s_lin = _Head(x["w_s"])
    t_lin = _Head(x["w_t"])
    # the loss head compares position t with token t+1: append a dummy last position
    s = torch.cat([x["h_s"], x["h_s"][:1]])[None]
    t = torch.cat([x["h_t"], x["h_t"][:1]])[None]
    spec = None if kind == "ce" else chunked.dense_kd(kind, 1.0, 0.5)
    kd, ce = chunked.chunked_kd_and_ce(s, chunked.LogitsHead(s_lin), chunked.LogitsHead(t_lin), t, None,
                                       x["labels"][None] if kind == "ce" else None, spec,
                                       chunked.default_chunk(x["w_s"].shape[0]), route=route)
    return ce if kind == "ce" else kd


class _Head(torch.nn.Linear):
    """An `nn.Linear` around a given weight tensor (the benchmark's leaf), so the loss head reads that tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = None

    forward = torch.nn.Linear.forward


def liger(x: dict, kind: str) -> torch.Tensor:
    from liger_kernel.transformers import LigerFusedLinearJSD

    return LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0)(x["h_s"], x["w_s"], x["h_t"], x["w_t"], None)


def trl(x: dict, kind: str) -> torch.Tensor:
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    beta = {"kl": 0.0, "jsd": 0.5}[kind]
    divergence, _ = ChunkedDivergenceFunction.apply(x["h_s"], x["w_s"], None, x["h_t"], x["w_t"], None, beta, 1.0)
    return divergence.mean()


def gradients(fn, x: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    x["h_s"].requires_grad_(True)
    x["w_s"].requires_grad_(True)
    x["h_s"].grad = x["w_s"].grad = None
    loss = fn(x)
    loss.backward()
    out = float(loss.detach()), x["h_s"].grad.detach().clone(), x["w_s"].grad.detach().clone()
    x["h_s"].grad = x["w_s"].grad = None
    return out


def rel(g: torch.Tensor, ref: torch.Tensor) -> float:
    return float((g.double() - ref).norm() / ref.norm())


def eager(fn):
    """`fn` with the loss head's elementwise work uncompiled (HF_DISTILL_COMPILE=0), to compare both on a GPU."""

    def run(*args):
        os.environ["HF_DISTILL_COMPILE"] = "0"
        chunked._fused.cache_clear()
        try:
            return fn(*args)
        finally:
            os.environ["HF_DISTILL_COMPILE"] = "1"
            chunked._fused.cache_clear()

    return run


def variants(device: str) -> list[tuple[str, list[str], object]]:
    out = [
        ("hf_distill loss head (direct)", KINDS, lambda x, k: head(x, k, "direct")),
        ("hf_distill loss head (module route)", KINDS, lambda x, k: head(x, k, "module")),
        ("whole logits, GEMM in the input dtype", KINDS, lambda x, k: whole(x, k, "input")),
        ("whole logits, float32-output GEMM", KINDS, lambda x, k: whole(x, k, "float32")),
    ]
    if device == "cuda":
        out += [("hf_distill loss head (direct, eager elementwise)", KINDS, eager(lambda x, k: head(x, k, "direct"))),
                ("Liger-Kernel LigerFusedLinearJSD", ["jsd"], liger),
                ("TRL ChunkedDivergenceFunction", ["kl", "jsd"], trl)]
    return out


def run(device: str, dtypes: list[torch.dtype], scales: list[float], kinds: list[str]) -> dict:
    shape = SHAPES[device]
    rows, notes = [], []
    for dtype in dtypes:
        for scale in scales:
            x = inputs(device, dtype, scale, shape)
            for kind in kinds:
                ref_x = {k: (v.detach().double() if v.is_floating_point() else v) for k, v in x.items()}
                ref_loss, ref_h, ref_w = gradients(lambda r, k=kind: whole(r, k, "float64"), ref_x)
                del ref_x
                for name, supported, fn in variants(device):
                    if kind not in supported:
                        continue
                    try:
                        loss, g_h, g_w = gradients(lambda x, k=kind, f=fn: f(x, k), x)
                    except ImportError as err:
                        note = f"{name}: not installed ({err})"
                        if note not in notes:
                            notes.append(note)
                        continue
                    row = {"variant": name, "kind": kind, "dtype": str(dtype).removeprefix("torch."),
                           "scale": scale, "dh": rel(g_h, ref_h), "dW": rel(g_w, ref_w),
                           "loss_rel": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del g_h, g_w
                if device == "cuda":
                    torch.cuda.empty_cache()
    head_rows = [r for r in rows if r["variant"].startswith("hf_distill")]
    worst = max(max(r["dh"], r["dW"]) for r in head_rows)
    return {"shape": {"tokens": shape[0], "hidden": shape[1], "vocab": shape[2]}, "rows": rows, "notes": notes,
            "worst_hf_distill": worst, "bound": BOUND, "met": worst <= BOUND,
            "device": torch.cuda.get_device_name() if device == "cuda" else "CPU", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}


def markdown(data: dict) -> str:
    md = ["# Causal-LM KD gradients in low precision vs float64", "",
          "Relative Frobenius error of d loss / d student hidden states (`dh`) and d loss / d LM-head weight (`dW`) "
          "against float64 on the same low-precision inputs; agreement regime (student = teacher + 2% noise), "
          "T = 1, mean over tokens (`python benchmarks/kd_precision.py [--device cuda]`).", ""]
    for sec in data.values():
        shape = sec["shape"]
        md += [f"## {sec['device']} ({shape['tokens']:,} tokens x hidden {shape['hidden']:,} x vocab "
               f"{shape['vocab']:,}), torch {sec['torch']}, {sec['date']}", "",
               f"Worst hf_distill error: **{sec['worst_hf_distill']:.2%}** (bound {sec['bound']:.1%}: "
               f"{'met' if sec['met'] else 'NOT met'}).", ""]
        dtypes = sorted({r["dtype"] for r in sec["rows"]})
        scales = sorted({r["scale"] for r in sec["rows"]})
        head = " | ".join(f"{d} scale {s:g} dh / dW" for d in dtypes for s in scales)
        md += [f"| variant | kind | {head} |", "| --- | --- |" + " ---: |" * (len(dtypes) * len(scales))]
        keys = []
        for r in sec["rows"]:
            if (r["variant"], r["kind"]) not in keys:
                keys.append((r["variant"], r["kind"]))
        for variant, kind in keys:
            cells = []
            for d in dtypes:
                for s in scales:
                    r = next((r for r in sec["rows"] if (r["variant"], r["kind"], r["dtype"], r["scale"]) ==
                              (variant, kind, d, s)), None)
                    cells.append(f"{r['dh']:.2%} / {r['dW']:.2%}" if r else "")
            md.append(f"| {variant} | {kind} | " + " | ".join(cells) + " |")
        md += [f"\n{n}" for n in sec["notes"]] + [""]
    return "\n".join(md)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kinds", nargs="+", default=None, choices=KINDS,
                   help="default: every kind on the CPU; kl, jsd and ce on CUDA (each kind compiles its own kernels)")
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no CUDA device is available")
    dtypes = [torch.bfloat16, torch.float16] if a.device == "cpu" else [torch.bfloat16]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "kd_precision.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    kinds = a.kinds or (KINDS if a.device == "cpu" else ["kl", "jsd", "ce"])
    data[a.device] = run(a.device, dtypes, [4.0, 16.0], kinds)
    from sections import portable_tree  # no machine's absolute path (e.g. --out) in a results file

    data = portable_tree(data)
    path.write_text(json.dumps(data, indent=2) + "\n")
    (out / "kd_precision.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
