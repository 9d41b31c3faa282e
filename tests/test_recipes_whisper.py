"""recipes/distil_whisper.py end to end on espeak-ng speech with a tiny Whisper trained here, each stage alone, and
its refusals (one line each, before anything trains)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import run_script
from whisper_models import noise_rows

from hf_distill.data import speech

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "distil_whisper.py"
CONFIG = ROOT / "recipes" / "configs" / "distil_whisper_espeak.yaml"


def tiny(tmp: Path, out: Path) -> list:
    """A 1-encoder / 3-decoder-layer width-32 teacher on 8 sentences x 2 voices, everything one or two steps."""
    return ["--config", CONFIG, "--output_dir", out, "--teacher_cache_dir", tmp / "teachers", "--sentences_file",
            _sentences(tmp), "--num_sentences", "8", "--eval_seen_sentences", "3", "--eval_new_sentences", "3",
            "--teacher_voices", "2", "--train_voices", "1", "--eval_voices", "1", "--teacher_d_model", "32",
            "--teacher_encoder_layers", "1", "--teacher_decoder_layers", "3", "--teacher_heads", "2",
            "--teacher_ffn", "64", "--teacher_epochs", "1", "--vocab_size", "300", "--num_mel_bins", "40",
            "--num_train_epochs", "1", "--per_device_train_batch_size", "8", "--speed_clips", "2",
            "--speed_tokens", "3", "--transcript_max_tokens", "6", "--wer_threshold", "1.0", "--disable_tqdm",
            "true", "--logging_steps", "1"]


def _sentences(tmp: Path) -> Path:
    path = tmp / "sentences.tsv"
    words = ["good", "bad", "film", "movie", "great", "dull", "fun", "story", "plot", "actors", "funny", "slow"]
    rows = [" ".join(words[(i + k * 5) % len(words)] for k in range(3 + i % 2)) for i in range(11)]
    path.write_text("sentence\tlabel\n" + "".join(f"{r} ,\t{i % 2}\n" for i, r in enumerate(rows)))
    return path


def _one_error(proc) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), proc.stderr[-3000:]
    return lines[0]


@pytest.mark.slow
@pytest.mark.skipif(speech.espeak_ng() is None, reason="espeak-ng is not installed (`apt-get install espeak-ng`)")
def test_recipe_end_to_end_then_stages_alone(tmp_path):
    out = tmp_path / "out"
    proc = run_script(RECIPE, *tiny(tmp_path, out), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["rows"] == {"teacher": 16, "train": 8, "eval_seen_text": 3, "eval_new_text": 3}
    assert results["kept_rows"] == 8 and results["kept_share"] == 1.0  # threshold 1.0: WER <= 1 keeps every row
    assert results["student_decoder_layers"] == [0, 2]
    facts = results["distillation"]
    assert (facts["kd_loss"], facts["kd_weight"], facts["task_weight"], facts["temperature"]) == ("kl", 1.0, 0.8, 2.0)
    for model in ("teacher", "student", "baseline"):
        for split in ("eval_seen_text", "eval_new_text"):
            assert 0.0 <= results[f"{model}_wer_{split}"], (model, split)
    assert results["decode_speedup"] > 0 and results["params"] < results["teacher_params"]
    assert "loss_kd" in proc.stdout + proc.stderr
    labels = out / "pseudo_labels" / "pseudo_labels.jsonl"
    assert len(labels.read_text().splitlines()) == 8
    for folder in (out, out / "baseline", out / "student_init"):
        assert (folder / "model.safetensors").is_file() and (folder / "processor_config.json").is_file()

    # A stage alone: the teacher is found in its cache, and pseudo-labelling continues where the file stops.
    whole = labels.read_text()
    labels.write_text("".join(whole.splitlines(keepends=True)[:5]))
    again = run_script(RECIPE, *tiny(tmp_path, out), "--stages", "pseudo_label", "filter", cwd=ROOT)
    assert again.returncode == 0 and "teacher: reusing" in again.stdout, again.stderr[-3000:]
    assert sorted(labels.read_text().splitlines()) == sorted(whole.splitlines())
    updated = json.loads((out / "results.json").read_text())
    assert updated["stages_run"] == ["pseudo_label", "filter"] and "student_wer_eval_new_text" in updated  # kept


def test_wer_threshold_outside_0_1_is_one_line(tmp_path):
    proc = run_script(RECIPE, *tiny(tmp_path, tmp_path / "out"), "--wer_threshold", "1.5", cwd=ROOT)
    assert "wer_threshold must be in [0, 1]" in _one_error(proc)
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()


@pytest.mark.parametrize("name", ["vocabulary", "voices_per_sentence"])
def test_a_negative_data_size_is_one_line(tmp_path, name):
    proc = run_script(RECIPE, *tiny(tmp_path, tmp_path / "out"), f"--{name}", "-1", cwd=ROOT)
    assert f"{name} must be >= 0 (0: no limit), got -1" in _one_error(proc)
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()


def test_decoder_layers_not_a_subset_is_one_line(tmp_path):
    proc = run_script(RECIPE, *tiny(tmp_path, tmp_path / "out"), "--student_decoder_layers", "0", "3", cwd=ROOT)
    line = _one_error(proc)
    assert "student_decoder_layers [0, 3] must be a subset of the teacher's 3 decoder layers" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()


def test_audio_at_the_wrong_sampling_rate_is_one_line_before_training(tmp_path):
    from datasets import DatasetDict

    data = tmp_path / "data"
    DatasetDict({name: noise_rows(2, rate=8_000) for name in ("teacher", "train", "eval_seen_text",
                                                              "eval_new_text")}).save_to_disk(data)
    proc = run_script(RECIPE, *tiny(tmp_path, tmp_path / "out"), "--dataset_dir", data, cwd=ROOT)
    line = _one_error(proc)
    assert "audio_column 'audio' has audio at [8000] Hz, the feature extractor expects 16000 Hz" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()


def test_a_student_with_another_feature_extractor_is_one_line_without_raw_audio(tmp_path):
    """Precomputed 40-bin features and no audio column: a given 16-bin student could not get its own features."""
    from datasets import Dataset, DatasetDict
    from whisper_models import processor, tiny_whisper

    proc = processor(num_mel_bins=16)
    student = tmp_path / "student"
    tiny_whisper(proc).save_pretrained(student)
    proc.save_pretrained(student)
    rows = Dataset.from_dict({"input_features": np.zeros((2, 40, 600), np.float32), "text": ["good film", "bad"]})
    data = tmp_path / "data"
    DatasetDict({name: rows for name in ("teacher", "train", "eval_seen_text", "eval_new_text")}).save_to_disk(data)
    proc = run_script(RECIPE, *tiny(tmp_path, tmp_path / "out"), "--dataset_dir", data, "--student", student,
                      cwd=ROOT)
    line = _one_error(proc)
    assert "feature extractors differ: feature_size 40 (teacher) vs 16 (student)" in line, line
    assert "the dataset has no raw audio" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()


def _whisper_data(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    return importlib.import_module("_whisper_data")


def test_vocabulary_keeps_the_sentences_made_of_the_most_frequent_words(tmp_path, monkeypatch):
    """issue #44 item 4: held-out sentences must reuse words the teacher heard, or their WER only says that a model
    cannot spell words it never met; `vocabulary` keeps the sentences made of the K most frequent words."""
    data = _whisper_data(monkeypatch)
    path = tmp_path / "s.tsv"
    rows = ["the film is good", "the film is bad", "a good film", "the plot is thin", "zany antics abound"]
    path.write_text("sentence\tlabel\n" + "".join(f"{r} .\t0\n" for r in rows))
    assert data.sentences(str(path), 3, 6) == rows  # 0: every sentence, as before
    # the, film, is: 3 each; good: 2; the rest 1 each: the 5 most frequent are those and bad (ties: first use)
    assert data.sentences(str(path), 3, 6, vocabulary=5) == ["the film is good", "the film is bad"]


@pytest.mark.skipif(speech.espeak_ng() is None, reason="espeak-ng is not installed (`apt-get install espeak-ng`)")
def test_voices_per_sentence_draws_that_many_voices_of_the_pool_for_each_sentence(monkeypatch):
    data = _whisper_data(monkeypatch)
    pool = speech.voices(4, seed=0)
    texts = ["good film", "bad plot", "fun"]
    rows = data._spoken(texts, pool, 2, seed=0)
    assert rows["text"] == [t for t in texts for _ in range(2)]
    keys = {v.key() for v in pool}
    for i in range(0, 6, 2):
        pair = rows["speaker"][i : i + 2]
        assert len(set(pair)) == 2 and set(pair) <= keys
    assert len({tuple(rows["speaker"][i : i + 2]) for i in range(0, 6, 2)}) > 1  # drawn per sentence
    assert rows["speaker"] == data._spoken(texts, pool, 2, seed=0)["speaker"]  # deterministic in the seed
    every = data._spoken(texts[:1], pool, 0, seed=0)
    assert every["speaker"] == [v.key() for v in pool]  # 0: all the pool's voices, as before


def test_the_teacher_trained_here_hears_the_audio_at_initialisation(monkeypatch):
    """issue #44 item 4: with Whisper's own init (std 0.02) the convolutions' output, what the audio adds to the
    encoder's input, was ~70x smaller than the sinusoidal positions it is summed with, and the teacher trained here
    learned a language model of its 60 transcripts (WER 0.62 on heard sentences); He init puts both on one scale."""
    import dataclasses

    import torch

    data = _whisper_data(monkeypatch)
    recipe = dataclasses.make_dataclass("R", [("num_mel_bins", int, 16), ("teacher_d_model", int, 32),
                                              ("teacher_encoder_layers", int, 1), ("teacher_decoder_layers", int, 2),
                                              ("teacher_heads", int, 2), ("teacher_ffn", int, 64),
                                              ("transcript_max_tokens", int, 8)])()
    from whisper_models import processor

    torch.manual_seed(0)
    model = data.new_teacher(recipe, processor(num_mel_bins=16), longest=8)
    encoder = model.model.encoder
    features = torch.randn(2, 16, 2 * encoder.config.max_source_positions) * 0.6  # log-mel features' spread
    with torch.no_grad():
        audio = torch.nn.functional.gelu(encoder.conv2(torch.nn.functional.gelu(encoder.conv1(features))))
    heard = (audio[0] - audio[1]).std().item()  # the part of the input that depends on the clip
    assert heard > 0.3 * encoder.embed_positions.weight.std().item()
    assert model.generation_config.no_timestamps_token_id is not None and not model.generation_config.is_multilingual


def test_seed_summary_pairs_kd_and_ce_only_by_seed(monkeypatch):
    """benchmarks/distil_whisper_seeds.py: KD's gain is the CE-only WER minus the KD WER of the same seed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import importlib

    seeds = importlib.import_module("distil_whisper_seeds")
    monkeypatch.delitem(sys.modules, "distil_whisper_seeds")  # the module object stays bound here; not cached
    runs = {"42": {"teacher_wer_new": 0.5, "student_wer_new": 0.6, "baseline_wer_new": 0.7, "decode_speedup": 1.2},
            "1": {"teacher_wer_new": 0.5, "student_wer_new": 0.8, "baseline_wer_new": 0.7, "decode_speedup": 1.4}}
    table = seeds.summary(runs)
    assert table["kd_gain_new"]["runs"] == pytest.approx([0.1, -0.1])
    assert table["student_wer_new"]["mean"] == pytest.approx(0.7)
    assert table["student_wer_new"]["std"] == pytest.approx(0.1 * 2**0.5)  # sample std, not the population's
    assert table["decode_speedup"]["mean"] == pytest.approx(1.3)


