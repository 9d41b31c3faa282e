"""Speech-recognition data (hf_distill/data/asr.py): the offline WhisperProcessor, the refusals (sampling rate,
feature extractors), the collator, and distil-whisper's pseudo-labelling stage, resumable after a kill."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Audio
from whisper_models import TEXTS, noise_rows, processor, tiny_whisper

from hf_distill.data import asr


@pytest.fixture(scope="module")
def proc():
    return processor()


def test_offline_processor_round_trips_and_saves(proc, tmp_path):
    from transformers import WhisperProcessor

    tok = proc.tokenizer
    ids = tok("the movie was great fun").input_ids
    prefix = ["<|startoftranscript|>", "<|notimestamps|>"]
    assert ids[:2] == tok.convert_tokens_to_ids(prefix)
    assert ids[-1] == tok.eos_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == "the movie was great fun"
    proc.save_pretrained(tmp_path)
    again = WhisperProcessor.from_pretrained(tmp_path)
    assert again.tokenizer("not bad at all").input_ids == tok("not bad at all").input_ids
    assert again.feature_extractor.feature_size == 16 and again.feature_extractor.nb_max_frames == 100


def test_wrong_sampling_rate_is_refused_in_one_line():
    rows = noise_rows(3, rate=8_000)
    with pytest.raises(ValueError, match=r"audio_column 'audio' has audio at \[8000\] Hz, the feature extractor "
                                         r"expects 16000 Hz: resample") as err:
        asr.check_audio(rows, "audio", 16_000)
    assert "\n" not in str(err.value)
    asr.check_audio(noise_rows(2), "audio", 16_000)
    # a datasets.Audio column is decoded (and resampled) at its feature's rate: that rate is the one checked
    # (decoding a real Audio column needs torchcodec: its schema is what is read, so a stand-in with that schema)
    cast = type("AudioColumn", (), {"column_names": ["audio"], "features": {"audio": Audio(sampling_rate=16_000)}})
    assert asr.audio_sampling_rates(cast, "audio") == {16_000}
    native = type("AudioColumn", (), {"column_names": ["audio"], "features": {"audio": Audio()}})  # no rate
    with pytest.raises(ValueError, match=r"datasets.Audio column without a sampling_rate .*cast_column"):
        asr.check_audio(native, "audio", 16_000)
    with pytest.raises(ValueError, match="'speech' is not a column"):
        asr.check_audio(rows, "speech", 16_000)


def test_pseudo_labelling_refuses_a_wrong_rate_before_generating(proc, tmp_path, monkeypatch):
    model = tiny_whisper(proc)
    monkeypatch.setattr(model, "generate", lambda **kw: pytest.fail("generated before the check"))
    with pytest.raises(ValueError, match=r"\[44100\] Hz"):
        asr.pseudo_label(model, proc, noise_rows(2, rate=44_100), tmp_path / "labels")
    assert not (tmp_path / "labels").exists()


def test_precomputed_features_of_another_shape_are_refused_before_generating(proc, tmp_path, monkeypatch):
    """40-bin features for a 16-bin model failed in its first convolution, with a traceback, after the settings
    file was written (which then refused the corrected dataset's labels)."""
    from datasets import Dataset

    model = tiny_whisper(proc)
    monkeypatch.setattr(model, "generate", lambda **kw: pytest.fail("generated before the check"))
    rows = Dataset.from_dict({"input_features": torch.zeros(2, 40, 100).tolist(), "text": ["a", "b"]})
    with pytest.raises(ValueError, match=r"input_features are 40 x 100 \(mel bins x frames\), the feature extractor "
                                         r"makes 16 x 100"):
        asr.pseudo_label(model, proc, rows, tmp_path / "labels")
    assert not (tmp_path / "labels").exists()


def test_a_labelling_run_that_failed_before_its_first_batch_does_not_block_the_corrected_one(proc, tmp_path):
    """`max_new_tokens` past the model's positions failed in generate after the settings file was written: the
    corrected call was refused ("other settings") though the folder held no label."""
    model, rows = tiny_whisper(proc), noise_rows(2)
    with pytest.raises(ValueError, match="max_target_positions"):
        asr.pseudo_label(model, proc, rows, tmp_path, max_new_tokens=40)
    assert len(asr.pseudo_label(model, proc, rows, tmp_path, max_new_tokens=2)) == 2
    assert len((tmp_path / asr.PSEUDO_LABEL_FILE).read_text().splitlines()) == 2


def test_clips_longer_than_the_window_are_refused_not_cut(proc, tmp_path, monkeypatch):
    """The feature extractor cut a 1.5 s clip to its 1 s window silently, while its transcript kept every word. The
    dataset is concatenated, whose flattened column datasets 5 could not iterate (check_audio failed: KeyError)."""
    from datasets import concatenate_datasets

    rows = concatenate_datasets([noise_rows(2), noise_rows(1, seconds=1.5)])
    asr.check_audio(rows, "audio", 16_000)  # the rate is right
    model = tiny_whisper(proc)
    monkeypatch.setattr(model, "generate", lambda **kw: pytest.fail("generated before the check"))
    message = r"1 clip\(s\) up to 1.5 s, longer than the feature extractor's 1 s window"
    with pytest.raises(ValueError, match=message):
        asr.pseudo_label(model, proc, rows, tmp_path / "labels")
    assert not (tmp_path / "labels").exists()
    with pytest.raises(ValueError, match=message):  # a clip decoded by datasets.Audio meets the collator's check
        asr.SpeechSeq2SeqCollator(proc)([rows[2]])


def test_different_feature_extractors_are_refused(proc):
    other = processor(num_mel_bins=8).feature_extractor
    with pytest.raises(ValueError, match=r"feature_size 16 \(teacher\) vs 8 \(student\); the dataset has no raw "
                                         "audio") as err:
        asr.check_feature_extractors(proc.feature_extractor, other, has_audio=False)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="one batch of input_features"):
        asr.check_feature_extractors(proc.feature_extractor, other, has_audio=True)
    from transformers import WhisperFeatureExtractor

    rate = WhisperFeatureExtractor(feature_size=16, chunk_length=1, sampling_rate=8_000)
    with pytest.raises(ValueError, match="sampling_rate 16000 \\(teacher\\) vs 8000"):
        asr.check_feature_extractors(proc.feature_extractor, rate, has_audio=False)
    asr.check_feature_extractors(proc.feature_extractor, processor().feature_extractor, has_audio=False)


