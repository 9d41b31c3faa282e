"""Speech-recognition students: distil-whisper's "shrink" step (Gandhi et al. 2023).

distil-whisper keeps the teacher's whole encoder, copied and frozen (the encoder is most of the compute of a
forward, but runs once per utterance, while the decoder runs once per generated token: cutting decoder layers is
what speeds decoding up), and copies a few decoder layers, maximally spaced, by default the first and the last
(distil-large-v3: layers 0 and 31 of 32). :func:`whisper_student` builds that student from any Whisper teacher
through :func:`hf_distill.students.from_teacher`, so every kept weight is bit-exact and the provenance is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedModel

from .build import from_teacher

__all__ = ["check_decoder_layers", "default_decoder_layers", "whisper_student"]


def default_decoder_layers(num_teacher_layers: int, count: int = 2) -> list[int]:
    """`count` decoder layers spread evenly from the teacher's first to its last (distil-whisper: the first and
    the last for a 2-layer student)."""
    if count < 1 or count > num_teacher_layers:
        raise ValueError(f"student decoder layers: {count} asked, the teacher has {num_teacher_layers}")
    if count == 1:
        return [0]
    step = (num_teacher_layers - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})


def check_decoder_layers(layers: Sequence[int], num_teacher_layers: int) -> list[int]:
    """The student's decoder layers as a list, or a one-line ValueError when they are not a subset of the teacher's
    (an index out of range, repeated or out of order)."""
    layers = [int(i) for i in layers]
    bad = [i for i in layers if not 0 <= i < num_teacher_layers]
    if not layers or bad or len(set(layers)) != len(layers) or layers != sorted(layers):
        raise ValueError(
            f"student_decoder_layers {layers} must be a subset of the teacher's {num_teacher_layers} decoder layers: "
            f"distinct, increasing indices in 0..{num_teacher_layers - 1}"
        )
    return layers


def whisper_student(teacher: PreTrainedModel, decoder_layers: Sequence[int] | None = None,
                    freeze_encoder: bool = True) -> PreTrainedModel:
    """The teacher's whole encoder (frozen unless `freeze_encoder=False`) and its `decoder_layers` (default: the
    first and the last), copied bit-exactly; `student.config.distillation` records the kept layers and the freeze."""
    if getattr(teacher.config, "model_type", None) != "whisper":
        raise ValueError(f"whisper_student needs a Whisper teacher, got model_type {teacher.config.model_type!r}")
    depth = teacher.config.decoder_layers
    layers = check_decoder_layers(decoder_layers, depth) if decoder_layers is not None else \
        default_decoder_layers(depth)
    student = from_teacher(teacher, decoder_layers=layers)
    if freeze_encoder:
        student.model.encoder.requires_grad_(False)
    student.config.distillation = {**student.config.distillation, "frozen": ["encoder"] if freeze_encoder else []}
    return student
