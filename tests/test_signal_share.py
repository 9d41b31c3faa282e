"""Sharing and robustness of the offline teacher signal: a Hub dataset repo with a card (a real HTTP round trip to
the local stand-in Hub, tests/hub_server.py), the `hf-distill signal` commands, processors, exact-only temperature
rescaling, streaming, and exact resume from a mid-run checkpoint."""

from __future__ import annotations

import json
import math

import datasets
import huggingface_hub.constants as hub_constants
import pytest
import torch
from helpers import VOCAB, args, flat_params, labelled_collate, llama, sft_rows, word_tokenizer
from hub_server import FakeHub, online
from huggingface_hub import DatasetCard
from signal_distributed_run import Recording
from transformers import ProcessorMixin

from hf_distill.cli import main
from hf_distill.data.collators import TeacherOutputsCollator
from hf_distill.data.signal_hub import push_teacher_signal
from hf_distill.data.signal_rescale import rescale_teacher_signal
from hf_distill.data.teacher_signal import (
    attach_teacher_signal,
    create_teacher_signal,
    load_teacher_signal,
    signal_metadata,
    signal_teacher,
    streamed,
    vocabulary_hash,
)
from hf_distill.losses.normalise import kd_positions
from hf_distill.publish.hub import HubPushError, push_folder

K, T = 8, 2.0
SIGNAL_FILES = {"README.md", "teacher_signal.json", "shard-00000.arrow", "shard-00001.arrow"}


def _tokenizer(prefix: str = "w"):
    return word_tokenizer([f"{prefix}{i}" for i in range(VOCAB - 2)])


def _signal(folder, rows=None, teacher=None, **kw):
    settings = dict(tokenizer=_tokenizer(), k=K, temperature=T, rows_per_shard=4, batch_size=4, progress=False)
    settings.update(kw)
    return create_teacher_signal(teacher or llama(1), rows if rows is not None else sft_rows(8), folder, **settings)


def _trainer(out, train, tokenizer=None, cls=Recording, **kw):
    settings = dict(temperature=T, kd_loss="jsd", jsd_beta=0.3, kd_weight=0.6, task_weight=0.4, max_steps=2,
                    per_device_train_batch_size=4)
    settings.update(kw)
    trainer = cls(model=llama(0), teacher_model=None, args=args(out, **settings), train_dataset=train,
                  data_collator=labelled_collate, processing_class=tokenizer if tokenizer is not None else _tokenizer())
    trainer.seen = []
    return trainer


