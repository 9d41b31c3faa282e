"""The offline speech data (hf_distill/data/speech.py): real espeak-ng waveforms, varied speakers, cached."""

from __future__ import annotations

import numpy as np
import pytest

from hf_distill.data import speech

pytestmark = pytest.mark.skipif(speech.espeak_ng() is None,
                                reason="espeak-ng is not installed (`apt-get install espeak-ng`, a Debian package)")


def test_spoken_digits_rows_and_waveforms(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DISTILL_CACHE", str(tmp_path))
    ds = speech.spoken_digits(speakers=2, seed=1)
    assert ds.num_rows == 20 and sorted(set(ds["label"])) == list(range(10))
    clips = [np.asarray(r["audio"]["array"], dtype=np.float32) for r in ds]
    assert all(r["audio"]["sampling_rate"] == 16_000 for r in ds)
    # A spoken word lasts between a tenth of a second and two seconds, and is not silence.
    assert all(1_600 < len(c) < 32_000 and np.abs(c).max() > 0.05 for c in clips)
    # Two speakers saying the same word give different waveforms.
    assert ds[0]["speaker"] != ds[1]["speaker"]
    n = min(len(clips[0]), len(clips[1]))
    assert len(clips[0]) != len(clips[1]) or not np.allclose(clips[0][:n], clips[1][:n])


def test_cache_returns_the_same_clip(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DISTILL_CACHE", str(tmp_path))
    first = speech.speak("seven", speech.Voice("en-gb", 130, 35))
    assert len(list((tmp_path / "speech").glob("*.npy"))) == 1
    np.testing.assert_array_equal(first, speech.speak("seven", speech.Voice("en-gb", 130, 35)))


def test_refusals():
    with pytest.raises(ValueError, match="text is empty"):
        speech.speak("  ")
    with pytest.raises(ValueError, match="at most"):
        speech.voices(10_000)
    with pytest.raises(ValueError, match="labels: 1 given for 2 texts"):
        speech.spoken_dataset(["a", "b"], speech.voices(1), labels=[0])
