"""hf_distill's loggers follow the Trainer's `log_level` (and `log_level_replica`), as transformers' own do.

The Trainer sets the verbosity of transformers' loggers only; hf_distill's (`logging.getLogger("hf_distill.*")`) stayed
at Python's default, so `log_level="info"` showed none of their info lines (the shared vocabulary of
`cross_tokenizer="aligned"`, a stage switch). A level the user gave is applied to the `hf_distill` logger; `passive`
leaves it as the user's own logging set it."""

from __future__ import annotations

import logging

NAME = "hf_distill"


def follow_log_level(log_level: str, level: int) -> None:
    """Set the `hf_distill` logger to `level` unless `log_level` (the field that applies to this process) is passive.
    Where neither it nor the root logger has a handler, Python would print warnings only: give it one on stderr."""
    if log_level == "passive":
        return
    logger = logging.getLogger(NAME)
    logger.setLevel(level)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = _UntilConfigured()
        handler.setFormatter(logging.Formatter(f"[{NAME}] %(message)s"))
        logger.addHandler(handler)


class _UntilConfigured(logging.StreamHandler):
    """stderr while the process has configured no logging; silent once the root logger has a handler (a script's
    `logging.basicConfig()` after the trainer was built), which then prints the line: else it came out twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)
