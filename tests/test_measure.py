"""hf_distill.publish.measure on tiny random BERTs: exact counts and sizes, sane (not timed) speeds."""

from __future__ import annotations

import math
import os
import time

import torch
from helpers import bert
from torch import nn

from hf_distill.publish import measure


def batches(n: int = 3, length: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (n, 4, length), generator=g)
    # `labels` would add a loss to the timed work and `sentence_id` is no input at all: both are dropped.
    return [
        {
            "input_ids": x,
            "attention_mask": torch.ones_like(x),
            "labels": torch.zeros(4, dtype=torch.long),
            "sentence_id": torch.arange(4),
        }
        for x in ids
    ]


def test_count_parameters_matches_a_hand_sum():
    model = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2, bias=False))
    model[0].weight.requires_grad_(False)  # frozen parameters count too
    assert measure.count_parameters(model) == 3 * 5 + 5 + 5 * 2


def test_count_parameters_of_a_bert():
    model = bert(layers=2, hidden=32, heads=4)
    assert measure.count_parameters(model) == sum(p.numel() for p in model.parameters())
    # one more layer adds exactly one layer's parameters
    layer = sum(p.numel() for p in model.bert.encoder.layer[0].parameters())
    assert measure.count_parameters(bert(layers=3)) == measure.count_parameters(model) + layer


class Recorder(nn.Module):
    """Takes only `input_ids` (an unexpected keyword would raise) and records how it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append((self.training, torch.is_grad_enabled()))
        return input_ids.float().sum()


def test_inference_seconds_passes_named_inputs_in_eval_no_grad():
    model = Recorder()
    seconds = measure.inference_seconds(model, batches(n=3), repeats=2)
    assert 0 < seconds < 60
    assert len(model.calls) == 3 * (1 + 2)  # one warm-up pass, then `repeats` timed passes
    assert set(model.calls) == {(False, False)}
    assert model.training  # the mode is put back as found


class Wrapper(nn.Module):
    """Like DDP: holds the model as `.module` and forwards *args, **kwargs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_inputs_are_those_the_wrapped_model_names():
    inner = Recorder()
    measure.inference_seconds(Wrapper(inner), batches(n=2), repeats=1)
    assert len(inner.calls) == 2 * 2


def test_inference_seconds_of_a_bert():
    assert 0 < measure.inference_seconds(bert(layers=1), batches(), repeats=2) < 60


class Sleeper(nn.Module):
    """The same tiny work as `Recorder` plus a fixed sleep per batch: a model slower by construction."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return input_ids.float().sum()


def test_speedup_is_teacher_time_over_student_time():
    """A teacher that sleeps 50 ms per batch against a student that sleeps 2 ms: the speed-up of the student is
    above 1 and the reverse pair's below 1, whatever the machine's speed (a sum of 32 ids is microseconds, so
    only a stall of ~50 ms inside a student pass in most rounds could break it). An inverted ratio fails."""
    slow, fast = Sleeper(0.05), Sleeper(0.002)
    assert measure.speedup(slow, fast, batches(n=2), repeats=3) > 1
    assert measure.speedup(fast, slow, batches(n=2), repeats=3) < 1


def test_speedup_of_berts_is_finite_and_puts_modes_back():
    teacher, student = bert(layers=4), bert(layers=1)
    ratio = measure.speedup(teacher, student, batches(n=2), repeats=2)
    assert ratio > 0 and math.isfinite(ratio)
    assert teacher.training and student.training  # fresh models train; the modes are put back


def test_speedup_interleaves_the_two_models():
    order: list[str] = []
    teacher, student = Recorder(), Recorder()
    teacher.register_forward_hook(lambda *_: order.append("t"))
    student.register_forward_hook(lambda *_: order.append("s"))
    measure.speedup(teacher, student, batches(n=1), repeats=3)
    assert "".join(order) == "ts" * 4  # warm-up round + 3 rounds, each one teacher pass then one student pass


def test_size_on_disk_counts_weight_files_only(tmp_path):
    model = bert(layers=1)
    model.save_pretrained(tmp_path)
    (tmp_path / "training_args.bin").write_bytes(b"x" * 123)  # a .bin, but no weights
    (tmp_path / "optimizer.pt").write_bytes(b"z" * 11)
    (tmp_path / "notes.txt").write_text("not weights")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "nested.safetensors").write_bytes(b"y" * 7)  # only the folder itself is counted
    expected = os.path.getsize(tmp_path / "model.safetensors")  # the one weight file from_pretrained loads
    assert (tmp_path / "model.safetensors").exists()
    assert measure.size_on_disk(tmp_path) == expected
    assert measure.size_on_disk(str(tmp_path)) == expected


def test_stored_parameters_reads_the_safetensors_headers(tmp_path):
    model = bert(layers=2)
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="20KB")
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    for folder in ("one", "shards"):
        assert measure.stored_parameters(tmp_path / folder) == measure.count_parameters(model)
    assert measure.stored_parameters(tmp_path) is None  # no weights in the folder itself
