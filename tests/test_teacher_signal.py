"""The offline teacher signal of a causal LM (hf_distill.data.teacher_signal): its layout, resumption, metadata
checks, and training from it with the loss of the online teacher's top-k + tail."""

from __future__ import annotations

import copy
import json

import datasets
import pytest
import torch
from helpers import VOCAB, args, flat_params, labelled_collate, llama, sft_rows, word_tokenizer

from hf_distill import DistillationTrainer, losses
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.teacher_signal import (
    SIGNAL_CODES,
    SIGNAL_POSITIONS,
    SIGNAL_ROW,
    SIGNAL_TAIL,
    SIGNAL_TOPK,
    SIGNAL_VALUES,
    attach_teacher_signal,
    create_teacher_signal,
    load_teacher_signal,
    pack,
    signal_metadata,
    signal_teacher,
    streamed,
    unpack,
)
from hf_distill.distiller import Distiller
from hf_distill.losses.normalise import kd_positions

K, T = 8, 2.0


def _tokenizer(prefix: str = "w"):
    return word_tokenizer([f"{prefix}{i}" for i in range(VOCAB - 2)])


def _signal(tmp_path, teacher=None, rows=None, **kw):
    settings = dict(tokenizer=_tokenizer(), k=K, temperature=T, rows_per_shard=4, batch_size=3, progress=False)
    settings.update(kw)
    return create_teacher_signal(teacher or llama(1), rows if rows is not None else sft_rows(8),
                                 tmp_path / "signal", **settings)


def _batch(joined, n=None):
    return TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(n or len(joined))])


def _online(teacher, batch, k=K, temperature=T):
    """The online teacher's top-k + tail on the batch, with the values rounded as stored (float16) and the k + 1
    outcomes renormalised, as the signal is read back."""
    with torch.no_grad():
        z = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    values, ids, tail = losses.topk_with_tail(z, k, temperature)
    both = torch.cat([values.half().float(), tail.unsqueeze(-1)], -1)
    both = both - both.logsumexp(-1, keepdim=True)
    return (both[..., :k], ids, both[..., k]), (values, ids, tail)


# ---------------------------------------------------------------------- creating it


def test_signal_rows_hold_the_counted_positions_top_k_and_tail(tmp_path):
    rows, teacher = sft_rows(8), llama(1)
    signal = _signal(tmp_path, teacher, rows)
    assert signal.features == datasets.Features({
        SIGNAL_TOPK: datasets.List(datasets.Value("uint32")), SIGNAL_TAIL: datasets.List(datasets.Value("float32")),
        SIGNAL_ROW: datasets.Value("int64"), SIGNAL_POSITIONS: datasets.Value("int64")})
    meta = signal_metadata(signal)
    assert (meta["k"], meta["temperature"], meta["layout"], meta["kd_token_mask"]) == (K, T, "packed", "labels")
    # One entry per position whose next label is learnt (the trainer's kd_positions, shifted).
    counted = [sum(1 for label in r["labels"][1:] if label != -100) for r in rows]
    assert [len(t) for t in signal[SIGNAL_TAIL]] == counted
    assert [len(t) for t in signal[SIGNAL_TOPK]] == [K * n for n in counted]
    assert meta["positions"] == sum(counted)
    batch = _batch(attach_teacher_signal(rows, signal))
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    got = signal_teacher(cached, batch, "labels", "labels")
    (want_lp, want_ids, want_tail), (raw_lp, _, raw_tail) = _online(teacher, batch)
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    at = lambda x: x[:, :-1][mask]  # noqa: E731
    assert torch.equal(at(got[1]), at(want_ids))
    torch.testing.assert_close(at(got[0]), at(want_lp), atol=1e-6, rtol=0)
    torch.testing.assert_close(at(got[2]), at(want_tail), atol=1e-6, rtol=0)
    # float16 storage: within half a float16 step of the exact values (plus the renormalisation's shift)
    assert (at(got[0]) - at(raw_lp)).abs().max() < 2e-3 * at(raw_lp).abs().max() + 1e-3
    assert not got[0][:, :-1][~mask].any() and not got[2][:, :-1][~mask].any()  # uncounted positions: zeros


