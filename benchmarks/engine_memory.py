"""Per-process peak memory of the causal-LM KD step under each engine: the loss head against whole logits (#41 item 4).

Each engine (DDP, FSDP2, DeepSpeed ZeRO-3) is launched as a user would (torchrun, `accelerate launch`) on this file's
worker, which trains a Llama student from a Llama teacher (vocabulary 32,768 by default) through
DistillationTrainer.train() twice in one process group: through the loss head (`kd_chunk_size`) and with whole
logits (the path taken where chunking is impossible). Per process and per training step it records the peak memory
above the step's start:

- CPU: the resident set size sampled every 0.2 ms by a thread, glibc told to serve every block over 64 KiB by mmap
  (`MALLOC_MMAP_THRESHOLD_`), so a freed tensor leaves the RSS at once and the step's own peak shows;
- GPU (`--gpu`, world size 1 per engine: the code path of each engine on one device): `torch.cuda.max_memory_allocated`
  reset at the step's start.

The first step (warm-up: the engines' buffers, the logits check) is left out; the figure is the largest of the rest.

    python benchmarks/engine_memory.py            # 2 CPU processes per engine -> results/engine_memory.{json,md}
    python benchmarks/engine_memory.py --gpu      # one GPU per engine -> results/engine_memory_gpu.{json,md}
    python benchmarks/engine_memory.py --gpu --tiny   # the GPU step's code on the CPU at a tiny size (a check)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CONFIGS = TESTS / "configs"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(TESTS))

ENGINES = ("ddp", "fsdp2", "zero3")
TARGET = 0.35  # the head's peak at most this fraction of whole logits' (FSDP2 and ZeRO-3)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepPeak:
    """The peak memory of each training step above its start (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peaks = device, []
        self._stop = threading.Event()

    def __enter__(self) -> StepPeak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        self._base = self._top = _rss()
        self._stop.clear()

        def sample() -> None:
            while not self._stop.is_set():
                self._top = max(self._top, _rss())
                time.sleep(0.0002)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peaks.append(torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        self._stop.set()
        self._thread.join()
        self.peaks.append(max(self._top, _rss()) - self._base)


def _trainer(out: Path, engine: str, vocab: int, hidden: int, seq: int, batch: int, steps: int, chunk: int,
             gpu: bool, deepspeed_config: str | None):
    import datasets
    from engine_run import engine_kwargs
    from helpers import args
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_distill import DistillationTrainer

    def llama(seed: int, layers: int) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=seq, tie_word_embeddings=False))

    g = torch.Generator().manual_seed(0)
    rows = datasets.Dataset.from_dict({"input_ids": torch.randint(0, vocab, (batch * 2 * steps, seq), generator=g)
                                       .tolist()})

    def collate(features):
        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    a = args(out, per_device_train_batch_size=batch, max_steps=steps, optim="sgd", learning_rate=0.1,
             use_cpu=not gpu, kd_loss="kl", kd_weight=0.5, task_weight=0.5, kd_chunk_size=chunk,
             bf16=gpu, **engine_kwargs(engine, deepspeed_config, "LlamaDecoderLayer", not gpu))
    return DistillationTrainer(model=llama(0, 2), teacher_model=llama(1, 2), args=a, train_dataset=rows,
                               data_collator=collate)


def worker(out: Path, engine: str, vocab: int, hidden: int, seq: int, batch: int, steps: int, chunk: int, gpu: bool,
           deepspeed_config: str | None) -> None:
    """Both modes in this process group; rank 0 writes `<engine>.json`."""
    from hf_distill import DistillationTrainer

    result = {}
    for mode in ("head", "whole"):
        trainer = _trainer(out / mode, engine, vocab, hidden, seq, batch, steps, chunk, gpu, deepspeed_config)
        if mode == "whole":
            trainer.distiller.paths.chunk = None  # whole logits: the path taken where chunking is impossible
        meter = StepPeak(trainer.args.device)
        step = trainer.training_step

        def measured(*a, _step=step, _meter=meter, **k):
            with _meter:
                return _step(*a, **k)

        trainer.training_step = measured
        trainer.train()
        acc = trainer.accelerator
        used = trainer.distiller._student_state(trainer.model_wrapped).rebuilds
        peaks = acc.gather_for_metrics([{"peaks": meter.peaks, "loss_head": used}], use_gather_object=True)
        result[mode] = {"per_process": peaks, "distributed_type": acc.distributed_type.value,
                        "world_size": acc.num_processes}
        assert isinstance(trainer, DistillationTrainer)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / f"{engine}.json").write_text(json.dumps(result))


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _zero3_config(processes: int, cpu: bool, folder: Path) -> str:
    path = folder / "accelerate_zero3.yaml"
    text = (CONFIGS / "accelerate_zero3_cpu.yaml").read_text()
    text = text.replace("num_processes: 2", f"num_processes: {processes}")
    if not cpu:
        text = text.replace("use_cpu: true", "use_cpu: false")
    path.write_text(text)
    return str(path)


