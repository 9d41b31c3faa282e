"""Audio data for a teacher and a student that read different inputs: one raw clip, two feature extractors.

A wav2vec2 student and an AST teacher (or two wav2vec2 models with other sampling rates or normalisation) cannot
share `input_values`: each model's feature extractor makes its own (a normalised waveform at its sampling rate, a
log-mel spectrogram with its mel settings). `AudioTeacherCollator` reads each row's raw `audio` column (the Hub's
decoded form: `{"array", "sampling_rate"}`) and emits the student's `input_values` (and `attention_mask` where its
extractor returns one) next to the teacher's `teacher_input_values` (and `teacher_attention_mask`); the Distiller
gives the teacher its own (`teacher_own_inputs`), as the cross-tokenizer collator gives it its own tokenization.

What is refused, in one line, before any model loads (`check_audio_inputs`, run by `DistillationTrainer`):

* a clip at another sampling rate than the student's extractor (resampling silently would change what the student
  learns from; `dataset.cast_column("audio", Audio(sampling_rate=...))` is the fix); the teacher's extractor may
  have another rate, and gets the clip resampled to it (polyphase, scipy);
* the collator on a dataset whose raw `audio` column is gone (a `map` that kept only `input_values`);
* a teacher whose feature extractor differs from the student's while the batch holds one set of `input_values`.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd
from typing import Any

import numpy as np
import torch

OWN_INPUTS = ("input_values", "input_features", "pixel_values")
"""Model inputs a teacher may read in its own form, from a `teacher_<name>` batch key (its attention mask too)."""
_IRRELEVANT = {"processor_class", "feature_extractor_type", "image_processor_type", "auto_map", "_processor_class"}


def teacher_own_inputs(inputs: dict[str, Any], cached: dict[str, Any]) -> dict[str, Any]:
    """The batch the teacher reads: the student's, with each of `OWN_INPUTS` replaced by its `teacher_<name>` where
    the collator made one; the student's `attention_mask` then gives way to `teacher_attention_mask` (or to none:
    the student's mask is over the student's samples)."""
    own = {name: cached[f"teacher_{name}"] for name in OWN_INPUTS if f"teacher_{name}" in cached}
    if not own:
        return inputs
    batch = {k: v for k, v in inputs.items() if k != "attention_mask"}
    if "teacher_attention_mask" in cached:
        batch["attention_mask"] = cached["teacher_attention_mask"]
    return {**batch, **own}


def _resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return audio
    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(audio, target // g, rate // g).astype(np.float32)


def extractor_settings(extractor: Any) -> dict[str, Any]:
    """What decides a feature extractor's output: its class and settings (not its saved class names)."""
    found = extractor.to_dict() if hasattr(extractor, "to_dict") else dict(vars(extractor))
    return {"class": type(extractor).__name__, **{k: v for k, v in found.items() if k not in _IRRELEVANT}}


def differences(a: Any, b: Any) -> list[str]:
    """The settings in which two feature extractors differ, as `name a vs b` (empty when they make equal inputs)."""
    sa, sb = extractor_settings(a), extractor_settings(b)
    return [f"{k} {sa.get(k)!r} vs {sb.get(k)!r}" for k in sorted(set(sa) | set(sb))
            if not np.array_equal(np.asarray(sa.get(k), dtype=object), np.asarray(sb.get(k), dtype=object))]


