"""What the three recipes share: argument parsing with `--config file.yaml`, data loading, metrics, results.

Kept deliberately plain (no registry, no framework): each recipe reads top to bottom and calls these
helpers for the parts that are not about distillation. Data are local files (chosen by extension) or a
Hub dataset name; metrics are computed here because `evaluate.load("accuracy")` needs the Hub.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import re
import shlex
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


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


# --------------------------------------------------------------------------------------------- task data


def _read_file(path: str):
    """One local file as a `datasets.Dataset`, by extension. TSVs are GLUE-style: quoting off (see
    ../shared/data/README.md: a default CSV reader silently eats bare quotes)."""
    import datasets

    ext = Path(path).suffix.lower()
    if not Path(path).is_file():
        fail(f"data file {path} does not exist")
    if ext in (".tsv", ".csv"):
        return datasets.load_dataset("csv", data_files=path, split="train", delimiter="\t" if ext == ".tsv" else ",",
                                     quoting=csv.QUOTE_NONE if ext == ".tsv" else csv.QUOTE_MINIMAL,
                                     keep_default_na=False)
    if ext in (".json", ".jsonl"):
        return datasets.load_dataset("json", data_files=path, split="train")
    if ext in (".txt", ".raw", ".text"):
        return datasets.load_dataset("text", data_files=path, split="train")
    fail(f"data file {path}: unknown extension {ext!r} (use .tsv, .csv, .json, .jsonl, .txt or .raw)")


def load_task(data: DataArguments):
    """(train, validation) datasets of the task, from local files or the Hub, with the training subset."""
    import datasets

    if data.train_file:
        train = _read_file(data.train_file)
        valid = _read_file(data.validation_file) if data.validation_file else None
    elif data.dataset_name:
        train = datasets.load_dataset(data.dataset_name, data.dataset_config, split=data.train_split)
        valid = datasets.load_dataset(data.dataset_name, data.dataset_config, split=data.validation_split)
    else:
        return None, None
    for ds, what in ((train, "train"), (valid, "validation")):
        if ds is None:
            continue
        needed = [data.text_column, data.label_column] + ([data.text_pair_column] if data.text_pair_column else [])
        missing = [c for c in needed if c not in ds.column_names]
        if missing:
            fail(f"{what} data has no column(s) {missing}; it has {ds.column_names} (set text_column, "
                 "text_pair_column, label_column)")
    if data.max_train_rows is not None and data.max_train_rows < len(train):
        indices = list(range(len(train)))
        if data.train_subset_seed is not None:
            random.Random(data.train_subset_seed).shuffle(indices)
        train = train.select(indices[: data.max_train_rows])
    if valid is not None and data.max_eval_rows is not None:
        valid = valid.select(range(min(data.max_eval_rows, len(valid))))
    return train, valid


@dataclass
class TaskLabels:
    """The task's classes numbered as the teacher numbers them, so that the student's logit k means what the
    teacher's logit k means (a sorted label set or the file's order could silently swap classes)."""

    id2label: dict[int, str]
    lookup: dict[Any, int]  # every label value found in the data -> its class id

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in self.id2label.items()}

    def config_kwargs(self) -> dict[str, Any]:
        """`from_pretrained` keywords that give a loaded student this head size and these names."""
        return {"num_labels": self.num_labels, "id2label": dict(self.id2label), "label2id": self.label2id}

    def apply(self, model, what: str) -> None:
        """Give `model`'s config these id2label/label2id (its head must already have `num_labels` outputs)."""
        if model.config.num_labels != self.num_labels:
            fail(f"the {what} has {model.config.num_labels} labels but the task has {self.num_labels} "
                 f"({self.id2label}); build the {what} with num_labels={self.num_labels}")
        model.config.id2label = dict(self.id2label)
        model.config.label2id = self.label2id


def _default_names(id2label: dict) -> bool:
    return all(str(name) == f"LABEL_{i}" for i, name in id2label.items())


