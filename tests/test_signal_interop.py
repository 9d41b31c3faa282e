"""Teacher signals in other tools' formats (hf_distill.data.signal_interop): the `(topk_ids, topk_logprobs)` columns
and DistillKit's compressed parquet files, each built here by the test to the format's documented schema (not by this
package), read into a signal and trained from without a teacher; the refusals of data that lacks what a signal needs;
the columns written on request and read back."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from helpers import VOCAB, args, labelled_collate, llama, sft_rows, word_tokenizer

from hf_distill import DistillationTrainer
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.signal_interop import export_topk_columns, import_distillkit, import_topk_columns
from hf_distill.data.teacher_signal import attach_teacher_signal, create_teacher_signal, signal_metadata, signal_teacher
from hf_distill.losses.normalise import kd_positions

K, T = 6, 2.0


def _tokenizer(prefix="w"):
    return word_tokenizer([f"{prefix}{i}" for i in range(VOCAB - 2)])


def _teacher_topk(teacher, rows, k=K):
    """Per row, the teacher's top-k ids and log-probabilities at T at its n - 1 next-token positions (float64)."""
    out = []
    with torch.no_grad():
        for r in rows:
            z = teacher(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1].double()
            values, ids = (z / T).log_softmax(-1).topk(k, -1)
            out.append((ids, values))
    return out


def _columns(rows, topk):
    """The column format (axolotl / verl): input_ids, topk_ids and topk_logprobs per next-token position."""
    import datasets

    return datasets.Dataset.from_dict({"input_ids": rows["input_ids"],
                                       "topk_ids": [ids.tolist() for ids, _ in topk],
                                       "topk_logprobs": [v.float().tolist() for _, v in topk]})


def _read(signal, rows):
    joined = attach_teacher_signal(rows, signal)
    batch = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    return [x[:, :-1][mask] for x in signal_teacher(cached, batch, "labels", "labels")], batch, mask


def _expected(topk, batch, mask):
    ids = torch.zeros(*mask.shape, K, dtype=torch.long)
    values = torch.zeros(*mask.shape, K, dtype=torch.float64)
    for i, (top, v) in enumerate(topk):
        ids[i, : len(top)], values[i, : len(top)] = top, v
    tail = torch.log1p(-values.exp().sum(-1).clamp(max=1))
    return ids[mask], values[mask], tail[mask]


def test_topk_columns_are_read_and_trained_from_without_a_teacher(tmp_path):
    rows, teacher = sft_rows(8), llama(1)
    topk = _teacher_topk(teacher, rows)
    signal = import_topk_columns(_columns(rows, topk), rows, tmp_path / "signal", tokenizer=_tokenizer(),
                                 temperature=T)
    meta = signal_metadata(signal)
    assert (meta["k"], meta["temperature"], meta["imported_from"]) == (K, T, "topk columns")
    (lp, ids, tail), batch, mask = _read(signal, rows)
    want_ids, want_lp, want_tail = _expected(topk, batch, mask)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(lp.double(), want_lp, atol=2e-3, rtol=0)  # float16 storage, renormalised
    torch.testing.assert_close(tail.double(), want_tail, atol=1e-4, rtol=1e-4)
    trainer = DistillationTrainer(model=llama(0), teacher_model=None, train_dataset=attach_teacher_signal(rows, signal),
                                  data_collator=labelled_collate, processing_class=_tokenizer(),
                                  args=args(tmp_path, temperature=T, max_steps=1, per_device_train_batch_size=8))
    trainer.train()
    assert [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r]


def test_data_that_lacks_what_a_signal_needs_is_refused_in_one_line(tmp_path):
    rows, teacher = sft_rows(4), llama(1)
    topk = _teacher_topk(teacher, rows)
    data = _columns(rows, topk)
    out = tmp_path / "signal"
    cases = [
        (dict(), "records no temperature: pass temperature="),
        (dict(temperature=T, data=data.remove_columns("topk_logprobs")), r"lacks \['topk_logprobs'\]"),
        (dict(temperature=T, data=data.map(lambda r, i: {"topk_ids": [[p[0] + (VOCAB if i == 3 else 0), *p[1:]]
                                                                        for p in r["topk_ids"]]}, with_indices=True)),
         f"Row 3 of the topk columns data holds id .*, outside the tokenizer's vocabulary of {VOCAB} ids: it was "
         "made with another vocabulary"),
        (dict(temperature=T, data=data.map(lambda r, i: {"topk_ids": r["topk_ids"][:-1] if i == 2 else r["topk_ids"],
                                                           "topk_logprobs": r["topk_logprobs"][:-1] if i == 2
                                                           else r["topk_logprobs"]}, with_indices=True)),
         "Row 2 of the topk columns data holds .* positions, but its .* tokens have .*: the positions do not match"),
        (dict(temperature=T, rows=rows.map(lambda r, i: {"input_ids": r["input_ids"][::-1] if i == 1
                                                          else r["input_ids"]}, with_indices=True)),
         "Row 1 of the training rows is not the topk columns data's row 1"),
    ]
    for kw, match in cases:
        given = {"data": data, "rows": rows, "tokenizer": _tokenizer(), **kw}
        with pytest.raises(ValueError, match=match):
            import_topk_columns(given.pop("data"), given.pop("rows"), out, **given)
        assert not out.exists(), kw


