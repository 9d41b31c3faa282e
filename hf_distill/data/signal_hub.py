"""Sharing a teacher signal: a Hub dataset repository with a dataset card, and loading it back by repo id.

`push_teacher_signal(folder, "user/name")` publishes a complete signal folder (its `shard-*.arrow` files,
`teacher_signal.json` and README.md, the dataset card, written first when missing) through hf_distill.publish.hub's
one push path (`push_folder`, repo type "dataset"): temporary files of an interrupted run never leave the machine.
The card states what a user must know before training from it: the teacher and its weight fingerprint, k, the
temperature, the vocabulary hash, kd_token_mask, the tokens and bytes per token, the hf_distill version and the
command that made it. `load_teacher_signal("user/name")` downloads it (`download_teacher_signal`: the Hub cache, so
a second load, or one offline, reads the cached copy) and checks it as it checks a local folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from ..publish.hub import HubPushError, ensure_repo, push_folder
from .signal_download import CARD_FILE, download_teacher_signal  # noqa: F401 - part of this module's API
from .teacher_signal import _META_FILE, load_teacher_signal

__all__ = ["download_teacher_signal", "push_teacher_signal", "signal_card", "signal_files", "write_signal_card"]

DEFAULT_COMMIT_MESSAGE = "Upload teacher signal (hf_distill)"


def signal_files(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` that make up a published signal; refuses a folder that is not a complete signal."""
    folder = Path(folder)
    try:
        load_teacher_signal(folder)  # complete, readable, rows as the metadata says
    except (ValueError, OSError) as error:
        raise HubPushError(f"Could not push {folder}: {error}") from error
    names = [_META_FILE, *sorted(p.name for p in folder.glob("shard-*.arrow"))]
    return names + ([CARD_FILE] if (folder / CARD_FILE).is_file() else [])


