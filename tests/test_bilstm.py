"""The BiLSTM student (hf_distill.students.bilstm): a transformers model the Trainer, save/load and Auto
classes take."""

import pytest
import torch
from helpers import VOCAB, teacher
from transformers import AutoModelForSequenceClassification

from hf_distill.students import bilstm


def student(labels=2, **kw):
    torch.manual_seed(0)
    return bilstm.BiLSTMForSequenceClassification(
        bilstm.BiLSTMConfig(vocab_size=VOCAB, embedding_size=12, hidden_size=8, classifier_size=6, num_labels=labels,
                            **kw))


def test_logits_ignore_padding_and_follow_the_paper_layout():
    """Right padding changes nothing; the features are the last forward state and the first backward state's
    output (the backward LSTM's final state), computed here by hand from the same LSTM."""
    model = student().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    padded = torch.tensor([[5, 6, 7, 8, 9, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    a = model(ids).logits
    b = model(padded, attention_mask=mask).logits
    torch.testing.assert_close(a, b)
    out, _ = model.lstm(model.embeddings(ids))
    h = model.config.hidden_size
    features = torch.cat([out[:, -1, :h], out[:, 0, h:]], dim=-1)
    torch.testing.assert_close(a, model.classifier(torch.relu(model.dense(features))))
    assert a.shape == (1, 2)


def test_batch_rows_are_independent():
    model = student().eval()
    rows = [[5, 6, 7], [8, 9, 10, 11, 12]]
    alone = [model(torch.tensor([r])).logits for r in rows]
    batch = torch.tensor([rows[0] + [0, 0], rows[1]])
    together = model(batch, attention_mask=(batch != 0).long()).logits
    torch.testing.assert_close(together, torch.cat(alone))


@pytest.mark.parametrize(("labels", "problem", "target"), [
    (2, None, torch.tensor([0, 1])),
    (1, None, torch.tensor([0.5, -1.0])),
    (3, "multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])),
])
def test_loss_is_the_one_hf_heads_take(labels, problem, target):
    model = student(labels=labels, problem_type=problem)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model(ids, labels=target)
    if labels == 1:
        expected = torch.nn.functional.mse_loss(out.logits.squeeze(-1), target)
    elif problem:
        expected = torch.nn.functional.binary_cross_entropy_with_logits(out.logits, target)
    else:
        expected = torch.nn.functional.cross_entropy(out.logits, target)
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"attention_mask": torch.tensor([[0, 1, 1]])}, "needs right padding"),
    ({"attention_mask": torch.tensor([[0, 0, 0]])}, "has no tokens"),
    ({"token_type_ids": torch.tensor([[0, 1, 1]])}, "sentence pairs"),
    ({"output_hidden_states": True}, "no transformer hidden states"),
])
def test_bad_input_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        student()(torch.tensor([[5, 6, 7]]), **kwargs)


def test_from_teacher_takes_vocabulary_labels_and_embeddings():
    t = teacher(hidden=32)
    t.config.id2label, t.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    s = bilstm.from_teacher(t, hidden_size=8, classifier_size=6)
    assert s.config.vocab_size == t.config.vocab_size and s.config.embedding_size == 32
    assert s.config.id2label == {0: "neg", 1: "pos"} and s.config.num_labels == 2
    torch.testing.assert_close(s.embeddings.weight, t.get_input_embeddings().weight)
    r = bilstm.from_teacher(t, hidden_size=8, classifier_size=6, embedding_init="random")
    assert not torch.allclose(r.embeddings.weight, t.get_input_embeddings().weight)
    with pytest.raises(ValueError, match="embedding_init"):
        bilstm.from_teacher(t, embedding_init="glove")


def test_save_and_load_through_the_auto_class(tmp_path):
    model = student(dropout=0.1).eval()
    model.config.id2label, model.config.label2id = {0: "neg", 1: "pos"}, {"neg": 0, "pos": 1}
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is bilstm.BiLSTMForSequenceClassification
    assert loaded.config.id2label == {0: "neg", 1: "pos"} and loaded.config.dropout == 0.1
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)


def test_a_new_head_on_reload_is_initialised(tmp_path):
    """transformers leaves weights a checkpoint lacks to _init_weights: a new 3-class head must be a real init."""
    student().save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3, ignore_mismatched_sizes=True)
    bound = 1 / loaded.config.classifier_size ** 0.5  # nn.Linear's default uniform bound
    assert loaded.classifier.weight.shape == (3, 6)
    assert float(loaded.classifier.weight.abs().max()) <= bound and float(loaded.classifier.bias.abs().max()) <= bound
    torch.testing.assert_close(loaded.dense.weight, student().dense.weight)  # loaded weights are not re-drawn


def test_return_dict_false_gives_a_tuple():
    model = student()
    ids, labels = torch.tensor([[5, 6, 7]]), torch.tensor([1])
    loss, logits = model(ids, labels=labels, return_dict=False)
    out = model(ids, labels=labels)
    torch.testing.assert_close(logits, out.logits)
    torch.testing.assert_close(loss, out.loss)
    assert len(model(ids, return_dict=False)) == 1


def test_from_teacher_leaves_the_callers_random_stream_alone():
    t = teacher(hidden=32)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    bilstm.from_teacher(t, hidden_size=8, classifier_size=6, seed=0)
    torch.testing.assert_close(torch.rand(3), expected)


def test_card_usage_imports_the_module_that_registers_the_architecture(tmp_path):
    """The card's "How to use" must run in a fresh process: transformers knows `hf_distill_bilstm` only once
    hf_distill.students.bilstm is imported (before, the card said AutoModelForSequenceClassification.from_pretrained
    alone, which fails with "Transformers does not recognize this architecture")."""
    from hf_distill.publish.card import write_model_card

    student().save_pretrained(tmp_path)
    card = write_model_card(tmp_path).read_text(encoding="utf-8")
    usage = card.split("## How to use", 1)[1]
    assert "import hf_distill.students.bilstm" in usage
    assert usage.index("import hf_distill.students.bilstm") < usage.index(".from_pretrained(")
