"""`hf-distill`: the command line of hf_distill (demo, run, card, push, report, signal, auto, teacher;
docs/guides/cli.md).

Exit codes: 0 success, 2 usage error, 1 failure (one `error: ...` line on stderr, no traceback), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path

from .base.tokenizer_files import check_teacher_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent


class CommandError(Exception):
    """An expected failure: reported as one `error:` line, exit code `code`."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="hf-distill", epilog="Run `hf-distill <command> --help` for the options of a command.",
        description="Knowledge distillation native to transformers.Trainer: run, document and publish students.")
    parser.add_argument("--version", action="version", version=f"hf-distill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.add_parser("demo", add_help=False,
                   help="distil a real sentiment classifier end to end, offline (options: hf-distill demo --help)")
    run = sub.add_parser(
        "run", help="run a recipe script with its own arguments",
        description="Run recipes/<recipe>.py (from the current folder or the hf_distill repository) or a script "
        "path, as `python <script> [args]` would. Everything after <recipe> goes to the script, e.g. "
        "`hf-distill run tinybert --config recipes/configs/tinybert_sst2.yaml --output_dir out`.",
        epilog=f"Available recipes: {', '.join(available_recipes()) or 'none found'}.")
    run.add_argument("recipe", help="recipe name (e.g. tinybert) or path to a .py script")
    card = sub.add_parser(
        "card", help="write or refresh README.md (the model card) of a saved student folder",
        description="Write the model card of a saved student from what its folder holds (config.json, "
        "trainer_state.json, training_args.bin, results.json, a previous card's distillation_report.json). "
        "Options override what the folder says.")
    card.add_argument("student_dir", help="folder saved by trainer.save_model() or save_pretrained()")
    for flag, kind, text in (("--teacher", None, "teacher Hub id (becomes base_model) or name"),
                             ("--dataset", "append", "Hub dataset id (repeatable)"),
                             ("--dataset_name", None, "display name of the evaluation dataset"),
                             ("--license", None, "license id, e.g. apache-2.0"),
                             ("--language", "append", "language code (repeatable)"),
                             ("--method", None, "distillation method tag (tinybert, distilbert, minilm, ...)"),
                             ("--repo_id", None, "Hub repo id the card's loading snippet names")):
        card.add_argument(flag, action=kind, help=text)
    push = sub.add_parser(
        "push", help="publish a saved student folder to the Hub (student files and card only)",
        description="Upload config.json, the safetensors weights, the tokenizer files and README.md (plus the loss "
        "plot it links) of a student folder; never checkpoints, optimizer state, projections or training_args.bin. "
        "A folder without README.md gets a card first.")
    push.add_argument("student_dir")
    _hub_arguments(push, "e.g. my-user/my-tiny-student")
    report = sub.add_parser(
        "report", help="plot loss components (and accuracy vs parameters across runs)",
        description="Write loss_components.png from trainer_state.json (the folder's or its latest checkpoint's) "
        "and, when subfolders hold results.json files with accuracy and params, accuracy_vs_params.png.")
    report.add_argument("output_dir")
    _signal_parser(sub)
    from .auto.command import add_parser as auto_parser

    auto_parser(sub)
    from .serving.command import add_parser as teacher_parser

    teacher_parser(sub)  # hf-distill teacher serve (issue #42)
    return parser