def signal_card(meta: dict[str, Any], repo_id: str | None = None) -> str:
    """The dataset card (README.md: YAML front matter, then markdown) of a signal with metadata `meta`."""
    front = {"tags": ["hf_distill", "knowledge-distillation", "teacher-signal"],
             "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "shard-*.arrow"}]}]}
    teacher = meta.get("teacher") or "(unnamed)"
    k, vocab = meta["k"], meta["vocab_size"]
    rows = [
        ("Teacher", f"`{teacher}`"),
        ("Teacher weight fingerprint", f"`{meta['teacher_fingerprint']}`"),
        ("k (ids kept per token)", f"{k} of {vocab}" + (" (the whole vocabulary: no tail)" if k == vocab else "")),
        ("Temperature", f"{meta['temperature']}" + (f" (rescaled from {meta['rescaled_from']})"
                                                    if "rescaled_from" in meta else "")),
        ("Vocabulary hash", f"`{meta['vocab_hash']}`"),
        ("kd_token_mask", f"`{meta['kd_token_mask']}`"),
        ("Rows", f"{meta['rows']:,}"),
        ("Tokens (stored positions)", f"{meta.get('positions', 0):,}"),
        ("Bytes per token", f"{meta.get('bytes_per_token')} (files), {meta.get('payload_bytes_per_token')} (data)"),
        ("Layout", _layout(meta)),
        *([("Imported from", f"{meta['imported_from']} (tail: {meta.get('tail')})")] if "imported_from" in meta
          else []),
        ("Teacher dtype", f"{meta.get('dtype') or 'as loaded'}"),
        ("Rows digest", f"`{meta.get('dataset')}`"),
        ("hf_distill version", f"{meta.get('hf_distill')}"),
    ]
    table = "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])
    where = repo_id or "path/or/user-name"
    return f"""---
{yaml.safe_dump(front, sort_keys=False).strip()}
---

# Teacher signal of {teacher}

The teacher's top-{k} log-probabilities ({_values(meta)}), their ids and the log of the remaining (tail) mass at
each counted token of a tokenised dataset, made once with hf_distill so that a student trains without running the
teacher.

{table}

## How it was made

```{"bash" if str(meta.get("command")).startswith("hf-distill") else "python"}
{meta.get("command") or "(not recorded)"}
```

## Training from it

The student must share the teacher's tokenizer (vocabulary hash above), train at temperature
{meta['temperature']} with `kd_token_mask="{meta['kd_token_mask']}"`, on the rows the signal was made from, in the
same order; hf_distill refuses anything else, naming the mismatch.

```python
from hf_distill import DistillationArguments, DistillationTrainer
from hf_distill.data.teacher_signal import attach_teacher_signal, load_teacher_signal

train = attach_teacher_signal(rows, load_teacher_signal("{where}"))  # checks every row's ids and positions
args = DistillationArguments(output_dir="out", temperature={meta['temperature']}, \
kd_token_mask="{meta['kd_token_mask']}", kd_loss="jsd")
trainer = DistillationTrainer(model=student, teacher_model=None, args=args, train_dataset=train,
                              data_collator=collate, processing_class=tokenizer)
trainer.train()
```

`teacher_signal.json` holds this metadata; each `shard-*.arrow` file is a block of rows ({_columns(meta)},
`teacher_signal_tail`: the log tail mass per token, `teacher_signal_row`: a hash of the row's `input_ids`,
`teacher_signal_positions`: a hash of its counted positions, so rows whose labels moved are refused). The layout is
specified byte by byte in hf_distill's teacher-signal guide (docs/guides/teacher_signal.md).
"""


def _layout(meta: dict[str, Any]) -> str:
    if meta["layout"] == "compact":
        return (f"compact (format {meta['format']}): ids in {meta['id_bits']} bits, log-probabilities quantised to "
                f"{meta['value_bits']} bits in steps of {meta['value_step']:.4g} nats below each token's largest "
                f"(error <= one step), float16 log tail"
                + (f"; adaptive k: each token keeps the fewest of its {meta['k']} ids whose mass reaches 1 - "
                   f"{meta['epsilon']:g}, its count in {meta['count_bits']} bits" if "epsilon" in meta else "")
                + f"; {meta.get('payload_bytes_per_token')} bytes per token")
    return f"{meta['layout']} (format {meta['format']}); {meta.get('payload_bytes_per_token')} bytes per token"


def _values(meta: dict[str, Any]) -> str:
    if meta["layout"] == "compact":
        return f"{meta['value_bits']}-bit steps of {meta['value_step']:.4g} nats below each token's largest"
    return "float16"


def _columns(meta: dict[str, Any]) -> str:
    if meta["layout"] == "compact":
        return ("`teacher_signal_codes`: each row's bit stream of ids and quantised log-probabilities, "
                "`teacher_signal_spec`: its k, id bits, value bits and step")
    return "`teacher_signal_topk`: packed id and value entries" + (
        ", `teacher_signal_values`: float16 log-probabilities" if meta["layout"] == "split" else "")


def write_signal_card(folder: str | os.PathLike, repo_id: str | None = None) -> Path:
    """Write (or refresh) `folder/README.md`, the dataset card, from `teacher_signal.json`."""
    folder = Path(folder)
    signal_files(folder)
    meta = json.loads((folder / _META_FILE).read_text())
    path = folder / CARD_FILE
    path.write_text(signal_card(meta, repo_id), encoding="utf-8")
    return path


def push_teacher_signal(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                        revision: str | None = None, token: str | None = None,
                        commit_message: str = DEFAULT_COMMIT_MESSAGE, endpoint: str | None = None) -> str:
    """Publish the complete signal in `folder` to the dataset repo `repo_id` (created when needed; the branch
    `revision` too), its card written first when the folder has none; returns the commit URL. Raises `HubPushError`
    when the folder is not a complete signal (before any request) or the Hub fails."""
    signal_files(folder)
    if not (Path(folder) / CARD_FILE).is_file():  # named by the full id the Hub gives the repo
        full_id = ensure_repo(repo_id, private=private, token=token, endpoint=endpoint, folder=folder,
                              repo_type="dataset")
        write_signal_card(folder, full_id)
    return push_folder(folder, repo_id, signal_files(folder), repo_type="dataset", private=private,
                       revision=revision, token=token, commit_message=commit_message, endpoint=endpoint)