def _card_table(card: str) -> dict[str, str]:
    """The card's two-column table as {field: value} (its empty header left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in card.splitlines()
            if line.startswith("| ") and not line.startswith("| |")]
    return {name: value for name, value in rows}


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    """The stand-in Hub, huggingface_hub pointed at it, downloads cached under tmp_path."""
    with FakeHub() as server:
        online(monkeypatch, server.endpoint)
        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        yield server


# ---------------------------------------------------------------------- the Hub


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, "compact", "adaptive"])
def test_push_publishes_the_signal_with_its_card_and_loads_back_by_repo_id(tmp_path, hub, monkeypatch, layout):
    rows = sft_rows(8)
    adaptive = dict(layout="compact", epsilon=0.5) if layout == "adaptive" else dict(layout=layout)
    signal = _signal(tmp_path / "signal", rows, **adaptive)
    (tmp_path / "signal" / ".shard-00002.arrow.123.tmp").write_bytes(b"an interrupted write")  # never published
    (tmp_path / "signal" / "notes.txt").write_text("mine")
    url = push_teacher_signal(tmp_path / "signal", "fake-org/tiny-signal", private=True)
    repo = hub.datasets["fake-org/tiny-signal"]
    assert url == f"{hub.endpoint}/datasets/fake-org/tiny-signal/commit/{repo['commits'][-1]['oid']}"
    assert "fake-org/tiny-signal" not in hub.repos and repo["private"] is True  # a dataset repo, not a model repo
    files = hub.files("fake-org/tiny-signal", repo_type="dataset")
    assert set(files) == SIGNAL_FILES
    for name, data in files.items():
        assert data == (tmp_path / "signal" / name).read_bytes(), name

    meta = signal_metadata(signal)
    card = DatasetCard(files["README.md"].decode())
    assert "teacher-signal" in card.data.tags
    assert card.data.configs == [{"config_name": "default", "data_files": [{"split": "train",
                                                                            "path": "shard-*.arrow"}]}]
    table = _card_table(card.text)
    assert table["Teacher weight fingerprint"] == f"`{meta['teacher_fingerprint']}`"
    assert table["k (ids kept per token)"] == f"{K} of {VOCAB}"
    assert table["Temperature"] == str(T) and table["kd_token_mask"] == "`labels`"
    assert table["Vocabulary hash"] == f"`{vocabulary_hash(_tokenizer())}`"
    assert table["Tokens (stored positions)"] == str(meta["positions"]) and meta["positions"] > 0
    assert table["Bytes per token"].startswith(f"{meta['bytes_per_token']} (files)")
    assert table["hf_distill version"] == meta["hf_distill"]
    # The card states the layout and its bytes per token (the compact one: its bits and step too).
    want = (f"compact (format {4 if layout == 'adaptive' else 3}): ids in 7 bits, log-probabilities quantised to 8 "
            f"bits in steps of {meta.get('value_step', 0):.4g} nats" if layout else "packed (format 2)")
    assert table["Layout"].startswith(want)
    assert ("; adaptive k: each token keeps the fewest of its" in table["Layout"]) == (layout == "adaptive")
    assert f"; {meta['payload_bytes_per_token']} bytes per token" in table["Layout"]
    assert meta["command"].startswith("create_teacher_signal(") and meta["command"] in card.text
    assert 'load_teacher_signal("fake-org/tiny-signal")' in card.text

    back = load_teacher_signal("fake-org/tiny-signal")
    assert signal_metadata(back) == meta
    assert back.to_dict() == signal.to_dict()
    stream = load_teacher_signal("fake-org/tiny-signal", streaming=True)
    assert isinstance(stream, datasets.IterableDataset) and stream.n_shards == 2 and signal_metadata(stream) == meta

    # The refusals hold for the downloaded signal, and it trains without the teacher.
    joined = attach_teacher_signal(rows, back)
    with pytest.raises(ValueError, match="temperature 2.0, but the run's temperature is 1.0"):
        _trainer(tmp_path / "t1", joined, temperature=1.0)
    with pytest.raises(ValueError, match="another vocabulary"):
        _trainer(tmp_path / "t2", joined, tokenizer=_tokenizer("x"))
    with pytest.raises(ValueError, match="Row 0 of the rows"):
        attach_teacher_signal(sft_rows(8, seed=9), back)
    trainer = _trainer(tmp_path / "t3", joined)
    trainer.train()
    assert flat_params(trainer.model).ne(flat_params(llama(0))).any()

    # Offline afterwards: read from the Hub cache, no request.
    requests = len(hub.requests)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert load_teacher_signal("fake-org/tiny-signal").to_dict() == signal.to_dict()
    assert len(hub.requests) == requests


def test_an_incomplete_signal_is_refused_before_any_request(tmp_path, hub):
    folder = tmp_path / "signal"
    _signal(folder)
    meta = json.loads((folder / "teacher_signal.json").read_text())
    (folder / "teacher_signal.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(HubPushError, match=f"Could not push {folder}: .*incomplete"):
        push_teacher_signal(folder, "fake-user/half")
    with pytest.raises(HubPushError, match="holds no teacher signal"):
        push_teacher_signal(tmp_path, "fake-user/none")
    assert hub.requests == [] and hub.datasets == {}
    assert not (folder / "README.md").exists()


def test_a_repo_that_is_not_a_signal_or_cannot_be_reached(tmp_path, hub, monkeypatch):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README.md").write_text("# just a dataset\n")
    push_folder(tmp_path / "other", "fake-user/other", None, repo_type="dataset")
    with pytest.raises(ValueError, match="holds no teacher signal"):
        load_teacher_signal("fake-user/other")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="No teacher signal folder 'fake-user/never' here, and the Hub dataset repo"):
        load_teacher_signal("fake-user/never")
    with pytest.raises(ValueError, match="holds no teacher signal"):  # a path, not a repo id: never the Hub
        load_teacher_signal(tmp_path / "missing" / "deeper" / "signal")


def test_cli_creates_and_pushes_a_signal(tmp_path, hub, capsys):
    teacher, tokenizer, rows = llama(1), _tokenizer(), sft_rows(8)
    teacher.save_pretrained(tmp_path / "teacher")
    tokenizer.save_pretrained(tmp_path / "teacher")
    rows.save_to_disk(str(tmp_path / "rows"))
    argv = ["signal", "create", str(tmp_path / "teacher"), str(tmp_path / "rows"), str(tmp_path / "signal"),
            "--k", str(K), "--temperature", str(T), "--rows_per_shard", "4", "--batch_size", "3", "--no_progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()[-1]  # deepspeed's first import may print a line before it
    signal = load_teacher_signal(tmp_path / "signal")
    meta = signal_metadata(signal)
    assert out.startswith(f"Wrote the teacher signal to {tmp_path / 'signal'}: 8 rows, {meta['positions']} tokens")
    assert meta["command"].startswith("hf-distill signal create ") and "--k 8 --temperature 2.0" in meta["command"]
    assert meta["teacher"] == "teacher"  # the local folder by its name, not the machine's absolute path
    # The same signal as the Python call on the same teacher, tokenizer and rows.
    python = _signal(tmp_path / "python", rows, teacher, batch_size=3)
    assert signal.to_dict() == python.to_dict()
    assert {k: v for k, v in meta.items() if k not in ("command", "teacher")} == {
        k: v for k, v in signal_metadata(python).items() if k not in ("command", "teacher")}

    assert main(["signal", "push", str(tmp_path / "signal"), "fake-org/cli-signal", "--endpoint", hub.endpoint,
                 "--commit_message", "first signal"]) == 0
    assert capsys.readouterr().out.startswith(f"Pushed the teacher signal {tmp_path / 'signal'} to the dataset repo")
    files = hub.files("fake-org/cli-signal", repo_type="dataset")
    assert set(files) == SIGNAL_FILES and meta["command"] in files["README.md"].decode()
    assert hub.datasets["fake-org/cli-signal"]["commits"][-1]["summary"] == "first signal"
    for name, data in files.items():  # the command and the teacher recorded without the machine's paths
        assert str(tmp_path).encode() not in data, name
    assert load_teacher_signal("fake-org/cli-signal").to_dict() == signal.to_dict()


def test_cli_signal_errors_are_one_line(tmp_path, capsys):
    assert main(["signal"]) == 2
    assert "needs an action: create or push" in capsys.readouterr().err
    assert main(["signal", "create", "t", str(tmp_path / "rows.csv"), str(tmp_path / "out")]) == 2
    assert "give a folder written by Dataset.save_to_disk" in capsys.readouterr().err
    assert main(["signal", "push", str(tmp_path), "fake-user/x"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: Could not push {tmp_path}: ") and err.count("\n") == 1


def _cli_inputs(tmp_path, capsys):
    """A saved teacher (with its tokenizer) and saved rows, as a user of `hf-distill signal create` has them."""
    llama(1).save_pretrained(tmp_path / "teacher")
    _tokenizer().save_pretrained(tmp_path / "teacher")
    sft_rows(8).save_to_disk(str(tmp_path / "rows"))
    sft_rows(8).remove_columns("labels").save_to_disk(str(tmp_path / "unlabelled"))
    capsys.readouterr()  # their progress bars
    return str(tmp_path / "teacher"), str(tmp_path / "rows")


def test_cli_signal_create_refuses_bad_settings_before_loading_the_teacher(tmp_path, capsys, monkeypatch):
    import transformers

    teacher, rows = _cli_inputs(tmp_path, capsys)
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: loaded.append(a))
    (tmp_path / "a_file").write_text("mine")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    cases = [
        ([teacher, rows, "new", "--k", str(VOCAB + 1)], 1, f"k={VOCAB + 1} exceeds the teacher's vocabulary "
                                                           f"({VOCAB} ids): choose k <= {VOCAB}"),
        ([teacher, str(tmp_path / "unlabelled"), "new"], 1, "no ['labels'] column"),
        ([teacher, rows, "new", "--temperature", "0"], 1, "temperature must be a finite number > 0"),
        ([teacher, rows, str(tmp_path / "a_file")], 1, "is a file: give a new folder"),
        ([teacher, rows, str(tmp_path / "notes")], 1, "is not empty and holds no teacher signal"),
        ([teacher, rows, "new", "--device", "not-a-device"], 2, "--device not-a-device: not a device name"),
        ([str(tmp_path / "no-teacher"), rows, "new"], 1, f"teacher {str(tmp_path / 'no-teacher')!r}: could not "
                                                         "load it"),
        ([teacher, rows, "new", "--tokenizer", str(tmp_path / "no-tok")], 1, "--tokenizer"),
        ([teacher, rows, "new", "--batch_size", "0"], 1, "batch_size must be an integer >= 1, got 0"),
        ([teacher, rows, "new", "--rows_per_shard", "0"], 1, "rows_per_shard must be an integer >= 1, got 0"),
        ([teacher, rows, "new", "--layout", "compact", "--value_bits", "0"], 1, "value_bits must be an integer in "
                                                                                "1..16, got 0"),
        ([teacher, rows, "new", "--value_bits", "4"], 2, "--value_bits 4: the compact layout's quantisation, which "
                                                         "--layout packed does not have: add --layout compact"),
        ([teacher, rows, "new", "--value_step", "0.1"], 2, "--value_step 0.1: the compact layout's"),
        ([teacher, rows, "new", "--epsilon", "0.1"], 2, "--epsilon 0.1 (adaptive k) is a setting of the compact "
                                                        "layout: add --layout compact."),
        ([teacher, rows, "new", "--layout", "compact", "--epsilon", "1.5"], 1, "epsilon must be a number in [0, 1)"),
    ]
    if not torch.cuda.is_available():
        cases.append(([teacher, rows, "new", "--device", "cuda"], 2, "--device cuda: this machine has no such device"))
    monkeypatch.chdir(tmp_path)
    for argv, code, message in cases:
        assert main(["signal", "create", "--k", "4", "--no_progress", *argv]) == code, argv  # a later --k wins
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert loaded == [] and not (tmp_path / "new").exists()
    assert (tmp_path / "a_file").read_text() == "mine" and sorted(p.name for p in (tmp_path / "notes").iterdir()) == [
        "todo.txt"]


def test_cli_signal_create_reads_the_split_it_is_given(tmp_path, capsys):
    """A saved DatasetDict: --split picks the rows, "train" by default; a missing split, or --split on a folder
    of one Dataset (where it would be ignored), is one error line naming --split, before the teacher loads."""
    teacher, rows = _cli_inputs(tmp_path, capsys)
    datasets.DatasetDict(validation=sft_rows(4), train=sft_rows(8)).save_to_disk(str(tmp_path / "splits"))
    datasets.DatasetDict(validation=sft_rows(4)).save_to_disk(str(tmp_path / "no_train"))
    sft_rows(8).to_parquet(str(tmp_path / "rows.parquet"))
    capsys.readouterr()
    base = ["signal", "create", teacher, "--k", str(K), "--temperature", str(T), "--rows_per_shard", "4",
            "--no_progress"]
    cases = [
        ([str(tmp_path / "no_train"), "out"], "has no split 'train' (splits: validation): pass --split validation"),
        ([str(tmp_path / "splits"), "out", "--split", "test"], "has no split 'test' (splits: validation, train)"),
        ([rows, "out", "--split", "validation"], "holds one Dataset, not a DatasetDict: leave --split out"),
        ([str(tmp_path / "rows.parquet"), "out", "--split", "train"], "is one file of rows, not a DatasetDict"),
    ]
    for argv, message in cases:
        assert main([*base[:3], argv[0], str(tmp_path / argv[1]), *base[3:], *argv[2:]]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "out").exists()
    for split, n in (("validation", 4), (None, 8)):
        out = tmp_path / f"signal_{split}"
        assert main([*base[:3], str(tmp_path / "splits"), str(out), *base[3:],
                     *(["--split", split] if split else [])]) == 0
        assert signal_metadata(load_teacher_signal(out))["rows"] == n


def test_cli_signal_create_interrupted_then_run_again(tmp_path, capsys, monkeypatch):
    from hf_distill.data import teacher_signal

    teacher, rows = _cli_inputs(tmp_path, capsys)
    argv = ["signal", "create", teacher, rows, str(tmp_path / "signal"), "--k", str(K), "--temperature", str(T),
            "--rows_per_shard", "4", "--batch_size", "4", "--no_progress"]
    real, calls = teacher_signal._signal_table, []

    def ctrl_c_on_the_second_batch(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(teacher_signal, "_signal_table", ctrl_c_on_the_second_batch)
    assert main(argv) == 130
    err = capsys.readouterr().err.splitlines()[-1]  # after transformers' "Loading weights" bar
    assert err.startswith(f"error: interrupted: 1 of 2 shards (4 rows each) are written in {tmp_path / 'signal'}; "
                          "run the same command again"), err
    assert main([*argv[:-1], "--batch_size", "2"]) == 0  # run again (another batch size: the same signal)
    assert len(calls) == 4  # the interrupted batch, then the second shard's two batches of 2 rows only
    signal = load_teacher_signal(tmp_path / "signal")
    monkeypatch.setattr(teacher_signal, "_signal_table", real)
    python = _signal(tmp_path / "python", sft_rows(8), llama(1))
    assert signal.to_dict() == python.to_dict()
    assert signal_metadata(signal)["command"].endswith("--batch_size 4 --no_progress")  # the command that started it
    assert main([*argv[:5], "--k", str(K + 1), "--no_progress"]) == 1
    err = capsys.readouterr().err
    assert f"k: {K} there, {K + 1} now" in err and "temperature: 2.0 there, 1.0 now" in err, err


# ---------------------------------------------------------------------- processors


class TextProcessor(ProcessorMixin):
    """A processor holding a tokenizer (as multimodal students' processing_class does)."""

    attributes = ["tokenizer"]
    tokenizer_class = "PreTrainedTokenizerFast"


def test_vocabulary_hash_and_training_take_a_processor(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows))
    assert vocabulary_hash(TextProcessor(tokenizer=_tokenizer())) == vocabulary_hash(_tokenizer())
    _trainer(tmp_path / "ok", joined, tokenizer=TextProcessor(tokenizer=_tokenizer())).train()
    with pytest.raises(ValueError, match="another vocabulary"):
        _trainer(tmp_path / "other", joined, tokenizer=TextProcessor(tokenizer=_tokenizer("x")))
    with pytest.raises(ValueError, match="or a processor holding one as .tokenizer"):
        vocabulary_hash(object())