def test_tail_is_exact_when_the_top_k_hold_nearly_all_the_mass(tmp_path):
    """A peaked teacher (top-8 mass ~ 1 - 1e-9): the tail is the logsumexp of the other ids, not log1p(-sum)."""
    teacher = llama(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(400.0)
    rows = sft_rows(4)
    signal = _signal(tmp_path, teacher, rows, temperature=1.0)
    batch = labelled_collate([rows[i] for i in range(4)])
    with torch.no_grad():
        z = teacher(input_ids=batch["input_ids"]).logits[:, :-1].double()
    log_p = z.log_softmax(-1)
    top = log_p.topk(K, -1).indices
    want = log_p.scatter(-1, top, float("-inf")).logsumexp(-1)
    mask = kd_positions(None, batch["labels"], "labels", causal=True)
    got = torch.cat([torch.tensor(t) for t in signal[SIGNAL_TAIL]]).double()
    assert want[mask].max() < -15  # the regime where 1 - sum(p_k) cancels in float32
    torch.testing.assert_close(got, want[mask], atol=1e-3, rtol=1e-5)


def test_packing_keeps_float16_values_and_17_bit_ids():
    ids = torch.tensor([[0, 1, 2**16, 2**17 - 1]])
    values = torch.tensor([[0.0, -0.0, -1e-4, -30.7]])
    packed, none = pack(values, ids, "packed")
    assert none is None and packed.dtype.name == "uint32"
    got_values, got_ids = unpack(torch.from_numpy(packed.astype("int64")))
    assert torch.equal(got_ids, ids)
    assert torch.equal(got_values, values.half().float())
    with pytest.raises(ValueError, match="below 2\\*\\*17"):
        pack(values, ids + 1, "packed")


def test_large_vocabulary_uses_the_split_layout(tmp_path):
    vocab = 2**17 + 8
    teacher = llama(1, vocab=vocab, layers=1)
    rows = datasets.Dataset.from_list([{"input_ids": [3, vocab - 1, 7, 9], "labels": [-100, vocab - 1, 7, 9]}])
    signal = _signal(tmp_path, teacher, rows, k=4)
    assert signal_metadata(signal)["layout"] == "split"
    assert signal.features[SIGNAL_VALUES] == datasets.List(datasets.Value("float16"))
    batch = _batch(attach_teacher_signal(rows, signal))
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    got = signal_teacher(cached, batch, "labels", "labels")
    (want_lp, want_ids, want_tail), _ = _online(teacher, {**batch, "attention_mask": torch.ones_like(
        batch["input_ids"])}, k=4)
    assert torch.equal(got[1][:, :-1][:, 1:], want_ids[:, :-1][:, 1:])
    torch.testing.assert_close(got[0][:, :-1][:, 1:], want_lp[:, :-1][:, 1:], atol=1e-6, rtol=0)


def test_bytes_per_token_at_k64(tmp_path):
    rows = datasets.Dataset.from_list([{"input_ids": list(range(5, 45)), "labels": list(range(5, 45))}] * 4)
    meta = signal_metadata(_signal(tmp_path, rows=rows, k=64, rows_per_shard=8))
    # 64 packed entries of 4 bytes and a float32 tail per token; per row: two list offsets, the row's ids hash and
    # its counted positions' hash.
    assert meta["payload_bytes_per_token"] == pytest.approx(64 * 4 + 4 + (4 + 4 + 8 + 8) / 39, abs=0.01)
    assert meta["payload_bytes_per_token"] <= 300


class _Interrupted(torch.nn.Module):
    """A teacher that counts its forwards and is interrupted at forward `stop_at` (KeyboardInterrupt)."""

    def __init__(self, inner, stop_at=None):
        super().__init__()
        self.inner, self.stop_at, self.calls = inner, stop_at, 0

    @property
    def config(self):
        return self.inner.config

    def forward(self, input_ids, attention_mask):
        self.calls += 1
        if self.calls == self.stop_at:
            raise KeyboardInterrupt
        return self.inner(input_ids=input_ids, attention_mask=attention_mask)


@pytest.mark.parametrize("layout", [None, "compact", "adaptive"])
def test_resumes_after_an_interruption(tmp_path, layout):
    rows = sft_rows(8)
    settings = dict(rows_per_shard=2, batch_size=2, layout=layout)  # one forward per shard, four shards
    if layout == "adaptive":  # the compact layout with adaptive k (format 4)
        settings.update(layout="compact", epsilon=0.5)
    with pytest.raises(KeyboardInterrupt):
        _signal(tmp_path, _Interrupted(llama(1), stop_at=3), rows, **settings)
    folder = tmp_path / "signal"
    assert sorted(p.name for p in folder.glob("shard-*.arrow")) == ["shard-00000.arrow", "shard-00001.arrow"]
    assert not json.loads((folder / "teacher_signal.json").read_text())["complete"]
    with pytest.raises(ValueError, match="incomplete"):
        load_teacher_signal(folder)
    with pytest.raises(ValueError, match=r"\(k(, count_bits)? differ"):  # adaptive k: its count width too
        _signal(tmp_path, _Interrupted(llama(1)), rows, **{**settings, "k": K + 1})
    resumed = _Interrupted(llama(1))
    signal = _signal(tmp_path, resumed, rows, **settings)
    assert resumed.calls == 2  # the two missing shards only
    fresh = create_teacher_signal(_Interrupted(llama(1)), rows, tmp_path / "fresh", tokenizer=_tokenizer(), k=K,
                                  temperature=T, progress=False, **settings)
    assert signal.to_dict() == fresh.to_dict()
    assert signal_metadata(signal)["layout"] == {"adaptive": "compact"}.get(layout, layout or "packed")


def test_metadata_survives_save_load_and_streaming(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path, rows=rows))
    joined.save_to_disk(str(tmp_path / "saved"))
    loaded = datasets.load_from_disk(str(tmp_path / "saved"))
    assert signal_metadata(loaded) == signal_metadata(joined) is not None
    stream = load_teacher_signal(tmp_path / "signal", streaming=True)
    assert isinstance(stream, datasets.IterableDataset) and signal_metadata(stream)["k"] == K
    assert [r[SIGNAL_ROW] for r in stream] == joined[SIGNAL_ROW]
    whole = load_teacher_signal(tmp_path / "signal")
    for streamed_rows, signal in ((rows, stream), (rows.to_iterable_dataset(), whole)):
        with pytest.raises(ValueError, match=r"attach_teacher_signal got a streamed (signal|rows) \(IterableDataset\)"
                                             r".*streamed\(attach_teacher_signal\(rows, signal\)\)"):
            attach_teacher_signal(streamed_rows, signal)


