"""Time and peak CUDA memory of the causal-LM KD loss head at LLM scale, beside Liger-Kernel, TRL and the bare
LM-head GEMM, measured in one run (issue #29). Needs a CUDA GPU.

    python benchmarks/causal_lm_gpu.py                       # 8,192 tokens x H 4,096 x V 128,256, bf16
    python benchmarks/causal_lm_gpu.py --chunks 256 512      # the loss head at several kd_chunk_size values

Only the loss is measured, not the models: the student's and teacher's last hidden states (bf16, (tokens, H)) and
LM heads (bf16, (V, H)) are given; one forward + backward into the student's hidden states and head. Variants:

- the floor: the student's LM-head GEMM forward + backward alone (`(h W^T).backward(g)`: three GEMMs);
- hf_distill's loss head (`losses.chunked`, direct route), JSD (beta 0.5, T = 1) + CE and JSD alone, as it runs
  by default on CUDA (the forward's row statistics and the backward's gradient blocks in Triton kernels), and for
  comparison compiled without the Triton kernels (`HF_DISTILL_TRITON=0`) and eager (`HF_DISTILL_COMPILE=0`);
- Liger-Kernel's `LigerFusedLinearJSD` (JSD alone) and TRL's `ChunkedDivergenceFunction` (JSD alone), when installed;
- whole logits (JSD + CE from `(tokens, V)` float32 logits of a bf16 GEMM).

Peak = torch.cuda.max_memory_allocated during the step minus the memory allocated before it (inputs excluded,
gradients included). Each variant runs `--repeats` times after a warm-up (compilation excluded); times are
CUDA-event medians. The three ways of running the head are compared (loss and both gradients). Writes
benchmarks/results/causal_lm_gpu.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hf_distill import losses  # noqa: E402
from hf_distill.losses import chunked  # noqa: E402


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    t_hidden = torch.randn(tokens, hidden, device=dev, generator=g)
    t_weight = torch.randn(vocab, hidden, device=dev, generator=g) * 4 * hidden**-0.5
    return {  # the agreement regime: student = teacher + 2% noise
        "s_hidden": (t_hidden + 0.02 * torch.randn(tokens, hidden, device=dev, generator=g)).to(dt),
        "t_hidden": t_hidden.to(dt),
        "s_weight": (t_weight + 0.02 * 4 * hidden**-0.5 * torch.randn(vocab, hidden, device=dev, generator=g)).to(dt),
        "t_weight": t_weight.to(dt),
        "labels": torch.randint(0, vocab, (tokens,), device=dev, generator=g),
    }


class _Head(torch.nn.Linear):
    """An `nn.Linear` around a given weight tensor, so the loss head reads (and differentiates) that tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight, self.bias = weight, None

    forward = torch.nn.Linear.forward


def floor(x: dict, grad: torch.Tensor) -> None:
    (x["s_hidden"] @ x["s_weight"].T).backward(grad)


def whole(x: dict) -> torch.Tensor:
    z = (x["s_hidden"] @ x["s_weight"].T).float()
    with torch.no_grad():
        t = (x["t_hidden"] @ x["t_weight"].T).float()
    return losses.logit_kd_loss("jsd", z, t, 1.0, beta=0.5) + torch.nn.functional.cross_entropy(z, x["labels"])


def ours(x: dict, ce: bool, chunk: int) -> torch.Tensor:
    # the loss head compares position t with token t+1: append a dummy last position
    s = torch.cat([x["s_hidden"], x["s_hidden"][:1]])[None]
    t = torch.cat([x["t_hidden"], x["t_hidden"][:1]])[None]
    kd, ce_value = chunked.chunked_kd_and_ce(
        s, chunked.LogitsHead(_Head(x["s_weight"])), chunked.LogitsHead(_Head(x["t_weight"])), t, None,
        x["labels"][None] if ce else None, chunked.dense_kd("jsd", 1.0, 0.5), chunk, route="direct")
    return kd + ce_value if ce else kd