# ---------------------------------------------------------------------- rescaling the temperature


def _signal_values(signal, rows):
    """Every stored position's (log-probabilities, ids, log tail) as read for training."""
    joined = attach_teacher_signal(rows, signal)
    batch = TeacherOutputsCollator(labelled_collate)([joined[i] for i in range(len(joined))])
    cached = {k: batch.pop(k) for k in list(batch) if k.startswith("teacher_")}
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    return tuple(x[:, :-1][mask] for x in signal_teacher(cached, batch, "labels", "labels"))


class _Masked(torch.nn.Module):
    """A teacher whose logits are -inf beyond its first `keep` ids: its top `keep` hold all the mass."""

    def __init__(self, inner, keep):
        super().__init__()
        self.inner, self.keep = inner, keep

    @property
    def config(self):
        return self.inner.config

    def forward(self, input_ids, attention_mask):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits.clone()
        logits[..., self.keep :] = float("-inf")
        return {"logits": logits}


def _sharp_teacher():
    teacher = llama(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(8.0)  # sharper: T = 2 and T = 1 differ by up to ~2 in log p here
    return teacher


@pytest.mark.slow
@pytest.mark.parametrize("k", [VOCAB, 16], ids=["k=vocabulary", "k<vocabulary,other-logits-inf"])
def test_rescaling_is_exact_when_the_signal_has_no_tail(tmp_path, k):
    """No tail mass: the signal made at T = 2, rescaled to 1, is the signal made at 1 (float16 rounding apart),
    and the trainer then takes it at temperature 1 and refuses it at 2."""
    rows, teacher = sft_rows(8), _sharp_teacher()
    teacher = teacher if k == VOCAB else _Masked(teacher, keep=k)
    hot = _signal(tmp_path / "hot", rows, teacher, k=k)
    cold = _signal(tmp_path / "cold", rows, teacher, k=k, temperature=1.0)
    rescaled = rescale_teacher_signal(hot, 1.0)
    assert signal_metadata(rescaled)["temperature"] == 1.0 and signal_metadata(rescaled)["rescaled_from"] == T
    assert rescale_teacher_signal(hot, T) is hot
    by_id = [(lp.gather(-1, ids.argsort(-1)), ids.sort(-1).values, tail)
             for lp, ids, tail in (_signal_values(s, rows) for s in (rescaled, cold, hot))]
    (got, got_ids, got_tail), (want, want_ids, want_tail), (before, _, _) = by_id
    assert torch.isneginf(got_tail).all() and torch.isneginf(want_tail).all()  # no tail, before and after
    assert torch.equal(got_ids, want_ids)
    # float16 storage: each stored value is within 2**-11 of its magnitude; rescaling by T / T' = 2 doubles the hot
    # signal's error, and the rescaled value is rounded again: within 4 * 2**-11 of |log p| (+ renormalisation).
    assert ((got - want).abs() <= 4 * 2**-11 * want.abs() + 1e-3).all()
    assert (got.exp() - want.exp()).abs().max() < 1e-3
    assert (before - want).abs().max() > 0.5  # a real change of temperature, ~50x the tolerance above
    joined = attach_teacher_signal(rows, rescaled)
    _trainer(tmp_path / "t", joined, temperature=1.0)  # accepted
    with pytest.raises(ValueError, match="made at temperature 1.0, but the run's temperature is 2.0"):
        _trainer(tmp_path / "t2", joined)
    assert rescale_teacher_signal(joined, 1.5).format["type"] == "torch"  # rows joined with it: rescaled in place
    trainer = _trainer(tmp_path / "t3", joined, temperature=1.0)
    trainer.train()
    kd = [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r]
    assert len(kd) == 2 and all(math.isfinite(v) and v > 0 for v in kd)


def test_training_from_a_signal_of_the_whole_vocabulary_is_finite(tmp_path):
    rows = sft_rows(8)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows, k=VOCAB))
    trainer = _trainer(tmp_path / "t", joined)
    trainer.train()
    kd = [r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r]
    assert len(kd) == 2 and all(math.isfinite(v) for v in kd)


