"""Step time with a served teacher (issue #42, item 5): the same teacher local vs served on 127.0.0.1 (the package's
server, in a thread of this process), and served with an added per-request latency with and without prefetch; bytes
per token over the wire.

Why it is built this way: on this machine (2 cores shared with other jobs) one step's time varies by about 0.1 s and
the load drifts over minutes, so a mode measured after another is biased. Every mode therefore runs as a short run
(`--steps`) inside each of `--repeats` repeats, the order rotated from one repeat to the next (ABCDEF, BCDEFA, ...),
and each figure is a paired difference within a repeat (the same minutes of load), with a bootstrap 95% interval over
the repeats.

Two sizes:
  issue: the ratio served / local (a 4-layer teacher, hidden 256, vocabulary 4096, a 2-layer student, hidden 128,
      96-token rows, batch 4 x gradient accumulation 2, k = 64).
  small: the latency (a 2-layer teacher, hidden 128, a 1-layer student, hidden 64, 64-token rows, batch 2 x
      gradient accumulation 2), a step short enough that 50 ms per request is a visible fraction of it; served with
      and without `--latency-ms` added per request (an aiohttp middleware sleeping before each answer), with and
      without prefetch. The 2 requests of a step go out together (teacher_requests=4), so without prefetch the
      expected added time is one latency per step; `hidden` = 1 - added(prefetch) / added(no prefetch), each added
      time against the same prefetch setting without latency, in the same repeat.

Step time: the wall time between consecutive optimizer steps after 2 warm-up steps. Torch threads: 1 (`--threads`;
with 2 intra-op threads on this oversubscribed machine the main thread's ops stall). CPU contention: the server's
teacher forward runs on the same cores as the student (one process); the served/local ratio measures that, not a
network. Run under `nice -n 19`: `python benchmarks/served_teacher.py [--repeats 20] [--steps 8] [--latency-ms 50]`;
writes benchmarks/results/<name>.json and .md and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
from aiohttp import web  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

from hf_distill import DistillationArguments, DistillationTrainer  # noqa: E402
from hf_distill.serving.server import ServedModel, ServerThread, build_app  # noqa: E402

VOCAB = 4096
# size -> (teacher layers, teacher hidden, student layers, student hidden, row length, prompt, batch)
SIZES = {"issue": (4, 256, 2, 128, 96, 32, 4), "small": (1, 64, 2, 128, 96, 32, 4)}
ACCUMULATION, WARMUP = 2, 2


def _model(layers: int, hidden: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 2,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=128))


def _tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<pad>", *[f"w{i}" for i in range(VOCAB - 2)]])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")


def _rows(n: int, length: int, prompt: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return Dataset.from_list(rows)


def _collate(features):
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "labels": torch.tensor([f["labels"] for f in features])}


class _Clock(TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter())


def _delayed(app: web.Application, seconds: float) -> web.Application:
    @web.middleware
    async def delay(request, handler):
        await asyncio.sleep(seconds)
        return await handler(request)

    app.middlewares.append(delay)
    return app


def run_mode(mode: dict, teachers: dict, steps: int, out: Path) -> dict:
    """One short run of one mode: its per-step wall times (after the warm-up) and the bytes per token."""
    t_layers, t_hidden, s_layers, s_hidden, length, prompt, batch = SIZES[mode["size"]]
    teacher = teachers[mode["size"]]
    server, teacher_model, client = None, teacher, None
    if mode["served"]:
        app = build_app(ServedModel(teacher, _tokenizer(), "bench-teacher", max_k=64))
        latency = mode["latency_ms"] / 1000
        server = ServerThread(_delayed(app, latency) if latency else app)
        teacher_model = server.url
    clock = _Clock()
    total = steps + WARMUP + 1
    args = DistillationArguments(output_dir=str(out), per_device_train_batch_size=batch,
                                 gradient_accumulation_steps=ACCUMULATION, max_steps=total, learning_rate=0.1,
                                 optim="sgd", kd_loss="kl", temperature=1.0, kd_weight=1.0, task_weight=0.0,
                                 report_to=[], use_cpu=True, save_strategy="no", logging_steps=total,
                                 disable_tqdm=True, teacher_top_k=64, teacher_prefetch=mode["prefetch"],
                                 dataloader_num_workers=0)
    trainer = DistillationTrainer(model=_model(s_layers, s_hidden, 0), args=args, teacher_model=teacher_model,
                                  train_dataset=_rows(total * batch * ACCUMULATION, length, prompt),
                                  data_collator=_collate, processing_class=_tokenizer(), callbacks=[clock])
    try:
        trainer.train()
    finally:
        if server is not None:
            client = trainer.distiller.served[0].client
            server.stop()
    gaps = [b - a for a, b in zip(clock.times[WARMUP:], clock.times[WARMUP + 1:], strict=False)]
    return {"gaps": gaps, "bytes_per_token": round(client.bytes_per_token, 1) if client is not None else None}


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def _ci(values: list[list[float]], stat, draws: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The statistic on the repeats and its bootstrap 95% interval (repeats resampled with replacement, the
    modes of one repeat kept together: the pairing)."""
    rng = random.Random(seed)
    n = len(values)
    point = stat(values)
    got = sorted(s for s in (stat([values[rng.randrange(n)] for _ in range(n)]) for _ in range(draws))
                 if s is not None)
    return point, got[int(0.025 * len(got))], got[min(len(got) - 1, int(0.975 * len(got)))]


