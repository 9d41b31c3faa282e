"""Feature taps: what hooks capture under SDPA equals what eager attention computes."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import bert, collate, distilbert, mobilebert, token_dataset

from hf_distill.features import families
from hf_distill.features.taps import FeatureTaps, TapRequest, attention_scores, model_info


def _batch(n=5):
    return collate([token_dataset(n, seed=2)[i] for i in range(n)])


def _eager_copy(model):
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return eager.eval()


@pytest.mark.parametrize("make", [bert, distilbert, mobilebert], ids=["bert", "distilbert", "mobilebert"])
def test_probabilities_from_taps_equal_eager_attentions(make):
    model = make(layers=3).eval()
    assert model.config._attn_implementation == "sdpa"
    layers = set(range(1, 4))
    tap = FeatureTaps(model, TapRequest(q=layers, k=layers))
    batch = _batch()
    batch.pop("labels")
    with torch.no_grad(), tap.capture() as feats:
        model(**batch)
        eager = _eager_copy(model)(**batch, output_attentions=True).attentions
    heads = model.config.num_attention_heads
    key_pad = (batch["attention_mask"] == 0)[:, None, None, :]
    for i in layers:
        scores = attention_scores(feats.q[i], feats.k[i], heads).masked_fill(key_pad, torch.finfo(torch.float32).min)
        torch.testing.assert_close(scores.softmax(-1), eager[i - 1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("make", [bert, distilbert, mobilebert], ids=["bert", "distilbert", "mobilebert"])
def test_hidden_taps_equal_output_hidden_states(make):
    model = make(layers=3).eval()
    tap = FeatureTaps(model, TapRequest(hidden={0, 1, 3}))
    batch = _batch()
    batch.pop("labels")
    with torch.no_grad(), tap.capture() as feats:
        reference = model(**batch, output_hidden_states=True).hidden_states
    assert sorted(feats.hidden) == [0, 1, 3]  # only what was asked for
    for i in (0, 1, 3):
        assert torch.equal(feats.hidden[i], reference[i])


def test_mobilebert_attention_width_is_the_bottleneck():
    """Q/K/V project to `true_hidden_size` (16 here), not to the inter-block width (32)."""
    info = model_info(mobilebert(hidden=32, heads=4, bottleneck=16))
    assert info.hidden_size == 32 and info.head_dim == 4 and info.q_width == 16


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_hooks_exist_only_inside_capture_even_on_error():
    model = bert(2)
    tap = FeatureTaps(model, TapRequest(hidden={0, 1, 2}, q={1, 2}, k={2}, v={1}))
    assert _hook_count(model) == 0
    with tap.capture():
        assert _hook_count(model) == 3 + 2 + 1 + 1
    assert _hook_count(model) == 0
    with pytest.raises(RuntimeError), tap.capture():
        raise RuntimeError("forward failed")
    assert _hook_count(model) == 0


def test_unregistered_family_falls_back_to_hidden_states_for_hidden_only(monkeypatch):
    monkeypatch.delitem(families.FAMILIES, "bert")
    model = bert(2).eval()
    tap = FeatureTaps(model, TapRequest(hidden={0, 2}))
    assert tap.forward_kwargs() == {"output_hidden_states": True}
    batch = _batch()
    batch.pop("labels")
    with torch.no_grad(), tap.capture() as feats:
        out = model(**batch, **tap.forward_kwargs())
    tap.collect(feats, out)
    assert torch.equal(feats.hidden[2], out.hidden_states[2])
    with pytest.raises(ValueError, match="not in the hf_distill.features.families registry.*register_family"):
        FeatureTaps(model, TapRequest(q={1}), role="teacher")


def test_register_family_teaches_the_taps_a_new_architecture(monkeypatch):
    monkeypatch.delitem(families.FAMILIES, "bert")
    families.register_family("bert", layers="encoder.layer", embeddings=("embeddings",),
                             query="attention.self.query", key="attention.self.key", value="attention.self.value")
    tap = FeatureTaps(bert(2), TapRequest(v={2}))
    assert not tap.use_hidden_states_output


def test_an_unregistered_causal_lm_distils_hidden_states_through_the_loss_head(tmp_path, monkeypatch):
    """The loss head asks the student for its hidden states too: the fallback's `output_hidden_states` joins that
    request (it was passed twice: a TypeError), and the terms equal the hooked ones of the registered family."""
    from helpers import args, labelled_collate, llama, sft_rows

    from hf_distill import DistillationTrainer

    rows = sft_rows(6)
    batch = labelled_collate([rows[i] for i in range(6)])

    def components():
        student = llama(0).train()
        trainer = DistillationTrainer(model=student, teacher_model=llama(1, layers=4), data_collator=labelled_collate,
                                      args=args(tmp_path, distill_terms=["loss=hidden_mse,layers=0:0;1:2;2:4"]))
        trainer.compute_loss(student, dict(batch))
        return trainer.intermediate.student_taps.use_hidden_states_output, trainer.tracker.pop_means()

    hooked, registered = components()
    monkeypatch.delitem(families.FAMILIES, "llama")
    fallback, unregistered = components()
    assert (hooked, fallback) == (False, True)
    assert unregistered == pytest.approx(registered, rel=1e-6) and unregistered["hidden"] > 0