def _label_values(ds, data: DataArguments, split: str, by_name: bool) -> list[tuple[Any, Any]]:
    """(raw value, label) for each distinct label of `ds`: a label is a class name (str) or a class id (int).
    A Hub ClassLabel column is read by name when there are names to map it through, else by its ids."""
    feature = ds.features[data.label_column]
    names = getattr(feature, "names", None)
    out = []
    for raw in ds.unique(data.label_column):
        if names is not None and isinstance(raw, int) and by_name and 0 <= raw < len(names):
            out.append((raw, names[raw]))
        elif isinstance(raw, str):
            out.append((raw, raw))
        elif isinstance(raw, int) or (isinstance(raw, float) and raw.is_integer()):
            out.append((raw, int(raw)))
        else:
            fail(f"{split} data: label {raw!r} in column {data.label_column!r} is neither a class id (an integer) "
                 "nor a class name")
    return out


def _find(name: str, names: list[str]) -> int | None:
    """Index of `name` in `names`: the exact name, else the one name equal to it but for case (MNLI teachers
    such as roberta-large-mnli name their classes ENTAILMENT, ...); the mapping used is printed."""
    if name in names:
        return names.index(name)
    folded = [i for i, n in enumerate(names) if n.casefold() == name.casefold()]
    return folded[0] if len(folded) == 1 else None


def task_labels(train, valid, data: DataArguments, teacher=None) -> TaskLabels:
    """How the data's labels become class ids, checked on every distinct label of both splits before training.

    With a teacher, its config decides: class names map through its id2label (or `class_names` when it has
    only LABEL_k names), integer labels must be below its label count. Without one (a student fine-tuned
    alone), `class_names` or the sorted set of the names in the data number the classes."""
    config = teacher.config if teacher is not None else None
    who = "teacher's" if config is not None else "class_names'"
    names = None  # class names in id order, when they are known
    if config is not None and not _default_names(config.id2label):
        names = [str(config.id2label[i]) for i in range(config.num_labels)]
    if data.class_names:
        given = list(data.class_names)
        if names is not None and given != names:
            fail(f"class_names {given} disagree with the teacher's classes {names} (its config.id2label): leave "
                 "class_names out, the teacher's are used")
        if config is not None and len(given) != config.num_labels:
            fail(f"class_names has {len(given)} names but the teacher has {config.num_labels} labels: give one name "
                 "per teacher id, in id order")
        if len(set(given)) != len(given):
            fail(f"class_names {given} repeat a name")
        names = given
    found = []
    for ds, split in ((train, "train"), (valid, "validation")):
        if ds is not None:
            found += [(split, raw, value) for raw, value in _label_values(ds, data, split, by_name=names is not None)]
    strings = sorted({value for _, _, value in found if isinstance(value, str)})
    if strings and names is None:
        if config is not None:
            defaults = ", ".join(str(config.id2label[i]) for i in range(config.num_labels))
            fail(f"the data's labels are names ({', '.join(map(repr, strings[:8]))}) but the teacher's config names "
                 f"its {config.num_labels} classes only {defaults}"
                 ", so which id means which name is unknown: set class_names to the names in the teacher's id order "
                 "(--class_names NAME_OF_ID_0 NAME_OF_ID_1 ..., or class_names: [...] in the YAML), or save "
                 "id2label/label2id in the teacher's config.json")
        names = strings
        who = "class_names'"
        print(f"no teacher: classes numbered in sorted order {dict(enumerate(names))}")
    if config is not None:
        n = config.num_labels
    elif names is not None:
        n = len(names)
    else:
        n = max((v for _, _, v in found), default=0) + 1
    lookup: dict[Any, int] = {}
    for split, raw, value in found:
        if isinstance(value, str):
            index = _find(value, names)
            if index is None:
                fail(f"{split} data: label {value!r} in column {data.label_column!r} is not one of the {who} "
                     f"classes {names}: use a teacher fine-tuned on this task's classes")
        else:
            if not 0 <= value < n:
                named = f" ({dict(enumerate(names))})" if names else ""
                fail(f"{split} data: label {value} in column {data.label_column!r} is out of range: the "
                     f"{'teacher has' if config is not None else 'task has'} {n} labels, ids 0..{n - 1}{named}; use "
                     "a teacher fine-tuned on this task's classes")
            index = value
        if lookup.setdefault(raw, index) != index:
            fail(f"label {raw!r} means class {lookup[raw]} in the train data but {index} in the validation data")
    if strings:
        mapping = ", ".join(f"{raw!r} -> {i}" for raw, i in sorted(lookup.items(), key=lambda x: (x[1], str(x[0]))))
        print(f"labels (data -> class id): {mapping}")
    if names is not None:
        id2label = dict(enumerate(names))
    elif config is not None:
        id2label = {i: str(config.id2label[i]) for i in range(n)}
    else:
        id2label = {i: f"LABEL_{i}" for i in range(n)}
    return TaskLabels(id2label=id2label, lookup=lookup)


