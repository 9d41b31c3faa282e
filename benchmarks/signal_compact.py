"""Teacher signal bytes per token against fidelity (issue #45): the packed layout (format 2) at k = 8 / 64 / 256
and the compact layout (format 3) at a few settings, on the WikiText-2 teacher of benchmarks/causal_lm.py's signal
section, with its protocol (batch 8 x 128 tokens, JSD beta 0.5 + CE, T = 1, cosine LR 1e-3, seed 0, the recipe's
pruned student; perplexity on held-out wiki.test.raw blocks). Not part of CI.

    python benchmarks/signal_compact.py --teacher <folder> --kept 0,1,5 --steps 60

The protocol of benchmarks/README.md's signal section is `--steps 60 --eval-blocks 256` with the recipe's teacher
(recipes/configs/causal_lm_wikitext.yaml, 4 epochs) and its pruned student's blocks. `--adaptive k:bits:epsilon`
adds compact signals with adaptive k (format 4), each compared with the online teacher's top-k cut the same way per
position (float32, exact tail, nothing stored). `--references` names the k whose online top-k + tail runs are made
(the per-step KD column needs them; default: every k). Results are written after every run, so a run stopped for
time keeps what it measured.

For each signal: bytes per token (files and payload) and teacher tokens/s while creating it (the compact layout's
packing runs on a worker thread beside the teacher); then the student trained from it without the teacher. The
"uncompressed" reference of a k is the online teacher's float32 top-k + exact tail at each step (nothing stored):
the per-step KD loss of a signal run is compared with it, and every run's held-out perplexity with the k = 64
packed signal's. Writes benchmarks/results/signal_compact.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import sections  # noqa: E402

ROOT = HERE.parent
RESULTS = HERE / "results"


def distillkit_files(teacher, train, folder: Path, k: int, exact_k: int, terms: list) -> None:
    """The teacher's top-k over `train` written as DistillKit V2 writes them (its documented format, our code):
    parquet rows of input_ids, compressed_logprobs and bytepacked_indices per position (n - 1 a row), delta
    encoding, `exact_k` float32 values, a float32 least-squares fit of the rest at t = 0, 1, ... over `terms`, no
    residual bins (the budget setting), and compression_config.yaml beside them."""
    import math

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import yaml

    vocab = teacher.config.vocab_size
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"d": vocab, "k": k, "exact_k": exact_k, "exact_dtype": "float32", "polynomial_terms": terms,
           "term_dtype": "float32", "residual_bins": [], "delta_encoding": True, "error_diffusion": False,
           "normalize_t": False}
    (folder / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    t = np.arange(k - exact_k, dtype=np.float64)
    x = np.stack([t**p if isinstance(p, int) else np.sqrt(t) for p in terms], -1)
    pinv = np.linalg.pinv(x)
    id_bits = math.ceil(math.log2(vocab))
    shifts = np.arange(id_bits - 1, -1, -1)
    out = {"input_ids": [], "compressed_logprobs": [], "bytepacked_indices": []}
    with torch.no_grad():
        for i in range(0, len(train), 8):
            ids = torch.tensor(train[i : i + 8]["input_ids"])
            lp, top = teacher(input_ids=ids).logits[:, :-1].float().log_softmax(-1).topk(k, -1)
            lp, top = lp.double().numpy(), top.numpy()
            deltas = np.concatenate([lp[..., :1], np.diff(lp, axis=-1)], -1)
            coeffs = (deltas[..., exact_k:] @ pinv.T).astype("<f4")
            raw = np.concatenate([deltas[..., :exact_k].astype("<f4").view(np.uint8),
                                  coeffs.view(np.uint8)], -1)
            bits = ((top[..., None] >> shifts) & 1).astype(np.uint8).reshape(*top.shape[:-1], -1)
            packed = np.packbits(bits, axis=-1)
            for r in range(len(ids)):
                out["input_ids"].append(ids[r].tolist())
                out["compressed_logprobs"].append(raw[r].tolist())
                out["bytepacked_indices"].append(packed[r].tolist())
    schema = pa.schema([("input_ids", pa.list_(pa.uint64())), ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))),
                        ("bytepacked_indices", pa.list_(pa.list_(pa.uint8())))])
    pq.write_table(pa.table(out, schema=schema), folder / "data-00000.parquet")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", required=True)
    p.add_argument("--kept", default="0,1,5")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-blocks", type=int, default=256)
    p.add_argument("--ks", default="8,64,256", help="k of the packed (format 2) signals")
    p.add_argument("--compact", default="32:8,24:8,48:6", help="k:value_bits of the compact signals")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--distillkit", default="50:1", help="k:exact_k of a DistillKit-style polynomial signal ('' none)")
    p.add_argument("--adaptive", default="", help="k:value_bits:epsilon of adaptive-k compact signals ('' none)")
    p.add_argument("--sizes", default="", help="k:value_bits:epsilon of adaptive-k signals measured for size only")
    p.add_argument("--references", default="", help="k of the online top-k + tail runs (default: every k)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", default="signal_compact", help="the results files' name under benchmarks/results")
    p.add_argument("--no-dense", action="store_true", help="leave out the online dense run")
    a = p.parse_args()
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, default_data_collator

    spec = importlib.util.spec_from_file_location("bench_causal_lm", HERE / "causal_lm.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # the signal section's online top-k + tail objective (_online_topk)
    sys.path.insert(0, str(ROOT / "recipes"))
    from causal_lm import blocks as make_blocks
    from causal_lm import perplexity

    from hf_distill import DistillationArguments, DistillationTrainer, students
    from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal, signal_metadata

    torch.set_num_threads(a.threads)
    kept = [int(k) for k in a.kept.split(",")]
    tok = AutoTokenizer.from_pretrained(a.teacher)
    teacher = AutoModelForCausalLM.from_pretrained(a.teacher).eval()
    data = ROOT.parent / "shared" / "data" / "wikitext2"
    batch = 8
    train = make_blocks((data / "wiki.valid.raw").read_text(encoding="utf-8"), tok, 128, a.steps * batch)
    valid = make_blocks((data / "wiki.test.raw").read_text(encoding="utf-8"), tok, 128, a.eval_blocks)
    work = HERE / ".cache" / a.results
    shutil.rmtree(work, ignore_errors=True)
    create_teacher_signal(teacher, train.select(range(batch)), work / "warmup", tokenizer=tok, k=8,
                          batch_size=batch, progress=False)  # first-call costs, untimed
    settings = {f"packed_k{k}": dict(k=k) for k in (int(x) for x in a.ks.split(","))}
    for spec in filter(None, a.compact.split(",")):
        k, bits = (int(x) for x in spec.split(":"))
        settings[f"compact_k{k}_b{bits}"] = dict(k=k, layout="compact", value_bits=bits)
    for spec in filter(None, a.adaptive.split(",")):
        k, bits, eps = spec.split(":")
        settings[f"adaptive_k{k}_b{bits}_e{eps}"] = dict(k=int(k), layout="compact", value_bits=int(bits),
                                                         epsilon=float(eps))
    signals, runs = {}, {}
    for name, kw in settings.items():
        t0 = time.perf_counter()
        signal = create_teacher_signal(teacher, train, work / name, tokenizer=tok, temperature=1.0, batch_size=batch,
                                       progress=False, **kw)
        seconds = time.perf_counter() - t0
        meta = signal_metadata(signal)
        signals[name] = {**kw, "create_s": seconds, "teacher_tokens_per_s": len(train) * 128 / seconds,
                         "bytes_per_token": meta["bytes_per_token"],
                         "payload_bytes_per_token": meta["payload_bytes_per_token"],
                         **({"value_step": meta["value_step"]} if "value_step" in meta else {}),
                         **({"mean_k": _mean_k(signal)} if "epsilon" in kw else {})}
        print("signal", name, json.dumps(signals[name]), flush=True)
        signals[name]["rows"] = attach_teacher_signal(train, signal)
    a.size_results = {}
    for spec in filter(None, a.sizes.split(",")):  # adaptive settings measured for their size alone (not trained)
        k, bits, eps = spec.split(":")
        name = f"adaptive_k{k}_b{bits}_e{eps}"
        signal = create_teacher_signal(teacher, train, work / "sizes" / name, tokenizer=tok, temperature=1.0,
                                       batch_size=batch, progress=False, k=int(k), layout="compact",
                                       value_bits=int(bits), epsilon=float(eps))
        meta = signal_metadata(signal)
        a.size_results[name] = {"k": int(k), "value_bits": int(bits), "epsilon": float(eps),
                                "bytes_per_token": meta["bytes_per_token"],
                                "payload_bytes_per_token": meta["payload_bytes_per_token"], "mean_k": _mean_k(signal)}
        print("size", name, json.dumps(a.size_results[name]), flush=True)
    if a.distillkit:
        from hf_distill.data.signal_interop import import_distillkit

        k, exact = (int(x) for x in a.distillkit.split(":"))
        name = f"distillkit_k{k}_exact{exact}"
        distillkit_files(teacher, train, work / "distillkit", k, exact, [0, 1, 2, 3, 4, "sqrt"])
        files = sum(f.stat().st_size for f in (work / "distillkit").glob("*.parquet"))
        signal = import_distillkit(work / "distillkit", train, work / name, tokenizer=tok, temperature=1.0)
        meta = signal_metadata(signal)
        # Its own bytes: the parquet files DistillKit would publish (the imported copy here is format 2).
        signals[name] = {"k": k, "create_s": float("nan"), "teacher_tokens_per_s": float("nan"),
                         "bytes_per_token": round(files / meta["positions"], 2),
                         "payload_bytes_per_token": (k * math.ceil(math.log2(len(tok))) + 7) // 8 + 4 * exact + 4 * 6,
                         "rows": attach_teacher_signal(train, signal)}
        print("signal", name, json.dumps({x: v for x, v in signals[name].items() if x != "rows"}), flush=True)

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

    def run(name: str, rows, k: int | None, online: bool, epsilon: float | None = None) -> None:
        clock = Clock()
        args = DistillationArguments(
            output_dir=str(work / "out" / name), max_steps=a.steps, per_device_train_batch_size=batch,
            learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=0.05, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, seed=0, disable_tqdm=True, dataloader_num_workers=0, kd_loss="jsd",
            jsd_beta=0.5, temperature=1.0, kd_weight=1.0, task_weight=1.0)
        trainer = DistillationTrainer(model=students.from_teacher(teacher, kept), teacher_model=teacher if online
                                      else None, args=args, train_dataset=rows, data_collator=default_data_collator,
                                      processing_class=tok, callbacks=[clock])
        if online and k is not None:
            bench._online_topk(trainer.distiller, k)
            if epsilon is not None:
                _online_adaptive(trainer.distiller, k, epsilon)
        trainer.train()
        runs[name] = {"k": k, "online": online, "step_s": statistics.median(clock.times[a.warmup:]),
                      "kd_loss": [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r],
                      "perplexity": perplexity(trainer.model, valid)}
        print("run", name, json.dumps({x: v for x, v in runs[name].items() if x != "kd_loss"}), flush=True)
        write(signals, runs, a, kept, train, valid)

    wanted = {int(k) for k in a.references.split(",")} if a.references else {s["k"] for s in signals.values()}

    def reference_of(s: dict) -> str | None:
        if "epsilon" in s:
            return f"online_adaptive_k{s['k']}_e{s['epsilon']}"
        return f"online_topk{s['k']}" if s["k"] in wanted else None

    # The most telling runs first (results are written after each): the k = 64 packed signal and its reference,
    # then each compact signal beside its reference, then the rest.
    order = sorted(signals, key=lambda n: (n != "packed_k64", "packed" in n, "distillkit" in n))
    for name in order:
        s = signals[name]
        ref = reference_of(s)
        if ref is not None and ref not in runs:
            run(ref, train, s["k"], True, s.get("epsilon"))
        run(name, s.pop("rows"), s["k"], False)
    if not a.no_dense:
        run("online_dense", train, None, True)


def _mean_k(signal) -> float:
    """The mean entries per position of an adaptive-k signal (its codes read back)."""
    import numpy as np

    from hf_distill.data.signal_compact import decode_rows
    from hf_distill.data.teacher_signal import SIGNAL_CODES, SIGNAL_SPEC, SIGNAL_TAIL

    data = signal.with_format(None)
    spec_row = data[0][SIGNAL_SPEC]
    from hf_distill.data.signal_compact import CompactSpec

    spec = CompactSpec(*(int(x) for x in spec_row[:3]), float(spec_row[3]), int(spec_row[4]))
    total, n = 0, 0
    for start in range(0, len(data), 64):
        chunk = data[start : start + 64]
        per_row = [len(t) for t in chunk[SIGNAL_TAIL]]
        _, ids = decode_rows([np.asarray(c, np.uint8) for c in chunk[SIGNAL_CODES]], per_row, spec)
        total += int((ids >= 0).sum())
        n += len(ids)
    return total / max(n, 1)


def _online_adaptive(distiller, k: int, epsilon: float) -> None:
    """After `_online_topk`: the online teacher's top-k cut per position as an adaptive-k signal cuts it (the
    fewest ids reaching 1 - epsilon, the exact mass of the rest as the tail), in float32, nothing stored."""
    import torch

    from hf_distill.data.signal_compact import adaptive_counts
    from hf_distill.teacher_sources import SIGNAL, TeacherLogits

    side = distiller.teacher_side
    topk = type(side)

    class OnlineAdaptive(topk):
        def _first(self, inputs, cached, hidden_only):
            out, _, _ = topk._first(self, inputs, cached, hidden_only)
            values, ids, tail = out.views[0]
            shape = values.shape
            counts, cut = adaptive_counts(values.reshape(-1, k), tail.reshape(-1), epsilon)
            keep = (torch.arange(k) < counts[:, None]).reshape(shape)
            return TeacherLogits(SIGNAL, [(torch.where(keep, values, float("-inf")), torch.where(keep, ids, -1),
                                           cut.reshape(shape[:-1]))]), None, None

    side.__class__ = OnlineAdaptive


def write(signals: dict, runs: dict, a, kept, train, valid) -> None:
    """The results so far: every signal whose run is done, with the columns its runs allow."""
    done = {}
    reference = runs["packed_k64"]["perplexity"] if "packed_k64" in runs else None
    wanted = {int(k) for k in a.references.split(",")} if a.references else {s["k"] for s in signals.values()}
    for name, s in signals.items():
        if name not in runs:
            continue
        s = {x: v for x, v in s.items() if x != "rows"}
        r = runs[name]
        ref = (f"online_adaptive_k{s['k']}_e{s['epsilon']}" if "epsilon" in s else
               f"online_topk{s['k']}" if s["k"] in wanted else None)
        online = runs.get(ref)
        s["kd_loss_max_abs_diff_vs_uncompressed"] = (
            max(abs(x - y) for x, y in zip(r["kd_loss"], online["kd_loss"], strict=True)) if online else None)
        s["perplexity"] = r["perplexity"]
        s["perplexity_vs_packed_k64"] = r["perplexity"] / reference - 1 if reference else None
        s["perplexity_vs_online_dense"] = (r["perplexity"] / runs["online_dense"]["perplexity"]
                                           if "online_dense" in runs else None)
        done[name] = s
    data_out = sections.portable_tree({
        "signals": done, "sizes": a.size_results, "runs": runs, "teacher": a.teacher, "kept_blocks": kept,
        "steps": a.steps,
        "batch": 8, "seq": 128, "train_blocks": len(train), "eval_blocks": len(valid), "machine":
        sections.machine(), "command": " ".join(sys.argv), "load_after": list(__import__("os").getloadavg())})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.results}.json").write_text(json.dumps(data_out, indent=2, default=str) + "\n")
    lines = ["# Teacher signal: bytes per token against fidelity (issue #45)", "",
             f"Written by `benchmarks/signal_compact.py` (its docstring says how). Command: `{data_out['command']}`;"
             f" machine: {data_out['machine']}; load average after: {data_out['load_after']}.", "",
             "| signal | bytes / token (files) | payload B / token | teacher tokens/s creating | per-step KD max "
             "abs diff vs uncompressed top-k | held-out ppl | ppl vs packed k=64 | ppl / online dense |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, s in data_out["signals"].items():
        rel, kd, dense = (s["perplexity_vs_packed_k64"], s["kd_loss_max_abs_diff_vs_uncompressed"],
                          s["perplexity_vs_online_dense"])
        mean_k = f" (mean k {s['mean_k']:.1f})" if "mean_k" in s else ""
        lines.append(f"| {name}{mean_k} | {s['bytes_per_token']:.1f} | {s['payload_bytes_per_token']:.1f} | "
                     f"{s['teacher_tokens_per_s']:,.0f} | {'' if kd is None else f'{kd:.2e}'} | "
                     f"{s['perplexity']:.2f} | {'' if rel is None else f'{rel:+.3%}'} | "
                     f"{'' if dense is None else f'{dense:.4f}'} |")
    if data_out["sizes"]:
        lines += ["", "Adaptive k, size alone (not trained):", "",
                  "| signal | mean k | bytes / token (files) | payload B / token |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| {n} | {x['mean_k']:.1f} | {x['bytes_per_token']:.1f} | {x['payload_bytes_per_token']:.1f} |"
                  for n, x in data_out["sizes"].items()]
    lines += ["", "| run | held-out ppl | median s/step |", "| --- | ---: | ---: |"]
    lines += [f"| {n} | {r['perplexity']:.2f} | {r['step_s']:.3f} |" for n, r in data_out["runs"].items()]
    (RESULTS / f"{a.results}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
