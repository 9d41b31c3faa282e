"""Publishing students to the Hub: one push path, `push_student`, used by the CLI, `push_trainer` and
`push_checkpoint`. It uploads a student's own files (`upload_files`), so a teacher, projections, optimizer state,
checkpoints, `training_args.bin` or logs lying in the same folder never leave the machine. `push_folder` is the
upload itself (any repo type: a teacher signal goes to a dataset repo through it, hf_distill.data.signal_hub).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..compat import finish_current_push

INDEX_FILE = "model.safetensors.index.json"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "adapter_config.json",
               "adapter_model.safetensors", "early_exit_config.json", "early_exit.safetensors")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                   "processor_config.json")
PLOTS = ("loss_components.png", "early_exit.png")  # published when the card shows them
DEFAULT_COMMIT_MESSAGE = "Upload distilled student (hf_distill)"
_background: list[ThreadPoolExecutor] = []  # one worker: background pushes land in the order they were asked


class HubPushError(RuntimeError):
    """A push that did not happen; the message names the folder, the repo, the endpoint and the cause."""


def upload_files(folder: str | os.PathLike) -> list[str]:
    """The files of `folder` that make up a published student (top level only, exact names)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HubPushError(f"Could not push {folder}: it is not a folder.")
    names = {p.name for p in folder.iterdir() if p.is_file()}
    if "config.json" not in names and "adapter_config.json" not in names:
        raise HubPushError(f"Could not push {folder}: it holds no config.json, so it is not a saved model. "
                           "Save the student with trainer.save_model() or model.save_pretrained() first.")
    files = [n for n in MODEL_FILES + TOKENIZER_FILES if n in names]
    if INDEX_FILE in names:
        shards = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
        missing = [s for s in shards if s not in names]
        if missing:
            raise HubPushError(f"Could not push {folder}: {INDEX_FILE} lists missing shard(s) {missing}.")
        files += [INDEX_FILE, *shards]
    if not any(n.endswith(".safetensors") for n in files):
        raise HubPushError(f"Could not push {folder}: it holds no safetensors weights (model.safetensors or an "
                           f"{INDEX_FILE} with its shards).")
    if "README.md" in names:
        card = (folder / "README.md").read_text(encoding="utf-8")
        files += ["README.md", *(p for p in PLOTS if p in names and p in card)]
    return files


def ensure_repo(repo_id: str, *, private: bool | None = None, token: str | None = None,
                endpoint: str | None = None, folder: str | os.PathLike | None = None, repo_type: str = "model") -> str:
    """Create the repo (a model repo unless `repo_type` says otherwise) if needed; returns its full id (with the
    namespace the Hub gave it)."""
    api, endpoint = _api(endpoint, token)
    try:
        return api.create_repo(repo_id, private=private, exist_ok=True, repo_type=repo_type).repo_id
    except Exception as error:  # any failure (network, HTTP, validation) becomes one clear message
        raise _error(folder or "the student", repo_id, endpoint, error) from error


def push_student(folder: str | os.PathLike, repo_id: str, *, private: bool | None = None,
                 revision: str | None = None, token: str | None = None,
                 commit_message: str = DEFAULT_COMMIT_MESSAGE, endpoint: str | None = None,
                 path_in_repo: str | None = None, whole_folder: bool = False, blocking: bool = True) -> Any:
    """Publish `upload_files(folder)` (all of it with `whole_folder`: a resumable checkpoint) to `repo_id`, creating
    the repo and the branch `revision` when needed; returns the commit URL, or its Future when not `blocking`
    (background pushes run one at a time). Raises `HubPushError` when the folder is not a student (before any
    request) or the Hub fails."""
    files = None if whole_folder else upload_files(folder)
    return push_folder(folder, repo_id, files, private=private, revision=revision, token=token,
                       commit_message=commit_message, endpoint=endpoint, path_in_repo=path_in_repo, blocking=blocking)


