"""Audio classification students through DistillationTrainer (issue #43): the head is found as for text and every
divergence that fits distils it, a teacher with another feature extractor reads its own input_values from the same
raw clip (hf_distill.data.audio), and transformers' run_audio_classification.py distils with three edited lines."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import yaml
from audio_models import ast, inputs, wav2vec2
from datasets import Dataset
from helpers import args, flat_params
from hub_server import FakeHub, online
from transformers import ASTFeatureExtractor, HfArgumentParser, Wav2Vec2FeatureExtractor

from hf_distill import DistillationArguments, DistillationTrainer, Distiller, students
from hf_distill.data import speech
from hf_distill.data.audio import AudioTeacherCollator, teacher_own_inputs
from hf_distill.features.heads import Head, HeadKind, head_kind, runtime_head
from hf_distill.losses.registry import KindMap, kinds

needs_espeak = pytest.mark.skipif(speech.espeak_ng() is None,
                                  reason="espeak-ng is not installed (`apt-get install espeak-ng`, a Debian package)")


def extractor(rate: int = 16_000, normalize: bool = True) -> Wav2Vec2FeatureExtractor:
    return Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=rate, padding_value=0.0, do_normalize=normalize,
                                    return_attention_mask=True)


def spectrogram() -> ASTFeatureExtractor:
    """The tiny AST's extractor: 16 mel bins, 32 frames (audio_models.ast)."""
    return ASTFeatureExtractor(num_mel_bins=16, max_length=32, sampling_rate=16_000)


def clips(n: int = 6, seed: int = 0, rate: int = 16_000) -> Dataset:
    """Raw rows as a Hub audio dataset decodes them: varied lengths (a tone plus noise), three labels."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 1200 + 300 * (i % 3)
        t = torch.arange(length) / rate
        wave = torch.sin(2 * torch.pi * (200 + 150 * (i % 3)) * t) + 0.1 * torch.randn(length, generator=g)
        rows.append({"audio": {"array": wave.numpy(), "sampling_rate": rate}, "label": i % 3})
    return Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------- heads


@pytest.mark.parametrize("build", [wav2vec2, ast], ids=["wav2vec2", "ast"])
def test_audio_classifiers_are_their_own_head_kind(build):
    model = build()
    assert head_kind(model) is HeadKind.AUDIO_CLASSIFICATION
    assert HeadKind.AUDIO_CLASSIFICATION.facts.pipeline_tag == "audio-classification"
    multi = build(problem_type="multi_label_classification")
    assert runtime_head(multi, torch.zeros(2, 3), None) is Head.MULTI_LABEL


def _kd_only(tmp_path, student, teacher, batch, kind):
    distiller = Distiller(student, args(tmp_path, kd_loss=kind, kd_weight=1.0, task_weight=0.0, temperature=1.0),
                          teacher_model=teacher)
    student.train()
    return distiller.compute_loss(student, dict(batch))


def test_every_divergence_distils_a_single_label_audio_student(tmp_path):
    """Each registered divergence trains a wav2vec2 student on the teacher's logits; forward KL at T = 1 equals the
    KL of the two models' softmaxes computed here."""
    teacher, student = wav2vec2(seed=1), wav2vec2(layers=2, seed=2)
    batch = {**inputs(teacher), "labels": torch.tensor([0, 1, 2])}
    for kind in kinds():
        student.zero_grad()
        loss = _kd_only(tmp_path, student, teacher, batch, kind)
        loss.backward()
        assert loss.isfinite() and loss > 0 and student.classifier.weight.grad.abs().sum() > 0, kind
    loss = _kd_only(tmp_path, student, teacher, batch, "kl")
    with torch.no_grad():
        t, s = teacher(**inputs(teacher)).logits, student(**inputs(teacher)).logits
    expected = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)


def test_multi_label_audio_students_distil_per_label(tmp_path):
    teacher = ast(seed=1, problem_type="multi_label_classification")
    student = ast(layers=2, seed=2, problem_type="multi_label_classification")
    batch = {**inputs(teacher), "labels": torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])}
    for kind in KindMap("multi_label"):
        loss = _kd_only(tmp_path, student, teacher, batch, kind)
        loss.backward()
        assert loss.isfinite() and loss > 0, kind


