"""Refusals before a teacher signal is computed (hf_distill.data.signal_checks): ids outside the teacher's
vocabulary and a tokenizer that does not fit the teacher, from Python and from `hf-distill signal create`, each one
error line before the teacher's weights load and before anything is written; a run that fails before its first
shard leaves nothing that refuses the corrected run."""

from __future__ import annotations

import datasets
import pytest
from helpers import VOCAB, llama, sft_rows, word_tokenizer

from hf_distill.cli import main
from hf_distill.data import teacher_signal
from hf_distill.data.teacher_signal import create_teacher_signal, load_teacher_signal, signal_metadata

K, T = 8, 2.0


def _tokenizer(prefix: str = "w", size: int = VOCAB):
    return word_tokenizer([f"{prefix}{i}" for i in range(size - 2)])


def _with_id(rows: datasets.Dataset, row: int, value: int) -> datasets.Dataset:
    return rows.map(lambda r, i: {"input_ids": [*r["input_ids"][:-1], value] if i == row else r["input_ids"]},
                    with_indices=True)


def _create(folder, rows, tokenizer=None, teacher=None):
    return create_teacher_signal(teacher or llama(1), rows, folder, tokenizer=tokenizer or _tokenizer(), k=K,
                                 temperature=T, rows_per_shard=4, batch_size=4, progress=False)


def test_ids_outside_the_teachers_vocabulary_are_refused_before_anything_is_written(tmp_path):
    rows = sft_rows(8)
    for value in (VOCAB + 3, -1):
        with pytest.raises(ValueError, match=f"Row 6 of the dataset holds input id {value}, outside the teacher's "
                                             f"vocabulary \\(config.vocab_size {VOCAB}: ids 0..{VOCAB - 1}\\): "
                                             "tokenise the rows with the teacher's tokenizer"):
            _create(tmp_path / "signal", _with_id(rows, 6, value))
        assert not (tmp_path / "signal").exists()
    assert signal_metadata(_create(tmp_path / "signal", rows))["rows"] == 8  # the corrected run, same folder


def test_a_tokenizer_that_does_not_fit_the_teacher_is_refused(tmp_path):
    rows = sft_rows(8)
    with pytest.raises(ValueError, match=f"tokenizer has {VOCAB + 6} tokens, more than the teacher's vocabulary "
                                         f"\\({VOCAB} ids\\)"):
        _create(tmp_path / "signal", rows, tokenizer=_tokenizer(size=VOCAB + 6))
    teacher = llama(1)
    teacher.save_pretrained(tmp_path / "teacher")
    _tokenizer().save_pretrained(tmp_path / "teacher")
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "teacher")  # its own tokenizer is at its name_or_path
    with pytest.raises(ValueError, match="tokenizer has another vocabulary than the teacher's own tokenizer"):
        _create(tmp_path / "signal", rows, tokenizer=_tokenizer("x"), teacher=saved)
    assert not (tmp_path / "signal").exists()
    _create(tmp_path / "signal", rows, teacher=saved)


def test_a_run_that_fails_before_its_first_shard_leaves_nothing_behind(tmp_path, monkeypatch):
    rows = sft_rows(8)

    def fails(*a, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(teacher_signal, "_signal_table", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        _create(tmp_path / "signal", rows)
    assert not (tmp_path / "signal").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError, match="out of memory"):
        _create(tmp_path / "kept", rows)
    assert list((tmp_path / "kept").iterdir()) == []  # a folder the user made stays, empty
    monkeypatch.undo()
    other = sft_rows(8, seed=5)  # the corrected run may change anything: nothing is resumed or refused
    assert signal_metadata(_create(tmp_path / "signal", other))["rows"] == 8


def test_cli_refuses_bad_ids_and_a_foreign_tokenizer_before_loading_the_teacher(tmp_path, capsys, monkeypatch):
    import transformers

    llama(1).save_pretrained(tmp_path / "teacher")
    _tokenizer().save_pretrained(tmp_path / "teacher")
    _tokenizer("x").save_pretrained(tmp_path / "other_tok")
    _tokenizer(size=VOCAB + 6).save_pretrained(tmp_path / "big_tok")
    _with_id(sft_rows(8), 6, VOCAB + 3).save_to_disk(str(tmp_path / "bad_rows"))
    sft_rows(8).save_to_disk(str(tmp_path / "rows"))
    capsys.readouterr()
    out = str(tmp_path / "signal")
    base = ["signal", "create", str(tmp_path / "teacher")]
    settings = ["--k", str(K), "--temperature", str(T), "--rows_per_shard", "4", "--no_progress"]
    real, loaded = transformers.AutoModelForCausalLM.from_pretrained, []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: loaded.append(a))
    cases = [
        ([str(tmp_path / "bad_rows"), out], f"Row 6 of the dataset holds input id {VOCAB + 3}, outside the teacher's "
                                            "vocabulary"),
        ([str(tmp_path / "rows"), out, "--tokenizer", str(tmp_path / "other_tok")],
         f"--tokenizer {tmp_path / 'other_tok'} has another vocabulary than the teacher's own tokenizer"),
        ([str(tmp_path / "rows"), out, "--tokenizer", str(tmp_path / "big_tok")],
         f"--tokenizer {tmp_path / 'big_tok'} has {VOCAB + 6} tokens, more than the teacher's vocabulary"),
    ]
    for argv, message in cases:
        assert main([*base, *argv, *settings]) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert loaded == [] and not (tmp_path / "signal").exists()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", real)
    assert main([*base, str(tmp_path / "rows"), out, *settings]) == 0  # the corrected command, same folder
    assert signal_metadata(load_teacher_signal(out))["rows"] == 8
