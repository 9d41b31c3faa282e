"""The private Trainer methods DistillationMixin overrides: each still exists in the installed transformers, with the
parameters ours expect, and each has its reason on the design page. A transformers upgrade that renames one fails
here, loudly, instead of silently skipping our override (teacher columns dropped, projections unsaved...)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import transformers
from helpers import args, bert, collate, token_dataset
from helpers import teacher as make_teacher
from transformers import Seq2SeqTrainer, Trainer

from hf_distill import DistillationTrainer
from hf_distill.compat import PRIVATE_CALLS
from hf_distill.seq2seq import DistillationSeq2SeqTrainer
from hf_distill.trainer import PRIVATE_OVERRIDES

DESIGN = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def _ours(cls: type) -> set[str]:
    """Private methods of `Trainer` that a hf_distill class in `cls`'s MRO defines."""
    return {
        name
        for klass in cls.__mro__
        if klass.__module__.startswith("hf_distill")
        for name in vars(klass)
        if name.startswith("_") and not name.startswith("__") and callable(getattr(Trainer, name, None))
    }


def test_every_private_override_still_exists_in_transformers():
    missing = [name for name in PRIVATE_OVERRIDES if not callable(getattr(Trainer, name, None))]
    assert not missing, (
        f"transformers {transformers.__version__} has no Trainer.{', '.join(missing)}: it was renamed or removed, so "
        "DistillationMixin's override is never called. Port the override (see docs/design.md) and update "
        "hf_distill.trainer.PRIVATE_OVERRIDES."
    )


def test_every_private_method_we_call_still_takes_what_we_pass():
    for name, passed in PRIVATE_CALLS.items():
        method = getattr(Trainer, name, None)
        assert callable(method), f"transformers {transformers.__version__} has no Trainer.{name} (hf_distill calls it)"
        params = list(inspect.signature(method).parameters)[1:]
        assert params[: len(passed)] == list(passed), f"Trainer.{name} now takes {params}, we pass {passed}"
    text = " ".join(DESIGN.read_text().split())
    for name in PRIVATE_CALLS:
        assert re.search(rf"`{name}` \(called\): needed because .+? checked against transformers \d+\.\d+", text), name


def test_the_list_names_every_private_override():
    assert _ours(DistillationTrainer) == set(PRIVATE_OVERRIDES)
    assert _ours(DistillationSeq2SeqTrainer) == set(PRIVATE_OVERRIDES)


def test_overrides_take_the_parameters_transformers_passes():
    for name in PRIVATE_OVERRIDES:
        theirs = inspect.signature(getattr(Trainer, name)).parameters
        ours = inspect.signature(getattr(DistillationTrainer, name)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in ours.values())
        lost = [p for p in theirs if p not in ours and not takes_any and theirs[p].kind is not theirs[p].VAR_KEYWORD]
        assert not lost, f"Trainer.{name} now takes {lost}, which DistillationMixin.{name} does not accept."
    assert issubclass(DistillationSeq2SeqTrainer, Seq2SeqTrainer)


def test_each_override_has_its_reason_on_the_design_page():
    text = DESIGN.read_text()
    section = text.split("## Trainer methods we override", 1)[1].split("\n## ", 1)[0]
    items = [" ".join(item.split()) for item in section.split("\n- ")[1:]]
    for name in PRIVATE_OVERRIDES:
        item = next((it for it in items if it.startswith(f"`{name}`")), None)
        assert item is not None, f"docs/design.md does not say why {name} is overridden"
        assert re.search(r"needed because .+ checked against transformers \d+\.\d+", item), item


def test_teacher_evaluation_patches_no_method_on_the_instance(tmp_path):
    trainer = DistillationTrainer(model=bert(layers=2), teacher_model=make_teacher(layers=2),
                                  args=args(tmp_path), eval_dataset=token_dataset(8), data_collator=collate)
    before = {k for k, v in vars(trainer).items() if callable(v)}
    seen = []
    original = type(trainer).prediction_step

    class Spy(type(trainer)):
        def prediction_step(self, *a, **kw):
            seen.append({k for k, v in vars(self).items() if callable(v)})
            return original(self, *a, **kw)

    trainer.__class__ = Spy
    metrics = trainer.evaluate_teacher()
    assert "teacher_loss" in metrics and seen
    assert all(names == before for names in seen)  # nothing set on the instance during the teacher's loop
