"""The recipes' data: the task's labelled table (local files or a Hub dataset), its labels numbered as the teacher
numbers them, tokenised; and the plain-text corpus of general distillation. Imported through `common`."""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from _common_args import fail

if TYPE_CHECKING:
    from _common_args import DataArguments


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
