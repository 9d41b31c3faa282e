"""What a Trainer user does after `train()`, for each kind of student the package builds or accepts:
`trainer.save_model(out)`, then load `out` as its guide says. The loaded model computes what the trained one does,
and the folder holds the student alone (no teacher, no projection). EarlyExitModel's own round trip, push and resume
are in test_early_exit.py, a SentenceTransformer's in test_sentence.py, a Whisper student's card in
test_students_speech.py."""

from __future__ import annotations

import glob

import pytest
import torch
from decoder_models import decoder
from helpers import args, bert, collate, teacher, token_dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

from hf_distill import DistillationTrainer
from hf_distill.students import bilstm, prune_depth, prune_width, shrink


def _calibration() -> list[dict]:
    rows = [collate(token_dataset(4, seed=s).to_list()) for s in range(2)]
    return [{k: v for k, v in b.items() if k != "labels"} for b in rows]


def _lm_collate(features: list[dict]) -> dict:
    batch = collate(features)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _lora(merge: bool):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    student = peft.get_peft_model(bert(2), peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                           target_modules=["query", "value"]))
    load = ((lambda out: peft.PeftModel.from_pretrained(bert(2), out)) if not merge
            else AutoModelForSequenceClassification.from_pretrained)
    return student, load


def _text(kind: str):
    """(student, teacher, load, extra arguments) of one kind, all on the tiny BERT teacher."""
    t = teacher(layers=4, seed=1).eval()
    auto = AutoModelForSequenceClassification.from_pretrained
    if kind == "shrink_with_projection":  # hidden 16 -> 32: a trained projection the folder must not hold
        return shrink(t, 2, 16, 2, 32, seed=0), t, auto, {"distill_terms": ["loss=hidden_mse,layers=uniform"]}
    if kind == "prune_depth":  # students.from_teacher with the blocks it picks
        return prune_depth(t, 2, _calibration())[0], t, auto, {}
    if kind == "prune_width":
        return prune_width(t, _calibration(), intermediate_size=24, num_attention_heads=2)[0], t, auto, {}
    if kind == "bilstm":
        return bilstm.from_teacher(t, hidden_size=8, classifier_size=8), t, auto, {}
    student, load = _lora(merge=kind == "lora_merged")
    return student, t, load, {}


@pytest.mark.parametrize("kind", ["shrink_with_projection", "prune_depth", "prune_width", "bilstm",
                                  "lora_adapter", "lora_merged"])
def test_saved_text_student_loads_as_its_guide_says_and_holds_the_student_alone(tmp_path, kind):
    student, t, load, extra = _text(kind)
    trainer = DistillationTrainer(model=student, teacher_model=t, train_dataset=token_dataset(8),
                                  data_collator=collate, args=args(tmp_path, max_steps=1, learning_rate=1e-2, **extra))
    trainer.train()
    assert (trainer._projections() is not None) == (kind == "shrink_with_projection")
    if kind == "lora_merged":  # trainer.md: merge before saving to publish a plain transformers model
        trainer.model = trainer.model.merge_and_unload()
    trainer.save_model(str(tmp_path / "saved"))
    _same_outputs(trainer.model, load(tmp_path / "saved"), collate(token_dataset(4, seed=5).to_list()))
    _student_alone(tmp_path / "saved", trainer.model)


def test_saved_width_pruned_causal_lm(tmp_path):
    t = decoder("llama", layers=4, seed=1).eval()
    calibration = [{"input_ids": torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0)),
                    "attention_mask": torch.ones(2, 7, dtype=torch.long)}]
    student, _ = prune_width(t, calibration, intermediate_size=40, num_layers=2, hidden_size=24)
    trainer = DistillationTrainer(model=student, teacher_model=t, train_dataset=token_dataset(8),
                                  data_collator=_lm_collate, args=args(tmp_path, max_steps=1, learning_rate=1e-2))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert (loaded.config.hidden_size, loaded.config.num_hidden_layers) == (24, 2)  # the student's shape
    _same_outputs(student, loaded, dict(calibration[0]))
    _student_alone(tmp_path / "saved", student)


def test_saved_deit_student_keeps_both_heads(tmp_path):
    from test_distillation_token import collate as image_collate
    from test_distillation_token import images, token_student, vit_teacher

    t = vit_teacher()
    student = token_student(t)
    trainer = DistillationTrainer(model=student, teacher_model=t, train_dataset=images(), data_collator=image_collate,
                                  args=args(tmp_path, max_steps=1, learning_rate=1e-2, distillation_token="hard"))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    loaded = AutoModelForImageClassification.from_pretrained(tmp_path / "saved")
    assert type(loaded) is type(student)
    _same_outputs(student, loaded, {"pixel_values": image_collate(images(4, seed=3))["pixel_values"]})
    _student_alone(tmp_path / "saved", student)


def _same_outputs(trained: torch.nn.Module, loaded: torch.nn.Module, batch: dict) -> None:
    batch = {k: v for k, v in batch.items() if k != "labels"}
    trained.eval(), loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, trained(**batch).logits, rtol=0, atol=1e-6)


def _student_alone(folder, student: torch.nn.Module) -> None:
    """The weights files hold the student's own tensors (peft's names: the adapters'), the same shapes."""
    saved = {}
    for path in glob.glob(str(folder / "*.safetensors")):
        saved.update(load_file(path))
    own = {tuple(v.shape) for v in student.state_dict().values()}
    assert saved and all(tuple(v.shape) in own for v in saved.values())
    assert not any(k.startswith(("teacher", "hf_distill_projections")) or "projections" in k for k in saved)
    assert sum(v.numel() for v in saved.values()) <= sum(p.numel() for p in student.state_dict().values())