def test_multi_hot_labels_for_wav2vec2_s_own_single_label_loss_are_refused_and_train_with_bce(tmp_path):
    teacher = wav2vec2(seed=1, problem_type="multi_label_classification")
    student = wav2vec2(layers=2, seed=2, problem_type="multi_label_classification")
    batch = {**inputs(teacher), "labels": torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.0]])}
    student.train()
    with pytest.raises(ValueError, match=r"own loss is single-label cross-entropy.*compute_loss_func"):
        Distiller(student, args(tmp_path), teacher_model=teacher).compute_loss(student, dict(batch))

    def bce(out, labels, num_items_in_batch=None):
        return F.binary_cross_entropy_with_logits(out.logits, labels)

    distiller = Distiller(student, args(tmp_path, kd_loss="soft_ce"), teacher_model=teacher, compute_loss_func=bce)
    assert distiller.compute_loss(student, dict(batch)).isfinite()


# ---------------------------------------------------------------------------------------------- own inputs


def test_the_teacher_reads_its_own_input_values_from_the_same_clip(tmp_path):
    """A wav2vec2 student at 16 kHz and an AST teacher (log-mel spectrograms): the KD term is the KL between the
    student on its waveform and the teacher on its own spectrogram of the same clip."""
    rows = clips()
    collator = AudioTeacherCollator(extractor(), spectrogram())
    batch = collator([rows[i] for i in range(3)])
    assert batch["input_values"].shape[:1] == batch["teacher_input_values"].shape[:1] == (3,)
    assert batch["teacher_input_values"].shape[1:] == (32, 16) and "teacher_attention_mask" not in batch
    expected_t = spectrogram()([r["audio"]["array"] for r in rows.select(range(3))], sampling_rate=16_000,
                               return_tensors="pt")["input_values"]
    torch.testing.assert_close(batch["teacher_input_values"], expected_t)
    teacher, student = ast(seed=1), wav2vec2(layers=2, seed=2)
    distiller = Distiller(student, args(tmp_path, kd_weight=1.0, task_weight=0.0, temperature=1.0),
                          teacher_model=teacher)
    student.train()
    loss = distiller.compute_loss(student, dict(batch))
    with torch.no_grad():
        t = teacher(input_values=expected_t).logits
        s = student(input_values=batch["input_values"], attention_mask=batch["attention_mask"]).logits
    expected = F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-4)


def test_a_teacher_at_another_sampling_rate_gets_the_clip_resampled():
    rows = clips()
    batch = AudioTeacherCollator(extractor(), extractor(8_000, normalize=False))([rows[0], rows[1]])
    assert batch["input_values"].shape[1] == 1500 and batch["teacher_input_values"].shape[1] == 750
    assert batch["teacher_attention_mask"][0].sum() == 600  # rows[0]: 1,200 samples at 16 kHz
    own = teacher_own_inputs({"input_values": batch["input_values"], "attention_mask": batch["attention_mask"],
                              "labels": batch["labels"]},
                             {k: v for k, v in batch.items() if k.startswith("teacher_")})
    assert own["input_values"] is batch["teacher_input_values"] and own["attention_mask"] is batch[
        "teacher_attention_mask"] and own["labels"] is batch["labels"]


def _trainer(tmp_path, collator, train, processing_class=None, teacher_processing_class=None, **kw):
    return DistillationTrainer(model=wav2vec2(layers=2, seed=2), teacher_model=ast(seed=1),
                               args=args(tmp_path, remove_unused_columns=False, **kw), train_dataset=train,
                               data_collator=collator, processing_class=processing_class,
                               teacher_processing_class=teacher_processing_class)


def test_refused_before_training_wrong_rate_raw_audio_gone_and_one_input_for_two_extractors(tmp_path):
    collator = AudioTeacherCollator(extractor(), spectrogram())
    with pytest.raises(ValueError, match=r"sampled at 8000 Hz .* reads 16000 Hz: dataset.cast_column\('audio'"):
        _trainer(tmp_path, collator, clips(rate=8_000))
    gone = clips().map(lambda r: {"input_values": r["audio"]["array"]}, remove_columns=["audio"])
    with pytest.raises(ValueError, match=r"no 'audio' column .* the raw audio is gone"):
        _trainer(tmp_path, collator, gone)
    with pytest.raises(ValueError, match=r"processing_class differs .*AudioTeacherCollator\(student_extractor"):
        _trainer(tmp_path, None, gone, processing_class=extractor(), teacher_processing_class=spectrogram())
    folder = tmp_path / "teacher"  # a teacher given by path: its saved extractor is compared, before it loads
    extractor(8_000).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"differs from the student's feature extractor \(sampling_rate 16000 vs 8000"):
        DistillationTrainer(model=wav2vec2(layers=2), teacher_model=str(folder), args=args(tmp_path),
                            train_dataset=gone, processing_class=extractor())


