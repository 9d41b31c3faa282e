"""A model folder without tokenizer files is refused where a command would read its tokenizer: transformers 5 builds
an empty one (special tokens only) from it without an error (hf_distill.base.tokenizer_files)."""

from __future__ import annotations

import pytest
from helpers import sft_rows, teacher, word_tokenizer
from transformers import AutoTokenizer

from hf_distill.base.tokenizer_files import check_tokenizer_folder, lacks_tokenizer


def test_transformers_builds_an_empty_tokenizer_that_the_check_refuses(tmp_path):
    teacher().save_pretrained(tmp_path / "model")  # a BERT's config and weights, no tokenizer
    empty = AutoTokenizer.from_pretrained(tmp_path / "model")  # what a script got before: no error
    assert len(empty) < 10 and empty("tok word")["input_ids"][1:-1] == [empty.unk_token_id] * 2
    assert lacks_tokenizer(tmp_path / "model") and not lacks_tokenizer("org/hub-id")
    with pytest.raises(ValueError, match=r"The teacher '.*model' holds no tokenizer files .* Save it there\."):
        check_tokenizer_folder(tmp_path / "model", "The teacher", "Save it there.")
    word_tokenizer(["tok", "word"]).save_pretrained(tmp_path / "model")
    assert not lacks_tokenizer(tmp_path / "model")
    check_tokenizer_folder(tmp_path / "model", "The teacher", "")


def test_signal_create_and_teacher_serve_refuse_it_before_the_weights_load(tmp_path, capsys, monkeypatch):
    import transformers

    from hf_distill.cli import main

    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: loaded.append(a))
    teacher().save_pretrained(tmp_path / "teacher")  # BERT: transformers builds its empty tokenizer silently
    sft_rows(4).save_to_disk(str(tmp_path / "rows"))
    capsys.readouterr()
    for argv in (["signal", "create", str(tmp_path / "teacher"), str(tmp_path / "rows"), str(tmp_path / "signal"),
                  "--no_progress"],
                 ["teacher", "serve", str(tmp_path / "teacher"), "--port", "0"]):
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: The ") and "holds no tokenizer files" in err and err.count("\n") == 1, err
    assert loaded == [] and not (tmp_path / "signal").exists()
