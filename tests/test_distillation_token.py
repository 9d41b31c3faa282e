"""DeiT's distillation token, trained through the Trainer (issue #43 item 4)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import args
from transformers import (
    AutoModelForImageClassification,
    DeiTForImageClassificationWithTeacher,
    ViTConfig,
    ViTForImageClassification,
)

from hf_distill import DistillationTrainer, losses
from hf_distill.students import from_teacher, shrink


def vit_teacher(seed: int = 0, **kw) -> ViTForImageClassification:
    torch.manual_seed(seed)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, image_size=16,
                       patch_size=4, num_channels=1, num_labels=4, **kw)
    return ViTForImageClassification(config).eval()


def token_student(teacher) -> DeiTForImageClassificationWithTeacher:
    return shrink(teacher, num_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, seed=1,
                  distillation_token=True)


def images(n: int = 8, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 16, 16, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return [{"pixel_values": x[i], "labels": int(y[i])} for i in range(n)]


def collate(rows: list[dict]) -> dict:
    return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]),
            "labels": torch.tensor([r["labels"] for r in rows])}


def _trainer(tmp_path, student, teacher, **kw) -> DistillationTrainer:
    return DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path, **kw),
                               train_dataset=images(), data_collator=collate)


@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_class_head_learns_labels_and_distillation_head_the_teacher(tmp_path, mode):
    teacher = vit_teacher()
    student = token_student(teacher)
    trainer = _trainer(tmp_path, student, teacher, distillation_token=mode, kd_weight=0.3, task_weight=0.7,
                       temperature=2.0)
    assert trainer.label_names == ["labels"]  # the model's forward takes no labels; its class head's loss reads them
    batch = collate(images())
    student.train()
    loss = trainer.compute_loss(student, dict(batch)).detach()
    with torch.no_grad():
        out = student(pixel_values=batch["pixel_values"])
        t = teacher(pixel_values=batch["pixel_values"]).logits
    task = F.cross_entropy(out.cls_logits, batch["labels"])
    kd = (F.cross_entropy(out.distillation_logits, t.argmax(-1)) if mode == "hard"
          else losses.kl_div(out.distillation_logits, t, 2.0))
    assert float(loss) == pytest.approx(float(0.7 * task + 0.3 * kd), rel=1e-5)
    # not the plain logit KD of the averaged logits
    plain = 0.7 * F.cross_entropy(out.logits, batch["labels"]) + 0.3 * losses.kl_div(out.logits, t, 2.0)
    assert abs(float(loss) - float(plain)) > 1e-4


def test_trained_token_student_saves_and_reloads_as_plain_transformers(tmp_path):
    teacher = vit_teacher()
    student = from_teacher(teacher, [1], distillation_token=True)
    trainer = _trainer(tmp_path, student, teacher, max_steps=2)
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path / "saved").eval()
    assert type(reloaded) is DeiTForImageClassificationWithTeacher
    x = collate(images())["pixel_values"]
    student.eval()
    with torch.no_grad():
        a, b = student(pixel_values=x), reloaded(pixel_values=x)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.logits, (a.cls_logits + a.distillation_logits) / 2)  # the average at inference


def test_from_teacher_copies_the_vit_blocks_and_both_heads():
    teacher = vit_teacher()
    student = from_teacher(teacher, [1], distillation_token=True)
    assert student.config.num_hidden_layers == 1 and student.config.distillation["distillation_token"]
    for name, p in teacher.vit.layers[1].state_dict().items():
        assert torch.equal(student.deit.layers[0].state_dict()[name], p)
    for head in (student.cls_classifier, student.distillation_classifier):
        assert torch.equal(head.weight, teacher.classifier.weight)
    pos = student.deit.embeddings.position_embeddings
    assert torch.equal(pos[:, 2:], teacher.vit.embeddings.position_embeddings[:, 1:])
    with pytest.raises(ValueError, match="ViT or DeiT teacher"):
        from transformers import BertConfig

        from hf_distill.students.distillation_token import deit_config

        deit_config(BertConfig())


def test_distillation_token_value_is_checked(tmp_path):
    with pytest.raises(ValueError, match="distillation_token must be 'hard' or 'soft'"):
        args(tmp_path, distillation_token="token")


def test_distillation_token_on_a_student_without_the_token_is_refused(tmp_path):
    """A field that would do nothing is refused, as the project's others (it was ignored)."""
    teacher = vit_teacher()
    with pytest.raises(ValueError, match="distillation_token='soft' applies to a student with DeiT's"):
        _trainer(tmp_path, vit_teacher(seed=1), teacher, distillation_token="soft")


@pytest.mark.slow
def test_a_resumed_token_student_continues_exactly(tmp_path):
    """transformers 5 saves DeiT's encoder under its old names; the resumed run loads them all (issue #43 item 5)."""
    teacher = vit_teacher()
    flags = dict(max_steps=4, save_strategy="steps", save_steps=2, per_device_train_batch_size=4,
                 distillation_token="hard", learning_rate=1e-2)
    whole = _trainer(tmp_path, token_student(teacher), teacher, **flags)
    whole.train()
    resumed = _trainer(tmp_path, token_student(teacher), teacher, **flags)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    flat = [torch.cat([p.detach().flatten() for p in t.model.parameters()]) for t in (whole, resumed)]
    torch.testing.assert_close(flat[1], flat[0], atol=0, rtol=0)