# ---------------------------------------------------------------------- refusing misuse


def _trainer(tmp_path, train, tokenizer=None, **kw):
    return DistillationTrainer(model=llama(0), teacher_model=None, args=args(tmp_path, **{"temperature": T, **kw}),
                               train_dataset=train, data_collator=labelled_collate,
                               processing_class=tokenizer if tokenizer is not None else _tokenizer())


def test_training_refuses_a_signal_that_does_not_fit(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path, rows=rows))
    with pytest.raises(ValueError, match="temperature 2.0, but the run's temperature is 1.0"):
        _trainer(tmp_path, joined, temperature=1.0)
    with pytest.raises(ValueError, match="another vocabulary"):
        _trainer(tmp_path, joined, tokenizer=_tokenizer("x"))
    with pytest.raises(ValueError, match="kd_token_mask='labels'"):
        _trainer(tmp_path, joined, kd_token_mask="attention")
    with pytest.raises(ValueError, match="kd_loss='mse' needs teacher logits over the whole vocabulary.*set kd_loss"):
        _trainer(tmp_path, joined, kd_loss="mse")
    changed = rows.map(lambda r, i: {"input_ids": r["input_ids"][:-1] if i == 5 else r["input_ids"]},
                       with_indices=True)
    with pytest.raises(ValueError, match="Row 5 of the rows"):
        attach_teacher_signal(changed, load_teacher_signal(tmp_path / "signal"))
    forced = datasets.concatenate_datasets([changed, load_teacher_signal(tmp_path / "signal")], axis=1)
    with pytest.raises(ValueError, match="Row 5 of the train dataset"):
        _trainer(tmp_path, forced)
    with pytest.raises(ValueError, match="other settings"):
        _signal(tmp_path, rows=sft_rows(8, seed=4))  # same folder, other rows


