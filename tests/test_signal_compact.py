"""The compact teacher-signal layout (hf_distill.data.signal_compact, format 3): its error bound against float64,
its size, and a signal in it read back and trained from like the packed one."""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from helpers import VOCAB, args, flat_params, labelled_collate, llama, sft_rows, word_tokenizer

from hf_distill import DistillationTrainer, losses
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.signal_compact import adaptive_counts, compact_spec, decode_rows, encode_rows, normalised
from hf_distill.data.signal_hub import signal_card
from hf_distill.data.signal_interop import export_topk_columns
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


def _topk_of_float64(rows: int, vocab: int, k: int, seed: int, spread: tuple[float, float]):
    """`(log_p, values, ids, tail)` of float64 log-softmaxes, rows from flat to peaked (`spread`: logit scales)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(*spread, rows, dtype=torch.float64)[:, None]
    log_p = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale).log_softmax(-1)
    values, ids = log_p.topk(k, -1)
    return log_p, values, ids, log_p.scatter(-1, ids, float("-inf")).logsumexp(-1)


@pytest.mark.parametrize(("value_bits", "step"), [(4, 0.1), (8, 0.02)])
def test_quantised_log_probs_are_within_the_stated_bound_of_float64(value_bits, step):
    _, values, ids, tail = _topk_of_float64(300, 5000, 32, 0, (0.5, 10))
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
    adaptive = compact_spec(4, 120, 8, None, epsilon=0.1)  # counts first, then ids and gaps: both read bounded
    codes = encode_rows(torch.tensor([[-0.1, -1.0, -2.0, -3.0]] * 2), torch.tensor([[1, 2, 3, 4]] * 2), [2], adaptive,
                        torch.tensor([4, 2]))
    assert decode_rows(codes, [2], adaptive)[1].tolist() == [[1, 2, 3, 4], [1, 2, -1, -1]]
    for cut in (len(codes[0]) - 1, 0):
        with pytest.raises(ValueError, match=r"Row 0 of this batch reads a damaged teacher signal \(\d+ bytes of bit "
                                             r"stream for 2 positions of \d+ bits\): its files changed"):
            decode_rows([codes[0][:cut]], [2], adaptive)


# ---------------------------------------------------------------------- adaptive k (format 4)


def test_adaptive_counts_and_tails_against_float64():
    log_p, values, ids, tail = _topk_of_float64(400, 300, 16, 1, (0.2, 8))
    counts, tails = adaptive_counts(values.float(), tail.float(), 0.1)
    cum = values.exp().cumsum(-1)
    want = torch.where(cum >= 0.9, torch.arange(1, 17, dtype=torch.float64), 17.0).amin(-1).clamp(max=16).long()
    assert torch.equal(counts, want) and (counts == 1).any() and (counts == 16).any() and (counts < 16).any()
    keep = torch.arange(16) < counts[:, None]
    exact = log_p.scatter(-1, torch.where(keep, ids, ids[:, :1]), float("-inf")).logsumexp(-1)
    torch.testing.assert_close(tails.double(), exact, atol=2e-6, rtol=1e-6)
    assert torch.equal(tails[counts == 16], tail.float()[counts == 16])  # a full row keeps its tail bit for bit


def test_adaptive_rows_encode_their_counts_and_decode_padded():
    g = torch.Generator().manual_seed(2)
    log_p = (torch.randn(60, 500, generator=g, dtype=torch.float64) * 3).log_softmax(-1)
    values, ids = log_p.topk(12, -1)
    tail = log_p.scatter(-1, ids, float("-inf")).logsumexp(-1)
    counts, _ = adaptive_counts(values.float(), tail.float(), 0.3)
    assert (counts < 12).any() and (counts == 12).any()
    fixed, adaptive = compact_spec(12, 500, 6, None), compact_spec(12, 500, 6, None, epsilon=0.3)
    assert adaptive.count_bits == 4 and adaptive.row == [12, 9, 6, fixed.value_step, 4]
    per_row = [25, 0, 35]
    codes = encode_rows(values.float(), ids, per_row, adaptive, counts)
    ends = [0, 25, 25, 60]
    for c, s, e in zip(codes, ends[:-1], ends[1:], strict=True):
        n = counts[s:e]
        assert len(c) == math.ceil((len(n) * 4 + int(n.sum()) * 9 + int((n - 1).sum()) * 6) / 8)
    rel, got = decode_rows(codes, per_row, adaptive)
    rel_fixed, got_fixed = decode_rows(encode_rows(values.float(), ids, per_row, fixed), per_row, fixed)
    keep = torch.arange(12) < counts[:, None]
    assert torch.equal(got[keep], got_fixed[keep]) and (got[~keep] == -1).all()
    assert torch.equal(rel[keep], rel_fixed[keep]) and (rel[~keep] == float("-inf")).all()


def _adaptive_signal(path, teacher, rows, **kw):
    return create_teacher_signal(teacher, rows, path, tokenizer=_tokenizer(), k=K, temperature=T, rows_per_shard=4,
                                 batch_size=3, progress=False, layout="compact", value_bits=8, **kw)


def test_an_adaptive_signal_reads_back_padded_within_its_bound(tmp_path):
    rows, teacher = sft_rows(8), llama(1)
    with torch.no_grad():  # a peaked teacher: its positions need from 1 to k ids
        teacher.lm_head.weight.mul_(50.0)
    signal = _adaptive_signal(tmp_path / "signal", teacher, rows, epsilon=0.2)
    meta = signal_metadata(signal)
    assert (meta["format"], meta["layout"], meta["epsilon"], meta["count_bits"]) == (4, "compact", 0.2, 3)
    assert ("adaptive k: each token keeps the fewest of its 8 ids whose mass reaches 1 - 0.2, its count in 3 bits; "
            f"{meta['payload_bytes_per_token']} bytes per token") in signal_card(meta)  # the Hub card states it
    with pytest.raises(ValueError, match="holds fewer at some positions: export a fixed-k signal"):
        export_topk_columns(signal, rows)  # the column format's k entries per position would be invented
    joined = attach_teacher_signal(rows, signal)
    batch = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    log_probs, ids, tail = signal_teacher(cached, batch, "labels", "labels")
    with torch.no_grad():
        z = teacher.double()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    log_p = torch.log_softmax(z / T, -1)
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    at = lambda x: x[:, :-1][mask]  # noqa: E731
    values, top = at(log_p).topk(K, -1)
    keep = at(ids) >= 0
    counts = keep.sum(-1)
    assert (counts < K).any() and (counts <= 2).any() and (counts == K).any()
    assert torch.equal(keep, torch.arange(K) < counts[:, None])  # padding after the kept entries only
    assert torch.equal(at(ids)[keep], top[keep]) and (at(log_probs)[~keep] == float("-inf")).all()
    cum = torch.cat([torch.zeros(len(values), 1, dtype=torch.float64), values.exp().cumsum(-1)], -1)
    reached = cum.gather(-1, counts[:, None])[:, 0]
    assert (reached[counts < K] >= 0.8 - 1e-6).all()  # 1 - epsilon reached (or k ids kept) ...
    assert (cum.gather(-1, counts[:, None] - 1)[:, 0] < 0.8 + 1e-6).all()  # ... by the fewest ids
    assert (at(log_probs)[keep].double() - values[keep]).abs().max() <= meta["value_step"] + 2e-3
    exact_tail = at(log_p).scatter(-1, torch.where(keep, top, top[:, :1]), float("-inf")).logsumexp(-1)
    assert (at(tail).double() - exact_tail).abs().max() <= 2e-3 * exact_tail.abs().max()  # float16


@pytest.mark.slow
def test_an_adaptive_signal_at_full_k_trains_bit_for_bit_as_the_fixed_one(tmp_path):
    """epsilon = 0 on a flat teacher keeps k ids everywhere: the same teacher rows as the fixed-k compact signal,
    and the same losses and weights after Trainer steps (torch.equal)."""
    rows, teacher = sft_rows(8), llama(1)
    fixed = _adaptive_signal(tmp_path / "fixed", teacher, rows)
    adaptive = _adaptive_signal(tmp_path / "adaptive", teacher, rows, epsilon=0.0)
    assert signal_metadata(adaptive)["format"] == 4 and signal_metadata(fixed)["format"] == 3
    runs = []
    for signal in (fixed, adaptive):
        joined = attach_teacher_signal(rows, signal)
        batch = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
        cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
        runs.append(signal_teacher(cached, batch, "labels", "labels"))
        trainer = DistillationTrainer(model=llama(0), teacher_model=None,
                                      args=args(tmp_path / f"run{len(runs)}", temperature=T, max_steps=2,
                                                per_device_train_batch_size=4, logging_steps=1),
                                      train_dataset=joined, data_collator=labelled_collate,
                                      processing_class=_tokenizer())
        trainer.train()
        runs.append(([r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r],
                     flat_params(trainer.model)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[2], strict=True))
    assert len(runs[1][0]) == 2 and runs[1][0] == runs[3][0] and torch.equal(runs[1][1], runs[3][1])


def test_adaptive_settings_are_refused_before_anything_is_written(tmp_path):
    for kw, match in ((dict(epsilon=0.1), "epsilon=0.1 \\(adaptive k\\) is a setting of the compact layout"),
                      (dict(layout="compact", epsilon=1.0), "epsilon must be a number in \\[0, 1\\)"),
                      (dict(layout="compact", epsilon=-0.1), "epsilon must be a number in \\[0, 1\\)")):
        with pytest.raises(ValueError, match=match):
            create_teacher_signal(llama(1), sft_rows(2), tmp_path / "s", tokenizer=_tokenizer(), progress=False, **kw)
        assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("kind", ["jsd"])
def test_a_step_from_an_adaptive_signal_through_the_head_equals_whole_logits(tmp_path, kind):
    """Rows of 1..k entries (padded) through the Distiller: the loss head and the whole-logits path, loss and
    gradients within 1e-5."""
    from hf_distill.distiller import Distiller

    rows, teacher = sft_rows(8), llama(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(50.0)
    joined = attach_teacher_signal(rows, _adaptive_signal(tmp_path / "signal", teacher, rows, epsilon=0.2))
    results = []
    for whole in (False, True):
        model = llama(0).train()
        run = args(tmp_path, kd_loss=kind, temperature=T, kd_weight=0.6, task_weight=0.4, kd_chunk_size=5)
        distiller = Distiller(model, run, None, processing_class=_tokenizer(), train_dataset=joined)
        if whole:
            distiller.paths.chunk = None
        loss = distiller.compute_loss(model, TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(8)]))
        loss.backward()
        results.append((float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (loss_head, grad_head), (loss_whole, grad_whole) = results
    assert loss_head == pytest.approx(loss_whole, rel=1e-5) and math.isfinite(loss_head)
    assert float((grad_head - grad_whole).norm() / grad_whole.norm()) < 1e-5