def test_evaluate_refuses_a_student_trained_from_another_teacher_student_init_or_filter(tmp_path, monkeypatch, capsys):
    """The filter or student stage run alone changes the training rows or rebuilds student_init (other decoder
    layers), or evaluate is given another teacher: the distilled student left in output_dir came from the old ones,
    and evaluate wrote its WER as the new configuration's, silently."""
    from datasets import DatasetDict
    from whisper_models import processor, tiny_whisper

    proc = processor()
    tiny_whisper(proc).save_pretrained(tmp_path / "teacher")
    proc.save_pretrained(tmp_path / "teacher")
    DatasetDict({name: noise_rows(2) for name in ("teacher", "train", "eval_seen_text", "eval_new_text")}) \
        .save_to_disk(tmp_path / "data")
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    recipe = __import__("importlib").import_module("distil_whisper")
    base = ["--config", str(CONFIG), "--teacher", str(tmp_path / "teacher"), "--dataset_dir", str(tmp_path / "data"),
            "--output_dir", str(tmp_path / "out"), "--wer_threshold", "1.0", "--max_steps", "1", "--disable_tqdm",
            "true", "--speed_clips", "1", "--speed_tokens", "1", "--transcript_max_tokens", "2"]

    def run(*extra: str) -> None:
        monkeypatch.setattr(sys, "argv", ["distil_whisper.py", *base, *extra])
        recipe.main()

    tiny_whisper(proc, seed=1).save_pretrained(tmp_path / "other")
    proc.save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit):  # filter alone reads the labels back: it ran the teacher's generation unasked
        recipe.run_main(lambda: run("--stages", "filter"))
    assert "holds 0 of the 2 pseudo-labels: label them first" in capsys.readouterr().err
    assert not (tmp_path / "out" / "pseudo_labels" / "pseudo_labels.jsonl").exists()
    run("--stages", "pseudo_label", "filter", "student", "distil")
    for stage in (["filter", "--wer_threshold", "0.0"], ["student", "--student_decoder_layers", "1", "2"], None):
        if stage:
            run("--stages", *stage)  # other training rows, then another initial student
        capsys.readouterr()
        with pytest.raises(SystemExit):
            run("--stages", "evaluate", *([] if stage else ["--teacher", str(tmp_path / "other")]))  # or teacher
        assert "the student in" in capsys.readouterr().err and not (tmp_path / "out" / "baseline").exists()
        assert "student_wer_eval_seen_text" not in json.loads((tmp_path / "out" / "results.json").read_text())
        run("--stages", "filter", "student")  # the first run's rows and initial student again (the same bytes)


def test_precomputed_features_of_another_shape_are_one_line_before_the_teacher_trains(tmp_path, monkeypatch, capsys):
    """40-bin features for the 80-bin teacher the recipe trains: it failed in the convolution, mid-training."""
    from datasets import Dataset, DatasetDict

    rows = Dataset.from_dict({"input_features": np.zeros((2, 40, 300), np.float32), "text": ["good film", "bad"]})
    DatasetDict({name: rows for name in ("teacher", "train", "eval_seen_text", "eval_new_text")}) \
        .save_to_disk(tmp_path / "data")
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    recipe = __import__("importlib").import_module("distil_whisper")
    monkeypatch.setattr(sys, "argv", ["distil_whisper.py", "--config", str(CONFIG), "--dataset_dir",
                                      str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"),
                                      "--teacher_cache_dir", str(tmp_path / "teachers"), "--num_mel_bins", "80"])
    with pytest.raises(SystemExit):
        recipe.run_main(recipe.main)  # a ValueError while the recipe checks and builds: one `error:` line
    assert "error: input_features are 40 x 300 (mel bins x frames), the feature extractor makes 80 x 300" in \
        capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "teachers").exists()