def test_an_output_dir_that_is_not_a_signal_is_refused_untouched(tmp_path):
    (tmp_path / "signal").mkdir()
    (tmp_path / "signal" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty and holds no teacher signal .* it holds notes.txt"):
        _signal(tmp_path)
    assert [p.name for p in (tmp_path / "signal").iterdir()] == ["notes.txt"]
    (tmp_path / "signal" / "notes.txt").unlink()
    (tmp_path / "signal").rmdir()
    (tmp_path / "signal").write_text("mine")
    with pytest.raises(ValueError, match="is a file: give a new folder"):
        _signal(tmp_path)
    assert (tmp_path / "signal").read_text() == "mine"
    with pytest.raises(ValueError, match=f"k={VOCAB + 1} exceeds the teacher's vocabulary .*choose k <= {VOCAB}"):
        _signal(tmp_path / "other", k=VOCAB + 1)


def test_bad_run_settings_are_refused_before_anything_is_written(tmp_path):
    """Each setting the teacher's run cannot honour is one error naming it, before the folder is created: a
    rows_per_shard of 0 used to write a metadata file that then refused every corrected run ("rows_per_shard
    differ"), and a float32 dtype on a bfloat16 teacher ran it in bfloat16 while recording float32."""
    rows = sft_rows(4)
    cases = [
        (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
        (dict(rows_per_shard=0), "rows_per_shard must be an integer >= 1, got 0"),
        (dict(rows_per_shard=-3), "rows_per_shard must be an integer >= 1, got -3"),
        (dict(dtype="bfloat16"), "dtype='bfloat16': use torch.bfloat16 or torch.float16"),
        (dict(dtype=torch.int8), "dtype=torch.int8: use torch.bfloat16 or torch.float16"),
        (dict(dtype=torch.float32, teacher=llama(1).to(torch.bfloat16)),
         r"dtype=torch.float32, but the teacher's weights are torch.bfloat16.*dtype=None"),
        (dict(device="meta"), "device=meta, but the teacher's weights are on cpu: move it there first"),
        (dict(rows=datasets.DatasetDict(train=rows)), r"a DatasetDict \(splits: train\): give one split"),
        (dict(rows=rows.to_iterable_dataset()), "an IterableDataset: .*give a datasets.Dataset"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _signal(tmp_path, **kw)
        assert not (tmp_path / "signal").exists(), kw
    assert signal_metadata(_signal(tmp_path, rows=rows))["rows_per_shard"] == 4  # the folder is free


# ---------------------------------------------------------------------- training from it


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["kl", "reverse_kl", "jsd", "tvd", "skew_kl", "skew_reverse_kl", "soft_ce"])
def test_kd_loss_from_the_signal_equals_the_online_top_k_and_tail(tmp_path, kind):
    rows, teacher = sft_rows(8), llama(1)
    joined = attach_teacher_signal(rows, _signal(tmp_path, teacher, rows))
    student = llama(0).train()
    run = args(tmp_path, kd_loss=kind, temperature=T, kd_weight=1.0, task_weight=0.0,
               **({"jsd_beta": 0.3} if kind == "jsd" else {}))
    distiller = Distiller(student, run, None, processing_class=_tokenizer(), train_dataset=joined)
    batch = _batch(joined)
    inputs = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
    got = distiller.compute_loss(student, batch)
    (lp, ids, tail), raw = _online(teacher, inputs)
    mask = kd_positions(inputs["attention_mask"], inputs["labels"], "labels", causal=True)
    s = student(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits[:, :-1]
    shifted = lambda t: tuple(x[:, :-1] for x in t)  # noqa: E731
    want = losses.logit_kd_loss(kind, s, shifted((lp, ids, tail)), T, mask=mask, beta=0.3)
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    exact = losses.logit_kd_loss(kind, s, shifted(raw), T, mask=mask, beta=0.3)  # no float16 rounding
    assert got.item() == pytest.approx(exact.item(), rel=2e-2)


def test_accumulated_steps_from_the_signal_equal_the_big_batch(tmp_path):
    """Two SGD steps of jsd + CE from the signal, prompts masked: GA=2 x 4 rows gives the weights of GA=1 x 8."""
    rows = sft_rows(16)
    joined = attach_teacher_signal(rows, _signal(tmp_path, rows=rows))
    runs = []
    for name, shape in (("big", dict(per_device_train_batch_size=8)),
                        ("acc", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2))):
        trainer = _trainer(tmp_path / name, joined, max_steps=2, optim="sgd", learning_rate=0.5, kd_loss="jsd",
                           kd_weight=0.6, task_weight=0.4, **shape)
        trainer.train()
        runs.append(trainer)
    torch.testing.assert_close(flat_params(runs[0].model), flat_params(runs[1].model), atol=1e-6, rtol=0)
    assert flat_params(runs[0].model).ne(flat_params(llama(0))).any()
    logged = [[r["loss_kd"] for r in t.state.log_history if "loss_kd" in r] for t in runs]
    assert len(logged[0]) == 2 and logged[0] == pytest.approx(logged[1], rel=1e-5)


@pytest.mark.parametrize("layout", [None, "compact", "adaptive"])
def test_trains_from_a_streamed_signal(tmp_path, layout):
    """Streamed rows (Python lists), one of them without a learnt token (an empty signal row); "adaptive": the
    compact layout with adaptive k (format 4), its positions padded."""
    rows = datasets.concatenate_datasets([sft_rows(7), datasets.Dataset.from_list(
        [{"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}])])
    teacher, kw = llama(1), dict(layout=layout)
    if layout == "adaptive":
        with torch.no_grad():  # a peaked teacher: its positions keep from 1 to K ids
            teacher.lm_head.weight.mul_(50.0)
        kw = dict(layout="compact", epsilon=0.2)
    joined = streamed(attach_teacher_signal(rows, _signal(tmp_path, teacher, rows=rows, **kw)), num_shards=2)
    streamed_rows = list(joined)
    last = TeacherOutputsCollator(labelled_collate)([streamed_rows[-1], streamed_rows[0]])  # [] reads as float32
    entries = SIGNAL_CODES if layout else SIGNAL_TOPK
    assert not last[entries].dtype.is_floating_point and last[SIGNAL_TAIL][0].isnan().all()
    trainer = _trainer(tmp_path, joined, max_steps=2, per_device_train_batch_size=4)
    trainer.train()
    assert [r for r in trainer.state.log_history if "loss_kd" in r]


def test_bf16_teacher_forwards(tmp_path):
    """dtype=torch.bfloat16 runs the teacher under autocast (CPU here): the same positions, and tails within bf16's
    rounding of a float64 forward of the same teacher on the same rows, where the float32 signal is far closer (so
    the bf16 one did run in bf16)."""
    rows, teacher = sft_rows(4), llama(1)
    exact = _signal(tmp_path / "fp32", teacher, rows)
    half = _signal(tmp_path / "bf16", teacher, rows, dtype=torch.bfloat16)
    assert signal_metadata(half)["dtype"] == "torch.bfloat16"
    assert [len(t) for t in half[SIGNAL_TAIL]] == [len(t) for t in exact[SIGNAL_TAIL]]
    batch = labelled_collate([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        z = copy.deepcopy(teacher).double()(input_ids=batch["input_ids"]).logits[:, :-1]
    log_p = (z / T).log_softmax(-1)
    want = log_p.scatter(-1, log_p.topk(K, -1).indices, float("-inf")).logsumexp(-1)
    want = want[kd_positions(None, batch["labels"], "labels", causal=True)]
    errors = [(torch.tensor(sum(s[SIGNAL_TAIL], []), dtype=torch.float64) - want).abs().max() for s in (exact, half)]
    assert errors[0] < 1e-5 and 10 * errors[0] < errors[1] < 1e-3, errors


# ---------------------------------------------------------------------- damaged files


def test_a_truncated_shard_is_refused_naming_it_and_the_same_command_repairs_it(tmp_path):
    rows = sft_rows(5)  # shards of 4 and 1 rows (the reading is layout-blind)
    signal = _signal(tmp_path, rows=rows, layout="compact").to_dict()
    shard = tmp_path / "signal" / "shard-00001.arrow"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"signal: shard-00001\.arrow cannot be read .*a truncated or damaged file: "
                                         r"download the signal again, or run the command that made it again"):
        load_teacher_signal(tmp_path / "signal")
    assert _signal(tmp_path, rows=rows, layout="compact").to_dict() == signal


def _damaged(cached: dict, layout: str | None, damage: str, row: int) -> dict:
    """The batch's signal columns with one position of `row` changed as no writer changes it."""
    cached = {key: value.clone() for key, value in cached.items()}
    if damage == "tail":
        cached[SIGNAL_TAIL][row, 0] = 0.5  # a tail mass above 1
    elif layout is None:  # packed uint32 entries, id << 15 | the float16 bits of -log p
        first = cached[SIGNAL_TOPK][row]
        top, last = first[0].clone(), first[K - 1].clone()
        if damage == "ids":  # the last entry gets the first one's id
            first[K - 1] = (top >> 15 << 15) | (last & 0x7FFF)
        else:  # the values of the first and last entries swapped, ids kept: the least likely value first
            first[0], first[K - 1] = (top >> 15 << 15) | (last & 0x7FFF), (last >> 15 << 15) | (top & 0x7FFF)
    else:  # the compact bit stream: K ids of 7 bits, then K - 1 gaps of 8 bits
        codes = cached[SIGNAL_CODES][row]
        if damage == "ids":
            codes[: (K * 7) // 8] = 0  # the first ids all 0
        else:  # the first gap set to its largest value: the next, smaller ones come out of order
            gaps = K * 7
            codes[gaps // 8] |= 0xFF >> (gaps % 8)
            codes[gaps // 8 + 1] |= (0xFF << (8 - gaps % 8)) & 0xFF
    return cached


@pytest.mark.parametrize("layout", [None, "compact"])
def test_a_batch_of_damaged_signal_bytes_is_refused_not_trained(tmp_path, layout):
    """Bytes changed after writing (neither layout has a checksum) into what no writer makes: an id repeated in a
    position's top k, log-probabilities out of their order, a tail mass above 1."""
    rows = sft_rows(4)
    batch = _batch(attach_teacher_signal(rows, _signal(tmp_path, rows=rows, layout=layout)))
    cached = {key: batch.pop(key) for key in list(batch) if key.startswith("teacher_signal")}
    signal_teacher(dict(cached), dict(batch), "labels", "labels")  # intact: read
    for damage in ("ids", "order", "tail"):
        with pytest.raises(ValueError, match=r"Row 2 of this batch reads a damaged teacher signal .*download the "
                                             "signal again.*The batch was not trained"):
            signal_teacher(_damaged(cached, layout, damage, 2), dict(batch), "labels", "labels")
