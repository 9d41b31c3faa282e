"""The teacher: loading from a path, and the refusal of a checkpoint whose head would be random."""

from __future__ import annotations

import pytest
import torch
from helpers import args, bert, bert_config, collate, token_dataset
from helpers import teacher as make_teacher
from transformers import BertForMaskedLM, BertModel

from hf_distill import DistillationTrainer
from hf_distill.teacher import load_teacher


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