def test_rescaling_a_signal_with_tail_mass_is_refused(tmp_path):
    rows = sft_rows(8)
    signal = _signal(tmp_path / "signal", rows)
    n = signal_metadata(signal)["positions"]
    with pytest.raises(ValueError, match=rf"holds tail mass at {n} of {n} positions, so it cannot be rescaled from "
                                         r"temperature 2.0 to 1.0 exactly: the tail's individual logits are not"):
        rescale_teacher_signal(signal, 1.0)
    with pytest.raises(ValueError, match="not streamed"):
        rescale_teacher_signal(streamed(signal), 1.0)
    with pytest.raises(ValueError, match="rescale it with hf_distill.data.signal_rescale.rescale_teacher_signal"):
        _trainer(tmp_path / "t", attach_teacher_signal(rows, signal), temperature=1.0)
    compact = _signal(tmp_path / "compact", rows, k=VOCAB, layout="compact")  # no tail, but relative values
    with pytest.raises(ValueError, match=r"takes format 2 signals .*a compact signal \(format 3\).*create it at"):
        rescale_teacher_signal(compact, 1.0)


# ---------------------------------------------------------------------- streaming and resuming


@pytest.mark.slow
def test_a_streamed_signal_trains_the_weights_of_the_dataset(tmp_path):
    """The joined rows streamed from 2 shards train, step by step, the weights of the same rows read in order."""
    rows = sft_rows(16)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows))
    runs = {"stream": _trainer(tmp_path / "stream", streamed(joined, num_shards=2), max_steps=4),
            "dataset": _trainer(tmp_path / "dataset", joined, max_steps=4, train_sampling_strategy="sequential")}
    for trainer in runs.values():
        trainer.train()
    assert runs["stream"].seen == runs["dataset"].seen and len(runs["stream"].seen) == 4
    assert runs["stream"].seen[0] == [rows[i]["input_ids"] for i in range(4)]
    torch.testing.assert_close(flat_params(runs["stream"].model), flat_params(runs["dataset"].model), atol=1e-6,
                               rtol=0)
    assert flat_params(runs["stream"].model).ne(flat_params(llama(0))).any()


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "layout"), [("dataset", None), ("stream", None), ("stream", "compact")])
def test_resuming_from_a_mid_checkpoint_gives_the_uninterrupted_weights(tmp_path, mode, layout):
    """6 AdamW steps over 16 rows (1.5 epochs: a reshuffle or a second pass inside), checkpoints every 2; resumed
    from checkpoint-2 in a new trainer, the same rows at steps 3-6 and the same final weights."""
    rows = sft_rows(16)
    joined = attach_teacher_signal(rows, _signal(tmp_path / "signal", rows, layout=layout))
    data = (lambda: streamed(joined, num_shards=2)) if mode == "stream" else (lambda: joined)  # noqa: E731
    settings = dict(max_steps=6, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    full = _trainer(tmp_path / "full", data(), **settings)
    full.train()
    resumed = _trainer(tmp_path / "resumed", data(), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    assert resumed.state.global_step == 6 and len(resumed.seen) == 4  # steps 3..6 only
    assert resumed.seen == full.seen[2:]
    if mode == "dataset":
        assert sorted(map(tuple, sum(full.seen[:4], []))) == sorted(tuple(r) for r in rows["input_ids"])  # 1 epoch
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    logged = [{k: v for k, v in r.items() if k.startswith("loss")} for r in resumed.state.log_history if "loss" in r]
    want = [{k: v for k, v in r.items() if k.startswith("loss")} for r in full.state.log_history if "loss" in r]
    assert len(logged) == len(want) == 6  # steps 1-2 come back from the checkpoint
    for got, expected in zip(logged[2:], want[2:], strict=True):
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-5), key
