"""Real speech that ships offline: words and sentences spoken by espeak-ng (a Debian package) in several voices,
speeds and pitches, resampled to the 16 kHz that speech models expect.

Why synthesised: the audio and Whisper tests and benchmarks must run without a network, and a formant synthesiser
with varied voices gives real, varied waveforms (not noise) whose transcripts are known exactly. The clips are
cached on disk by their settings, so a second call reads WAV files instead of running espeak-ng again.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAMPLING_RATE = 16_000
# espeak-ng voices that ship with the Debian package (English variants: the texts are English).
VOICES = ("en-us", "en-gb", "en-gb-scotland", "en-us+f3", "en-gb+m3", "en-us+f2")
SPEEDS = (130, 160, 190)  # words per minute
PITCHES = (35, 50, 65)  # 0-99, espeak-ng's default is 50


def espeak_ng() -> str | None:
    """The espeak-ng executable, or None when it is not installed (callers skip or refuse, saying so)."""
    return shutil.which("espeak-ng")


def require_espeak() -> str:
    found = espeak_ng()
    if found is None:
        raise RuntimeError("espeak-ng is not installed: `apt-get install espeak-ng` (a Debian package): it makes "
                           "the offline speech data")
    return found


@dataclass(frozen=True)
class Voice:
    """One speaker setting: espeak-ng's voice name, speed (words per minute) and pitch (0-99)."""

    name: str = "en-us"
    speed: int = 160
    pitch: int = 50

    def key(self) -> str:
        return f"{self.name}-{self.speed}-{self.pitch}"


def voices(count: int, seed: int = 0) -> list[Voice]:
    """`count` distinct speaker settings drawn from the voice x speed x pitch grid (deterministic in `seed`)."""
    grid = [Voice(v, s, p) for v in VOICES for s in SPEEDS for p in PITCHES]
    if count > len(grid):
        raise ValueError(f"count={count}: at most {len(grid)} distinct voices")
    order = np.random.default_rng(seed).permutation(len(grid))
    return [grid[i] for i in order[:count]]


def _resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return audio
    from math import gcd

    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(audio, target // g, rate // g).astype(np.float32)


def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as f:
        if f.getsampwidth() != 2 or f.getnchannels() != 1:
            raise RuntimeError(f"espeak-ng wrote {f.getnchannels()} channel(s) of {8 * f.getsampwidth()} bits; "
                               "expected mono 16-bit")
        rate = f.getframerate()
        pcm = np.frombuffer(f.readframes(f.getnframes()), dtype="<i2")
    return pcm.astype(np.float32) / 32768.0, rate


def _cache_dir() -> Path:
    root = os.environ.get("HF_DISTILL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_distill")
    return Path(root) / "speech"


def speak(text: str, voice: Voice = Voice(), sampling_rate: int = SAMPLING_RATE, cache: bool = True) -> np.ndarray:
    """`text` spoken by `voice`: a float32 waveform in [-1, 1] at `sampling_rate`, leading/trailing silence trimmed."""
    if not text.strip():
        raise ValueError("text is empty: espeak-ng would return silence")
    digest = hashlib.sha256(f"{text}\0{voice.key()}\0{sampling_rate}".encode()).hexdigest()[:24]
    path = _cache_dir() / f"{digest}.npy"
    if cache and path.exists():
        return np.load(path)
    exe = require_espeak()
    done = subprocess.run([exe, "-v", voice.name, "-s", str(voice.speed), "-p", str(voice.pitch), "--stdout", text],
                          capture_output=True, timeout=60, check=False)
    if done.returncode != 0 or not done.stdout:
        raise RuntimeError(f"espeak-ng failed on {text!r} with voice {voice.key()}: {done.stderr.decode()[-300:]}")
    audio, rate = _read_wav(done.stdout)
    loud = np.flatnonzero(np.abs(audio) > 1e-3)
    if loud.size:
        audio = audio[max(loud[0] - 160, 0): loud[-1] + 160]
    audio = _resample(audio, rate, sampling_rate)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, audio)
        os.replace(tmp, path)
    return audio


def spoken_dataset(texts: Sequence[str], speakers: Sequence[Voice], labels: Sequence[int] | None = None,
                   sampling_rate: int = SAMPLING_RATE):
    """A `datasets.Dataset` with one row per (text, speaker): `audio` ({"array", "sampling_rate"}, as the Hub's
    audio datasets decode), `text`, `speaker` and, when given, `label` (one per text)."""
    from datasets import Dataset

    if labels is not None and len(labels) != len(texts):
        raise ValueError(f"labels: {len(labels)} given for {len(texts)} texts")
    rows: dict[str, list] = {"audio": [], "text": [], "speaker": []}
    if labels is not None:
        rows["label"] = []
    for i, text in enumerate(texts):
        for voice in speakers:
            rows["audio"].append({"array": speak(text, voice, sampling_rate), "sampling_rate": sampling_rate})
            rows["text"].append(text)
            rows["speaker"].append(voice.key())
            if labels is not None:
                rows["label"].append(int(labels[i]))
    return Dataset.from_dict(rows)


SPOKEN_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


def spoken_digits(speakers: int = 12, seed: int = 0, sampling_rate: int = SAMPLING_RATE):
    """Keyword spotting on the ten digit words, as in Speech Commands: `label` is the digit."""
    return spoken_dataset(SPOKEN_WORDS, voices(speakers, seed), labels=list(range(10)), sampling_rate=sampling_rate)