def test_columns_written_on_request_are_read_back_with_their_temperature(tmp_path):
    rows, teacher = sft_rows(6), llama(1)
    signal = create_teacher_signal(teacher, rows, tmp_path / "made", tokenizer=_tokenizer(), k=K, temperature=T,
                                   progress=False, layout="compact")
    exported = export_topk_columns(signal, rows)
    assert exported.column_names == ["input_ids", "topk_ids", "topk_logprobs"]
    assert [len(p) for p in exported["topk_ids"]] == [len(r) - 1 for r in rows["input_ids"]]
    back = import_topk_columns(exported, rows, tmp_path / "back", tokenizer=_tokenizer())  # temperature recorded
    assert signal_metadata(back)["temperature"] == T
    (lp, ids, _), _, _ = _read(signal, rows)
    (lp2, ids2, _), _, _ = _read(back, rows)
    assert torch.equal(ids, ids2)
    torch.testing.assert_close(lp, lp2, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="another vocabulary"):
        import_topk_columns(exported, rows, tmp_path / "other", tokenizer=_tokenizer("x"))
    before = (tmp_path / "back" / "shard-00000.arrow").read_bytes()
    with pytest.raises(ValueError, match="already holds a teacher signal: choose a new output_dir"):
        import_topk_columns(exported, rows, tmp_path / "back", tokenizer=_tokenizer())
    assert (tmp_path / "back" / "shard-00000.arrow").read_bytes() == before


# ------------------------------------------------------------------ DistillKit, built to its documented schema


def _bits(values, width):
    """MSB-first bit packing, zero-padded to a byte (DistillKit's bitpack.pack_to_bytes, as documented)."""
    bits = [(int(v) >> s) & 1 for v in values for s in range(width - 1, -1, -1)]
    bits += [0] * (-len(bits) % 8)
    return [int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8)]


def _distillkit_position(ids, logprobs, cfg):
    """One position's (compressed_logprobs, bytepacked_indices): delta encoding, exact_k float32 values, a
    float32 polynomial fit of the rest at t = 0, 1, ..., one residual bin (float16 scale, 4-bit elements)."""
    deltas = np.concatenate([logprobs[:1], np.diff(logprobs)])
    exact = deltas[: cfg["exact_k"]].astype("<f4")
    rest = deltas[cfg["exact_k"] :]
    t = np.arange(len(rest), dtype=np.float64)
    x = np.stack([t**p if isinstance(p, int) else np.sqrt(t) for p in cfg["polynomial_terms"]], -1)
    coeffs = np.linalg.lstsq(x, rest, rcond=None)[0].astype("<f4")
    residual = rest - x @ coeffs.astype(np.float64)
    bits = cfg["residual_bins"][0]["element_bits"]
    scale = np.float16(max(np.abs(residual).max(), 1e-8) / 2 ** (bits - 1))
    q = np.clip(np.rint(residual / float(scale)), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) + 2 ** (bits - 1)
    raw = (exact.tobytes() + coeffs.tobytes() + np.array([scale], "<f2").tobytes() + bytes(_bits(q, bits)))
    return list(raw), _bits(ids, math.ceil(math.log2(cfg["d"])))


@pytest.mark.slow
def test_distillkit_files_are_read_and_trained_from(tmp_path):
    rows, teacher = sft_rows(6), llama(1)
    topk = _teacher_topk(teacher, rows, k=K)
    cfg = {"d": VOCAB, "k": K, "exact_k": 1, "exact_dtype": "float32", "polynomial_terms": [0, 1, 2, "sqrt"],
           "term_dtype": "float32", "delta_encoding": True, "error_diffusion": False, "normalize_t": False,
           "residual_bins": [{"scale_dtype": "float16", "element_bits": 4, "num_elements": K - 1}]}
    folder = tmp_path / "distillkit"
    folder.mkdir()
    (folder / "compression_config.yaml").write_text(yaml.safe_dump(cfg))
    encoded = [[_distillkit_position(i.numpy(), v.numpy(), cfg) for i, v in zip(ids, values, strict=True)]
               for ids, values in topk]
    schema = pa.schema([("input_ids", pa.list_(pa.uint64())), ("compressed_logprobs", pa.list_(pa.list_(pa.uint8()))),
                        ("bytepacked_indices", pa.list_(pa.list_(pa.uint8())))])
    table = pa.table({"input_ids": rows["input_ids"], "compressed_logprobs": [[p[0] for p in r] for r in encoded],
                      "bytepacked_indices": [[p[1] for p in r] for r in encoded]}, schema=schema)
    pq.write_table(table, folder / "data-00000.parquet")
    with pytest.raises(ValueError, match="records no temperature: pass temperature= .*preapplied_temperature"):
        import_distillkit(folder, rows, tmp_path / "signal", tokenizer=_tokenizer())
    with pytest.raises(ValueError, match=r"vocabulary has 60 ids \(d\), fewer than tokenizer's 120"):
        import_distillkit(folder, rows, tmp_path / "signal", tokenizer=_tokenizer(), temperature=T,
                          config={**cfg, "d": 60})
    signal = import_distillkit(folder, rows, tmp_path / "signal", tokenizer=_tokenizer(), temperature=T)
    (lp, ids, _), batch, mask = _read(signal, rows)
    want_ids, want_lp, _ = _expected(topk, batch, mask)
    # The decoded values are re-sorted (quantisation may swap near-equal neighbours): compare entries by id.
    (ids, o1), (want_ids, o2) = ids.sort(-1), want_ids.sort(-1)
    lp, want_lp = lp.gather(-1, o1), want_lp.gather(-1, o2)
    assert torch.equal(ids, want_ids)
    # 4-bit residuals of a 4-term fit, summed back through the delta encoding: within a few hundredths
    assert (lp.double() - want_lp).abs().max() < 0.05
    DistillationTrainer(model=llama(0), teacher_model=None, train_dataset=attach_teacher_signal(rows, signal),
                        data_collator=labelled_collate, processing_class=_tokenizer(),
                        args=args(tmp_path, temperature=T, max_steps=1))
