"""Publishing distilled students to the Hugging Face Hub.

`push_student(folder, repo_id)` publishes a saved student folder and nothing else: an explicit list of files
(config, weights, tokenizer, card) is uploaded, so a teacher, projections, optimizer state, checkpoints,
`training_args.bin` or logs lying in the same folder never leave the machine. `push_trainer` is
`DistillationTrainer.push_to_hub`, `push_checkpoint` its save-time push during training. The card itself is
written by `hf_distill.publish.card`.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "adapter_config.json",
    "adapter_model.safetensors",
    "early_exit_config.json",  # hf_distill.students.early_exit branches, beside the unchanged backbone
    "early_exit.safetensors",
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)
DEFAULT_COMMIT_MESSAGE = "Upload distilled student (hf_distill)"


class HubPushError(RuntimeError):
    """A push that did not happen; the message names the folder, the repo, the endpoint and the cause."""


def upload_files(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` that make up a published student (top level only, exact names)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(f"Could not push {folder}: it is not a folder.")
    names = {p.name for p in folder.iterdir() if p.is_file()}
    if "config.json" not in names and "adapter_config.json" not in names:
        raise HubPushError(
            f"Could not push {folder}: it holds no config.json, so it is not a saved model. "
            "Save the student with trainer.save_model() or model.save_pretrained() first."
        )
    files = [n for n in MODEL_FILES + TOKENIZER_FILES if n in names]
    if INDEX_FILE in names:
        shards = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        missing = [s for s in shards if s not in names]
        if missing:
            raise HubPushError(f"Could not push {folder}: {INDEX_FILE} lists missing shard(s) {missing}.")
        files += [INDEX_FILE, *shards]
    if not any(n.endswith(".safetensors") for n in files):
        raise HubPushError(
            f"Could not push {folder}: it holds no safetensors weights (model.safetensors or an "
            f"{INDEX_FILE} with its shards)."
        )
    from .card import CARD_FILE  # imported here: the CLI imports this module for its error type alone
    from .report import LOSS_PLOT

    if CARD_FILE in names:
        files.append(CARD_FILE)
        card = (folder / CARD_FILE).read_text(encoding="utf-8")
        files += [p for p in (LOSS_PLOT, "early_exit.png") if p in names and p in card]
    return files


def _api(endpoint: str | None, token: str | None) -> tuple[Any, str]:
    from huggingface_hub import HfApi, constants

    from .. import __version__

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")  # read now: tests and users may change it
    return HfApi(
        endpoint=endpoint, token=token, library_name="hf_distill", library_version=__version__
    ), endpoint


def _cause(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines) or "no message"
    return f"{type(error).__name__}: {text}"


def ensure_repo(
    repo_id: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    folder: str | os.PathLike | None = None,
) -> str:
    """Create the model repo if needed; returns its full id (with the namespace the Hub gave it)."""
    api, endpoint = _api(endpoint, token)
    try:
        return api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    except Exception as error:  # any failure (network, HTTP, validation) becomes one clear message
        raise HubPushError(
            f"Could not push {folder or 'the student'} to {repo_id} at {endpoint}: {_cause(error)}"
        ) from error


def push_student(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool | None = None,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    endpoint: str | None = None,
) -> str:
    """Publish an already-trained student folder to `repo_id`; returns the commit URL.

    Creates the repo when needed (and the branch `revision`), then uploads exactly `upload_files(folder)`.
    The folder is only read. Raises `HubPushError` naming the repo, the endpoint and the cause when the Hub
    cannot be reached, refuses, or the folder is not a saved model.
    """
    files = upload_files(folder)
    repo_id = ensure_repo(repo_id, private=private, token=token, endpoint=endpoint, folder=folder)
    api, endpoint = _api(endpoint, token)
    try:
        if revision and revision != "main" and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            allow_patterns=files,
            commit_message=commit_message,
            revision=revision,
        )
    except Exception as error:  # any failure (network, HTTP, validation) becomes one clear message
        raise HubPushError(f"Could not push {folder} to {repo_id} at {endpoint}: {_cause(error)}") from error
    return info


# ---------------------------------------------------------------------- from a trainer


def push_trainer(
    trainer: Any,
    commit_message: str | None = "End of training",
    blocking: bool = True,
    token: str | None = None,
    revision: str | None = None,
    private: bool | None = None,
    **card_kwargs: Any,
) -> Any:
    """`DistillationTrainer.push_to_hub`: save the student, write its card, publish student files only."""
    from transformers.utils import PushInProgress

    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    repo_id = (
        getattr(trainer, "hub_model_id", None) or args.hub_model_id or Path(args.output_dir).absolute().name
    )
    token = token if token is not None else args.hub_token
    private = private if private is not None else args.hub_private_repo
    revision = revision if revision is not None else args.hub_revision
    trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    # The repo exists before the card is written, so that the card names it with its namespace.
    repo_id = ensure_repo(repo_id, private=private, token=token, folder=args.output_dir)
    trainer.hub_model_id = repo_id
    card_kwargs.setdefault("model_name", repo_id)
    trainer.create_model_card(**card_kwargs)
    trainer._finish_current_push()
    message = commit_message or DEFAULT_COMMIT_MESSAGE

    def push() -> str:
        return push_student(
            args.output_dir, repo_id, private=private, revision=revision, token=token, commit_message=message
        )

    if blocking:
        return push()
    executor = ThreadPoolExecutor(max_workers=1)
    future: Future = executor.submit(push)
    executor.shutdown(wait=False)
    trainer.push_in_progress = PushInProgress([future])
    return future


def push_checkpoint(trainer: Any, checkpoint_folder: str) -> None:
    """`DistillationTrainer._push_from_checkpoint`: the pushes `push_to_hub=True` makes at each save.

    The Trainer's own uploads all of `output_dir` (training_args.bin, logs, any file a user keeps there); this
    sends the checkpoint's student files (`upload_files`) to the repo root instead. The resumable checkpoint
    (optimizer state, projections: never the teacher) still goes to `last-checkpoint/` or `checkpoint-<step>/`
    when `hub_strategy` is `checkpoint` or `all_checkpoints`, as the user asked. Pushes run in the background,
    and one still in flight skips the next unless `hub_always_push`, as in the Trainer."""
    from transformers.trainer_utils import HubStrategy, SaveStrategy
    from transformers.utils import PushInProgress

    args = trainer.args
    if not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
        return
    in_flight = trainer.push_in_progress
    if not args.hub_always_push and in_flight is not None and not in_flight.is_done():
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    if args.save_strategy == SaveStrategy.STEPS:
        message = f"Training in progress, step {trainer.state.global_step}"
    else:
        message = f"Training in progress, epoch {int(trainer.state.epoch)}"
    api, _ = _api(None, args.hub_token)
    common = dict(repo_id=trainer.hub_model_id, folder_path=checkpoint_folder, token=args.hub_token,
                  revision=args.hub_revision, run_as_future=True)
    jobs = [api.upload_folder(allow_patterns=upload_files(checkpoint_folder), commit_message=message, **common)]
    if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
        path = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
        jobs.append(api.upload_folder(path_in_repo=path, commit_message=f"{message}, checkpoint", **common))
    if in_flight is None or in_flight.is_done():
        trainer.push_in_progress = PushInProgress(jobs)
    else:
        in_flight.jobs.extend(jobs)
