"""Run DistillationTrainer.train() under each distributed engine on this machine and record what happened.

Per engine (DDP, FSDP1, FSDP2, DeepSpeed ZeRO-3 with the HF template's "auto" values): whether it ran, where,
processes, device, steps, terms, the student's max abs difference from a single-process run with the same
global batch, per-rank teacher and student parameter bytes, peak memory per rank, wall time, and for each run
that did not complete the exact error. Each engine is launched as a user would (torchrun or
`accelerate launch --config_file`) on tests/engine_run.py. GPU rows come from benchmarks/distributed_gpu.sh
(benchmarks/results/distributed_gpu.json) when that script has been run.

    python benchmarks/distributed.py            # writes benchmarks/results/distributed.{json,md}
    python benchmarks/distributed.py --gpu-rows-only  # only refresh the GPU rows from distributed_gpu.json
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CONFIGS = TESTS / "configs"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(TESTS))

STEPS = 3


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _port()]


def _accelerate_zero3() -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(CONFIGS / "accelerate_zero3_cpu.yaml"), "--main_process_port", _port()]


NARROW = 16  # a student narrower than the teacher's 32 trains a projection

RUNS = {
    # name: (launcher, engine, extra args of tests/engine_run.py, what the student is compared with)
    "DDP": (_torchrun, "ddp", [], "sgd"),
    "FSDP1": (_torchrun, "fsdp1", [], "sgd"),
    "FSDP2": (_torchrun, "fsdp2", [], "sgd"),
    "ZeRO-3 (auto values, Trainer's SGD)": (
        _accelerate_zero3, "zero3", ["--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json")], "sgd"),
    "ZeRO-3 (HF template: DeepSpeed AdamW + WarmupLR, CPU offload)": (
        _accelerate_zero3, "zero3", ["--deepspeed_config", str(CONFIGS / "zero3_hf_template.json")], None),
    "ZeRO-3 + projection (student width 16, projection in the engine)": (
        _accelerate_zero3, "zero3",
        ["--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json"), "--student_width", str(NARROW)], "sgd"),
}


def _error(log: str) -> str:
    """The last exception line of a failed launch (the one the user would read)."""
    lines = [line.split("]: ", 1)[-1] for line in log.splitlines()]
    found = [line for line in lines if "Error:" in line and "ChildFailedError" not in line]
    return found[-1].strip() if found else log.strip().splitlines()[-1] if log.strip() else "no output"


def run_one(name: str, out: Path, references: dict) -> dict:
    launcher, engine, extra, compare = RUNS[name]
    reference = references[NARROW if "--student_width" in extra else None]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [*launcher(), str(TESTS / "engine_run.py"), str(out), "--engine", engine, "--per_device_batch", "4",
           "--steps", str(STEPS), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    launch_s = time.perf_counter() - start
    row = {"engine": name, "launcher": " ".join(Path(c).name if "/" in c else c for c in cmd[:cmd.index(str(
        TESTS / "engine_run.py"))][1:]), "processes": 2, "launch_wall_s": round(launch_s, 1)}
    if proc.returncode != 0:
        return {**row, "ran": "no", "where": "CPU, 2 processes (gloo)", "error": _error(proc.stdout + proc.stderr)}
    result = json.loads((out / "result.json").read_text())
    diff = proj_diff = None
    if compare:
        diff = (torch.tensor(result["student"]) - torch.tensor(reference["student"])).abs().max().item()
        if reference["projections"]:
            proj_diff = (torch.tensor(result["projections"]) - torch.tensor(reference["projections"])).abs().max()
            proj_diff = proj_diff.item()
    return {
        **row,
        "ran": "yes",
        "where": f"CPU, {result['world_size']} processes (gloo), end to end through DistillationTrainer.train()",
        "distributed_type": result["distributed_type"],
        "processes": result["world_size"],
        "device": result["device"],
        "steps": result["steps"],
        "terms": result["terms"],
        "teacher_type": result["teacher_type"],
        "student_wrapped_type": result["wrapped_type"],
        "max_abs_diff_vs_single_process": diff,
        "projection_max_abs_diff_vs_single_process": proj_diff,
        "compared_with": "1 process, DDP-free, SGD, same global batch" if compare else
        "not compared: DeepSpeed's AdamW and WarmupLR from the template (the single run uses the Trainer's SGD)",
        "teacher_bytes_per_rank": [r["teacher_bytes"] for r in result["ranks"]],
        "student_bytes_per_rank": [r["student_bytes"] for r in result["ranks"]],
        "peak_memory_bytes_per_rank (max RSS)": [r["peak_memory_bytes"] for r in result["ranks"]],
        "train_wall_s": round(result["wall_s"], 2),
        "losses": [{k: v for k, v in e.items() if k.startswith("loss")} for e in result["logs"]],
    }


def _markdown(report: dict) -> str:
    lines = [
        "# Distributed engines: DistillationTrainer.train() end to end",
        "",
        f"- command: `{report['command']}`",
        f"- date: {report['date']}; machine: {report['machine']}; load before: {report['loadavg_before']}, "
        f"after: {report['loadavg_after']}",
        f"- versions: {report['versions']}",
        f"- model: tiny BERT teacher (4 layers, width 32) -> BERT student (2 layers, width 32, no projection; "
        f"width {NARROW} with a shared projection in the row that says so), "
        f"{STEPS} steps, 2 x 4 rows per step, terms: {', '.join(report['terms'])}",
        f"- single-process reference: teacher {report['reference']['teacher_bytes']} B, student "
        f"{report['reference']['student_bytes']} B of parameters",
        "",
        "| engine | ran | where | type | student max abs diff vs 1 process | teacher bytes / rank | "
        "student bytes / rank | peak memory / rank (MB) | train wall (s) | error / reason |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if r["ran"] == "yes":
            diff, proj = r["max_abs_diff_vs_single_process"], r.get("projection_max_abs_diff_vs_single_process")
            shown = f"{diff:.2e}" if diff is not None else r["compared_with"]
            if proj is not None:
                shown += f" (projection {proj:.2e})"
            lines.append(
                f"| {r['engine']} | yes | {r['where']} | {r['distributed_type']} | {shown} | "
                f"{', '.join(map(str, r['teacher_bytes_per_rank']))} | "
                f"{', '.join(map(str, r['student_bytes_per_rank']))} | "
                f"{', '.join(f'{b / 2**20:.0f}' for b in r['peak_memory_bytes_per_rank (max RSS)'])} | "
                f"{r['train_wall_s']} | |"
            )
        else:
            lines.append(f"| {r['engine']} | no | {r['where']} | | | | | | | `{r['error']}` |")
    for r in report.get("gpu_runs", []):
        resumed = r.get("resumed_max_abs_diff")
        lines.append(f"| {r.get('engine')} | {r.get('ran')} | {r.get('where')} | {r.get('distributed_type', '')} | "
                     f"{'' if resumed is None else f'resume vs uninterrupted: {resumed:.2e}'} | "
                     f"{', '.join(map(str, r.get('teacher_bytes_per_rank', [])))} | "
                     f"{', '.join(map(str, r.get('student_bytes_per_rank', [])))} | "
                     f"{', '.join(f'{b / 2**20:.0f}' for b in r.get('peak_memory_bytes_per_rank', []))} | "
                     f"{r.get('train_wall_s', '')} | {r.get('error', '')} |")
    lines += ["", "Notes:", *[f"- {n}" for n in report["notes"]], ""]
    return "\n".join(lines)


def gpu_note(gpu: dict) -> str:
    """The GPU rows' provenance, from the machine `distributed_gpu.sh` recorded in distributed_gpu.json."""
    m = gpu.get("machine") or {}
    where = (f"last run on an {m['gpu']} on {m['date']} (torch {m['torch']}, transformers {m['transformers']}, "
             f"accelerate {m['accelerate']}, deepspeed {m['deepspeed']})") if m else "machine not recorded"
    return (
        "GPU rows: `bash benchmarks/distributed_gpu.sh` (world size 1, 20 steps, then a push with the card), "
        f"{where}. FSDP2 runs with fsdp_config transformer_layer_cls_to_wrap=['BertLayer']: with BERT's default wrap "
        "classes (BertEmbeddings, BertLayer) accelerate 1.15 shards the word embeddings a second time and torch fails "
        "(\"Invariant encountered: value was None\"); DistillationTrainer refuses that wrap before training "
        "(placement.check_fsdp2_wrap). Peak memory of a GPU row: torch.cuda.max_memory_allocated (MiB); of a CPU "
        "row: the process's max RSS."
    )


