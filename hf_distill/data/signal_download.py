"""Downloading a shared teacher signal (a Hub dataset repo pushed by hf_distill.data.signal_hub) into the Hub cache.

A module of its own so that reading a signal (hf_distill.data.teacher_signal.load_teacher_signal, which takes a repo
id too) and publishing one (signal_hub, which checks a folder by reading it) do not import each other."""

from __future__ import annotations

from pathlib import Path

from .signal_checks import META_FILE

__all__ = ["CARD_FILE", "download_teacher_signal"]

CARD_FILE = "README.md"
_PATTERNS = [META_FILE, "shard-*.arrow", CARD_FILE]


def download_teacher_signal(repo_id: str, *, revision: str | None = None, token: str | None = None,
                            endpoint: str | None = None) -> Path:
    """The local folder (in the Hub cache) of the signal in the dataset repo `repo_id`, downloaded when needed."""
    from huggingface_hub import constants, snapshot_download

    endpoint = endpoint or constants.ENDPOINT  # read now (HF_ENDPOINT), as the push does
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, token=token,
                                      endpoint=endpoint, allow_patterns=_PATTERNS))
    except Exception as error:  # offline and not cached, no such repo, network: one message naming the repo
        text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())[:300]
        raise ValueError(f"No teacher signal folder {repo_id!r} here, and the Hub dataset repo {repo_id!r} could not "
                         f"be downloaded ({type(error).__name__}: {text}). Give the signal's folder, or a dataset "
                         "repo pushed with push_teacher_signal (set HF_HUB_OFFLINE=0 and a token if it is "
                         "private).") from error
