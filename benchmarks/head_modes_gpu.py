"""The loss head's issue #41 rows: the sparse (top-k + tail teacher signal) head beside the dense head (item 5), and
the dense head's fused mode (`kd_head_mode="fused"`, item 6) beside its default and the LM-head GEMM floor: time,
peak memory, and bf16 gradients against float64. Needs a CUDA GPU, except `--tiny`.

    python benchmarks/head_modes_gpu.py --out DIR          # 8,192 tokens x H 4,096 x V 128,256, bf16, k = 64 and 256
    python benchmarks/head_modes_gpu.py --tiny --out DIR   # 256 x 64 x 2,000 on the CPU: checks the script
    python benchmarks/head_modes_gpu.py --only-sweep --fused-chunks 1024,2048,4096,8192 --profile-fused \
        --name head_fused_sweep --out DIR                  # the fused mode's chunk sweep (gpu_checks.sh step)

Only the loss is measured (as `causal_lm_gpu.py`): the student's and teacher's last hidden states and LM heads are
given (the agreement regime: student = teacher + 2% noise); one forward + backward of JSD (beta 0.5, T = 1) + CE into
the student's hidden states and head, through `hf_distill.losses.chunked` (direct route, the library's default chunk
for each mode). Variants: the floor (the student's LM-head GEMM forward + backward), and the KD floor (that + the
teacher's LM-head forward GEMM: issue #41 item 6's floor for the dense head); the dense head, default and
fused; the sparse head against the teacher's top-k + tail at k = 64 and 256 (from the teacher's logits, made before
timing), default and fused; Liger-Kernel's `LigerFusedLinearJSD` and TRL's `ChunkedDivergenceFunction` (JSD alone)
when installed. Peak = the allocator's maximum during the step minus what was allocated before it (CUDA only).
Precision: each hf_distill variant's `dh` and `dW` on bf16 inputs against float64 whole logits on the same inputs,
at 4,096 x 2,048 x 65,536 (kd_precision.py's shape; the tiny shape with --tiny); bound 0.5%. Targets: the sparse
head no slower than the dense head (k <= 256), the fused dense head <= 1.5x the KD floor. Writes
head_modes_gpu.{json,md} (`--name`: another stem). `--fused-chunks`: the fused dense head at each token chunk too
(time, peak, x the KD floor, bf16 vs float64; issue #41 item 6 and `chunked.FUSED_CHUNK_FACTOR`); `--only-sweep`:
only the floors, the default mode and that sweep; `--profile-fused`: one fused step per chunk through torch.profiler,
its CUDA kernels' time by kind of work (`kernel_groups.py`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from causal_lm_gpu import _Head, liger, trl  # noqa: E402
from causal_lm_gpu import floor as student_floor  # noqa: E402

from hf_distill import losses  # noqa: E402
from hf_distill.losses import chunked, sparse_head  # noqa: E402

BOUND = 5e-3
KD_FLOOR = "KD floor: the above + the teacher's LM-head forward GEMM"


def make_inputs(tokens: int, hidden: int, vocab: int, device: str, ks: list[int], seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    t_hidden = torch.randn(tokens, hidden, device=device, generator=g)
    t_weight = torch.randn(vocab, hidden, device=device, generator=g) * 4 * hidden**-0.5
    x = {"s_hidden": (t_hidden + 0.02 * torch.randn(tokens, hidden, device=device, generator=g)).bfloat16(),
         "t_hidden": t_hidden.bfloat16(),
         "s_weight": (t_weight + 0.02 * 4 * hidden**-0.5 * torch.randn(vocab, hidden, device=device, generator=g))
         .bfloat16(),
         "t_weight": t_weight.bfloat16(),
         "labels": torch.randint(0, vocab, (tokens,), device=device, generator=g)}
    for k in ks:  # the teacher signal at T = 1, 1,024 rows at a time (no (tokens, V) float32 at once)
        parts = [losses.topk_with_tail(mm(x["t_hidden"][r:r + 1024], x["t_weight"]), k) for r in range(0, tokens, 1024)]
        x[f"signal{k}"] = tuple(torch.cat(p) for p in zip(*parts, strict=True))
    return x


def mm(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return chunked.mm_f32(h, w.t())


def head(x: dict, mode: str, k: int | None, chunk: int | None = None) -> torch.Tensor:
    """JSD + CE through the loss head (the dense teacher's head, or the top-k + tail signal `k`), in token chunks of
    `chunk` (None: the library's default for `mode`)."""
    s = torch.cat([x["s_hidden"], x["s_hidden"][:1]])[None]  # position t is compared with token t+1: one more
    fused = (1.0, 1.0) if mode == "fused" else None
    s_head = chunked.LogitsHead(_Head(x["s_weight"]))
    chunk = chunk or chunked.default_chunk(x["s_weight"].shape[0], mode)
    spec = chunked.dense_kd("jsd", 1.0, 0.5)
    if k is None:
        t = torch.cat([x["t_hidden"], x["t_hidden"][:1]])[None]
        kd, ce = chunked.chunked_kd_and_ce(s, s_head, chunked.LogitsHead(_Head(x["t_weight"])), t, None,
                                           x["labels"][None], spec, chunk, route="direct", fused=fused)
    else:
        signal = tuple(p[None] for p in x[f"signal{k}"])
        kd, ce = sparse_head.sparse_kd_and_ce(s, s_head, signal, None, x["labels"][None], spec, chunk,
                                              route="direct", fused=fused)
    return kd + ce


def floor(x: dict, grad: torch.Tensor, teacher: bool = False) -> None:
    """The GEMMs no dense KD head can skip: the student's LM head forward + backward (and the teacher's forward)."""
    student_floor(x, grad)
    if teacher:
        with torch.no_grad():
            x["t_hidden"] @ x["t_weight"].T


def sweep_name(chunk: int) -> str:
    return f"dense head JSD + CE, fused, chunk {chunk}"


def measure(name: str, fn, x: dict, repeats: int) -> dict:
    cuda = x["s_hidden"].is_cuda
    times, peaks, value = [], [], None
    for i in range(repeats + 1):  # the first run warms up (and compiles): not counted
        for key in ("s_hidden", "s_weight"):
            x[key].grad = None
            x[key].requires_grad_(True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        loss = fn(x)
        if loss is not None:
            loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
            peaks.append((torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None)
        value = float(loss.detach()) if loss is not None else None
        del loss
    row = {"variant": name, "median_ms": statistics.median(times), "peak_mib": peaks[-1] if not cuda else max(peaks),
           "loss": value}
    print(json.dumps(row), flush=True)
    return row


def precision(x: dict, variants: dict) -> dict:
    """Each variant's relative error of `dh` and `dW` against float64 whole logits on the same bf16 inputs. A variant
    is `(mode, k)` or `(mode, k, chunk)`; the float64 reference is computed once per teacher (`k`)."""
    h64 = x["s_hidden"].detach().double().requires_grad_(True)
    w64 = x["s_weight"].detach().double().requires_grad_(True)
    out, refs = {}, {}
    for name, (mode, k, *chunk) in variants.items():
        if k not in refs:
            z = h64 @ w64.T
            teacher = x[f"signal{k}"] if k is not None else x["t_hidden"].double() @ x["t_weight"].double().T
            if k is not None:
                teacher = tuple(p.double() if p.is_floating_point() else p for p in teacher)
            ref = losses.logit_kd_loss("jsd", z, teacher, 1.0, beta=0.5) + F.cross_entropy(z, x["labels"])
            refs[k] = torch.autograd.grad(ref, (h64, w64))
            del z, teacher, ref
        g64 = refs[k]
        for key in ("s_hidden", "s_weight"):
            x[key].grad = None
            x[key].requires_grad_(True)
        head(x, mode, k, *chunk).backward()
        errors = [float((got.double() - want).norm() / want.norm())
                  for got, want in zip((x["s_hidden"].grad, x["s_weight"].grad), g64, strict=True)]
        out[name] = {"dh_rel": errors[0], "dW_rel": errors[1], "within_bound": max(errors) < BOUND}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def _chunks(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--ks", type=int, nargs="+", default=[64, 256])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fused-chunks", type=_chunks, default=[],
                   help="comma-separated token chunks of the fused dense head to time, with peak memory, bf16 vs "
                   "float64 gradients and x KD floor each (e.g. 1024,2048,4096; issue #41 item 6)")
    p.add_argument("--only-sweep", action="store_true",
                   help="only the floors, the dense head's default mode and the --fused-chunks sweep (no sparse head, "
                   "Liger-Kernel or TRL)")
    p.add_argument("--profile-fused", action="store_true",
                   help="a kernel-time breakdown of one fused step (each --fused-chunks chunk, else the default): GEMM "
                   "/ row stats / gradient block / copies + casts + fills / other")
    p.add_argument("--name", default="head_modes_gpu", help="the results' file stem (NAME.json, NAME.md)")
    p.add_argument("--tiny", action="store_true", help="256 x 64 x 2,000 on the CPU, for checking the script")
    p.add_argument("--out", default=str(HERE / "results"))
    a = p.parse_args()
    if a.only_sweep and not a.fused_chunks:
        p.error("--only-sweep needs --fused-chunks")
    if a.only_sweep:
        a.ks = []
    return a


def main() -> None:
    a = parse()
    cuda = torch.cuda.is_available() and not a.tiny
    if not cuda and not a.tiny:
        raise SystemExit("error: no CUDA device; this benchmark measures CUDA time and memory (--tiny: the CPU)")
    device = "cuda" if cuda else "cpu"
    shape = (a.tokens, a.hidden, a.vocab) if not a.tiny else (256, 64, 2000)
    if a.tiny:
        a.repeats = min(a.repeats, 2)
    x = make_inputs(*shape, device, a.ks)
    rows = []
    upstream = {"grad": torch.ones(shape[0], shape[2], device=device, dtype=torch.bfloat16)}
    rows.append(measure("floor: student LM-head GEMM forward + backward", lambda x: floor(x, upstream["grad"]), x,
                        a.repeats))
    rows.append(measure(KD_FLOOR, lambda x: floor(x, upstream["grad"], teacher=True), x, a.repeats))
    upstream.clear()
    variants = {"dense head JSD + CE": ("recompute", None)}
    if not a.only_sweep:
        variants["dense head JSD + CE, fused"] = ("fused", None)
    for k in a.ks:
        variants[f"sparse head k={k} JSD + CE"] = ("recompute", k)
        variants[f"sparse head k={k} JSD + CE, fused"] = ("fused", k)
    for c in a.fused_chunks:
        variants[sweep_name(c)] = ("fused", None, c)
    for name, (mode, k, *chunk) in variants.items():
        rows.append(measure(name, lambda x, m=mode, k=k, c=chunk: head(x, m, k, *c), x, a.repeats))
    profiles = {}
    if a.profile_fused:
        from kernel_groups import breakdown

        for c in a.fused_chunks or [chunked.default_chunk(shape[2], "fused")]:
            _step(x, c)  # warm-up: no compilation in the profile
            profiles[c] = breakdown(functools.partial(_step, x, c), cuda)
            print(json.dumps({f"profile, chunk {c}": profiles[c]["groups"]}), flush=True)
    notes = []
    if not a.only_sweep:
        notes += others(x, rows, a.repeats)
    del x
    if cuda:
        torch.cuda.empty_cache()
    p_shape = (4096, 2048, 65536) if cuda else shape
    checked = {name: v for name, v in variants.items() if v[1] in (None, *a.ks[:1])}
    errors = precision(make_inputs(*p_shape, device, a.ks[:1]), checked)
    by = {r["variant"]: r for r in rows}
    fl = by["floor: student LM-head GEMM forward + backward"]["median_ms"]
    dense = by["dense head JSD + CE"]["median_ms"]
    kd_floor = by[KD_FLOOR]["median_ms"]  # issue #41 item 6's floor for the dense head (teacher's GEMM included)
    targets = {"fused_target": 1.5, "recompute_over_kd_floor": dense / kd_floor,
               "bf16_within_half_percent": all(e["within_bound"] for e in errors.values())}
    if not a.only_sweep:
        targets |= {"fused_over_kd_floor": by["dense head JSD + CE, fused"]["median_ms"] / kd_floor,
                    "fused_over_student_floor": by["dense head JSD + CE, fused"]["median_ms"] / fl,
                    **{f"sparse_k{k}_{m}_le_dense": by[f"sparse head k={k} JSD + CE{s}"]["median_ms"] <= dense
                       for k in a.ks for m, s in (("recompute", ""), ("fused", ", fused"))}}
    sweep = [{"chunk": c, "median_ms": by[sweep_name(c)]["median_ms"], "peak_mib": by[sweep_name(c)]["peak_mib"],
              "over_kd_floor": by[sweep_name(c)]["median_ms"] / kd_floor,
              "meets_target": by[sweep_name(c)]["median_ms"] / kd_floor <= 1.5,
              "dh_rel": errors[sweep_name(c)]["dh_rel"], "dW_rel": errors[sweep_name(c)]["dW_rel"],
              "default": c == chunked.default_chunk(shape[2], "fused")} for c in a.fused_chunks]
    write(a, shape, cuda, rows, p_shape, errors, targets, sweep, profiles, notes, fl)


def _step(x: dict, chunk: int) -> None:
    """One fused forward + backward of the dense head in token chunks of `chunk`."""
    for key in ("s_hidden", "s_weight"):
        x[key].grad = None
        x[key].requires_grad_(True)
    head(x, "fused", None, chunk).backward()


def others(x: dict, rows: list, repeats: int) -> list[str]:
    """Liger-Kernel's and TRL's JSD rows, where installed (notes say why not)."""
    notes = []
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        module = LigerFusedLinearJSD(jsd_beta=0.5, temperature=1.0)
        rows.append(measure("Liger-Kernel fused linear JSD (JSD alone)", lambda x: liger(x, module), x, repeats))
    except ImportError as err:
        notes.append(f"liger-kernel not installed: {err}")
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

        rows.append(measure("TRL ChunkedDivergenceFunction (JSD alone)", lambda x: trl(x, ChunkedDivergenceFunction),
                            x, repeats))
    except ImportError as err:
        notes.append(f"trl's chunked divergence not importable: {err}")
    return notes


def write(a: argparse.Namespace, shape: tuple, cuda: bool, rows: list, p_shape: tuple, errors: dict, targets: dict,
          sweep: list, profiles: dict, notes: list, fl: float) -> None:
    """NAME.json and NAME.md: the rows, the fused chunk sweep and the kernel breakdowns, precision and targets."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "triton", "liger-kernel", "trl", "transformers"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    data = {"tokens": shape[0], "hidden": shape[1], "vocab": shape[2], "ks": a.ks, "dtype": "bfloat16",
            "device": torch.cuda.get_device_name() if cuda else "cpu (--tiny: checks the script, times mean nothing)",
            "versions": versions, "rows": rows, "precision_shape": p_shape, "precision": errors, "targets": targets,
            "fused_sweep": sweep, "fused_profiles": {str(c): v for c, v in profiles.items()},
            "notes": notes, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv)}
    from sections import portable_tree  # no machine's absolute path (e.g. --out) in a results file

    data = portable_tree(data)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = [f"# Loss head modes on {data['device']}", "",
             f"`{data['command']}`, {data['date']}: {shape[0]:,} tokens x H {shape[1]:,} x V {shape[2]:,}, bf16, "
             f"JSD (beta 0.5) + CE forward + backward. Versions: {versions}.", "",
             "| variant | median ms | x floor | peak MiB | loss |", "| --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        loss = "" if r["loss"] is None else f"{r['loss']:.6f}"
        lines.append(f"| {r['variant']} | {r['median_ms']:.1f} | {r['median_ms'] / fl:.2f} | {peak} | {loss} |")
    lines += ["", f"bf16 gradients against float64 at {p_shape} (bound {BOUND}): {errors}", "", f"Targets: {targets}"]
    lines += [f"\n{n}" for n in notes]
    if sweep:
        lines += ["", "## The fused mode's token chunk (issue #41 item 6: <= 1.5x the KD floor)", "",
                  "Chunk logits' memory, arithmetic: chunk x V x 10 bytes (float32 student and teacher logits, bf16 "
                  "gradient), beside the float32 (V, H) weight-gradient accumulator (V x H x 4 bytes: "
                  f"{shape[2] * shape[1] * 4 / 2**20:,.1f} MiB here).", "",
                  "| chunk | median ms | x KD floor | <= 1.5x | peak MiB | chunk logits MiB (arithmetic) | dh vs f64 "
                  "| dW vs f64 |", "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
        for r in sweep:
            peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
            lines.append(f"| {r['chunk']:,}{' (default)' if r['default'] else ''} | {r['median_ms']:.1f} | "
                         f"{r['over_kd_floor']:.3f} | {'yes' if r['meets_target'] else 'no'} | {peak} | "
                         f"{r['chunk'] * shape[2] * 10 / 2**20:,.1f} | {r['dh_rel']:.5f} | {r['dW_rel']:.5f} |")
    if profiles:
        from kernel_groups import markdown

        lines += ["", "## One fused step by kind of work (torch.profiler)", ""]
        for c, result in profiles.items():
            lines += markdown(f"chunk {c:,}", result)
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