def test_collator_makes_features_labels_and_shifted_decoder_inputs(proc):
    tok = proc.tokenizer
    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    rows = noise_rows(3)
    batch = asr.SpeechSeq2SeqCollator(proc, decoder_start_token_id=sot)([rows[i] for i in range(3)])
    assert batch["input_features"].shape == (3, 16, 100)
    first = tok(TEXTS[0]).input_ids[1:]  # <|startoftranscript|> dropped: the decoder inputs start with it
    assert batch["labels"][0, : len(first)].tolist() == first
    assert (batch["labels"][1, len(tok(TEXTS[1]).input_ids) - 1 :] == -100).all()
    assert batch["decoder_input_ids"][:, 0].tolist() == [sot] * 3
    assert batch["decoder_input_ids"][0, 1 : len(first)].tolist() == first[:-1]
    # precomputed features are used as they are
    pre = [{**rows[i], "input_features": batch["input_features"][i].numpy()} for i in range(3)]
    assert torch.equal(asr.SpeechSeq2SeqCollator(proc)(pre)["input_features"], batch["input_features"])


@pytest.mark.slow
def test_pseudo_labelling_resumes_after_a_kill_without_redoing_rows(proc, tmp_path, monkeypatch):
    model = tiny_whisper(proc)
    rows = noise_rows(7)
    expected = asr.pseudo_label(model, proc, rows, tmp_path / "whole", batch_size=3, max_new_tokens=2)
    assert len(expected) == 7

    calls, real = [], model.generate

    def killed_on_third(**kw):
        calls.append(kw["input_features"].shape[0])
        if len(calls) == 3:
            raise KeyboardInterrupt("killed")
        return real(**kw)

    folder = tmp_path / "labels"
    monkeypatch.setattr(model, "generate", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        asr.pseudo_label(model, proc, rows, folder, batch_size=3, max_new_tokens=2)
    assert calls == [3, 3, 1]
    calls.clear()
    before = (folder / asr.PSEUDO_LABEL_FILE).read_text()
    with pytest.raises(ValueError, match="holds 6 of the 7 pseudo-labels: label them first"):  # reading back only
        asr.pseudo_label(model, proc, rows, folder, batch_size=3, max_new_tokens=2, generate=False)
    assert calls == [] and (folder / asr.PSEUDO_LABEL_FILE).read_text() == before
    # a kill mid-write leaves half a line: dropped, and its rows labelled again
    with open(folder / asr.PSEUDO_LABEL_FILE, "a") as f:
        f.write('{"row": 6, "te')
    calls.clear()
    monkeypatch.setattr(model, "generate", lambda **kw: calls.append(kw["input_features"].shape[0]) or real(**kw))
    assert asr.pseudo_label(model, proc, rows, folder, batch_size=3, max_new_tokens=2) == expected
    assert calls == [1]  # only row 6 was left
    assert asr.pseudo_label(model, proc, rows, folder, batch_size=3, max_new_tokens=2, generate=False) == expected
    assert calls == [1]
    lines = (folder / asr.PSEUDO_LABEL_FILE).read_text().splitlines()
    assert sorted(json.loads(x)["row"] for x in lines) == list(range(7))


@pytest.mark.slow
def test_pseudo_labels_of_other_settings_are_refused_not_mixed(proc, tmp_path):
    model = tiny_whisper(proc)
    rows = noise_rows(2)
    asr.pseudo_label(model, proc, rows, tmp_path, batch_size=2, max_new_tokens=3)
    before = (tmp_path / asr.PSEUDO_LABEL_FILE).read_text()
    with pytest.raises(ValueError, match=r"other settings \(teacher differ\)"):
        asr.pseudo_label(tiny_whisper(proc, seed=1), proc, rows, tmp_path, batch_size=2, max_new_tokens=3)
    with pytest.raises(ValueError, match=r"other settings \(generate differ\)"):
        asr.pseudo_label(model, proc, rows, tmp_path, batch_size=2, max_new_tokens=5)
    assert (tmp_path / asr.PSEUDO_LABEL_FILE).read_text() == before
