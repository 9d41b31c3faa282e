"""The compact teacher-signal layout (hf_distill.data.signal_compact, format 3): its error bound against float64,
its size, and a signal in it read back and trained from like the packed one."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from helpers import VOCAB, labelled_collate, llama, sft_rows, word_tokenizer

from hf_distill import losses
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.signal_compact import compact_spec, decode_rows, encode_rows, normalised
from hf_distill.data.teacher_signal import (
    SIGNAL_CODES,
    SIGNAL_TAIL,
    attach_teacher_signal,
    create_teacher_signal,
    signal_metadata,
    signal_teacher,
)
from hf_distill.losses.normalise import kd_positions

K, T = 8, 2.0


def _tokenizer():
    return word_tokenizer([f"w{i}" for i in range(VOCAB - 2)])


@pytest.mark.parametrize(("value_bits", "step"), [(4, 0.1), (8, 0.02)])
def test_quantised_log_probs_are_within_the_stated_bound_of_float64(value_bits, step):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 5000, generator=g, dtype=torch.float64) * torch.linspace(0.5, 10, 300,
                                                                                     dtype=torch.float64)[:, None]
    log_p = logits.log_softmax(-1)
    values, ids = log_p.topk(32, -1)
    tail = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1)
    spec = compact_spec(32, 5000, value_bits, step)
    per_row = [100, 0, 150, 50]
    codes = encode_rows(values.float(), ids, per_row, spec)
    assert [len(c) for c in codes] == [math.ceil(n * spec.record_bits / 8) for n in per_row]
    relative, got_ids = decode_rows(codes, per_row, spec)
    assert torch.equal(got_ids, ids)
    read = normalised(relative, tail.to(torch.float16)).double()
    inside = (values[:, :1] - values) <= spec.value_range
    assert not inside.all() and inside.any()  # some gaps past the range: stored as the range
    # Bound: step/2 per gap, the same again for the renormalisation, plus the tail's float16 rounding.
    tail_error = (torch.log(-torch.expm1(tail.to(torch.float16).double())) - torch.log(-torch.expm1(tail))).abs()
    bound = spec.value_step + tail_error[:, None] + 1e-6
    renorm = (read - values).abs()
    at_range = (values[:, :1] - values).clamp(max=spec.value_range)
    whole = inside.all(-1)  # positions whose every gap lies within the range
    assert whole.any() and not whole.all()
    assert (renorm[whole] <= bound[whole]).all()
    # Past the range the gap reads as the range itself (within step/2): an id exp(-range) below the top one.
    gaps = relative.double().neg()
    assert ((gaps - at_range).abs() <= spec.value_step / 2 + 1e-6).all()
    # The k + 1 outcomes hold all the mass.
    total = torch.cat([read, tail.to(torch.float16).double()[:, None]], -1).logsumexp(-1)
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-5, rtol=0)


def test_a_compact_signal_reads_back_within_its_bound(tmp_path):
    rows, teacher = sft_rows(8), llama(1)
    signal = create_teacher_signal(teacher, rows, tmp_path / "signal", tokenizer=_tokenizer(), k=K, temperature=T,
                                   rows_per_shard=4, batch_size=3, progress=False, layout="compact", value_bits=8)
    meta = signal_metadata(signal)
    assert (meta["format"], meta["layout"], meta["id_bits"], meta["value_bits"]) == (3, "compact", 7, 8)
    counted = [sum(1 for label in r["labels"][1:] if label != -100) for r in rows]
    assert [len(t) for t in signal[SIGNAL_TAIL]] == counted
    record = K * 7 + (K - 1) * 8  # bits per position
    assert [len(c) for c in signal[SIGNAL_CODES]] == [math.ceil(n * record / 8) for n in counted]
    joined = attach_teacher_signal(rows, signal)
    batch = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    got = signal_teacher(cached, batch, "labels", "labels")
    with torch.no_grad():
        z = teacher.double()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    values, ids, tail = losses.topk_with_tail(z, K, T)
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    at = lambda x: x[:, :-1][mask]  # noqa: E731
    assert torch.equal(at(got[1]), at(ids))
    assert (at(got[0]).double() - at(values)).abs().max() <= meta["value_step"] + 2e-3
    assert (at(got[2]).double() - at(tail)).abs().max() <= 2e-3 * at(tail).abs().max()  # float16
    # Training from it: tests/test_teacher_signal.py (streamed), test_signal_share.py (exact resume),
    # test_signal_distributed.py (DDP), all over both layouts.


def test_bytes_per_token_of_the_compact_layout(tmp_path):
    """k = 32 of a 4,096-id vocabulary at 8 bits: 32 x 12 + 31 x 8 bits and a float16 tail per token."""
    vocab = 4096
    rows = datasets.Dataset.from_list([{"input_ids": list(range(5, 45)), "labels": list(range(5, 45))}] * 4)
    tokenizer = word_tokenizer([f"w{i}" for i in range(vocab - 2)])
    signal = create_teacher_signal(llama(1, vocab=vocab, layers=1), rows, tmp_path / "s", tokenizer=tokenizer,
                                   k=32, rows_per_shard=8, progress=False, layout="compact")
    meta = signal_metadata(signal)
    per_row = 4 + 4 + 4 + 8 + 8 + 4 * 8  # list offsets of codes, tail and spec, the two hashes, the spec
    assert meta["payload_bytes_per_token"] == pytest.approx((32 * 12 + 31 * 8) / 8 + 2 + per_row / 39, abs=0.02)
    assert meta["payload_bytes_per_token"] < 100


def test_compact_settings_are_refused_before_anything_is_written(tmp_path):
    for kw, match in ((dict(layout="tiny"), "layout='tiny': use None"),
                      (dict(layout="compact", value_bits=0), "value_bits must be an integer in 1..16"),
                      (dict(layout="compact", value_step=-1.0), "value_step must be a finite number"),
                      (dict(value_bits=4), "value_bits=4 set the compact layout's quantisation, which format 2 does "
                                           "not have: add layout='compact'"),
                      (dict(value_step=0.1), "value_step=0.1 set the compact")):
        with pytest.raises(ValueError, match=match):
            create_teacher_signal(llama(1), sft_rows(2), tmp_path / "s", tokenizer=_tokenizer(), progress=False, **kw)
        assert not (tmp_path / "s").exists()


def test_a_bit_stream_shorter_than_its_positions_is_refused():
    spec = compact_spec(4, 120, 8, None)
    codes = encode_rows(torch.tensor([[-0.1, -1.0, -2.0, -3.0]]), torch.tensor([[1, 2, 3, 4]]), [1], spec)
    assert decode_rows(codes, [1], spec)[1].tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"Row 0 of this batch reads a damaged teacher signal \(5 bytes of bit "
                                         r"stream for 1 positions of 52 bits\)"):
        decode_rows([codes[0][:-2]], [1], spec)