def tokenize_task(ds, tokenizer, data: DataArguments, labels: TaskLabels):
    """Tokenised rows (no padding: the collator pads each batch to its longest row) with `labels` as class ids."""
    if ds is None:
        return None

    def encode(batch):
        pair = batch[data.text_pair_column] if data.text_pair_column else None
        out = tokenizer(batch[data.text_column], pair, truncation=True, max_length=data.max_length)
        out["labels"] = [labels.lookup[y] for y in batch[data.label_column]]
        return out

    return ds.map(encode, batched=True, remove_columns=ds.column_names, desc="tokenising")


def load_corpus(data: DataArguments, tokenizer):
    """General-distillation blocks: the corpus lines tokenised, concatenated and cut into blocks of
    `corpus_block_size` tokens, each `[CLS] ... [SEP]` (as BERT pre-training data, single segment)."""
    import datasets

    if not data.corpus_files:
        return None
    texts = []
    for path in data.corpus_files:
        if not Path(path).is_file():
            fail(f"corpus file {path} does not exist")
        with open(path, encoding="utf-8") as f:
            texts += [line.strip() for line in f if line.strip()]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    flat = [t for row in ids for t in row]
    body = data.corpus_block_size - 2
    blocks = [[tokenizer.cls_token_id, *flat[i : i + body], tokenizer.sep_token_id]
              for i in range(0, len(flat) - body + 1, body)]
    if data.max_corpus_blocks is not None:
        blocks = blocks[: data.max_corpus_blocks]
    n = data.corpus_block_size
    return datasets.Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * n] * len(blocks),
                                       "token_type_ids": [[0] * n] * len(blocks)})


# ----------------------------------------------------------------------------------------------- metrics


def compute_metrics(eval_pred) -> dict[str, float]:
    """Accuracy and F1 (binary for 2 classes, macro otherwise), offline."""
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    if isinstance(logits, tuple):
        logits = logits[0]
    preds = np.asarray(logits).argmax(-1)
    labels = np.asarray(labels)
    classes = sorted(set(labels.tolist()) | set(preds.tolist()))
    f1s = []
    for c in classes if len(classes) > 2 else [1]:
        tp = int(((preds == c) & (labels == c)).sum())
        fp = int(((preds == c) & (labels != c)).sum())
        fn = int(((preds != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return {"accuracy": float((preds == labels).mean()), "f1": float(np.mean(f1s))}


def evaluate_model(model, dataset, collator, batch_size: int = 64, bf16: bool = False) -> dict[str, float]:
    """Metrics of any classifier on a tokenised dataset (used for the teacher, which no Trainer holds)."""
    import torch
    from transformers import EvalPrediction

    model.eval()
    logits, labels = [], []
    names = set(__import__("inspect").signature(model.forward).parameters)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=bf16 and model.device.type == "cpu"):
        for i in range(0, len(dataset), batch_size):
            batch = collator([dataset[j] for j in range(i, min(i + batch_size, len(dataset)))])
            inputs = {k: v.to(model.device) for k, v in batch.items() if k in names and k != "labels"}
            logits.append(model(**inputs).logits.float().cpu().numpy())
            labels.append(batch["labels"].numpy())
    return compute_metrics(EvalPrediction(np.concatenate(logits), np.concatenate(labels)))


# ----------------------------------------------------------------------------------------------- results


def write_results(output_dir: str, results: dict[str, Any]) -> Path:
    """`results.json` next to the saved student."""
    path = Path(output_dir) / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict | list)}, indent=2))
    return path


