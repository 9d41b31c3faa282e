"""Teacher tokens/s while `create_teacher_signal` writes a signal (issue #45 item 4): the packed layout (format 2,
k = 64) against the compact layout (format 3) at the same teacher, rows and batch size, alternated in one process.

The teacher has the causal-LM recipe's default shape (Llama, 6 x 256, MLP 512, GQA 4/2, a 4,096-id byte-level BPE
trained on wiki.valid.raw) with random weights: the speed of its forward and of the signal's packing does not depend
on what it learned. 480 blocks of 128 tokens of wiki.valid.raw, batch 8, as the benchmark's signal section
(benchmarks/causal_lm.py, 7,006 tokens/s at k = 64 on 2026-11-27). Not part of CI.

    python benchmarks/signal_create_speed.py [--repeats 3] [--threads 2]

Writes benchmarks/results/signal_create_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DATA = ROOT.parent / "shared" / "data" / "wikitext2"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--blocks", type=int, default=480)
    p.add_argument("--compact", default="32:8,48:6", help="k:value_bits of the compact runs")
    a = p.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "recipes"))
    from causal_lm import blocks, train_tokenizer

    from hf_distill.data.teacher_signal import create_teacher_signal, signal_metadata

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    text = (DATA / "wiki.valid.raw").read_text(encoding="utf-8")
    tok = train_tokenizer(text, 4096)
    rows = blocks(text, tok, 128, a.blocks)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    teacher = LlamaForCausalLM(config).eval()
    work = HERE / ".cache" / "signal_create_speed"
    shutil.rmtree(work, ignore_errors=True)
    settings = {"packed_k64": dict(k=64)}
    for spec in a.compact.split(","):
        k, bits = (int(x) for x in spec.split(":"))
        settings[f"compact_k{k}_b{bits}"] = dict(k=k, layout="compact", value_bits=bits)
    create_teacher_signal(teacher, rows.select(range(8)), work / "warmup", tokenizer=tok, k=8, batch_size=8,
                          progress=False)  # first-call costs, untimed
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in settings}
    meta: dict[str, dict] = {}
    for r in range(a.repeats):  # alternated, so a change in the machine's load hits every layout alike
        for name, kw in settings.items():
            out = work / f"{name}_{r}"
            t0 = time.perf_counter()
            signal = create_teacher_signal(teacher, rows, out, tokenizer=tok, temperature=1.0, batch_size=8,
                                           progress=False, **kw)
            times[name].append(time.perf_counter() - t0)
            m = signal_metadata(signal)
            meta[name] = {"bytes_per_token": m["bytes_per_token"],
                          "payload_bytes_per_token": m["payload_bytes_per_token"]}
            shutil.rmtree(out, ignore_errors=True)
            print(name, f"{len(rows) * 128 / times[name][-1]:,.0f} tokens/s", flush=True)
    load_after = os.getloadavg()
    result = {"command": "python benchmarks/signal_create_speed.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": load_before,
              "load_after": load_after, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "threads": a.threads, "tokens": len(rows) * 128, "versions": {"torch": torch.__version__},
              "runs": {name: {**meta[name], "seconds": ts,
                              "median_tokens_per_s": len(rows) * 128 / statistics.median(ts)}
                       for name, ts in times.items()}}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "signal_create_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"Command: `{result['command']}`, {result['date']}, {result['machine']}, torch threads {a.threads}, "
             f"load average before / after: {', '.join(f'{x:.2f}' for x in load_before)} / "
             f"{', '.join(f'{x:.2f}' for x in load_after)}.", "",
             f"{len(rows)} blocks x 128 tokens, batch 8, the recipe's default teacher shape (random weights); "
             f"{a.repeats} alternated repeats, median. Target (issue #45 item 4): the compact layout at least the "
             "packed layout's ~7,000 teacher tokens/s.", "",
             "| signal | bytes / token (files) | payload bytes / token | teacher tokens/s (median) | runs (s) |",
             "| --- | ---: | ---: | ---: | --- |"]
    for name, run in result["runs"].items():
        lines.append(f"| {name} | {run['bytes_per_token']:.1f} | {run['payload_bytes_per_token']:.1f} | "
                     f"{run['median_tokens_per_s']:,.0f} | {', '.join(f'{s:.2f}' for s in run['seconds'])} |")
    (RESULTS / "signal_create_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
