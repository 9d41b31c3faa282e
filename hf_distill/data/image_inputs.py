"""Each model sees its own image input (issue #43 item 3).

A teacher fine-tuned at 224 pixels with ImageNet's mean and std and a student trained at 160 with (0.5, 0.5) do not
read the same `pixel_values`: giving the teacher the student's tensor silently distils from a teacher that sees a
wrong image. Three cases, decided once from the two image processors (the trainer's `processing_class` and
`teacher_processing_class`, or the processor saved with a teacher given by folder or Hub id):

* the same processing: the teacher reads the student's `pixel_values`;
* only the pixel scale differs (`image_mean`, `image_std`, `rescale_factor`, `do_rescale`, `do_normalize`): the
  teacher's tensor is the student's mapped back to raw pixels and normalised the teacher's way, on the fly (timm's
  rule for a teacher with other mean/std; the map is affine, so nothing is lost);
* anything else (size, crop, resampling, ...): the teacher needs its own tensor made from the raw image, which
  `ImageProcessorsCollator` makes as `teacher_pixel_values` next to the student's, as the cross-tokenizer collator
  tokenizes each row twice. Without it (the raw images are gone by the time a batch is built) the run is refused
  before any training.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.utils import logging

from ..base.batch_keys import TEACHER_PREFIX

logger = logging.get_logger(__name__)

PIXELS = "pixel_values"
TEACHER_PIXELS = f"{TEACHER_PREFIX}{PIXELS}"
SCALE_FIELDS = ("image_mean", "image_std", "rescale_factor", "do_rescale", "do_normalize")
"""The processor fields a pixel-wise affine map can make up for (re-normalised on the fly)."""
IGNORED_FIELDS = ("image_processor_type", "processor_class", "_processor_class", "auto_map")
SAME, SCALE, OTHER = "same", "scale", "other"


def processor_fields(processor: Any) -> dict[str, Any]:
    """The settings of an image processor (its `to_dict`), without the fields that name its class."""
    values = processor.to_dict() if hasattr(processor, "to_dict") else dict(vars(processor))
    return {k: v for k, v in values.items() if k not in IGNORED_FIELDS}


def compare(student: Any, teacher: Any) -> tuple[str, list[str]]:
    """SAME, SCALE (only `SCALE_FIELDS` differ) or OTHER, with the fields that differ."""
    s, t = processor_fields(student), processor_fields(teacher)
    differ = sorted(k for k in set(s) | set(t) if s.get(k) != t.get(k))
    if not differ:
        return SAME, []
    return (SCALE if all(k in SCALE_FIELDS for k in differ) else OTHER), differ


def _affine(processor: Any, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(a, b) with pixel_values = a * raw + b per channel, raw being the image's 0..255 values."""
    scale = float(processor.rescale_factor) if getattr(processor, "do_rescale", True) else 1.0
    if getattr(processor, "do_normalize", True):
        mean = torch.as_tensor(processor.image_mean, dtype=torch.float64).flatten()
        std = torch.as_tensor(processor.image_std, dtype=torch.float64).flatten()
    else:
        mean, std = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    mean, std = mean.expand(channels) if mean.numel() == 1 else mean, std.expand(channels) if std.numel() == 1 else std
    return (scale / std).view(-1, 1, 1), (-mean / std).view(-1, 1, 1)


def renormalise(pixels: torch.Tensor, student: Any, teacher: Any) -> torch.Tensor:
    """The student's `pixel_values` as the teacher's processor would have normalised the same image."""
    channels = pixels.shape[-3]
    a_s, b_s = _affine(student, channels)
    a_t, b_t = _affine(teacher, channels)
    a, b = a_t / a_s, b_t - a_t * b_s / a_s  # raw = (x - b_s) / a_s; teacher = a_t * raw + b_t
    return (pixels.double() * a + b).to(pixels.dtype)


