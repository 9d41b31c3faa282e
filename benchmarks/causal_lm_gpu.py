"""Peak CUDA memory of the causal-LM KD loss at LLM scale: chunked (hf_distill.chunked) vs whole logits, and
Liger-Kernel's fused linear JSD beside them when `liger-kernel` is installed (issue #14). Needs a CUDA GPU.

    python benchmarks/causal_lm_gpu.py                       # H = 4,096, V = 128,256, 8,192 tokens, bf16
    python benchmarks/causal_lm_gpu.py --tokens 2048         # smaller

Only the loss is measured, not the models: the student's and teacher's last hidden states (bf16, (tokens, H)) and
LM heads (bf16, (V, H)) are given; one forward + backward of `JSD(beta 0.5, T = 1) + CE` into the student's hidden
states and head. Peak = torch.cuda.max_memory_allocated during the step minus the memory allocated before it.
Each variant runs `--repeats` times (the first is a warm-up); times are CUDA-event medians. The losses of the
three variants are compared (they compute the same JSD; Liger's has no CE, so its row is JSD only and ours are
measured both ways). Writes benchmarks/results/causal_lm_gpu.{json,md}. A few seconds per variant on an H100.
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

from hf_distill import chunked, losses  # noqa: E402


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt = "cuda", torch.bfloat16
    return {
        "s_hidden": torch.randn(tokens, hidden, device=dev, dtype=dt, generator=g),
        "t_hidden": torch.randn(tokens, hidden, device=dev, dtype=dt, generator=g),
        "s_weight": (torch.randn(vocab, hidden, device=dev, dtype=dt, generator=g) * hidden**-0.5),
        "t_weight": (torch.randn(vocab, hidden, device=dev, dtype=dt, generator=g) * hidden**-0.5),
        "labels": torch.randint(0, vocab, (tokens,), device=dev, generator=g),
    }


def naive(x: dict, ce: bool) -> torch.Tensor:
    z = (x["s_hidden"] @ x["s_weight"].T).float()
    with torch.no_grad():
        t = (x["t_hidden"] @ x["t_weight"].T).float()
    loss = losses.logit_kd_loss("jsd", z, t, 1.0, beta=0.5)
    return loss + torch.nn.functional.cross_entropy(z, x["labels"]) if ce else loss


def ours_chunked(x: dict, ce: bool, chunk: int) -> torch.Tensor:
    # chunked_kd_and_ce takes (B, T, H) states and compares position t with token t+1: add a dummy last position.
    s = torch.cat([x["s_hidden"], x["s_hidden"][:1]])[None]
    t = torch.cat([x["t_hidden"], x["t_hidden"][:1]])[None]
    kd, ce_value = chunked.chunked_kd_and_ce(
        s, lambda h: h @ x["s_weight"].T, lambda h: h @ x["t_weight"].T, t, None,
        x["labels"][None] if ce else None, chunked.dense_kd("jsd", 1.0, 0.5), chunk)
    return kd + ce_value if ce else kd


def ours_fused(x: dict, ce: bool, chunk: int) -> torch.Tensor:
    # the trainer's path on one GPU and under DDP: each chunk's gradient taken in the forward pass, no recompute
    s = torch.cat([x["s_hidden"], x["s_hidden"][:1]])[None]
    t = torch.cat([x["t_hidden"], x["t_hidden"][:1]])[None]
    loss, _, _ = chunked.fused_kd_and_ce(
        s, lambda h: h @ x["s_weight"].T, [x["s_weight"]], lambda h: h @ x["t_weight"].T, t, None,
        x["labels"][None] if ce else None, chunked.dense_kd("jsd", 1.0, 0.5), chunk, kd_weight=1.0,
        ce_weight=1.0 if ce else 0.0)
    return loss


def liger(x: dict, module) -> torch.Tensor:
    return module(x["s_hidden"], x["s_weight"], x["t_hidden"], x["t_weight"], None)  # no shift labels: all tokens


def measure(name: str, fn, x: dict, repeats: int) -> dict:
    times, peaks, value = [], [], None
    for _ in range(repeats):
        for k in ("s_hidden", "s_weight"):
            x[k].grad = None
            x[k].requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = fn(x)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20)
        times.append(start.elapsed_time(end))
        value = float(loss)
        del loss
    row = {"variant": name, "peak_mib": max(peaks[1:] or peaks), "median_ms": statistics.median(times[1:] or times),
           "loss": value}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--chunk", type=int, default=512)  # the library default (DEFAULT_CHUNK)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device; this benchmark measures CUDA memory (run it on a GPU machine)")
    x = make_inputs(a.tokens, a.hidden, a.vocab)
    rows = []
    for ce in (False, True):
        tag = "jsd+ce" if ce else "jsd"
        rows.append(measure(f"ours chunked ({a.chunk}) {tag}", lambda x, ce=ce: ours_chunked(x, ce, a.chunk), x,
                            a.repeats))
        rows.append(measure(f"ours fused chunks ({a.chunk}) {tag}", lambda x, ce=ce: ours_fused(x, ce, a.chunk), x,
                            a.repeats))
        try:
            rows.append(measure(f"naive whole logits {tag}", lambda x, ce=ce: naive(x, ce), x, a.repeats))
        except torch.cuda.OutOfMemoryError as err:
            rows.append({"variant": f"naive whole logits {tag}", "error": f"OutOfMemoryError: {str(err)[:200]}"})
            torch.cuda.empty_cache()
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        module = LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0)
        liger_note = None
        rows.append(measure("liger fused linear JSD jsd", lambda x: liger(x, module), x, a.repeats))
    except ImportError as err:
        liger_note = f"liger-kernel not installed: {err}"
    except Exception as err:  # a Liger API change must not lose our rows
        liger_note = f"liger-kernel failed: {type(err).__name__}: {str(err)[:300]}"
    data = {"tokens": a.tokens, "hidden": a.hidden, "vocab": a.vocab, "chunk": a.chunk, "dtype": "bfloat16",
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "liger": liger_note,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
            "load": os.getloadavg()}
    by = {r["variant"]: r for r in rows}
    for tag in ("jsd", "jsd+ce"):
        c, n = by.get(f"ours chunked ({a.chunk}) {tag}", {}), by.get(f"naive whole logits {tag}", {})
        if "peak_mib" in c and "peak_mib" in n:
            data[f"chunked_over_naive_peak_{tag}"] = c["peak_mib"] / n["peak_mib"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "causal_lm_gpu.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [f"# Causal-LM KD loss on {data['device']}", "",
          f"`{data['command']}`, {data['date']}: H = {a.hidden}, V = {a.vocab:,}, {a.tokens:,} tokens, bf16 inputs, "
          f"fp32 loss math; peak = max_memory_allocated during forward + backward minus memory before.", "",
          "| variant | peak MiB | median ms | loss |", "| --- | ---: | ---: | ---: |"]
    for r in rows:
        md.append(f"| {r['variant']} | {r.get('peak_mib', 0):.0f} | {r.get('median_ms', 0):.1f} | "
                  f"{r.get('loss', float('nan')):.5f} |" if "error" not in r else f"| {r['variant']} | "
                  f"{r['error']} | | |")
    for tag in ("jsd", "jsd+ce"):
        if f"chunked_over_naive_peak_{tag}" in data:
            md.append(f"\nchunked / naive peak ({tag}): **{data[f'chunked_over_naive_peak_{tag}']:.3f}**")
    if liger_note:
        md.append(f"\n{liger_note}")
    (out / "causal_lm_gpu.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
