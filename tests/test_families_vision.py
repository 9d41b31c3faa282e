"""Image classifiers: their head kind, their families (hidden, attention and relation terms; students by depth and
width, or refused with the reason) - issue #43 items 1 and 2."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from helpers import args

from hf_distill import DistillationTrainer
from hf_distill.features import heads
from hf_distill.features.heads import Head, HeadKind
from hf_distill.features.taps import FeatureTaps, TapRequest, attention_scores, model_info
from hf_distill.students import from_teacher, prune_depth, shrink
from hf_distill.students.width import prune_width

_VIT = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, image_size=16, patch_size=4,
            num_channels=1, num_labels=3)


def model(kind: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    configs = {
        "vit": lambda: T.ViTConfig(hidden_size=kw.pop("hidden_size", 32), **_VIT, **kw),
        "deit": lambda: T.DeiTConfig(hidden_size=32, **_VIT, **kw),
        "beit": lambda: T.BeitConfig(hidden_size=32, use_relative_position_bias=True, **_VIT, **kw),
        "swin": lambda: T.SwinConfig(embed_dim=16, depths=[1, 1], num_heads=[2, 2], image_size=16, patch_size=2,
                                     window_size=2, num_channels=1, num_labels=3, **kw),
        "convnext": lambda: T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_channels=1,
                                             num_labels=3, **kw),
        "resnet": lambda: T.ResNetConfig(hidden_sizes=[8, 16], depths=[1, 1], embedding_size=8, num_channels=1,
                                         num_labels=3, **kw),
    }
    config = configs[kind]()
    if kind == "deit":  # transformers' Auto class cannot pick between DeiT's two classes without `architectures`
        return T.DeiTForImageClassification(config).eval()
    return T.AutoModelForImageClassification.from_config(config).eval()


def pixels(n: int = 4, size: int = 16) -> torch.Tensor:
    return torch.randn(n, 1, size, size, generator=torch.Generator().manual_seed(0))


FAMILIES = ("vit", "deit", "beit", "swin", "convnext", "resnet")


@pytest.mark.parametrize("kind", FAMILIES)
def test_image_classifiers_are_image_classification_heads(kind):
    m = model(kind)
    assert heads.head_kind(m) is HeadKind.IMAGE_CLASSIFICATION
    assert heads.static_head(m) is Head.SEQUENCE and heads.num_labels(m) == 3
    multi = model(kind, problem_type="multi_label_classification")
    assert heads.static_head(multi) is Head.MULTI_LABEL
    assert heads.kind_for_task("image-classification") is HeadKind.IMAGE_CLASSIFICATION
    assert HeadKind.IMAGE_CLASSIFICATION.facts.auto_class == "AutoModelForImageClassification"


@pytest.mark.parametrize("kind", FAMILIES)
def test_taps_capture_every_hidden_state_as_the_model_returns_it(kind):
    """The hooks read the embeddings and each block (stage) output; CNN maps as (B, H*W, C) positions."""
    m = model(kind)
    info = model_info(m)
    request = TapRequest(hidden=set(range(info.num_layers + 1)))
    out, feats = FeatureTaps(m, request).run(m, {"pixel_values": pixels(), "output_hidden_states": True})
    for i, expected in enumerate(out.hidden_states):
        if expected.dim() == 4:
            expected = expected.flatten(2).transpose(1, 2)
        torch.testing.assert_close(feats.hidden[i], expected)


@pytest.mark.parametrize("kind", ["vit", "deit"])
def test_attention_scores_from_the_taps_are_the_models_own(kind):
    m = model(kind, attn_implementation="eager")
    info = model_info(m)
    out, feats = FeatureTaps(m, TapRequest(q={1, 2}, k={1, 2})).run(m, {"pixel_values": pixels(),
                                                                        "output_attentions": True})
    for i in (1, 2):
        probs = attention_scores(feats.q[i], feats.k[i], info.num_heads).softmax(-1)
        torch.testing.assert_close(probs, out.attentions[i - 1], atol=1e-5, rtol=1e-4)


def _rows(n: int = 8, size: int = 16):
    x = pixels(n, size)
    return [{"pixel_values": x[i], "labels": i % 3} for i in range(n)]


def _collate(rows):
    return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
            "labels": torch.tensor([r["labels"] for r in rows])}


@pytest.mark.slow
def test_vit_student_trains_on_hidden_attention_and_relation_terms_with_a_projection(tmp_path):
    teacher = model("vit", hidden_size=32)
    student = model("vit", seed=1, hidden_size=16)
    terms = ["loss=hidden_mse,layers=uniform", "loss=attention_score_mse,layers=last",
             {"loss": "relation_kl", "layers": "last", "relations": ["qq", "vv"], "relation_heads": 2}]
    trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=_rows(),
                                  data_collator=_collate,
                                  args=args(tmp_path, distill_terms=terms, projection="shared", max_steps=2))
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    names = ("loss_kd", "loss_task", "loss_hidden", "loss_attention", "loss_relation_qq", "loss_relation_vv")
    assert len(logged) == 2 and all(name in r for r in logged for name in names), logged[0].keys()
    assert all(r["loss_hidden"] > 0 for r in logged), str(logged)  # (random attention scores: tiny, logged rounded)


def test_convnext_stage_features_distil_between_equal_widths_and_refuse_others(tmp_path):
    teacher = model("convnext")
    student = T.AutoModelForImageClassification.from_config(
        T.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_channels=1, num_labels=3))
    trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=_rows(size=32),
                                  data_collator=_collate,
                                  args=args(tmp_path, distill_terms=["loss=hidden_mse,layers=uniform"], max_steps=1))
    trainer.train()
    # counted per image in the step's mean (a batch of pixel_values has no token mask)
    assert [r["loss_hidden"] > 0 for r in trainer.state.log_history if "loss" in r] == [True]
    with pytest.raises(ValueError, match="student hidden state 1 is 8 wide and teacher hidden state 2 16"):
        DistillationTrainer(model=student, teacher_model=teacher, train_dataset=_rows(size=32), data_collator=_collate,
                            args=args(tmp_path, distill_terms=[{"loss": "hidden_mse", "layers": [[1, 2]]}]))
    with pytest.raises(ValueError, match="convolutional network has no attention"):
        DistillationTrainer(model=student, teacher_model=teacher, train_dataset=_rows(size=32), data_collator=_collate,
                            args=args(tmp_path, distill_terms=["loss=attention_score_mse,layers=last"]))


def test_swin_attention_terms_and_beit_scores_are_refused_with_the_reason(tmp_path):
    swin = model("swin")
    with pytest.raises(ValueError, match="shifted windows"):
        DistillationTrainer(model=model("swin", seed=1), teacher_model=swin, train_dataset=_rows(),
                            data_collator=_collate, args=args(tmp_path, distill_terms=["loss=attention_score_mse"]))
    with pytest.raises(ValueError, match="relative position bias"):
        DistillationTrainer(model=model("beit", seed=1), teacher_model=model("beit"), train_dataset=_rows(),
                            data_collator=_collate, args=args(tmp_path, distill_terms=["loss=attention_score_mse"]))


@pytest.mark.parametrize("kind", ["vit", "deit", "beit"])
def test_vit_like_students_by_depth_and_width(kind):
    teacher = model(kind)
    batches = [{"pixel_values": pixels()}]
    student, report = prune_depth(teacher, 1, batches)
    assert student.config.num_hidden_layers == 1 and len(report.kept) == 1
    kept = {k: v for k, v in teacher.state_dict().items() if ".layers." not in k}
    for name, value in kept.items():
        assert torch.equal(student.state_dict()[name], value)
    assert from_teacher(teacher, [0]).config.num_hidden_layers == 1
    assert shrink(teacher, 1, 16, 2, 32, seed=0)(pixel_values=pixels()).logits.shape == (4, 3)
    if kind == "beit":
        with pytest.raises(ValueError, match="layer-scale"):
            prune_width(teacher, batches, intermediate_size=24)
        return
    narrow, _ = prune_width(teacher, batches, intermediate_size=24, num_attention_heads=1)
    assert narrow.config.intermediate_size == 24 and narrow.config.num_attention_heads == 1
    assert narrow(pixel_values=pixels()).logits.shape == (4, 3)


@pytest.mark.parametrize("kind", ["swin", "convnext", "resnet"])
def test_stage_models_refuse_students_from_blocks_with_the_reason(kind):
    teacher = model(kind)
    for build in (lambda: from_teacher(teacher, [0]), lambda: prune_depth(teacher, 1, [{"pixel_values": pixels()}]),
                  lambda: shrink(teacher, 1, 16, 2, 32), lambda: prune_width(teacher, [{"pixel_values": pixels()}],
                                                                             intermediate_size=4)):
        with pytest.raises(ValueError, match="grouped in stages"):
            build()
