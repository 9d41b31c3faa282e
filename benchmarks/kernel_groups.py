"""Where one loss-head step's time goes, by kind of work: torch.profiler's CUDA kernels (on the CPU, `--tiny`: its
aten ops' self time) summed into GEMM / row stats / gradient block / copies + casts + fills / other, in ms, with the
launches of each and the longest kernels. Used by `head_modes_gpu.py --profile-fused` (issue #41 item 6: what is left
between the fused mode and the KD floor)."""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Kind of work -> substrings of a kernel's (or aten op's) name, lower-case; the first group that matches wins.
GROUPS = (
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
    ("row stats", ("_row_stats_kernel",)),
    ("gradient block", ("_grad_block_kernel",)),
    ("copies, casts, fills", ("memcpy", "memset", "copy", "fill", "cast", "aten::to", "aten::zero", "aten::empty")),
)
OTHER = "other"


def group_of(name: str) -> str:
    low = name.lower()
    return next((group for group, needles in GROUPS if any(n in low for n in needles)), OTHER)


def breakdown(step: Callable[[], None], cuda: bool, top: int = 12) -> dict:
    """Profile one call of `step` (already warmed up by the caller): ms and launches per group, the total, and the
    `top` longest kernels (ops) by name. CUDA: kernels' device time; CPU: aten ops' self CPU time (there the row
    statistics and gradient blocks are PyTorch elementwise ops, counted in `other`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    groups = {g: {"ms": 0.0, "launches": 0} for g in [*(g for g, _ in GROUPS), OTHER]}
    names: dict[str, float] = {}
    for evt in prof.events():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.time_range.end - evt.time_range.start
        else:
            if not evt.name.startswith("aten::"):
                continue
            us = evt.self_cpu_time_total
        g = groups[group_of(evt.name)]
        g["ms"] += us / 1e3
        g["launches"] += 1
        names[evt.name] = names.get(evt.name, 0.0) + us / 1e3
    longest = sorted(names.items(), key=lambda kv: -kv[1])[:top]
    return {"source": "CUDA kernels (device time)" if cuda else "CPU aten ops (self time; --tiny: checks the script)",
            "groups": groups, "total_ms": sum(g["ms"] for g in groups.values()),
            "longest": [{"name": n[:90], "ms": ms} for n, ms in longest]}


def markdown(title: str, result: dict) -> list[str]:
    """The breakdown as a markdown section."""
    lines = [f"### {title}", "", f"{result['source']}; total {result['total_ms']:.2f} ms.", "",
             "| work | ms | launches |", "| --- | ---: | ---: |"]
    lines += [f"| {g} | {v['ms']:.2f} | {v['launches']} |" for g, v in result["groups"].items()]
    lines += ["", "| longest | ms |", "| --- | ---: |"]
    lines += [f"| `{k['name']}` | {k['ms']:.2f} |" for k in result["longest"]]
    return [*lines, ""]