class ImageProcessorsCollator:
    """Process each row's raw image twice, with the student's and the teacher's image processors.

    Output: `pixel_values` (the student's), `teacher_pixel_values` (the teacher's; left out when both processors
    process alike) and `labels` from `label_column` (ints, or lists of 0/1 for multi-label: floats). Give it as
    `data_collator` with `remove_unused_columns=False` (the distillation trainers keep `dataset_columns` anyway).
    `transform` (optional) is applied to each raw image first, for both models alike (augmentation)."""

    def __init__(self, image_processor: Any, teacher_image_processor: Any, image_column: str = "image",
                 label_column: str = "label", transform: Any = None) -> None:
        for name, proc in (("image_processor", image_processor), ("teacher_image_processor", teacher_image_processor)):
            if not callable(proc):
                raise TypeError(f"ImageProcessorsCollator.{name} must be an image processor, got "
                                f"{type(proc).__name__}.")
        self.image_processor, self.teacher_image_processor = image_processor, teacher_image_processor
        self.image_column, self.label_column, self.transform = image_column, label_column, transform
        self.kind, _ = compare(image_processor, teacher_image_processor)

    @property
    def dataset_columns(self) -> tuple[str, ...]:
        return (self.image_column, self.label_column)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.image_column not in rows[0]:
            raise ValueError(f"ImageProcessorsCollator reads the raw image from column {self.image_column!r}, but the "
                             f"rows have {sorted(rows[0])}: set image_column, and remove_unused_columns=False.")
        images = [row[self.image_column] for row in rows]
        if self.transform is not None:
            images = [self.transform(image) for image in images]
        batch = {PIXELS: self.image_processor(images, return_tensors="pt")[PIXELS]}
        if self.kind != SAME:
            batch[TEACHER_PIXELS] = self.teacher_image_processor(images, return_tensors="pt")[PIXELS]
        if self.label_column in rows[0]:
            labels = [row[self.label_column] for row in rows]
            multi = isinstance(labels[0], list | tuple)
            batch["labels"] = torch.tensor(labels, dtype=torch.float32 if multi else torch.long)
        return batch


def saved_processor(source: Any) -> Any:
    """The image processor saved with a teacher given by folder or Hub id (None when there is none)."""
    if not isinstance(source, str | os.PathLike):
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(source))
    except (OSError, ValueError, KeyError):
        return None


class TeacherImages:
    """What `pixel_values` the teacher reads (see the module's docstring); `kind` is SAME, SCALE or OTHER."""

    def __init__(self, student_processor: Any = None, teacher_processor: Any = None) -> None:
        self.student_processor, self.teacher_processor = student_processor, teacher_processor
        known = student_processor is not None and teacher_processor is not None
        self.kind, self.fields = compare(student_processor, teacher_processor) if known else (SAME, [])

    @classmethod
    def for_run(cls, student: Any, processing_class: Any, teacher_processing_class: Any, teacher: Any,
                collator: Any = None, n_teachers: int = 1) -> TeacherImages | None:
        """The rule of a run whose student reads `pixel_values` (None for other students), refused before training
        when the teacher needs its own processing of the raw images and `collator` (when known) does not make it."""
        if getattr(student, "main_input_name", None) != PIXELS:
            return None
        teacher_processing_class = teacher_processing_class or saved_processor(teacher)
        if teacher_processing_class is None or not hasattr(processing_class, "to_dict"):
            return cls()
        rule = cls(processing_class, teacher_processing_class)
        if rule.kind != SAME and n_teachers > 1:
            raise ValueError(f"The teacher's image processor differs from the student's ({', '.join(rule.fields)}); "
                             "with several teachers each would need its own pixel_values: distil from one teacher.")
        base = getattr(collator, "base", collator)
        if rule.kind == OTHER and collator is not None and not isinstance(base, ImageProcessorsCollator):
            raise ValueError(rule.refusal())
        return rule

    def refusal(self) -> str:
        return (f"The teacher's image processor differs from the student's in {', '.join(self.fields)}, and the "
                "batch holds only the student's pixel_values (the raw images are gone): use "
                "hf_distill.data.image_inputs.ImageProcessorsCollator(student_processor, teacher_processor) as "
                "data_collator with remove_unused_columns=False, so the teacher gets its own teacher_pixel_values.")

    def teacher_inputs(self, inputs: dict[str, Any], cached: dict[str, Any]) -> dict[str, Any]:
        """The batch the teacher reads: its own `teacher_pixel_values` when the batch has them, else the student's
        re-normalised (SCALE) or as they are (SAME); OTHER without them is refused."""
        own = cached.get(TEACHER_PIXELS)
        if own is not None:
            return {**inputs, PIXELS: own.to(inputs[PIXELS].device) if PIXELS in inputs else own}
        if self.kind == OTHER:
            raise ValueError(self.refusal())
        if self.kind == SCALE and PIXELS in inputs:
            return {**inputs, PIXELS: renormalise(inputs[PIXELS], self.student_processor, self.teacher_processor)}
        return inputs


__all__ = ["PIXELS", "SCALE_FIELDS", "TEACHER_PIXELS", "ImageProcessorsCollator", "TeacherImages", "compare",
           "renormalise", "saved_processor"]