def launch(engine: str, processes: int, shape: dict, gpu: bool, cpu_shims: bool, folder: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if engine == "zero3":
        head = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                _zero3_config(processes, not gpu, folder), "--main_process_port", _port()]
    else:
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                _port()]
    cmd = [*head, __file__, "--worker", engine, "--out", str(folder), *(["--gpu"] if gpu else []),
           *(["--fsdp_on_cpu"] if cpu_shims and engine == "fsdp2" else []),
           *[f"--{k}={v}" for k, v in shape.items()]]
    if engine == "zero3":
        cmd += ["--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json")]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Error" in ln]
        return {"engine": engine, "ran": False, "error": lines[-1] if lines else proc.stderr[-500:], "wall_s": wall}
    return {"engine": engine, "ran": True, "wall_s": wall, **json.loads((folder / f"{engine}.json").read_text())}


def _row(r: dict) -> str:
    if not r["ran"]:
        return f"| {r['engine']} | no | | | | | `{r['error']}` |"
    mib = {m: [max(p["peaks"][1:] or p["peaks"]) / 2**20 for p in r[m]["per_process"]] for m in ("head", "whole")}
    ratio = max(h / w for h, w in zip(mib["head"], mib["whole"], strict=True))
    through = all(p["loss_head"] for p in r["head"]["per_process"])
    return (f"| {r['engine']} | {r['head']['world_size']} x {r['head']['distributed_type']} | "
            f"{', '.join(f'{x:.0f}' for x in mib['head'])} | {', '.join(f'{x:.0f}' for x in mib['whole'])} | "
            f"{ratio:.3f} | {'yes' if through else 'NO'} | |")


def report(runs: list[dict], meta: dict) -> str:
    lines = [f"# Peak memory of the KD step per process: loss head vs whole logits ({meta['where']})", "",
             f"- command: `{meta['command']}`", f"- date: {meta['date']}; machine: {meta['machine']}; "
             f"load before: {meta['load_before']}, after: {meta['load_after']}", f"- versions: {meta['versions']}",
             f"- shape: {meta['shape']}; peak = {meta['measure']}", "",
             "| engine | processes x type | head peak / process (MiB) | whole-logits peak / process (MiB) | "
             "head / whole (worst process) | through the head | error |", "|---|---|---|---|---|---|---|"]
    lines += [_row(r) for r in runs]
    lines += ["", f"Target (issue #41 item 4): head / whole <= {TARGET} under FSDP2 and ZeRO-3.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=ENGINES)
    p.add_argument("--out", type=Path)
    p.add_argument("--gpu", action="store_true", help="one GPU per engine (world size 1)")
    p.add_argument("--tiny", action="store_true", help="with --gpu: the same code on the CPU at a tiny size")
    p.add_argument("--fsdp_on_cpu", action="store_true")
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("--engines", nargs="*", default=list(ENGINES))
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args()
    shape = {"vocab": a.vocab, "hidden": a.hidden, "seq": a.seq, "batch": a.batch, "steps": a.steps, "chunk": a.chunk}
    if a.worker:
        torch.set_num_threads(1)
        if a.fsdp_on_cpu:
            from engine_run import fsdp_on_cpu

            fsdp_on_cpu()
        worker(a.out, a.worker, gpu=a.gpu, deepspeed_config=a.deepspeed_config, **shape)
        from helpers import leave_distributed_run

        leave_distributed_run()
        return
    gpu = a.gpu and not a.tiny
    if a.gpu:  # world size 1 per engine; at a GPU's size unless --tiny
        if a.tiny:
            shape.update(vocab=512, hidden=32, seq=32, batch=2, steps=2, chunk=16)
        elif "--vocab" not in sys.argv:
            shape.update(vocab=128256, hidden=1024, seq=2048, batch=2, chunk=512)
    processes = 1 if a.gpu else 2
    import accelerate
    import transformers

    try:
        import deepspeed

        ds = deepspeed.__version__
    except ImportError:
        ds = "not installed"
    load_before = Path("/proc/loadavg").read_text().strip()
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for engine in a.engines:
            folder = Path(tmp) / engine
            folder.mkdir()
            runs.append(launch(engine, processes, shape, gpu, not gpu, folder))
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    meta = {
        "command": "python benchmarks/engine_memory.py" + (" --gpu" if a.gpu else "") + (" --tiny" if a.tiny else ""),
        "where": f"{processes} {'GPU' if gpu else 'CPU'} process{'es' if processes > 1 else ''} per engine",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {device}",
        "load_before": load_before, "load_after": Path("/proc/loadavg").read_text().strip(),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate "
                    f"{accelerate.__version__}, deepspeed {ds}",
        "shape": ", ".join(f"{k} {v}" for k, v in shape.items()) + (", bf16" if gpu else ", float32")
                 + ", Llama 2 layers (student and teacher), KL + CE",
        "measure": "torch.cuda.max_memory_allocated above the step's start" if gpu else
                   "RSS above the step's start, sampled every 0.2 ms (glibc mmap threshold 64 KiB)",
    }
    text = report(runs, meta)
    print(text)
    name = "engine_memory_gpu" if a.gpu and not a.tiny else "engine_memory_tiny" if a.tiny else "engine_memory"
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / f"{name}.json").write_text(json.dumps({**meta, "runs": runs}, indent=2) + "\n")
    (a.results / f"{name}.md").write_text(text)


if __name__ == "__main__":
    main()