def cache_task_logits(teacher, train, collator, cache_dir: str, progress: bool, bf16: bool = False):
    """`train` with the teacher's logits computed once (hf_distill.data.cache), under bf16 autocast when asked, so
    the cached logits equal those an online bf16 teacher would give."""
    import torch

    from hf_distill.data.cache import cache_teacher_outputs

    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        return cache_teacher_outputs(teacher, train, cache_dir=cache_dir, collator=collator, progress=progress,
                                     key={"bf16": True} if bf16 else None)


def run_length(args, state) -> dict[str, Any]:
    """How long a run really trained, from the trainer state (`train_steps`, `epochs_trained`), and the limit
    that ended it: `max_steps` when set (the Trainer then ignores `num_train_epochs`), else `epochs`."""
    limit = {"max_steps": args.max_steps} if args.max_steps and args.max_steps > 0 else {
        "epochs": args.num_train_epochs}
    return {**limit, "train_steps": state.global_step, "epochs_trained": round(float(state.epoch or 0.0), 4)}


def train_and_report(trainer, results: dict[str, Any], start: float, *, student, teacher, train, valid, collator,
                     evaluate_teacher: bool) -> None:
    """The end every recipe shares: train, save the student, evaluate it (and the teacher), write results.json
    (every metric of the evaluation in `student_metrics` / `teacher_metrics`, which the model card reads)."""
    args = trainer.args
    train_out = trainer.train()
    trainer.save_model()
    from hf_distill.publish import measure
    from hf_distill.publish.report import distillation_facts, latest_eval_metrics

    results.update(params=measure.count_parameters(student), train_rows=len(train), **run_length(args, trainer.state),
                   bf16=args.bf16, bf16_available=bf16_available(), distillation=distillation_facts(args),
                   train_runtime_s=train_out.metrics.get("train_runtime"))
    if teacher is not None:
        results["teacher_params"] = measure.count_parameters(teacher)
    if valid is not None:
        metrics = trainer.evaluate()
        results.update(accuracy=metrics["eval_accuracy"], f1=metrics["eval_f1"], eval_rows=len(valid),
                       student_metrics=latest_eval_metrics([metrics])[0])
        if evaluate_teacher and teacher is not None:
            t = evaluate_model(teacher, valid, collator, bf16=args.bf16)
            results.update(teacher_accuracy=t["accuracy"], teacher_f1=t["f1"], teacher_metrics=t)
    results["wall_s"] = time.time() - start
    write_results(args.output_dir, results)
    trainer.save_state()  # trainer_state.json (train and eval logs): `hf-distill report` plots the run


