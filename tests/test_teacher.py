"""The teacher: loading from a path, the refusal of a checkpoint whose head would be random, and the check that
its vocabulary is the student's (tokenizers compared, padded vocabularies measured)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from helpers import (
    VOCAB,
    args,
    bert,
    bert_config,
    collate,
    labelled_collate,
    llama,
    padded_llama,
    sft_rows,
    token_dataset,
    word_tokenizer,
)
from helpers import teacher as make_teacher
from transformers import BertForMaskedLM, BertModel, LlamaForCausalLM

from hf_distill import DistillationTrainer
from hf_distill.teacher import PADDING_MASS_BOUND, load_teacher, padding_mass, teacher_tokenizer


@pytest.mark.parametrize("base_class", [BertModel, BertForMaskedLM], ids=["encoder", "mlm"])
def test_a_base_checkpoint_is_refused_naming_the_missing_head_and_the_fix(tmp_path, base_class):
    """A checkpoint saved without the classifier would load with a random head: the distilled targets would be
    noise. It fails before training, naming the path, the weights that would be new, and the fix."""
    torch.manual_seed(0)
    base_class(bert_config()).save_pretrained(tmp_path / "base")
    path = str(tmp_path / "base")
    with pytest.raises(ValueError) as caught:
        load_teacher(path, like=bert(2))
    message = str(caught.value)
    assert path in message and "classifier.weight" in message and "classifier.bias" in message
    assert "fine-tune" in message
    with pytest.raises(ValueError, match="classifier.weight"):
        DistillationTrainer(model=bert(2), teacher_model=path, args=args(tmp_path), train_dataset=token_dataset(8),
                            data_collator=collate)


def test_a_fine_tuned_checkpoint_loads_with_its_own_weights(tmp_path):
    saved = make_teacher()
    saved.save_pretrained(tmp_path / "teacher")
    loaded = load_teacher(str(tmp_path / "teacher"), like=bert(2))
    assert type(loaded) is type(saved)
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    trainer = DistillationTrainer(model=bert(2), teacher_model=str(tmp_path / "teacher"), args=args(tmp_path),
                                  train_dataset=token_dataset(16), data_collator=collate)
    assert torch.equal(trainer.teacher.classifier.weight, saved.classifier.weight)


# ---------------------------------------------------------------- vocabularies (issue 28, cases 4 and 5)

WORDS = [f"w{i}" for i in range(100)]
OTHER = [f"x{i}" for i in range(100)]  # the same size, other tokens


def _causal(tmp_path, student, teacher, **kw):
    trainer_kw = {k: kw.pop(k) for k in ("processing_class", "teacher_processing_class") if k in kw}
    return DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path, max_steps=1, **kw),
                               train_dataset=sft_rows(8), data_collator=labelled_collate, **trainer_kw)


def test_a_teacher_folder_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    """Same vocabulary size, different tokens: the teacher would read the student's ids as other words. The
    tokenizer saved beside the teacher is compared whatever the sizes; the same tokenizer is accepted."""
    for name, words in (("same", WORDS), ("other", OTHER)):
        llama(1).save_pretrained(tmp_path / name)
        word_tokenizer(words).save_pretrained(tmp_path / name)
    _causal(tmp_path, llama(0), str(tmp_path / "same"), processing_class=word_tokenizer(WORDS))
    with pytest.raises(ValueError) as caught:
        _causal(tmp_path, llama(0), str(tmp_path / "other"), processing_class=word_tokenizer(WORDS))
    message = str(caught.value)
    assert "teacher's tokenizer" in message and str(tmp_path / "other") in message
    assert "100 of 102 ids differ" in message and "'w0' vs 'x0'" in message and "one tokenizer" in message


def test_an_in_memory_teacher_is_compared_through_teacher_processing_class_or_its_name_or_path(tmp_path):
    """A teacher passed as a model: its tokenizer is `teacher_processing_class`, else the one at its
    `name_or_path` (here the folder it was loaded from)."""
    with pytest.raises(ValueError, match="from teacher_processing_class.* is not the student's"):
        _causal(tmp_path, llama(0), llama(1), processing_class=word_tokenizer(WORDS),
                teacher_processing_class=word_tokenizer(OTHER))
    _causal(tmp_path, llama(0), llama(1), processing_class=word_tokenizer(WORDS),
            teacher_processing_class=word_tokenizer(WORDS))
    llama(1).save_pretrained(tmp_path / "teacher")
    word_tokenizer(OTHER).save_pretrained(tmp_path / "teacher")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "teacher")  # in memory, name_or_path = the folder
    with pytest.raises(ValueError, match="is not the student's: 100 of 102 ids differ"):
        _causal(tmp_path, llama(0), loaded, processing_class=word_tokenizer(WORDS))
    # one tokenizer per teacher for several teachers, checked each
    with pytest.raises(ValueError, match="2 entries for 1 teachers"):
        _causal(tmp_path, llama(0), llama(1), processing_class=word_tokenizer(WORDS),
                teacher_processing_class=[word_tokenizer(WORDS), word_tokenizer(WORDS)])


def test_a_teacher_whose_tokenizer_cannot_be_known_is_said_in_a_log_line(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_distill.teacher"):
        _causal(tmp_path, llama(0), llama(1), processing_class=word_tokenizer(WORDS))
    said = [r.getMessage() for r in caplog.records if "teacher's tokenizer is unknown" in r.getMessage()]
    assert len(said) == 1 and "without a name_or_path" in said[0] and "teacher_processing_class" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_distill.teacher"):
        _causal(tmp_path, llama(0), llama(1), processing_class=word_tokenizer(WORDS),
                teacher_processing_class=word_tokenizer(WORDS))
    assert not [r for r in caplog.records if "tokenizer is unknown" in r.getMessage()]


def test_hub_ids_read_the_teachers_tokenizer_and_in_memory_names_never_download(monkeypatch):
    """A teacher given as a Hub id has its tokenizer loaded from that id (as the model was); an in-memory
    teacher's Hub `name_or_path` is looked up in the local cache only (no download the user did not ask for)."""
    calls = []

    def from_pretrained(path, **kw):
        calls.append((path, kw.get("local_files_only")))
        raise OSError("not here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    found, why = teacher_tokenizer(llama(1), source="org/teacher")
    assert found is None and "org/teacher" in why and calls[-1] == ("org/teacher", False)
    model = llama(1)
    model.name_or_path = "org/teacher"
    found, why = teacher_tokenizer(model)
    assert found is None and "in the local cache" in why and calls[-1] == ("org/teacher", True)


@pytest.mark.parametrize("path", ["chunked", "whole"])
def test_a_larger_teacher_vocabulary_is_accepted_only_where_its_extra_ids_are_padding(tmp_path, path):
    """Teacher 200 ids, student 120, one tokenizer that fits both: the teacher's ids 120..199 carry real
    probability (they are tokens), so the first training step refuses naming both sizes and the bound; a teacher
    whose extra rows are padding (~1e-11 of its mass) trains. Chunked (default) and whole-logit paths."""
    kw = dict(processing_class=word_tokenizer(WORDS), teacher_processing_class=word_tokenizer(WORDS))
    if path == "whole":
        kw["label_smoothing_factor"] = 0.1  # needs the student's full logits: no chunks
    trainer = _causal(tmp_path, llama(0), llama(1, vocab=200), **kw)
    paths = trainer.distiller.paths
    assert (paths.chunk is None) == (path == "whole") and paths.context.shared_vocab == VOCAB
    with pytest.raises(ValueError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "student 120, teacher 200" in message and "ids 120..199" in message and f"{PADDING_MASS_BOUND:g}" in message
    assert "resize_token_embeddings(200)" in message
    trainer = _causal(tmp_path, llama(0), padded_llama(1, VOCAB, 80), **kw)
    trainer.train()
    assert trainer.distiller.paths.context.padding.checked == {0}


def test_padding_mass_is_the_mean_teacher_probability_on_the_extra_ids_over_the_counted_positions():
    logits = torch.zeros(2, 3, 4)  # uniform over 4 ids: half the mass on ids 2, 3
    logits[0, :, 2:] = -1e4  # row 0: none
    assert padding_mass(logits, 2) == pytest.approx(0.25)
    assert padding_mass(logits, 2, torch.tensor([[1, 1, 1], [0, 0, 0]])) == pytest.approx(0.0, abs=1e-12)
    assert padding_mass(logits, 2, torch.tensor([[0, 0, 0], [1, 0, 0]])) == pytest.approx(0.5)
    assert padding_mass(logits, 2, torch.zeros(2, 3)) is None  # nothing counted: no verdict


def test_a_teacher_folder_without_tokenizer_files_has_an_unknown_tokenizer(tmp_path, caplog):
    """transformers 5 builds an empty tokenizer (special tokens only) from a folder without tokenizer files: that is
    not the teacher's tokenizer, so the vocabularies are not compared (a log line says so) rather than refused as
    different (what the quick-start demo hit: its fine-tuned teacher is saved without its tokenizer)."""
    teacher = llama(1)
    teacher.save_pretrained(tmp_path / "teacher")  # weights and config only
    loaded = type(teacher).from_pretrained(tmp_path / "teacher")
    found, why = teacher_tokenizer(loaded)
    assert found is None and "no tokenizer files" in why
    with caplog.at_level(logging.WARNING, logger="hf_distill.teacher"):
        _causal(tmp_path, llama(0), loaded, processing_class=word_tokenizer(WORDS))
    assert [r for r in caplog.records if "teacher's tokenizer is unknown" in r.getMessage()]


@pytest.mark.parametrize("address", ["127.0.0.1:8000/v1", "localhost:8000", "teacher-host:30000/v1"])
def test_a_server_address_without_its_scheme_names_the_url_to_write(address):
    with pytest.raises(ValueError, match=rf"teacher_model='{address}' reads as a server address without its scheme: "
                                         rf"write 'http://{address}'"):
        load_teacher(address, like=bert(2))
