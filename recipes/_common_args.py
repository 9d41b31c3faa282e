"""The recipes' command line: their argument dataclasses, `--config file.yaml` parsing with every key and type checked,
and one-line errors (`fail`, `run_main`). Imported through `common` (recipes/common.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------------------------------------- arguments


@dataclass
class ModelArguments:
    """The teacher, and how the student is made (copied teacher layers, a smaller random copy, or a folder)."""

    teacher: str | None = field(
        default=None,
        metadata={"help": "Teacher folder or Hub id. Task distillation: a fine-tuned classifier; general "
                  "distillation: the pre-trained encoder."},
    )
    general_teacher: str | None = field(
        default=None,
        metadata={"help": "Teacher of general distillation: the pre-trained (not fine-tuned) encoder, as in all "
                  "three papers. Defaults to `teacher`."},
    )
    student: str | None = field(
        default=None,
        metadata={"help": "Start from this saved model folder (e.g. a general-distillation output). With "
                  "student_layers, copy those layers of it instead of the teacher's."},
    )
    student_layers: list[int] | None = field(
        default=None,
        metadata={"help": "Build the student by copying these layers (0-based) of the teacher, or of `student` "
                  "when given (DistilBERT-style initialisation)."},
    )
    student_num_layers: int | None = field(default=None, metadata={"help": "Random student: number of layers."})
    student_hidden_size: int | None = field(default=None, metadata={"help": "Random student: hidden size."})
    student_num_heads: int | None = field(default=None, metadata={"help": "Random student: attention heads."})
    student_intermediate_size: int | None = field(default=None, metadata={"help": "Random student: FFN size."})
    model_seed: int | None = field(
        default=None, metadata={"help": "Seed of the student's random weights (a random student, or a new head); "
                                "default: seed. With data_seed, a repeat that keeps the data and augmentation."})


@dataclass
class DataArguments:
    """Task data (a labelled table) and the corpus of general distillation (plain text)."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset name for the task (datasets.load_dataset(name, config))."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub dataset configuration, e.g. sst2."})
    train_split: str = field(default="train", metadata={"help": "Split name of the Hub dataset for training."})
    validation_split: str = field(default="validation", metadata={"help": "Split name for evaluation."})
    train_file: str | None = field(
        default=None, metadata={"help": "Local task training file: .tsv, .csv, .json/.jsonl (read by extension)."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Local task validation file."})
    text_column: str = field(default="sentence", metadata={"help": "Column of the (first) text."})
    text_pair_column: str | None = field(
        default=None, metadata={"help": "Column of the second text of a sentence-pair task (e.g. sentence2)."}
    )
    label_column: str = field(
        default="label", metadata={"help": "Column of the class label: an id, or a name (GLUE's TSVs: entailment, "
                                   "not_entailment, ...) that the teacher's config.label2id turns into its id."}
    )
    class_names: list[str] | None = field(
        default=None,
        metadata={"help": "The class names in the teacher's id order (id 0 first), for a teacher whose config names "
                  "its classes only LABEL_0, LABEL_1, ...: string labels in the data are mapped through them, and "
                  "both configs get them. Must equal the teacher's names when it has real ones."},
    )
    max_length: int = field(default=64, metadata={"help": "Truncate task inputs to this many tokens."})
    max_train_rows: int | None = field(default=None, metadata={"help": "Keep this many training rows."})
    train_subset_seed: int | None = field(
        default=None,
        metadata={"help": "With max_train_rows: shuffle the row indices with random.Random(seed) before keeping "
                  "the first rows (BENCHMARKS.md's SST-2 subset uses 42). Without it: the first rows."},
    )
    max_eval_rows: int | None = field(default=None, metadata={"help": "Evaluate on the first N rows only."})
    corpus_files: list[str] | None = field(
        default=None,
        metadata={"help": "Plain-text files for general (task-agnostic) distillation, e.g. "
                  "../shared/data/wikitext2/wiki.valid.raw. Without them, general distillation is skipped."},
    )
    corpus_block_size: int = field(
        default=128, metadata={"help": "General distillation: tokens per block ([CLS] ... [SEP] included)."}
    )
    max_corpus_blocks: int | None = field(default=None, metadata={"help": "Keep the first N corpus blocks."})


# ----------------------------------------------------------------------------------- parsing with YAML


class ConfigError(ValueError):
    """A malformed config or argument: reported as one `error:` line, exit code 2."""


def _check_value(name: str, value: Any, annotation: Any) -> Any:
    """`value` if it fits the field's type (ints are accepted for floats), else a ConfigError naming the key."""
    if annotation is Any or annotation is None:
        return value
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(name, value, option)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if errors else ConfigError(f"config key {name!r}: got {value!r}")
    if origin is typing.Literal:
        if value not in typing.get_args(annotation):
            raise ConfigError(f"config key {name!r} must be one of {typing.get_args(annotation)}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"config key {name!r} expects a list, got {type(value).__name__} {value!r}")
        (inner,) = typing.get_args(annotation)[:1] or (Any,)
        return [_check_value(name, v, inner) for v in value]
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {name!r} expects a mapping, got {type(value).__name__} {value!r}")
        return value
    if isinstance(annotation, type) and issubclass(annotation, __import__("enum").Enum):
        try:
            return annotation(value).value
        except ValueError:
            known = ", ".join(str(m.value) for m in annotation)
            raise ConfigError(f"config key {name!r} must be one of {known}, got {value!r}") from None
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key {name!r} expects true/false, got {type(value).__name__} {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {name!r} expects an int, got {type(value).__name__} {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {name!r} expects a number, got {type(value).__name__} {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key {name!r} expects a string, got {type(value).__name__} {value!r}")
        return value
    return value  # types we do not check (rare TrainingArguments fields) go to the dataclass as they are


def load_config(path: str, dataclass_types: list[type]) -> dict[str, Any]:
    """Flat YAML mapping -> field defaults, with every key and type checked before anything runs.

    The recipes' list-of-terms field (`distill_terms`) may hold mappings, as in DistillationArguments."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config {path} must be a mapping of field: value, got {type(values).__name__}")
    fields = {}
    for dtype in dataclass_types:
        hints = typing.get_type_hints(dtype)
        for f in dataclasses.fields(dtype):
            if f.init:
                fields[f.name] = hints.get(f.name, Any)
    checked = {}
    for key, value in values.items():
        if key not in fields:
            close = [k for k in fields if k.startswith(str(key)[:4])][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r} in {path}{hint}; see --help for the fields")
        annotation = fields[key]
        if key == "distill_terms":
            annotation = list[Any]
        checked[key] = _check_value(key, value, annotation)
    return checked


def parse_args(dataclass_types: list[type], description: str, argv: list[str] | None = None) -> tuple:
    """`HfArgumentParser` over `dataclass_types` plus `--config file.yaml`: the YAML gives the defaults and
    any field may be overridden on the command line. Errors (unknown key, wrong type, invalid value) end
    the program with one `error:` line and exit code 2, not a traceback."""
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(dataclass_types, description=description,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, help="YAML file of field: value defaults (flags override them).")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    try:
        defaults = load_config(known.config, dataclass_types) if known.config else {}
        if "use_cpu" not in defaults and not _has_accelerator():
            # transformers refuses bf16=True on a machine without a GPU unless use_cpu is set.
            defaults["use_cpu"] = True
        parser.set_defaults(**defaults)
        outputs = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    except (ConfigError, ValueError, TypeError) as err:
        fail(str(err))
    objs = outputs[: len(dataclass_types)]
    for obj in objs:
        for name in MODEL_PATH_FIELDS:
            check_model_path(name, getattr(obj, name, None))
        if hasattr(obj, "fp16"):  # fp16 on a CPU, refused by the trainers, refused here before anything loads
            from hf_distill.argument_checks import check_fp16_device

            try:
                check_fp16_device(obj)
            except ValueError as err:
                fail(str(err))
        if getattr(obj, "resume_from_checkpoint", None):  # TrainingArguments leaves it to scripts; these ignore it
            fail("resume_from_checkpoint: the recipes do not resume a run (they rebuild their students and stages "
                 "from the start); run the recipe again without it")
    return (*objs, known.config)


# Fields that name a model (a saved folder or a Hub id), checked by parse_args before anything loads (a recipe
# checks the fields it reads only in some runs, such as tinybert's augment_mlm, where it knows it will).
MODEL_PATH_FIELDS = ("teacher", "general_teacher", "student")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def check_model_path(name: str, value: str | None) -> None:
    """Fail in one line on a model path that cannot be one: a missing folder, a file, a folder without a
    config. Why here: transformers reads a missing local path as a Hub id and answers with a Hub error
    ("Repo id must use alphanumeric chars", "couldn't connect") that never says the folder is not there.
    Names that can be Hub ids (`name`, `org/name`) and are no local folder are left to the loader."""
    if not value:
        return
    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
            fail(f"{name} {value!r} is a folder without config.json: give the folder the model was saved to "
                 "(save_pretrained writes config.json)")
        return
    if path.exists():
        fail(f"{name} {value!r} is a file: give the model's folder (with config.json) or a Hub id")
    if not _HUB_ID.fullmatch(value) or value.startswith((".", "~")):
        fail(f"{name} {value!r}: no such folder (and not a Hub id, which reads `name` or `org/name`)")


def _has_accelerator() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available()) or \
        torch.backends.mps.is_available()


def fail(message: str, code: int = 2) -> typing.NoReturn:
    lines = [line for line in str(message).splitlines() if line.strip()]
    print(f"error: {lines[0] if lines else message}", file=sys.stderr)
    raise SystemExit(code)


# Exceptions of loading and validation (FileNotFoundError and the other OSErrors; huggingface_hub's
# HFValidationError is a ValueError) that run_main reports in one line when raised outside training.
SETUP_ERRORS = (ValueError, OSError)
# Frames of running code: an error raised under one of them is a crash, reported with its traceback; except
# under the callbacks' on_train_begin, where callbacks check their settings before the first step.
_RUNNING_FRAMES = (("/transformers/trainer.py", ("_inner_training_loop", "evaluation_loop", "prediction_loop")),
                   ("/torch/nn/modules/module.py", ("_call_impl",)))
_SETUP_FRAMES = (("/transformers/trainer_callback.py", ("on_train_begin",)),)


def raised_while_running(tb: types.TracebackType | None) -> bool:
    """Whether a traceback passes through the Trainer's training or evaluation loop or a module's forward (and
    not through the callbacks' on_train_begin)."""
    running = False
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = code.co_filename.replace(os.sep, "/")
        if any(filename.endswith(f) and code.co_name in names for f, names in _SETUP_FRAMES):
            return False
        running = running or any(filename.endswith(f) and code.co_name in names for f, names in _RUNNING_FRAMES)
        tb = tb.tb_next
    return running


def run_main(main: typing.Callable[[], None]) -> None:
    """Run a recipe's `main`: a ValueError or OSError raised while it loads, checks and builds (a wrong path,
    an out-of-range layer list, a flag the library refuses) ends the program with one `error:` line and exit
    code 2, as argparse does; raised inside the Trainer's training or evaluation loop or a model's forward, it
    is a crash and keeps its traceback."""
    try:
        main()
    except SETUP_ERRORS as err:
        if raised_while_running(err.__traceback__):
            raise
        print(f"error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def command_line() -> str:
    """The command that is running, as one could paste it again."""
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


# ------------------------------------------------------------------------------------------- run settings


# ModelArguments fields that describe how a student is made: recipes that build their own refuse them.
STUDENT_FIELDS = ("student", "student_layers", "student_num_layers", "student_hidden_size", "student_num_heads",
                  "student_intermediate_size")


def refuse_unused(recipe: str, why: str, names: tuple[str, ...], *sources) -> None:
    """Fail in one line on fields (of any of `sources`) that `recipe` would otherwise ignore."""
    unused = [n for n in names if any(getattr(src, n, None) is not None for src in sources)]
    if unused:
        fail(f"{', '.join(unused)}: not used by the {recipe} recipe ({why})")


def order_seed(args) -> int:
    """Seed of a recipe's own shuffles of the training rows: `data_seed` when set (as the Trainer's sampler
    does), else `seed`."""
    return args.data_seed if args.data_seed is not None else args.seed


def set_offline_defaults() -> None:
    """Nothing here needs the network; failing fast beats a 23 s retry loop on every Hub call."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