def bf16_available() -> bool:
    """bf16 autocast pays off on CPUs with native bf16 arithmetic (AVX-512 BF16 / AMX), else it is emulated."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check and check())


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


# ------------------------------------------------------------------------------------------------ models


def build_student(margs: ModelArguments, teacher, auto_class, seed: int, **load_kwargs):
    """The student, from (in this order of precedence): `student` + `student_layers` (copy those layers of
    that model), `student` alone (load it), `student_layers` (copy the teacher's layers, DistilBERT),
    `student_num_layers`... (random smaller copy of the teacher's family, TinyBERT)."""
    import torch

    from hf_distill import students

    if margs.model_seed is not None:
        seed = margs.model_seed
        torch.manual_seed(seed)  # a new classifier head of a copied or loaded student draws from here
    if margs.student and margs.student_layers:
        source = auto_class.from_pretrained(margs.student, **load_kwargs)
        return students.from_teacher(source, margs.student_layers)
    if margs.student:
        return auto_class.from_pretrained(margs.student, **load_kwargs)
    if margs.student_layers:
        return students.from_teacher(teacher, margs.student_layers)
    sizes = (margs.student_num_layers, margs.student_hidden_size, margs.student_num_heads,
             margs.student_intermediate_size)
    if any(s is None for s in sizes):
        fail("the student is undefined: set student (a folder), student_layers (copy teacher layers) or all of "
             "student_num_layers, student_hidden_size, student_num_heads, student_intermediate_size")
    return students.shrink(teacher, *sizes, seed=seed)


def load_model(auto_class, path: str, what: str, **kwargs):
    """`from_pretrained` with a one-line error for a missing folder (the usual mistake in a config)."""
    try:
        return auto_class.from_pretrained(path, **kwargs)
    except OSError as err:
        fail(f"cannot load the {what} from {path!r}{_as_hub_id(path)}: {_one_line(err)}")


def load_tokenizer(path: str, what: str, **kwargs):
    """`AutoTokenizer.from_pretrained` with a one-line error naming whose tokenizer could not be read (a folder
    without tokenizer files raises a ValueError listing the converters it tried)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        fail(f"cannot load the tokenizer of the {what} from {path!r}{_as_hub_id(path)}: {_one_line(err)}")


def _as_hub_id(path: str) -> str:
    return "" if Path(path).expanduser().is_dir() else " (not a local folder, so read as a Hub id)"


def _one_line(err: BaseException) -> str:
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def fit_mlm_head(mlm, missing: list[str], corpus, tokenizer, steps: int, seed: int, bf16: bool,
                 batch_size: int = 32, lr: float = 1e-3) -> float:
    """Train the parameters `from_pretrained` reported missing (an MLM head on an encoder shipped without one)
    on masked corpus blocks, everything else frozen; returns the final masked-token accuracy.

    Why: TinyBERT's augmentation asks a masked LM for word candidates; a random head gives random words.
    Fitting only the head (a probe of the frozen encoder) is cheap and keeps the encoder the teacher's."""
    import torch

    from hf_distill.data.collators import MLMDistillationCollator

    names = set(missing)
    trainable = [p for n, p in mlm.named_parameters() if n in names]
    for n, p in mlm.named_parameters():
        p.requires_grad_(n in names)
    if not trainable:
        return float("nan")
    head = getattr(mlm, "cls", None) or getattr(mlm, "lm_head", None)
    if head is None:
        fail(f"cannot find the MLM head of {type(mlm).__name__} (expected .cls or .lm_head)")
    collate = MLMDistillationCollator(tokenizer, mlm_probability=0.15, seed=seed)
    opt = torch.optim.AdamW(trainable, lr=lr)
    g = torch.Generator().manual_seed(seed)
    mlm.train()
    acc = float("nan")
    for step in range(steps):
        rows = torch.randint(len(corpus), (batch_size,), generator=g).tolist()
        batch = collate([corpus[i] for i in rows])
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                hidden = mlm.base_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
            targets = batch["labels"] != -100
            logits = head(hidden[targets]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["labels"][targets])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == batch["labels"][targets]).float().mean().item()
            print(f"MLM head step {step}: loss {loss.item():.3f}, masked-token accuracy {acc:.1%}", flush=True)
    mlm.eval()
    for p in mlm.parameters():
        p.requires_grad_(False)
    return acc
