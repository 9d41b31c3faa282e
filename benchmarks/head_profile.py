"""Where the causal-LM loss head's time goes on a GPU: each of its parts timed alone at the issue #29 shape, and a
kernel table of one forward + backward (issue #29: time <= Liger-Kernel's). Needs a CUDA GPU.

    python benchmarks/head_profile.py --out results/    # 8,192 tokens x H 4,096 x V 128,256, bf16, ~1 minute

Parts (medians of `triton.testing.do_bench`): the LM-head GEMM with bf16 and with float32 output, whole and as the
head runs it (token chunks in the forward, vocabulary blocks of every row in the backward, the weight- and
hidden-gradient GEMMs), the Triton row-statistics and gradient-block kernels at several launch settings (the best
gradient-block setting is written to `best_grad_config`, for `causal_lm_gpu.py`'s `GRAD_CONFIG`), the compiled
gradient block; then the head's forward alone and forward + backward, and torch.profiler's kernel totals.
Writes head_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from causal_lm_gpu import make_inputs, ours  # noqa: E402

from hf_distill.losses import kd_head, triton_head  # noqa: E402


def bench(fn, reps: int = 20) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=reps * 10, return_mode="median"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    n, hdim, v, chunk = a.tokens, a.hidden, a.vocab, a.chunk
    x = make_inputs(n, hdim, v)
    hs, ws, ht, wt = x["s_hidden"], x["s_weight"], x["t_hidden"], x["t_weight"]
    rows: list[dict] = []

    def add(name: str, ms: float, flops: float = 0.0, note: str = "") -> None:
        row = {"part": name, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1) if flops else None, "note": note}
        rows.append(row)
        print(json.dumps(row), flush=True)

    gemm = 2.0 * n * hdim * v
    add("GEMM h W^T, bf16 out (whole)", bench(lambda: hs @ ws.T), gemm)
    add("GEMM h W^T, float32 out (whole)", bench(lambda: torch.mm(hs, ws.T, out_dtype=torch.float32)), gemm)
    starts = range(0, n, chunk)
    add(f"forward: student GEMMs f32 out, {len(starts)} chunks of {chunk}",
        bench(lambda: [kd_head.mm_f32(hs[s:s + chunk], ws.t()) for s in starts]), gemm)
    add(f"forward: bf16-out GEMMs, {len(starts)} chunks of {chunk}",
        bench(lambda: [hs[s:s + chunk] @ ws.t() for s in starts]), gemm)
    cols = max(128, (chunk * v) // n // 128 * 128)
    blocks = list(kd_head._blocks(v, v, cols))
    add(f"backward: logits GEMMs f32 out, {len(blocks)} blocks of {cols} cols",
        bench(lambda: [kd_head.mm_f32(hs, ws[b].t()) for b in blocks]), gemm)
    g = torch.randn(n, cols, device="cuda").to(torch.bfloat16) * 1e-4
    add(f"backward: dW GEMMs g^T h f32 out, {len(blocks)} blocks",
        bench(lambda: [kd_head.mm_f32(g[:, : b.stop - b.start].t(), hs) for b in blocks]), gemm)
    acc = torch.zeros(n, hdim, device="cuda")
    add(f"backward: dh addmm f32 accumulate, {len(blocks)} blocks",
        bench(lambda: [kd_head.addmm_f32(acc, g[:, : b.stop - b.start], ws[b]) for b in blocks]), gemm)
    acc2 = torch.zeros(n, hdim, device="cuda", dtype=torch.bfloat16)
    add(f"backward: dh bf16 addmm (reference), {len(blocks)} blocks",
        bench(lambda: [acc2.addmm_(g[:, : b.stop - b.start], ws[b]) for b in blocks]), gemm)
    # the row statistics of one forward chunk, at several launch settings (32 chunks = the whole forward)
    zs = kd_head.mm_f32(hs[:chunk], ws.t())
    zt = kd_head.mm_f32(ht[:chunk], wt.t())
    tg = x["labels"][:chunk]
    logit_bytes = 2 * 2 * n * v * 4  # two passes over two float32 logit matrices
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            out = torch.empty(6, chunk, device="cuda")

            def run(block=block, warps=warps, out=out):
                triton_head._row_stats_kernel[(chunk,)](
                    zs, zs.stride(0), zt, zt.stride(0), tg, out, chunk, v, v, 1.0, 0.5, 0.1, KIND=3, HAS_KD=True,
                    HAS_CE=True, SAME=True, BLOCK=block, num_warps=warps)

            try:
                ms = bench(run) * len(starts)
                add(f"forward: Triton row stats JSD+CE, BLOCK {block}, {warps} warps (x{len(starts)} chunks)", ms,
                    note=f"{logit_bytes / ms / 1e9:.2f} TB/s")
            except Exception as err:  # a setting this GPU cannot run (registers, shared memory)
                add(f"forward: Triton row stats BLOCK {block}, {warps} warps", float("nan"), note=str(err)[:120])
    compiled = kd_head._row_stats_fn(torch.device("cuda"))
    add("forward: row stats as the head runs them (x chunks)",
        bench(lambda: compiled(zs, zt, tg, "jsd", 1.0, 0.5, 0.1, v)) * len(starts))
    eager_stats = kd_head._row_stats(zs, zt, tg, "jsd", 1.0, 0.5, 0.1, v)
    stats = torch.stack([eager_stats[2][:1].expand(n), eager_stats[3][:1].expand(n), eager_stats[0][:1].expand(n),
                         eager_stats[5][:1].expand(n)])
    zb = kd_head.mm_f32(hs, ws[blocks[0]].t())
    ztb = kd_head.mm_f32(ht, wt[blocks[0]].t())
    w = torch.ones(n, device="cuda")
    grad_args = (zb, ztb, 0, x["labels"], stats[2], w, stats[0], stats[1], stats[3], w, "jsd", 1.0, 0.5, 0.1, 1.0,
                 None, torch.bfloat16)
    moved = f"{(2 * n * cols * 4 + n * cols * 2) * len(blocks) / 1e9:.1f} GB moved"
    compiled_grad = kd_head._elementwise(kd_head._grad_block, torch.device("cuda"))
    add(f"backward: compiled gradient block (x{len(blocks)} blocks)",
        bench(lambda: compiled_grad(*grad_args)) * len(blocks), note=moved)
    best = (float("inf"), triton_head._GRAD_BLOCK, triton_head._GRAD_WARPS)
    for block in (1024, 2048, 4096):
        for warps in (4, 8, 16):
            triton_head._GRAD_BLOCK, triton_head._GRAD_WARPS = block, warps
            ms = bench(lambda: triton_head.grad_block(*grad_args)) * len(blocks)
            add(f"backward: Triton gradient block, BLOCK {block}, {warps} warps (x{len(blocks)} blocks)", ms,
                note=moved)
            best = min(best, (ms, block, warps))
    triton_head._GRAD_BLOCK, triton_head._GRAD_WARPS = best[1], best[2]
    print(f"best Triton gradient block setting: {best[1]}x{best[2]}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "best_grad_config").write_text(f"{best[1]}x{best[2]}\n")
    # the whole head
    for k in ("s_hidden", "s_weight"):
        x[k].requires_grad_(True)

    def fwd():
        with torch.no_grad():
            ours(x, True, chunk)

    def fwd_bwd():
        for k in ("s_hidden", "s_weight"):
            x[k].grad = None
        ours(x, True, chunk).backward()

    add(f"head forward only (JSD + CE), gradient block {best[1]}x{best[2]}", bench(fwd, 5))
    add(f"head forward + backward (JSD + CE), gradient block {best[1]}x{best[2]}", bench(fwd_bwd, 5))
    from torch.profiler import ProfilerActivity, profile

    fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    print(table)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"tokens": n, "hidden": hdim, "vocab": v, "chunk": chunk, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "head_profile.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [f"# Loss head parts on {data['device']}", "", f"{n:,} tokens x H {hdim:,} x V {v:,}, bf16, chunk {chunk}; "
          f"{data['date']}, torch {torch.__version__}.", "", "| part | ms | TFLOP/s | note |",
          "| --- | ---: | ---: | --- |"]
    md += [f"| {r['part']} | {r['ms']} | {r['tflops'] or ''} | {r['note']} |" for r in rows]
    md += ["", "```", table, "```"]
    (out / "head_profile.md").write_text("\n".join(md) + "\n")
    print("\n".join(md[:len(rows) + 6]))


if __name__ == "__main__":
    main()
