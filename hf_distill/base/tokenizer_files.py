"""Whether a local model folder holds a tokenizer: transformers 5 builds an *empty* tokenizer (its special tokens
only, every word `[UNK]`) from a folder that has no tokenizer files, without an error. Taken for the model's own
tokenizer, it silently turns every text into unknown tokens (a recipe's teacher then scored chance)."""

from __future__ import annotations

import os

# Files a saved tokenizer consists of (at least one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                   "tokenizer.model", "sentencepiece.bpe.model")


def lacks_tokenizer(path: str | os.PathLike) -> bool:
    """True for a local folder with none of TOKENIZER_FILES (a Hub id or a file: False, the loader decides)."""
    return os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def check_tokenizer_folder(path: str | os.PathLike, what: str, fix: str) -> None:
    """Refuse, in one line, a local folder without tokenizer files that is about to be read as `what`'s tokenizer."""
    if lacks_tokenizer(path):
        raise ValueError(f"{what} {str(path)!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): "
                         f"transformers would build an empty tokenizer that reads every word as unknown. {fix}")


def check_teacher_tokenizer(teacher: str | None, tokenizer: str | None) -> None:
    """The check of the commands that read a teacher's tokenizer from `--tokenizer`, else from the teacher's folder
    (`signal create`, `auto`), so that both name the same flag and fix."""
    if tokenizer:
        check_tokenizer_folder(tokenizer, "--tokenizer", "Give --tokenizer a folder that holds its tokenizer files.")
    elif teacher:
        check_tokenizer_folder(teacher, "The teacher", "Give --tokenizer, or save the tokenizer in the teacher's "
                               "folder.")