def _signal_parser(sub: argparse._SubParsersAction) -> None:
    signal = sub.add_parser(
        "signal", help="an offline causal-LM teacher signal: create it, push it to the Hub",
        description="The teacher's top-k log-probabilities and tail mass at each counted token, made once, shared "
        "as a Hub dataset, trained from without the teacher (docs/guides/caching.md).")
    actions = signal.add_subparsers(dest="signal_command", metavar="<action>")
    create = actions.add_parser(
        "create", help="run a causal-LM teacher over tokenised rows and write its signal (resumable)",
        description="Run the teacher batched over the rows and write the signal to output_dir; run the same command "
        "again after an interruption to finish it.")
    create.add_argument("teacher", help="teacher folder or Hub id (AutoModelForCausalLM)")
    create.add_argument("rows", help="the tokenised training rows (input_ids, labels): a folder written by "
                        "Dataset.save_to_disk, or a .parquet, .jsonl/.json or .arrow file")
    create.add_argument("output_dir")
    for flag, kind, default, text in (
            ("--tokenizer", str, None, "tokenizer folder or Hub id (default: the teacher's)"),
            ("--k", int, 64, "ids kept per token"),
            ("--temperature", float, 1.0, "temperature of the stored log-probabilities (training must use it)"),
            ("--kd_token_mask", ("labels", "attention"), "labels", "positions stored: labels (next label not "
             "-100) or attention (real tokens)"),
            ("--batch_size", int, 8, "rows per teacher forward"),
            ("--rows_per_shard", int, 1024, "rows per file (the unit of resumption)"),
            ("--dtype", ("bfloat16", "float16", "float32"), None, "load the teacher in this dtype and run it "
             "under autocast in it (default: as saved)"),
            ("--device", str, None, "where to run the teacher, e.g. cuda (default: cpu)"),
            ("--split", str, None, "the split of a saved DatasetDict (default: train)"),
            ("--teacher_name", str, None, "the teacher's name in the metadata and card (default: the "
             "teacher argument)"),
            ("--layout", ("packed", "compact"), "packed", "packed: format 2 (17-bit id + float16 per entry); "
             "compact: format 3 (bit-packed ids, quantised log-probabilities; docs/guides/teacher_signal.md)"),
            ("--value_bits", int, None, "compact layout: bits per quantised log-probability (default: 8)"),
            ("--value_step", float, None, "compact layout: the quantisation step in nats (default: a 16-nat range "
             "over value_bits)"),
            ("--epsilon", float, None, "compact layout: adaptive k (format 4), each position keeps the fewest of "
             "its k ids whose mass reaches 1 - epsilon (default: every position keeps k)")):
        choices = kind if isinstance(kind, tuple) else None
        text += f" (default: {default})" if default is not None and "default" not in text else ""
        create.add_argument(flag, type=str if choices else kind, choices=choices, default=default, help=text)
    create.add_argument("--no_progress", action="store_true", help="no progress bar")
    push = actions.add_parser(
        "push", help="publish a signal folder as a Hub dataset repo (with a dataset card)",
        description="Upload the signal's shards, teacher_signal.json and README.md (the dataset card, written "
        "first when missing). Load it back with load_teacher_signal(repo_id).")
    push.add_argument("signal_dir")
    _hub_arguments(push, "e.g. my-user/my-teacher-signal")


def _hub_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """The arguments every push command takes after its folder."""
    parser.add_argument("repo_id", help=example)
    parser.add_argument("--private", action="store_true", help="create the repo private (if it does not exist)")
    parser.add_argument("--revision", help="branch to push to (created if missing)")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the saved login)")
    parser.add_argument("--endpoint", help="Hub endpoint (default: HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--commit_message", default=None)


def _recipe_folders() -> tuple[Path, Path]:
    return Path.cwd() / "recipes", REPO_ROOT / "recipes"


def _is_recipe(path: Path) -> bool:
    """A recipe is a script: a module without a `__main__` block (recipes/common.py, the recipes' shared helpers)
    would run as one, do nothing and exit 0."""
    return not path.name.startswith("_") and "__name__ == " in path.read_text(encoding="utf-8")


def available_recipes() -> list[str]:
    return sorted({p.stem for folder in _recipe_folders() if folder.is_dir() for p in folder.glob("*.py")
                   if _is_recipe(p)})


def resolve_recipe(recipe: str) -> Path:
    if recipe.endswith(".py") or os.sep in recipe or "/" in recipe:
        if Path(recipe).is_file():
            return Path(recipe).resolve()
        raise CommandError(f"no recipe script at {recipe}.", code=2)
    found = next((folder / f"{recipe}.py" for folder in _recipe_folders() if (folder / f"{recipe}.py").is_file()), None)
    if found is None or not _is_recipe(found):
        known = ", ".join(available_recipes()) or "none found"
        what = f"unknown recipe {recipe!r}" if found is None else f"{found} is not a recipe (no __main__ block)"
        raise CommandError(f"{what}. Available recipes: {known}.", code=2)
    return found.resolve()


# ---------------------------------------------------------------------- commands


