"""Audio encoders in the registry (hf_distill.features.families_audio): wav2vec2, HuBERT and AST are tapped where
`output_hidden_states` reads them, their terms train, and each is pruned in depth and width or refused with why."""

from __future__ import annotations

import pytest
import torch
from audio_models import BUILDERS, inputs, wav2vec2
from helpers import args

from hf_distill import Distiller, students
from hf_distill.features.families_audio import frame_mask
from hf_distill.features.taps import FeatureTaps, TapRequest

FAMILIES = list(BUILDERS)
TRAINED = ["wav2vec2", "audio-spectrogram-transformer"]  # HuBERT has wav2vec2's layout: tapped and depth-pruned only


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_read_the_hidden_states_and_qkv_the_model_returns(family):
    model = BUILDERS[family]()
    batch = inputs(model)
    taps = FeatureTaps(model, TapRequest(hidden={0, 1, 2, 3, 4}, q={1, 4}, k={1}, v={4}))
    with torch.no_grad():
        own = model(**batch, output_hidden_states=True).hidden_states
        _, feats = taps.run(model, batch)
    assert len(own) == 5
    for i in range(5):
        torch.testing.assert_close(feats.hidden[i], own[i], atol=1e-6, rtol=0)
    assert feats.q[1].shape == feats.k[1].shape == feats.v[4].shape == own[1].shape


def test_frame_mask_is_the_mask_wav2vec2_attends_with():
    model = wav2vec2()
    batch = inputs(model)
    hidden = model.wav2vec2(**batch).last_hidden_state
    ours = frame_mask(model, batch["attention_mask"])
    assert ours.shape == hidden.shape[:2]
    torch.testing.assert_close(ours, model._get_feature_vector_attention_mask(hidden.shape[1], batch["attention_mask"]))
    assert ours[0].all() and not ours[-1].all()
    assert frame_mask(BUILDERS["audio-spectrogram-transformer"](), batch["attention_mask"]) is batch["attention_mask"]


@pytest.mark.parametrize("family", TRAINED)
def test_hidden_attention_and_relation_terms_train_a_shrunk_student(tmp_path, family):
    """A narrower, shallower student distils hidden states (projected), attention scores and relations from the
    teacher's layers; padded frames count nowhere (the loss equals the loss of the batch without its padding)."""
    teacher = BUILDERS[family](seed=1)
    student = students.shrink(teacher, num_layers=2, hidden_size=8, num_attention_heads=4, intermediate_size=16,
                              seed=2)
    terms = [{"loss": "hidden_mse", "layers": "uniform"}, {"loss": "attention_score_mse", "layers": "uniform"},
             {"loss": "relation_kl", "layers": "last", "relations": ["qk", "vv"]}]
    distiller = Distiller(student, args(tmp_path, distill_terms=terms, projection="shared", kd_weight=0.5,
                                        task_weight=0.5), teacher_model=teacher)
    batch = {**inputs(teacher), "labels": torch.tensor([0, 1, 2])}
    student.train()
    loss = distiller.compute_loss(student, dict(batch))
    loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in students.encoder_layers(student).parameters())
    assert distiller.projections is not None and next(distiller.parameters()).grad is not None


def test_padding_leaves_a_waveform_term_unchanged(tmp_path):
    """The term over a padded batch is the term of its real frames: the sample-level mask is made frame-level."""
    teacher = wav2vec2(seed=1)
    student = students.from_teacher(teacher, [1, 3])
    distiller = Distiller(student, args(tmp_path, distill_terms=[{"loss": "hidden_mse", "layers": [[2, 4]]}],
                                        kd_weight=0.0, task_weight=0.0), teacher_model=teacher)
    student.train()
    short = inputs(teacher, batch=1, samples=1000)
    padded = {"input_values": torch.cat([short["input_values"], torch.zeros(1, 600)], 1),
              "attention_mask": torch.cat([short["attention_mask"], torch.zeros(1, 600, dtype=torch.long)], 1)}
    with torch.no_grad():
        a = distiller.compute_loss(student, short)
        b = distiller.compute_loss(student, padded)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_layerdrop_in_a_tapped_student_is_refused(tmp_path):
    teacher = wav2vec2(seed=1)
    student = students.from_teacher(teacher, [1, 3])
    student.config.layerdrop = 0.1
    distiller = Distiller(student, args(tmp_path, distill_terms=[{"loss": "hidden_mse", "layers": "uniform"}]),
                          teacher_model=teacher)
    student.train()
    with pytest.raises(ValueError, match=r"layerdrop=0.1: LayerDrop skips whole blocks.*config.layerdrop = 0.0"):
        distiller.compute_loss(student, {**inputs(teacher), "labels": torch.tensor([0, 1, 2])})


# ---------------------------------------------------------------------------------------------- pruning


@pytest.mark.parametrize("family", FAMILIES)
def test_prune_depth_scores_real_frames_and_keeps_the_most_important_blocks(family):
    teacher = BUILDERS[family]()
    batch = inputs(teacher)
    student, report = students.prune_depth(teacher, 2, [batch])
    assert len(report.kept) == 2 and student.config.num_hidden_layers == 2
    with torch.no_grad():
        assert student(**batch).logits.isfinite().all()
    if family != "audio-spectrogram-transformer":  # padded samples are not frames the scores count
        rows = [{k: v[i:i + 1, : (1600 if i < 2 else 1066)] for k, v in batch.items()} for i in range(3)]
        torch.testing.assert_close(torch.tensor(students.block_importance(teacher, rows)),
                                   torch.tensor(report.scores), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["wav2vec2"])
def test_prune_width_of_a_waveform_model_prunes_mlp_channels_and_refuses_heads_and_hidden(family):
    teacher = BUILDERS[family]()
    batch = inputs(teacher)
    same, _ = students.prune_width(teacher, [batch])
    student, report = students.prune_width(teacher, [batch], intermediate_size=12, num_layers=3)
    assert student.config.intermediate_size == 12 and len(report.layers) == 3
    with torch.no_grad():
        torch.testing.assert_close(same(**batch).logits, teacher(**batch).logits)
        assert student(**batch).logits.isfinite().all()
    for kw in ({"hidden_size": 8}, {"num_attention_heads": 2}):
        with pytest.raises(ValueError, match="keeps the hidden size of .*positional convolution is grouped"):
            students.prune_width(teacher, [batch], **kw)


def test_prune_width_of_ast_prunes_heads_channels_and_hidden():
    teacher = BUILDERS["audio-spectrogram-transformer"]()
    batch = inputs(teacher)
    student, _ = students.prune_width(teacher, [batch], num_attention_heads=2, intermediate_size=12)
    assert (student.config.hidden_size, student.config.num_attention_heads) == (8, 2)
    with torch.no_grad():
        assert student(**batch).logits.isfinite().all()