def push_folder(folder: str | os.PathLike, repo_id: str, files: list[str] | None, *, repo_type: str = "model",
                private: bool | None = None, revision: str | None = None, token: str | None = None,
                commit_message: str = DEFAULT_COMMIT_MESSAGE, endpoint: str | None = None,
                path_in_repo: str | None = None, blocking: bool = True) -> Any:
    """Upload `files` of `folder` (None: all of it) to the `repo_type` repo `repo_id` in one commit, creating the
    repo and the branch `revision` when needed; returns the commit URL, or its Future when not `blocking`. Every
    failure is one `HubPushError` naming the folder, the repo, the endpoint and the cause."""

    def push() -> str:
        full_id = ensure_repo(repo_id, private=private, token=token, endpoint=endpoint, folder=folder,
                              repo_type=repo_type)
        api, url = _api(endpoint, token)
        try:
            if revision and revision != "main" and not revision.startswith("refs/"):
                api.create_branch(full_id, branch=revision, exist_ok=True, repo_type=repo_type)
            return api.upload_folder(repo_id=full_id, folder_path=str(folder), path_in_repo=path_in_repo,
                                     allow_patterns=files, commit_message=commit_message, revision=revision,
                                     repo_type=repo_type)
        except Exception as error:  # any failure (network, HTTP, validation) becomes one clear message
            raise _error(folder, full_id, url, error) from error

    if blocking:
        return push()
    if not _background:
        _background.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf_distill-push"))
    return _background[0].submit(push)


def push_trainer(trainer: Any, commit_message: str | None = "End of training", blocking: bool = True,
                 token: str | None = None, revision: str | None = None, private: bool | None = None,
                 **card_kwargs: Any) -> Any:
    """`DistillationTrainer.push_to_hub`: save the student, write its card, publish student files only."""
    from transformers.utils import PushInProgress

    args = trainer.args
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    repo_id = getattr(trainer, "hub_model_id", None) or args.hub_model_id or Path(args.output_dir).absolute().name
    token = token if token is not None else args.hub_token
    private = private if private is not None else args.hub_private_repo
    trainer.save_model(_internal_call=True)
    if not trainer.is_world_process_zero():
        return None
    # The repo exists before the card is written, so that the card names it with its namespace.
    trainer.hub_model_id = ensure_repo(repo_id, private=private, token=token, folder=args.output_dir)
    card_kwargs.setdefault("model_name", trainer.hub_model_id)
    trainer.create_model_card(**card_kwargs)
    finish_current_push(trainer)
    result = push_student(args.output_dir, trainer.hub_model_id, private=private, token=token, blocking=blocking,
                          revision=revision if revision is not None else args.hub_revision,
                          commit_message=commit_message or DEFAULT_COMMIT_MESSAGE)
    if not blocking:
        trainer.push_in_progress = PushInProgress([result])
    return result


def push_checkpoint(trainer: Any, checkpoint_folder: str) -> None:
    """`DistillationTrainer._push_from_checkpoint` (`push_to_hub=True`): the checkpoint's student files to the repo
    root, not all of `output_dir`; the whole checkpoint (never the teacher) to `last-checkpoint/` or
    `checkpoint-<step>/` as `hub_strategy` asks. In the background; one in flight skips the next unless
    `hub_always_push`, as in the Trainer."""
    from transformers.trainer_utils import HubStrategy, SaveStrategy
    from transformers.utils import PushInProgress

    args, in_flight = trainer.args, trainer.push_in_progress
    if not trainer.is_world_process_zero() or args.hub_strategy == HubStrategy.END:
        return
    if not args.hub_always_push and in_flight is not None and not in_flight.is_done():
        return
    trainer.callback_handler.on_push_begin(args, trainer.state, trainer.control)
    message = (f"Training in progress, step {trainer.state.global_step}" if args.save_strategy == SaveStrategy.STEPS
               else f"Training in progress, epoch {int(trainer.state.epoch)}")
    common = dict(token=args.hub_token, revision=args.hub_revision, blocking=False)
    jobs = [push_student(checkpoint_folder, trainer.hub_model_id, commit_message=message, **common)]
    if args.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
        path = "last-checkpoint" if args.hub_strategy == HubStrategy.CHECKPOINT else Path(checkpoint_folder).name
        jobs.append(push_student(checkpoint_folder, trainer.hub_model_id, commit_message=f"{message}, checkpoint",
                                 path_in_repo=path, whole_folder=True, **common))
    if in_flight is None or in_flight.is_done():
        trainer.push_in_progress = PushInProgress(jobs)
    else:
        in_flight.jobs.extend(jobs)


def _api(endpoint: str | None, token: str | None) -> tuple[Any, str]:
    from huggingface_hub import HfApi, constants

    from .. import __version__

    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")  # read now: tests and users may change it
    return HfApi(endpoint=endpoint, token=token, library_name="hf_distill", library_version=__version__), endpoint


def _error(folder: Any, repo_id: str, endpoint: str, error: BaseException) -> HubPushError:
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip()) or "no message"
    return HubPushError(f"Could not push {folder} to {repo_id} at {endpoint}: {type(error).__name__}: {text}")