def cmd_run(recipe: str, argv: list[str]) -> int:
    """`python <recipe> argv`: the script's folder importable, sys.argv and sys.path restored after."""
    path = resolve_recipe(recipe)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(path.parent))

    def script() -> int:
        runpy.run_path(str(path), run_name="__main__")
        return 0

    try:
        return _exit_code(script)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def cmd_card(args: argparse.Namespace) -> int:
    from .publish.card import write_model_card

    fields = {"teacher": args.teacher, "datasets": args.dataset, "dataset_name": args.dataset_name,
              "license": args.license, "language": args.language, "method": args.method, "model_name": args.repo_id}
    folder = Path(args.student_dir)
    if folder.is_dir() and not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
        raise CommandError(f"{folder} holds no config.json, so it is not a saved student (a card would describe "
                           "nothing): save it with trainer.save_model() or model.save_pretrained() first.")
    print(f"Wrote {write_model_card(args.student_dir, **{k: v for k, v in fields.items() if v})}")
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .publish.card import CARD_FILE, write_model_card
    from .publish.hub import DEFAULT_COMMIT_MESSAGE, push_student, upload_files

    folder = Path(args.student_dir)
    upload_files(folder)  # refuse a folder that is not a student before writing anything into it
    if not (folder / CARD_FILE).is_file():
        print(f"Writing a model card first: {write_model_card(folder, model_name=args.repo_id)}")
    url = push_student(folder, args.repo_id, private=args.private or None, revision=args.revision, token=args.token,
                       commit_message=args.commit_message or DEFAULT_COMMIT_MESSAGE, endpoint=args.endpoint)
    print(f"Pushed {folder} to {args.repo_id}: {url}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from .publish.plots import make_report

    for path in make_report(args.output_dir).values():
        print(f"Wrote {path}")
    return 0


def _load_rows(path: str, split: str | None):
    import datasets

    if Path(path).is_dir():
        rows = datasets.load_from_disk(path)
        if not isinstance(rows, datasets.DatasetDict):
            if split is not None:
                raise CommandError(f"rows {path!r} holds one Dataset, not a DatasetDict: leave --split out.", code=2)
            return rows
        if (split or "train") not in rows:
            names = ", ".join(rows)
            raise CommandError(f"rows {path!r} has no split {split or 'train'!r} (splits: {names}): pass --split "
                               f"{next(iter(rows))}.", code=2)
        return rows[split or "train"]
    builders = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow"}
    builder = builders.get(Path(path).suffix)
    if builder is None or not Path(path).is_file():
        raise CommandError(f"rows {path!r}: give a folder written by Dataset.save_to_disk or a "
                           f"{', '.join(builders)} file of tokenised rows.", code=2)
    if split is not None:
        raise CommandError(f"rows {path!r} is one file of rows, not a DatasetDict: leave --split out.", code=2)
    return datasets.load_dataset(builder, data_files=path, split="train")


def cmd_signal(args: argparse.Namespace, argv: list[str]) -> int:
    if args.signal_command == "push":
        from .data.signal_hub import DEFAULT_COMMIT_MESSAGE, push_teacher_signal

        url = push_teacher_signal(args.signal_dir, args.repo_id, private=args.private or None,
                                  revision=args.revision, token=args.token, endpoint=args.endpoint,
                                  commit_message=args.commit_message or DEFAULT_COMMIT_MESSAGE)
        print(f"Pushed the teacher signal {args.signal_dir} to the dataset repo {args.repo_id}: {url}")
        return 0

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .base.recorded_names import recorded_command
    from .data.signal_checks import check_signal_tokenizer
    from .data.signal_compact import layout_spec
    from .data.teacher_signal import check_signal_settings, create_teacher_signal, signal_metadata
    from .teacher import teacher_tokenizer

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, None: None}
    compact = args.layout == "compact"
    given = [f"{flag} {value}" for flag, value in (("--value_bits", args.value_bits), ("--value_step", args.value_step))
             if value is not None]
    if given and not compact:  # they would do nothing in format 2
        raise CommandError(f"{', '.join(given)}: the compact layout's quantisation, which --layout packed does not "
                           "have: add --layout compact, or remove them.", code=2)
    if args.epsilon is not None and not compact:
        raise CommandError(f"--epsilon {args.epsilon} (adaptive k) is a setting of the compact layout: add --layout "
                           "compact.", code=2)
    rows = _load_rows(args.rows, args.split)
    device = _signal_device(args.device)
    # Everything that can be checked without the teacher's weights is, before loading them (minutes for an LLM).
    config = _load("teacher", args.teacher, lambda: AutoConfig.from_pretrained(args.teacher))
    vocab = getattr(config, "vocab_size", None)
    check_signal_settings(rows, args.output_dir, k=args.k, temperature=args.temperature,
                          kd_token_mask=args.kd_token_mask, vocab_size=vocab if isinstance(vocab, int) else None,
                          batch_size=args.batch_size, rows_per_shard=args.rows_per_shard)
    layout_spec(args.layout if compact else None, args.k, vocab if isinstance(vocab, int) else 2, args.value_bits,
                args.value_step, args.epsilon)
    layout = {"layout": "compact", "value_bits": args.value_bits, "value_step": args.value_step} if compact else {}
    if args.epsilon is not None:
        layout["epsilon"] = args.epsilon
    where = args.tokenizer or args.teacher
    check_teacher_tokenizer(args.teacher, args.tokenizer)
    tokenizer = _load("--tokenizer" if args.tokenizer else "teacher", where,
                      lambda: AutoTokenizer.from_pretrained(where))
    if isinstance(vocab, int):  # a tokenizer that does not fit the teacher is refused before its weights load
        own = teacher_tokenizer(None, source=args.teacher)[0] if args.tokenizer else None
        check_signal_tokenizer(tokenizer, vocab, own=own,
                               flag=f"--tokenizer {args.tokenizer}" if args.tokenizer else "the teacher's tokenizer")
    teacher = _load("teacher", args.teacher, lambda: AutoModelForCausalLM.from_pretrained(
        args.teacher, **({"dtype": dtypes[args.dtype]} if args.dtype else {})))
    if device is not None:
        teacher.to(device)
    try:
        signal = create_teacher_signal(
            teacher, rows, args.output_dir, tokenizer=tokenizer, k=args.k, temperature=args.temperature,
            kd_token_mask=args.kd_token_mask, batch_size=args.batch_size, rows_per_shard=args.rows_per_shard,
            dtype=dtypes[args.dtype], teacher_name=args.teacher_name or args.teacher, progress=not args.no_progress,
            command=recorded_command(["hf-distill", *argv]), **layout)  # no machine's absolute path
    except KeyboardInterrupt:
        done, total = len(list(Path(args.output_dir).glob("shard-*.arrow"))), -(-len(rows) // args.rows_per_shard)
        raise CommandError(f"interrupted: {done} of {total} shards ({args.rows_per_shard} rows each) are written in "
                           f"{args.output_dir}; run the same command again to finish the signal.", code=130) from None
    meta = signal_metadata(signal)
    print(f"Wrote the teacher signal to {args.output_dir}: {meta['rows']} rows, {meta['positions']} tokens, "
          f"{meta['bytes_per_token']} bytes per token (k={meta['k']}, temperature={meta['temperature']}).")
    return 0


def _signal_device(name: str | None):
    """`--device` as a torch.device, refused before any loading when it is not a device this machine has."""
    import torch

    if name is None:
        return None
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise CommandError(f"--device {name}: not a device name ({error}); use e.g. cpu, cuda or cuda:1.", 2) from None
    accelerator = getattr(torch, device.type, None) if device.type != "cpu" else None
    available = device.type == "cpu" or (accelerator is not None and accelerator.is_available())
    count = accelerator.device_count() if available and hasattr(accelerator, "device_count") else None
    if not available or (device.index is not None and count is not None and device.index >= count):
        raise CommandError(f"--device {name}: this machine has no such device (torch {torch.__version__}); leave "
                           "--device out to run the teacher on the CPU, or run where that device is.", code=2)
    return device


def _load(what: str, where: str, load: Callable[[], object]):
    """A transformers `from_pretrained` call whose failure (no such folder or Hub id, offline) is one error line."""
    try:
        return load()
    except OSError as error:
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise CommandError(f"{what} {where!r}: could not load it ({first}). Give a folder saved with "
                           "save_pretrained, or a Hub id (downloads need HF_HUB_OFFLINE unset).") from None


def _exit_code(run: Callable[[], object]) -> int:
    """A script-like callable's return value or SystemExit as an exit code; `sys.exit("message")` prints the
    message and gives 1, as Python does."""
    try:
        code = run()
    except SystemExit as exit_:
        code = exit_.code
    if code is None or code is True:
        return 0
    if isinstance(code, int):
        return code
    print(f"error: {code}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `hf-distill` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from .publish.hub import HubPushError

    try:
        # demo and run hand every remaining argument (--help included) to the script they start.
        if argv[:1] == ["demo"]:
            from . import demo

            return _exit_code(lambda: demo.main(argv[1:]))
        if argv[:1] == ["run"] and len(argv) > 1 and not argv[1].startswith("-"):
            return cmd_run(argv[1], argv[2:])
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        if args.command == "signal":
            if args.signal_command is None:
                raise CommandError("`hf-distill signal` needs an action: create or push (see hf-distill signal "
                                   "--help).", code=2)
            return cmd_signal(args, argv)
        if args.command == "teacher":
            from .serving.command import cmd_teacher

            return cmd_teacher(args, CommandError, _signal_device, _load)
        if args.command == "auto":
            from .auto.command import cmd_auto

            return cmd_auto(args, argv)
        return {"card": cmd_card, "push": cmd_push, "report": cmd_report}[args.command](args)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt:
        print("error: interrupted.", file=sys.stderr)
        return 130
    except (CommandError, HubPushError, FileNotFoundError, NotADirectoryError, ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code if isinstance(error, CommandError) else 1


if __name__ == "__main__":
    raise SystemExit(main())