def _med(rows: list[list[float]], i: int) -> float:
    return statistics.median(r[i] for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per short run (after 2 warm-up steps)")
    parser.add_argument("--latency-ms", type=float, default=50.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--name", default="served_teacher", help="results file stem (default: served_teacher)")
    parser.add_argument("--summarise", metavar="JSON", help="recompute the figures and tables from a results "
                        "file's stored per-step times (no new measurement)")
    opts = parser.parse_args(argv)
    if opts.steps < 2 or opts.repeats < 1:
        parser.error("--steps must be at least 2 (quartiles of the step times) and --repeats at least 1")
    if opts.summarise:
        old = json.loads(Path(opts.summarise).read_text())
        modes = [{k: m[k] for k in ("size", "served", "latency_ms", "prefetch")} for m in old["modes"]]
        keep = ("bytes_per_token", "repeats", "steps_per_run", "threads", "wall_s", "contention")
        meta = {k: old["summary"][k] for k in keep}
        meta["command"] = _command(old["summary"]["command"].split()[2:])
        _write(old["runs_s_per_step"], modes, modes[-1]["latency_ms"], meta, Path(opts.out), opts.name)
        return 0
    torch.set_num_threads(opts.threads)
    teachers = {size: _model(cfg[0], cfg[1], 1).eval() for size, cfg in SIZES.items()}
    lat = opts.latency_ms
    modes = [{"size": "issue", "served": False, "latency_ms": 0.0, "prefetch": True},
             {"size": "issue", "served": True, "latency_ms": 0.0, "prefetch": True},
             {"size": "small", "served": True, "latency_ms": 0.0, "prefetch": True},
             {"size": "small", "served": True, "latency_ms": 0.0, "prefetch": False},
             {"size": "small", "served": True, "latency_ms": lat, "prefetch": True},
             {"size": "small", "served": True, "latency_ms": lat, "prefetch": False}]
    work = Path(tempfile.mkdtemp(prefix="served_teacher_"))  # the runs' output_dir: nothing is kept
    load_before = os.getloadavg()
    started = time.time()
    runs = []  # runs[r][i]: repeat r, mode i
    bytes_per_token = None
    for r in range(opts.repeats):
        order = [(r + j) % len(modes) for j in range(len(modes))]
        if r % 2:
            order = order[::-1]
        got = {}
        for i in order:
            res = run_mode(modes[i], teachers, opts.steps, work / f"r{r}m{i}")
            got[i] = res["gaps"]
            bytes_per_token = bytes_per_token or (res["bytes_per_token"] if modes[i]["size"] == "issue" else None)
            print(f"repeat {r} mode {i} median {statistics.median(res['gaps']):.3f} s", flush=True)
        runs.append([got[i] for i in range(len(modes))])
    load_after = os.getloadavg()
    meta = {"bytes_per_token": bytes_per_token, "repeats": opts.repeats, "steps_per_run": opts.steps,
            "threads": opts.threads, "wall_s": round(time.time() - started),
            "contention": f"{os.cpu_count()} CPU cores shared with other jobs (nice 19; load average 1/5/15 min "
                          f"{'/'.join(f'{x:.1f}' for x in load_before)} before, "
                          f"{'/'.join(f'{x:.1f}' for x in load_after)} after); server and student in one process",
            "command": _command(sys.argv[1:] if argv is None else argv)}
    _write(runs, modes, lat, meta, Path(opts.out), opts.name)
    return 0


def _command(argv: list[str]) -> str:
    """The command as the results record it: `--out` left out (where the files went is no part of the figures, and
    an absolute path there would name this machine's folders)."""
    kept, skip = [], False
    for a in argv:
        if skip or a == "--out" or a.startswith("--out="):
            skip = a == "--out"
            continue
        kept.append(a)
    return " ".join(["python benchmarks/served_teacher.py", *kept])


def summarise(runs: list[list[list[float]]], modes: list[dict], lat: float, meta: dict) -> tuple[list, dict]:
    """Per mode: median and quartiles of every timed step; the paired figures with their bootstrap intervals."""
    medians = [[statistics.median(g) for g in rep] for rep in runs]  # per repeat, per mode

    def ratio(rows):  # paired: the median over repeats of served / local in the same repeat
        return statistics.median(r[1] / r[0] for r in rows)

    def added_p(rows):
        return statistics.median(r[4] - r[2] for r in rows)

    def added_np(rows):
        return statistics.median(r[5] - r[3] for r in rows)

    def hidden(rows):
        a = added_np(rows)
        return 1 - added_p(rows) / a if a > 0 else None

    per_mode = []
    for i, m in enumerate(modes):
        pooled = [g for rep in runs for g in rep[i]]
        q1, med, q3 = _quartiles(pooled)
        per_mode.append({**m, "s_per_step_median": med, "s_per_step_q1": q1, "s_per_step_q3": q3,
                         "steps": len(pooled), "repeat_medians": [round(rep[i], 4) for rep in medians]})
    summary = {
        "served_over_local": _ci(medians, ratio),
        "served_over_local_ratio_of_medians": _med(medians, 1) / _med(medians, 0),
        "paired_served_over_local_per_repeat": [round(r[1] / r[0], 3) for r in medians],
        "expected_added_s_per_step_without_prefetch": lat / 1000,
        "expected_note": f"{ACCUMULATION} requests per optimizer step, sent together (teacher_requests=4): one "
                         f"latency per step; {ACCUMULATION * lat / 1000:g} s if they were sent one after the other",
        "added_s_per_step_without_prefetch": _ci(medians, added_np),
        "added_s_per_step_with_prefetch": _ci(medians, added_p),
        "hidden_by_prefetch": _ci(medians, hidden),
        "paired_added_without_prefetch_per_repeat": [round(r[5] - r[3], 4) for r in medians],
        "paired_added_with_prefetch_per_repeat": [round(r[4] - r[2], 4) for r in medians],
        **meta,
    }
    return per_mode, summary


def _write(runs: list, modes: list[dict], lat: float, meta: dict, out: Path, name: str) -> None:
    per_mode, summary = summarise(runs, modes, lat, meta)
    table = _table(per_mode, summary, lat)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    data = {"latency_ms": lat, "modes": per_mode, "summary": summary,
            "runs_s_per_step": [[[round(x, 4) for x in g] for g in rep] for rep in runs]}
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    title = (f"# Served teacher step time (benchmarks/served_teacher.py, {lat:g} ms added latency, "
             f"{meta['repeats']} interleaved repeats x {meta['steps_per_run']} steps)\n\n")
    (out / f"{name}.md").write_text(title + table + "\n")


def _table(per_mode: list[dict], s: dict, lat: float) -> str:
    lines = ["| size | teacher | added latency (ms) | prefetch | s/step median | IQR | steps |",
             "| --- | --- | ---: | --- | ---: | --- | ---: |"]
    for m in per_mode:
        lines.append(f"| {m['size']} | {'served' if m['served'] else 'local'} | {m['latency_ms']:.0f} | "
                     f"{'yes' if m['prefetch'] else 'no'} | {m['s_per_step_median']:.3f} | "
                     f"{m['s_per_step_q1']:.3f}-{m['s_per_step_q3']:.3f} | {m['steps']} |")

    def ci(key, fmt):
        v, lo, hi = s[key]
        return f"{fmt(v)} (95% CI {fmt(lo)} to {fmt(hi)})"

    ms = lambda x: f"{x * 1000:.0f} ms"  # noqa: E731
    lines += ["",
              f"- served / local (issue size, paired per repeat): {ci('served_over_local', lambda x: f'{x:.2f}x')}; "
              f"target <= 1.10x (ratio of the two modes' medians over all repeats: "
              f"{s['served_over_local_ratio_of_medians']:.2f}x).",
              f"- added per step by {lat:g} ms per request (small size), expected without prefetch "
              f"{ms(s['expected_added_s_per_step_without_prefetch'])} ({s['expected_note']}): measured without "
              f"prefetch {ci('added_s_per_step_without_prefetch', ms)}, with prefetch "
              f"{ci('added_s_per_step_with_prefetch', ms)}.",
              f"- hidden by prefetch: {ci('hidden_by_prefetch', lambda x: f'{x:.0%}')}; target >= 80%.",
              f"- bytes per token over the wire: {s['bytes_per_token']}.",
              f"- {s['repeats']} repeats x {s['steps_per_run']} timed steps per mode, modes interleaved (order "
              f"rotated per repeat); CIs: bootstrap over the repeats; torch threads {s['threads']}; "
              f"{s['contention']}; {s['wall_s']} s wall."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