def refresh_gpu_rows() -> None:
    """Rewrite distributed.{json,md} with the GPU rows of distributed_gpu.json, keeping the CPU rows as run."""
    report = json.loads((RESULTS / "distributed.json").read_text())
    gpu = json.loads((RESULTS / "distributed_gpu.json").read_text())
    report["gpu_runs"] = gpu.get("runs", [])
    report["notes"] = [n for n in report["notes"] if not n.startswith("GPU")] + [gpu_note(gpu)]
    (RESULTS / "distributed.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "distributed.md").write_text(_markdown(report))


def main() -> None:
    if "--gpu-rows-only" in sys.argv:  # after distributed_gpu.sh ran on a lent GPU: no CPU runs again
        refresh_gpu_rows()
        print((RESULTS / "distributed.md").read_text())
        return
    import accelerate
    import engine_run
    import transformers

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = "not installed"
    torch.set_num_threads(1)
    load_before = Path("/proc/loadavg").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        reference = engine_run.run(Path(tmp) / "single", "ddp", per_device_batch=8, steps=STEPS)
        narrow = engine_run.run(Path(tmp) / "single16", "ddp", per_device_batch=8, steps=STEPS, student_width=NARROW)
        runs = [run_one(name, Path(tmp) / f"run{i}", {None: reference, NARROW: narrow}) for i, name in enumerate(RUNS)]
    report = {
        "command": "python benchmarks/distributed.py",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "loadavg_before": load_before,
        "loadavg_after": Path("/proc/loadavg").read_text().strip(),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate "
        f"{accelerate.__version__}, deepspeed {ds_version}",
        "terms": ["kd (logits)", *engine_run.TERMS],
        "reference": {"teacher_bytes": reference["ranks"][0]["teacher_bytes"],
                      "student_bytes": reference["ranks"][0]["student_bytes"], "steps": reference["steps"]},
        "runs": runs,
        "notes": [
            "FSDP1 on a CPU is refused by accelerate itself (FullyShardedDataParallelPlugin.__post_init__ finds "
            "no GPU-like device: the error above). FSDP2 passes that check, but accelerate (1.15) sets "
            "DistributedType.FSDP only for GPU-like distributed types, so with use_cpu=True the Trainer "
            "(transformers 5.24) silently trained fsdp=... as MULTI_CPU DDP: before this change the FSDP2 row ran, "
            "student wrapped in DistributedDataParallel, the whole teacher (165256 B) and student (96904 B) on each "
            "rank. hf_distill now refuses that (placement.check_engine): the FSDP2 error above. FSDP2 fully_shard "
            "of the teacher itself works on CPU/gloo (tests/test_placement.py); the Trainer cannot shard the "
            "student there.",
            "ZeRO-3 on a CPU: DeepSpeed selects its CPU accelerator and JIT-builds a shared-memory comm op on "
            "first use (needs a C++ compiler; cached in ~/.cache/torch_extensions); the template's CPU-offloaded "
            "AdamW also JIT-builds cpu_adam (minutes, once).",
            "Bytes are the parameters each rank owns (DTensor shard, ZeRO-3 ds_tensor partition); peak memory on "
            "a CPU is the process's max RSS, dominated by the imports (torch, transformers, deepspeed).",
            "Wall times are from a shared 2-core machine: not a speed measurement.",
        ],
    }
    gpu = RESULTS / "distributed_gpu.json"
    if gpu.exists():
        gpu_report = json.loads(gpu.read_text())
        report["gpu_runs"] = gpu_report.get("runs", [])
        report["notes"].append(gpu_note(gpu_report))
    else:
        report["notes"].append("GPU (FSDP1/FSDP2 through the Trainer, ZeRO-3 on CUDA): not run, no GPU on this "
                               "machine; benchmarks/distributed_gpu.sh is prepared for one.")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "distributed.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "distributed.md").write_text(_markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