def liger(x: dict, module) -> torch.Tensor:
    return module(x["s_hidden"], x["s_weight"], x["t_hidden"], x["t_weight"], None)  # no shift labels: all tokens


def trl(x: dict, fn) -> torch.Tensor:
    divergence, _ = fn.apply(x["s_hidden"], x["s_weight"], None, x["t_hidden"], x["t_weight"], None, 0.5, 1.0)
    return divergence.mean()


def measure(name: str, fn, x: dict, repeats: int) -> dict:
    times, peaks, value = [], [], None
    for i in range(repeats + 1):  # the first run warms up (and compiles): not counted
        for k in ("s_hidden", "s_weight"):
            x[k].grad = None
            x[k].requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(x)
        if loss is not None:
            loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i:
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
            times.append(start.elapsed_time(end))
        value = float(loss) if loss is not None else None
        del loss
    row = {"variant": name, "peak_mib": max(peaks), "median_ms": statistics.median(times),
           "times_ms": [round(t, 2) for t in times], "loss": value}
    print(json.dumps(row), flush=True)
    return row


def grads(fn, x: dict) -> tuple[float, torch.Tensor, torch.Tensor]:
    for k in ("s_hidden", "s_weight"):
        x[k].grad = None
    loss = fn(x)
    loss.backward()
    return float(loss), x["s_hidden"].grad.clone(), x["s_weight"].grad.clone()