def test_trainer_distils_and_evaluates_the_teacher_on_its_own_inputs(tmp_path):
    rows = clips(8)
    collator = AudioTeacherCollator(extractor(), spectrogram())
    trainer = _trainer(tmp_path, collator, rows, max_steps=2, per_device_train_batch_size=4)
    before = flat_params(trainer.model).clone()
    trainer.train()
    assert not torch.equal(before, flat_params(trainer.model))
    assert all(torch.isfinite(torch.tensor(r["loss_kd"])) for r in trainer.state.log_history if "loss_kd" in r)
    metrics = trainer.evaluate_teacher(rows)  # the AST teacher cannot read the student's waveform: its own input
    assert metrics["teacher_loss"] > 0


# ------------------------------------------------------------------------ run_audio_classification.py's flow


def _script_run(tmp_path, teacher_dir, student, flags, rows, feature_extractor, resume=None):
    """run_audio_classification.py with its three edits: the import, DistillationArguments in the parser, and
    DistillationTrainer(teacher_model=...) for Trainer; its transforms, metric, train / evaluate / card calls."""
    (training_args,) = HfArgumentParser(DistillationArguments).parse_args_into_dataclasses(flags)

    def transforms(batch):
        out = feature_extractor([a["array"] for a in batch["audio"]], sampling_rate=feature_extractor.sampling_rate)
        return {"input_values": out["input_values"], "labels": list(batch["label"])}

    train, evaluation = rows.select(range(24)), rows.select(range(24, len(rows)))
    train.set_transform(transforms, output_all_columns=False)
    evaluation.set_transform(transforms, output_all_columns=False)

    def compute_metrics(pred):
        return {"accuracy": float((pred.predictions.argmax(1) == pred.label_ids).mean())}

    trainer = DistillationTrainer(teacher_model=str(teacher_dir), model=student, args=training_args,
                                  train_dataset=train, eval_dataset=evaluation, compute_metrics=compute_metrics,
                                  processing_class=feature_extractor)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return trainer


@needs_espeak
@pytest.mark.slow
def test_run_audio_classification_distils_resumes_exactly_keeps_the_best_and_pushes_its_card(tmp_path):
    rows = speech.spoken_digits(speakers=3).shuffle(seed=0)
    feature_extractor = extractor()
    teacher = wav2vec2(labels=10, seed=1)
    teacher.save_pretrained(tmp_path / "teacher")
    feature_extractor.save_pretrained(tmp_path / "teacher")
    flags = ["--output_dir", str(tmp_path / "out"), "--remove_unused_columns", "False", "--max_steps", "4",
             "--per_device_train_batch_size", "8", "--eval_strategy", "steps", "--eval_steps", "2", "--save_steps",
             "2", "--load_best_model_at_end", "--metric_for_best_model", "accuracy", "--kd_weight", "0.5",
             "--temperature", "2", "--learning_rate", "1e-3", "--use_cpu", "--report_to", "none", "--seed", "0",
             "--distill_terms", "loss=hidden_mse,layers=uniform", "--projection", "shared"]
    start = students.shrink(teacher, num_layers=2, hidden_size=8, num_attention_heads=2, intermediate_size=16, seed=3)
    full = _script_run(tmp_path, tmp_path / "teacher", start, flags, rows, feature_extractor)
    best = full.state.best_model_checkpoint
    assert best is not None and full.state.best_metric is not None
    resumed_student = students.shrink(teacher, num_layers=2, hidden_size=8, num_attention_heads=2,
                                      intermediate_size=16, seed=3)
    resumed = _script_run(tmp_path, tmp_path / "teacher", resumed_student, flags, rows, feature_extractor,
                          resume=str(tmp_path / "out" / "checkpoint-2"))
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    metrics = resumed.evaluate()
    assert metrics["eval_accuracy"] == pytest.approx(full.state.best_metric)
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        resumed.push_to_hub(finetuned_from="student-start", tasks="audio-classification",
                            dataset="spoken-digits", tags=["audio-classification"])
        files = hub.files("fake-user/out")
    card = files["README.md"].decode()
    meta = yaml.safe_load(card.split("---\n", 2)[1])
    assert meta["pipeline_tag"] == "audio-classification"
    result = meta["model-index"][0]["results"][0]
    assert result["task"]["type"] == "audio-classification"
    assert {m["name"] for m in result["metrics"]} >= {"accuracy"}
    assert "AutoFeatureExtractor.from_pretrained" in card and "AutoTokenizer" not in card
    assert 'pipeline("audio-classification"' in card
    assert "preprocessor_config.json" in files
