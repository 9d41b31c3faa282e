"""mkdocs hooks of the docs build (`make docs`), kept to one job: known docstring warnings that are someone else's.

`hf_distill/trainer.py`'s `DistillationTrainer` docstring ends its `Args:` section with a sentence ("All other
arguments are `Trainer`'s.") that the Google-style parser cannot read as an argument, so `--strict` would fail.
trainer.py is being rewritten (issue #30): there, end the section with a blank line and put that sentence at the
docstring's own indentation (body text, not an entry); then delete this file and its `hooks:` entry in mkdocs.yml.
Every other docstring warning still fails the build.
"""

from __future__ import annotations

import logging

KNOWN = ("hf_distill/trainer.py:", "Failed to get 'name: description' pair from 'All other arguments are ")


class _DropKnown(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(part in message for part in KNOWN)


def on_startup(command: str, dirty: bool) -> None:
    logging.getLogger("mkdocs.plugins.griffe").addFilter(_DropKnown())