def set_mode(mode: str) -> None:
    """"triton" (the default on CUDA: Triton forward statistics, compiled backward), "compile" (no Triton
    kernel) or "eager" (plain PyTorch elementwise work)."""
    os.environ["HF_DISTILL_COMPILE"] = "0" if mode == "eager" else "1"
    os.environ["HF_DISTILL_TRITON"] = "1" if mode == "triton" else "0"
    chunked._fused.cache_clear()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--chunks", type=int, nargs="+", default=None, help="kd_chunk_size values (default: the library's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; this benchmark measures CUDA time and memory (run it on a GPU)")
    default = chunked.default_chunk(a.vocab)
    chunks = a.chunks or [default]
    x = make_inputs(a.tokens, a.hidden, a.vocab)
    rows, notes = [], []
    if os.environ.get("GRAD_CONFIG"):  # "BLOCKxWARPS": the backward kernel's launch setting (head_profile.py's best)
        from hf_distill.losses import triton_head

        triton_head._GRAD_BLOCK, triton_head._GRAD_WARPS = map(int, os.environ["GRAD_CONFIG"].split("x"))
        notes.append(f"Triton gradient block launched as BLOCK x warps = {os.environ['GRAD_CONFIG']}")
    upstream = {"grad": torch.ones(a.tokens, a.vocab, device="cuda", dtype=torch.bfloat16)}  # made outside timing
    rows.append(measure("floor: student LM-head GEMM forward + backward", lambda x: floor(x, upstream["grad"]), x,
                        a.repeats))
    upstream.clear()
    torch.cuda.empty_cache()
    set_mode("triton")
    for chunk in chunks:
        rows.append(measure(f"hf_distill loss head JSD + CE (chunk {chunk})", lambda x, c=chunk: ours(x, True, c), x,
                            a.repeats))
        rows.append(measure(f"hf_distill loss head JSD (chunk {chunk})", lambda x, c=chunk: ours(x, False, c), x,
                            a.repeats))
    results = {"triton": grads(lambda x: ours(x, True, default), x)}
    for mode in ("compile", "eager"):
        set_mode(mode)
        rows.append(measure(f"hf_distill loss head JSD + CE (chunk {default}, {mode} elementwise)",
                            lambda x: ours(x, True, default), x, a.repeats))
        results[mode] = grads(lambda x: ours(x, True, default), x)
    set_mode("triton")
    try:
        from torch._dynamo.utils import counters

        notes.append(f"torch.compile graphs: {dict(counters['stats'])}")
    except ImportError:
        pass
    eager = results["eager"]
    agreement = {mode: {"loss_rel": abs(r[0] - eager[0]) / abs(eager[0]),
                        "dh_rel": float((r[1].float() - eager[1].float()).norm() / eager[1].float().norm()),
                        "dW_rel": float((r[2].float() - eager[2].float()).norm() / eager[2].float().norm())}
                 for mode, r in results.items() if mode != "eager"}
    del results, eager
    torch.cuda.empty_cache()
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        module = LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0)
        rows.append(measure("Liger-Kernel fused linear JSD", lambda x: liger(x, module), x, a.repeats))
    except ImportError as err:
        notes.append(f"liger-kernel not installed: {err}")
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        rows.append(measure("TRL ChunkedDivergenceFunction (JSD)", lambda x: trl(x, ChunkedDivergenceFunction), x,
                            a.repeats))
    except ImportError as err:
        notes.append(f"trl not installed: {err}")
    torch.cuda.empty_cache()
    try:
        rows.append(measure("whole logits JSD + CE", whole, x, a.repeats))
    except torch.cuda.OutOfMemoryError as err:
        rows.append({"variant": "whole logits JSD + CE", "error": f"OutOfMemoryError: {str(err)[:200]}"})
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "triton", "liger-kernel", "trl", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    data = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "chunks": chunks, "default_chunk": default,
            "dtype": "bfloat16", "device": torch.cuda.get_device_name(), "versions": versions, "rows": rows,
            "against_eager": agreement, "notes": notes,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    by = {r["variant"]: r for r in rows if "median_ms" in r}
    ref = by.get("floor: student LM-head GEMM forward + backward")
    head = by.get(f"hf_distill loss head JSD + CE (chunk {default})")
    head_jsd = by.get(f"hf_distill loss head JSD (chunk {default})")
    lig, trl_row = by.get("Liger-Kernel fused linear JSD"), by.get("TRL ChunkedDivergenceFunction (JSD)")
    targets = {}
    if head and ref:
        targets["jsd_ce_over_floor_time"] = head["median_ms"] / ref["median_ms"]
    if head and lig:
        targets["jsd_ce_time_le_liger"] = head["median_ms"] <= lig["median_ms"]
        targets["jsd_ce_peak_le_liger"] = head["peak_mib"] <= lig["peak_mib"]
    if head_jsd and lig:
        targets["jsd_time_le_liger"] = head_jsd["median_ms"] <= lig["median_ms"]
        targets["jsd_peak_le_liger"] = head_jsd["peak_mib"] <= lig["peak_mib"]
    if head and trl_row:
        targets["jsd_ce_time_le_trl"] = head["median_ms"] <= trl_row["median_ms"]
    data["targets"] = targets
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from sections import portable_tree  # no machine's absolute path (e.g. --out) in a results file

    data = portable_tree(data)
    (out / "causal_lm_gpu.json").write_text(json.dumps(data, indent=2) + "\n")
    md_lines = [f"# Causal-LM KD loss head on {data['device']}", "",
                f"`{data['command']}`, {data['date']}: H = {a.hidden:,}, V = {a.vocab:,}, {a.tokens:,} tokens, bf16 "
                f"inputs (agreement regime), forward + backward; peak = max_memory_allocated during the step minus "
                f"memory before it; median of {a.repeats} after a warm-up. Versions: {versions}.", "",
                "| variant | median ms | x floor | peak MiB | loss |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        if "error" in r:
            md_lines.append(f"| {r['variant']} | {r['error']} | | | |")
            continue
        over = f"{r['median_ms'] / ref['median_ms']:.2f}" if ref else ""
        loss = "" if r["loss"] is None else f"{r['loss']:.6f}"
        md_lines.append(f"| {r['variant']} | {r['median_ms']:.1f} | {over} | {r['peak_mib']:.0f} | {loss} |")
    md_lines += ["", f"Against the eager head on the same inputs (relative): {agreement}", "", f"Targets: {targets}"]
    md_lines += [f"\n{n}" for n in notes]
    (out / "causal_lm_gpu.md").write_text("\n".join(md_lines) + "\n")
    print("\n".join(md_lines))


if __name__ == "__main__":
    main()
