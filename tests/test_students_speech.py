"""distil-whisper's student (hf_distill/students/speech.py) and its loss through DistillationSeq2SeqTrainer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from whisper_models import noise_rows, processor, tiny_whisper

from hf_distill import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer, students
from hf_distill.data.asr import SpeechSeq2SeqCollator


@pytest.fixture(scope="module")
def proc():
    return processor()


def test_default_layers_are_first_and_last():
    assert students.default_decoder_layers(32) == [0, 31]  # distil-large-v3
    assert students.default_decoder_layers(4, 3) == [0, 2, 3] and students.default_decoder_layers(4, 1) == [0]


def test_student_copies_the_encoder_frozen_and_the_chosen_decoder_layers(proc):
    teacher = tiny_whisper(proc, decoder_layers=4)
    student = students.whisper_student(teacher)
    assert student.config.decoder_layers == 2 and student.config.encoder_layers == 1
    t, s = teacher.state_dict(), student.state_dict()
    for key, value in s.items():
        source = key.replace("decoder.layers.1.", "decoder.layers.3.")  # student layer 1 = teacher layer 3
        assert torch.equal(value, t[source]), key
    assert not any(p.requires_grad for p in student.model.encoder.parameters())
    assert all(p.requires_grad for p in student.model.decoder.parameters())
    record = student.config.distillation
    assert record["teacher_decoder_layers"] == [0, 3] and record["frozen"] == ["encoder"]
    chosen = students.whisper_student(teacher, [1, 2], freeze_encoder=False)
    assert chosen.config.distillation["teacher_decoder_layers"] == [1, 2]
    # not frozen: trainable exactly where the teacher's class is (its sinusoidal encoder positions never are)
    flags = {n: p.requires_grad for n, p in teacher.named_parameters()}
    assert all(p.requires_grad == flags[n] for n, p in chosen.named_parameters())
    assert all(p.requires_grad for p in chosen.model.encoder.layers.parameters())


@pytest.mark.parametrize("layers", [[0, 4], [2, 1], [1, 1], [-1], []])
def test_decoder_layers_not_a_subset_are_one_line(proc, layers):
    teacher = tiny_whisper(proc, decoder_layers=4)
    with pytest.raises(ValueError, match=r"student_decoder_layers .* must be a subset of the teacher's 4 decoder "
                                         r"layers") as err:
        students.whisper_student(teacher, layers)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_distil_whisper_loss_is_0_8_ce_plus_t2_kl_and_the_encoder_stays(proc, tmp_path):
    """task_weight 0.8, kd_weight 1, T 2, kd_loss kl, kd_token_mask labels = distil-whisper's
    0.8 * CE + KL(teacher || student at T) * T^2, the KL summed over the vocabulary and averaged over label tokens;
    checked against that formula in float64, then trained: the frozen encoder does not move, the decoder does."""
    teacher = tiny_whisper(proc, decoder_layers=4).double()
    student = students.whisper_student(teacher)
    with torch.no_grad():  # the student must differ from the teacher's layers for the KL to be > 0
        for p in student.model.decoder.layers[1].parameters():
            p.add_(0.2 * torch.randn_like(p))
    rows = noise_rows(4)
    collate = SpeechSeq2SeqCollator(proc, decoder_start_token_id=teacher.config.decoder_start_token_id)
    args = DistillationSeq2SeqArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, kd_weight=1.0,
        task_weight=0.8, temperature=2.0, kd_loss="kl", kd_token_mask="labels", remove_unused_columns=False,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = DistillationSeq2SeqTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows,
                                         data_collator=collate)
    batch = collate([rows[i] for i in range(4)])
    batch["input_features"] = batch["input_features"].double()
    student.train()
    loss = trainer.compute_loss(student, dict(batch))
    with torch.no_grad():
        s = student(**batch).logits
        t = teacher(**batch).logits
    real = batch["labels"] != -100
    ce = F.cross_entropy(s[real], batch["labels"][real])
    kl = F.kl_div(F.log_softmax(s[real] / 2, -1), F.log_softmax(t[real] / 2, -1), log_target=True,
                  reduction="sum") / real.sum()
    assert kl > 1e-3
    # (the package's KD losses compute in float32: agreement to float32's precision)
    assert loss.item() == pytest.approx((0.8 * ce + 4 * kl).item(), rel=1e-6)
    assert loss.item() != pytest.approx((0.8 * ce + kl).item(), rel=1e-3)  # T^2 is there

    teacher.float(), student.float()  # the collator's features are float32
    encoder = {k: v.clone() for k, v in student.model.encoder.state_dict().items()}
    decoder = {k: v.clone() for k, v in student.model.decoder.state_dict().items()}
    trainer.train()
    assert all(torch.equal(v, student.model.encoder.state_dict()[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, student.model.decoder.state_dict()[k]) for k, v in decoder.items())


def test_card_of_a_saved_whisper_student_tags_speech_recognition_and_loads_it_as_speech(proc, tmp_path):
    """A Whisper student's card: before, its class was taken for a text seq2seq LM (text2text-generation), and its
    usage called AutoModelForSeq2SeqLM, which refuses WhisperConfig."""
    from hf_distill.publish.card import write_model_card

    students.whisper_student(tiny_whisper(proc)).save_pretrained(tmp_path)
    proc.save_pretrained(tmp_path)
    card = write_model_card(tmp_path).read_text(encoding="utf-8")
    usage = card.split("## How to use", 1)[1]
    assert "pipeline_tag: automatic-speech-recognition" in card
    assert "AutoModelForSpeechSeq2Seq.from_pretrained(" in usage and "AutoProcessor.from_pretrained(" in usage
    assert 'pipeline("automatic-speech-recognition"' in usage and "AutoModelForSeq2SeqLM" not in usage
    teacher = tiny_whisper(proc)  # the card trainer.push_to_hub writes says the same
    args = DistillationSeq2SeqArguments(output_dir=str(tmp_path / "run"), report_to="none", use_cpu=True)
    trainer = DistillationSeq2SeqTrainer(model=students.whisper_student(teacher), teacher_model=teacher, args=args,
                                         processing_class=proc)
    trainer.create_model_card()
    card = (tmp_path / "run" / "README.md").read_text(encoding="utf-8")
    assert "pipeline_tag: automatic-speech-recognition" in card and "AutoModelForSpeechSeq2Seq" in card