class AudioTeacherCollator:
    """Batches of raw clips made into the student's inputs and, by the teacher's own feature extractor, the
    teacher's (`teacher_input_values`, `teacher_attention_mask`). `audio_column` holds `{"array", "sampling_rate"}`
    (a `datasets.Audio` column, decoded); `label_column` becomes `labels` (ints, or multi-hot float lists for a
    multi-label head). `max_length_seconds` cuts each clip (from its start) before both extractors; `extractor_kwargs`
    go to both calls (e.g. `padding="max_length", max_length=...`). Keep the audio column in the batches
    (`remove_unused_columns=False`, or the trainer keeps it: the collator names it in `dataset_columns`)."""

    def __init__(self, feature_extractor: Any, teacher_feature_extractor: Any, audio_column: str = "audio",
                 label_column: str = "label", max_length_seconds: float | None = None,
                 **extractor_kwargs: Any) -> None:
        self.feature_extractor, self.teacher_feature_extractor = feature_extractor, teacher_feature_extractor
        self.audio_column, self.label_column = audio_column, label_column
        self.max_length_seconds, self.extractor_kwargs = max_length_seconds, extractor_kwargs
        self.dataset_columns = (audio_column, label_column)

    @property
    def sampling_rate(self) -> int:
        return int(self.feature_extractor.sampling_rate)

    def check_clip(self, clip: Any, where: str = "a row") -> None:
        """Refuse a clip that is not a decoded audio dict at the student's sampling rate."""
        if not isinstance(clip, dict) or "array" not in clip or "sampling_rate" not in clip:
            raise ValueError(f"{self.audio_column}: {where} holds {type(clip).__name__}, not a decoded clip "
                             "{'array', 'sampling_rate'}: cast the column with datasets.Audio() (decode=True).")
        if int(clip["sampling_rate"]) != self.sampling_rate:
            raise ValueError(
                f"{self.audio_column}: {where} is sampled at {clip['sampling_rate']} Hz but the student's feature "
                f"extractor reads {self.sampling_rate} Hz: dataset.cast_column({self.audio_column!r}, "
                f"datasets.Audio(sampling_rate={self.sampling_rate}))."
            )

    def check_rows(self, rows: Any, which: str = "train") -> None:
        """The trainer's check at construction: the raw audio column is there, at the student's rate."""
        names = getattr(rows, "column_names", None)
        if names is not None and self.audio_column not in names:
            raise ValueError(
                f"The {which} dataset has no {self.audio_column!r} column (it has {', '.join(names)}): the raw audio "
                "is gone, so the teacher cannot get its own input_values. Keep the audio column (map without "
                f"remove_columns={self.audio_column!r}) and let AudioTeacherCollator extract both."
            )
        if names is not None and len(rows):
            self.check_clip(rows[0][self.audio_column], f"the {which} dataset's first row")

    def _inputs(self, extractor: Any, clips: Sequence[np.ndarray], rate: int) -> dict[str, torch.Tensor]:
        arrays = [_resample(np.asarray(c, dtype=np.float32), self.sampling_rate, rate) for c in clips]
        if self.max_length_seconds is not None:
            arrays = [a[: int(self.max_length_seconds * rate)] for a in arrays]
        kwargs = {"padding": True, **self.extractor_kwargs}
        out = extractor(arrays, sampling_rate=rate, return_tensors="pt", **kwargs)
        return {k: v for k, v in out.items() if k in ("input_values", "input_features", "attention_mask")}

    def __call__(self, rows: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        for row in rows:
            self.check_clip(row.get(self.audio_column), "a row")
        clips = [row[self.audio_column]["array"] for row in rows]
        batch = self._inputs(self.feature_extractor, clips, self.sampling_rate)
        teacher = self._inputs(self.teacher_feature_extractor, clips, int(self.teacher_feature_extractor.sampling_rate))
        batch.update({f"teacher_{k}": v for k, v in teacher.items()})
        if all(self.label_column in row for row in rows):
            labels = [row[self.label_column] for row in rows]
            multi = isinstance(labels[0], list | tuple | np.ndarray)
            batch["labels"] = torch.tensor(labels, dtype=torch.float32 if multi else torch.long)
        return batch


def check_audio_inputs(collator: Any, processing_class: Any, teacher_processing_class: Any, *datasets: Any,
                       teacher_model: Any = None) -> None:
    """A trainer's check at construction (before the teacher loads): an `AudioTeacherCollator` (possibly wrapped,
    `.base`) finds its raw audio column at the student's rate in each `datasets.Dataset` given; any other collator
    with a teacher feature extractor that differs from the student's is refused (the teacher would read the
    student's input_values), unless the rows carry the teacher's own `teacher_input_values`. The teacher's extractor
    is `teacher_processing_class`, else the one saved in a teacher folder (`preprocessor_config.json`)."""
    import datasets as hf_datasets

    if teacher_processing_class is None and _is_feature_extractor(processing_class):
        teacher_processing_class = _saved_extractor(teacher_model)
    base = getattr(collator, "base", collator)
    parts = [p for d in datasets if d is not None for p in (d.values() if isinstance(d, dict) else [d])]
    if isinstance(base, AudioTeacherCollator):
        for i, part in enumerate(parts):
            if isinstance(part, hf_datasets.Dataset):
                base.check_rows(part, "train" if i == 0 else "evaluation")
        return
    extractors = [e for e in (processing_class, teacher_processing_class) if _is_feature_extractor(e)]
    if len(extractors) < 2:
        return
    diff = differences(processing_class, teacher_processing_class)
    own = any(f"teacher_{n}" in (getattr(p, "column_names", None) or []) for p in parts for n in OWN_INPUTS)
    if diff and not own:
        raise ValueError(
            f"teacher_processing_class differs from the student's feature extractor ({'; '.join(diff[:3])}), so the "
            "teacher must read its own input_values from the raw audio: collate with hf_distill.data.audio."
            "AudioTeacherCollator(student_extractor, teacher_extractor) on rows that keep the audio column."
        )


def _saved_extractor(teacher_model: Any) -> Any:
    """The feature extractor saved beside a teacher given as a local folder (no model load), else None."""
    from pathlib import Path

    if not isinstance(teacher_model, str | Path) or not (Path(teacher_model) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(str(teacher_model))


def _is_feature_extractor(value: Any) -> bool:
    from transformers.feature_extraction_utils import FeatureExtractionMixin

    return isinstance(value, FeatureExtractionMixin)


__all__ = ["OWN_INPUTS", "AudioTeacherCollator", "check_audio_inputs", "differences", "teacher_own_inputs"]
