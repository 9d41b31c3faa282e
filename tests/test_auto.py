"""hf_distill.auto: candidates, the latency budget, the proxy ranking, the Pareto table, the card, `hf-distill auto`."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from helpers import args, collate, teacher, token_dataset
from hub_server import POSITIVE, VOCAB_WORDS, tiny_tokenizer

from hf_distill.auto import Candidate, auto_student, candidate_grid, rank
from hf_distill.auto import search as search_module
from hf_distill.cli import main

# Four candidates of the 4-layer, 4-head, 32-wide teacher: one per way of building a student.
POOL = [Candidate("prune", 2, 2, 32, 16), Candidate("prune", 1, 4, 64, 32), Candidate("copy", 2, 4, 64, 32),
        Candidate("shrink", 1, 2, 32, 16)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: a second intra-op thread only adds hand-off cost on a busy 2-core runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(tmp_path, **kw):
    settings = dict(budget_ms=1e6, args=args(tmp_path, max_steps=2), data_collator=collate, proxy_steps=2,
                    seq_len=12, repeats=2, calibration_rows=8, candidates=POOL[:2], progress=False)
    settings.update(kw)
    return auto_student(teacher(), token_dataset(24), token_dataset(8, seed=1), **settings)


def fixed_latencies(monkeypatch, seconds: list[float]) -> None:
    """measure.latencies answering fixed numbers (teacher first), after checking it was asked for them all."""
    def fake(models, batches, repeats, on_round=None):
        assert len(models) == len(seconds) and len(batches) == 1
        return list(seconds)

    monkeypatch.setattr(search_module.measure, "latencies", fake)


def scores(values: list[float]):
    """A compute_metrics returning `values` in call order (proxy evaluations first, then the full runs')."""
    queue = iter(values)
    return lambda _prediction: {"score": next(queue)}


# ---------------------------------------------------------------------- the search space


def test_default_grid_is_the_documented_one():
    grid = candidate_grid(teacher())
    assert [c.name for c in grid] == [
        "prune_L4_H3_I48_D24", "prune_L4_H2_I32_D16", "prune_L2_H4_I64_D32", "prune_L2_H3_I48_D24",
        "prune_L2_H2_I32_D16", "prune_L1_H4_I64_D32", "prune_L1_H3_I48_D24", "prune_L1_H2_I32_D16", "copy_L2",
        "shrink_L2_H2_I32_D16"]  # depth 1 x width 1 (the teacher itself) left out


def test_custom_grid_and_its_errors():
    grid = candidate_grid(teacher(), depths=[0.5], widths=[(0.5, 0.25, 0.5)], copy_depths=[], shrink_shapes=[])
    assert [c.name for c in grid] == ["prune_L2_H2_I16_D16"]
    with pytest.raises(ValueError, match=r"hidden size follows the heads"):
        candidate_grid(teacher(), widths=[(0.5, 0.5, 1.0)])
    with pytest.raises(ValueError, match=r"depths must hold fractions of the teacher in \(0, 1\], got 2"):
        candidate_grid(teacher(), depths=[2])
    with pytest.raises(ValueError, match="every shape is the teacher's own"):
        candidate_grid(teacher(), depths=[1.0], widths=[1.0], copy_depths=[1.0], shrink_shapes=[])
    with pytest.raises(ValueError, match="kind 'wide' is not one of prune, copy, shrink"):
        Candidate("wide", 1, 1, 1, 1)


def test_candidates_build_to_their_shape():
    t = teacher()
    importance = search_module.width_importance(t, [collate(token_dataset(8).to_list())])
    for candidate in POOL:
        student = candidate.build(t, importance)
        config = student.config
        assert (config.num_hidden_layers, config.num_attention_heads, config.intermediate_size,
                config.hidden_size) == tuple(candidate.shape().values())


# ---------------------------------------------------------------------- budget and ranking


@pytest.mark.slow
def test_within_budget_is_exactly_the_candidates_below_it_and_only_they_train(tmp_path, monkeypatch):
    fixed_latencies(monkeypatch, [0.010, 0.006, 0.002, 0.0049, 0.008])  # teacher, then POOL in order
    result = run(tmp_path, candidates=POOL, budget_ms=5.0)
    rows = {r["name"]: r for r in result.rows}
    assert [r["latency_ms"] for r in result.rows] == pytest.approx([6.0, 2.0, 4.9, 8.0])
    assert {n for n, r in rows.items() if r["within_budget"]} == {"prune_L1_H4_I64_D32", "copy_L2"}
    assert {n for n, r in rows.items() if r["proxy_metric"] is not None} == {"prune_L1_H4_I64_D32", "copy_L2"}
    assert result.picked in ("prune_L1_H4_I64_D32", "copy_L2")


@pytest.mark.slow
def test_the_best_proxy_metric_is_distilled_and_picked(tmp_path, monkeypatch):
    fixed_latencies(monkeypatch, [0.010, 0.003, 0.002, 0.004])
    # proxy scores of POOL[:3] in order, then the full run's score and the teacher's
    result = run(tmp_path, candidates=POOL[:3], metric="score", compute_metrics=scores([0.2, 0.9, 0.5, 0.7, 1.0]))
    assert result.picked == "prune_L1_H4_I64_D32"
    ranked = sorted(result.rows, key=lambda r: r["proxy_rank"])
    assert [(r["name"], r["proxy_metric"]) for r in ranked] == [
        ("prune_L1_H4_I64_D32", 0.9), ("copy_L2", 0.5), ("prune_L2_H2_I32_D16", 0.2)]
    assert [r["name"] for r in result.rows if r["final_metric"] is not None] == [result.picked]  # top_n=1
    assert json.loads((result.student_dir / "config.json").read_text())["num_hidden_layers"] == 1
    assert json.loads((tmp_path / "out" / "pareto.json").read_text())["teacher"]["metric"] == 1.0


def test_rank_breaks_ties_by_latency():
    rows = [{"name": "a", "proxy_metric": 0.8, "latency_ms": 3.0}, {"name": "b", "proxy_metric": 0.8,
            "latency_ms": 2.0}, {"name": "c", "proxy_metric": None, "latency_ms": 1.0},
            {"name": "d", "proxy_metric": 0.7, "latency_ms": 1.0}]
    assert [r["name"] for r in rank(rows)] == ["b", "a", "d"]
    assert [r["name"] for r in rank(rows, greater_is_better=False)] == ["d", "b", "a"]


def test_a_budget_no_candidate_meets_names_the_fastest_and_trains_nothing(tmp_path, monkeypatch):
    fixed_latencies(monkeypatch, [0.010, 0.006, 0.0025, 0.004])

    class NoTraining:
        def __init__(self, *a, **kw):
            raise AssertionError("nothing may train before the budget is checked")

    monkeypatch.setattr(search_module, "DistillationTrainer", NoTraining)
    out = tmp_path / "out"
    with pytest.raises(ValueError) as error:
        run(tmp_path, candidates=POOL[:3], budget_ms=2.0)
    message = str(error.value)
    assert "No candidate meets the budget of 2 ms" in message
    assert "the fastest, prune_L1_H4_I64_D32, takes 2.500 ms" in message
    assert not out.exists()


def test_bad_inputs_are_refused_before_anything_is_measured(tmp_path, monkeypatch):
    """Each input auto_student cannot use is one ValueError naming it, before the teacher's units are ranked or a
    candidate is built: a bad device was a RuntimeError (an AssertionError for CUDA without one) after that work, a
    NaN budget an error about "nan ms" after timing every candidate, a streamed train set an AttributeError."""
    import datasets

    def never(*a, **kw):
        raise AssertionError("nothing may be measured before the inputs are checked")

    monkeypatch.setattr(search_module, "width_importance", never)
    monkeypatch.setattr(search_module.measure, "latencies", never)
    stream = token_dataset(24).to_iterable_dataset()
    cases = [
        (dict(budget_ms=math.nan), "budget_ms must be a positive, finite number of milliseconds, got nan"),
        (dict(budget_ms=math.inf), "budget_ms must be a positive, finite number of milliseconds, got inf"),
        (dict(device="nonsense"), "device='nonsense' is not a device name"),
        (dict(train_dataset=datasets.DatasetDict(train=token_dataset(24))),
         r"train_dataset is a DatasetDict \(splits: train\): give one split"),
        (dict(eval_dataset=datasets.DatasetDict(validation=token_dataset(8))),
         r"eval_dataset is a DatasetDict \(splits: validation\): give one split"),
        (dict(train_dataset=stream, args=args(tmp_path, max_steps=-1, num_train_epochs=1)),
         "train_dataset is an IterableDataset .*set max_steps"),
    ]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda"), "device='cuda': this machine has no such device"))
    for kw, match in cases:
        settings = dict(train_dataset=token_dataset(24), eval_dataset=token_dataset(8, seed=1))
        settings.update(kw)
        with pytest.raises(ValueError, match=match):
            run_with(tmp_path, **settings)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_streamed_train_set_is_calibrated_on_its_first_rows(tmp_path, monkeypatch):
    """An IterableDataset of training rows (with max_steps) ranks the units on the same first rows as the Dataset."""
    fixed_latencies(monkeypatch, [0.010, 0.003])
    seen, real = [], search_module.width_importance

    def spy(model, batches):
        seen.append([{k: v.clone() for k, v in b.items()} for b in batches])
        return real(model, batches)

    monkeypatch.setattr(search_module, "width_importance", spy)
    rows = token_dataset(24)
    for name, train in (("dataset", rows), ("stream", rows.to_iterable_dataset(num_shards=3))):
        result = run_with(tmp_path / name, train_dataset=train, eval_dataset=token_dataset(8, seed=1),
                          candidates=POOL[:1], calibration_rows=10)
        assert result.rows[0]["final_metric"] is not None
    assert len(seen) == 2 and len(seen[0]) == len(seen[1]) > 1
    for a, b in zip(*seen):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run_with(tmp_path, train_dataset, eval_dataset, **kw):
    settings = dict(budget_ms=1e6, args=args(tmp_path, max_steps=2), data_collator=collate, proxy_steps=2,
                    seq_len=12, repeats=2, calibration_rows=8, candidates=POOL[:2], progress=False)
    settings.update(kw)
    return auto_student(teacher(), train_dataset, eval_dataset, **settings)


# ---------------------------------------------------------------------- what is written


@pytest.mark.slow
def test_real_measurement_table_plot_and_cards(tmp_path):
    pytest.importorskip("matplotlib")
    result = run(tmp_path, candidates=[POOL[0], POOL[3]], top_n=2)
    out = tmp_path / "out"
    assert result.student_dir == out / "student"
    assert all(math.isfinite(r["latency_ms"]) and r["latency_ms"] > 0 for r in result.rows)
    assert all(r["within_budget"] and r["final_metric"] is not None for r in result.rows)
    picked = next(r for r in result.rows if r["picked"])
    other = next(r for r in result.rows if not r["picked"])
    assert result.picked == picked["name"] and (out / other["name"] / "config.json").is_file()
    assert not (out / picked["name"]).exists()  # moved to student/

    data = json.loads((out / "pareto.json").read_text())
    assert data["budget_ms"] == 1e6 and data["picked"] == picked["name"] and data["student_dir"] == "student"
    assert data["teacher"]["latency_ms"] > 0 and data["proxy_steps"] == 2
    assert {r["name"]: r["latency_ms"] for r in data["candidates"]} == {r["name"]: r["latency_ms"]
                                                                       for r in result.rows}
    table = (out / "pareto.md").read_text()
    assert "# Students within 1e+06 ms" in table
    assert f"| {picked['name']} |" in table and f"{picked['latency_ms']:.3f}" in table and "**yes**" in table
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    card = (out / "student" / "README.md").read_text()
    assert "## How the shape was chosen" in card
    assert "latency budget of **1e+06 ms**" in card and f"takes **{picked['latency_ms']:.3f} ms**" in card
    assert f"`{picked['name']}`" in card and "as the most accurate" in card
    assert f"| {picked['name']} (this model) |" in card
    pruned = (out / "student" if picked["kind"] == "prune" else out / other["name"]) / "README.md"
    assert "width pruning of the teacher (4 layers, 4 heads" in pruned.read_text()
    assert "muralidharan2024minitron" in pruned.read_text()
    other_card = (out / other["name"] / "README.md").read_text()
    assert "number 1 by the proxy" in other_card or "number 2 by the proxy" in other_card


def test_a_non_empty_output_dir_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        run(tmp_path)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------- the command line


@pytest.fixture(scope="module")
def saved_teacher(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny BERT teacher folder with its tokenizer, and a TSV of labelled sentences."""
    from transformers import BertForSequenceClassification

    root = tmp_path_factory.mktemp("auto_cli")
    tokenizer = tiny_tokenizer(root / "tokenizer")
    model = teacher()
    model.resize_token_embeddings(tokenizer.vocab_size)
    model.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    assert isinstance(BertForSequenceClassification.from_pretrained(root / "teacher"), BertForSequenceClassification)
    rng = random.Random(0)
    lines = ["sentence\tlabel"]
    for _ in range(24):
        words = rng.choices(VOCAB_WORDS, k=rng.randint(3, 7))
        lines.append(f"{' '.join(words)}\t{int(any(w in POSITIVE for w in words))}")
    (root / "rows.tsv").write_text("\n".join(lines) + "\n")
    return root / "teacher", root / "rows.tsv"


def cli_args(saved_teacher, out: Path, budget: str = "1e6") -> list[str]:
    folder, rows = saved_teacher
    return ["auto", str(folder), "--budget_ms", budget, "--output_dir", str(out), "--train_file", str(rows),
            "--validation_file", str(rows), "--max_length", "16", "--max_steps", "2", "--proxy_steps", "2",
            "--per_device_train_batch_size", "8", "--depths", "0.5", "--widths", "0.5", "--copy_depths", "",
            "--shrink", "0.25x0.5", "--repeats", "2", "--calibration_rows", "8", "--no_progress"]


@pytest.mark.slow
def test_cli_end_to_end_and_no_silent_overwrite(saved_teacher, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(cli_args(saved_teacher, out)) == 0
    printed = capsys.readouterr().out
    data = json.loads((out / "pareto.json").read_text())
    assert [r["name"] for r in data["candidates"]] == ["prune_L2_H2_I32_D16", "shrink_L1_H2_I32_D16"]
    assert f"Picked {data['picked']}" in printed and "| candidate | kind |" in printed
    assert (out / "student" / "model.safetensors").is_file() and (out / "student" / "tokenizer.json").is_file()
    assert "latency budget of **1e+06 ms**" in (out / "student" / "README.md").read_text()
    assert (out / "command.txt").read_text().startswith("hf-distill auto ")

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(cli_args(saved_teacher, out)) == 1
    assert "is not empty" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_cli_budget_error_is_one_line(saved_teacher, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(cli_args(saved_teacher, out, budget="1e-9")) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith("error: No candidate meets the budget of 1e-09 ms")
    assert "the fastest, " in err[0] and not out.exists()


def test_cli_bad_settings_are_refused_before_the_teacher_loads(saved_teacher, tmp_path, capsys, monkeypatch):
    """A bad --device or training setting is one error line before the teacher loads (without a teacher folder,
    the demo's teacher is fine-tuned first: minutes of work the error used to come after)."""
    import transformers

    loaded = []
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **kw: loaded.append(a))
    cases = [(["--device", "nonsense"], "device='nonsense' is not a device name"),
             (["--kd_loss", "bogus"], "kd_loss='bogus' is unknown"),
             (["--temperature", "0"], "temperature must be > 0")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "device='cuda': this machine has no such device"))
    for extra, message in cases:
        assert main([*cli_args(saved_teacher, tmp_path / "never"), *extra]) == 1, extra
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (extra, err)
    assert loaded == [] and not (tmp_path / "never").exists()


# ------------------------------------------------------- a teacher without a trained head (issue 39, case 3)


@pytest.mark.parametrize("checkpoint", ["base encoder", "causal LM"])
def test_cli_refuses_a_teacher_whose_classifier_would_be_random(saved_teacher, tmp_path, capsys, monkeypatch,
                                                                checkpoint):
    """A base checkpoint (a sentence model such as all-MiniLM-L6-v2) or a causal LM loads as a sequence classifier
    with a random head: distilled, saved and carded, its students would be chance-level. One error line naming the
    head's weights and the fix, before any candidate is built or timed, and no output folder."""
    from helpers import bert_config, llama
    from transformers import BertModel

    folder, rows = saved_teacher
    where = tmp_path / "teacher"
    model = BertModel(bert_config()) if checkpoint == "base encoder" else llama(vocab=64)
    model.save_pretrained(where)
    tiny_tokenizer(where)
    monkeypatch.setattr(search_module, "candidate_grid", lambda *a, **kw: pytest.fail("candidates were built"))
    monkeypatch.setattr(search_module.measure, "latencies", lambda *a, **kw: pytest.fail("latencies were measured"))
    argv = cli_args((where, rows), tmp_path / "never")
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    head = "classifier.weight" if checkpoint == "base encoder" else "score.weight"
    assert len(err) == 1 and head in err[0] and "Fine-tune the teacher" in err[0] and str(where) in err[0]
    assert not (tmp_path / "never").exists()


def test_cli_refuses_a_teacher_folder_without_tokenizer_files(saved_teacher, tmp_path, capsys, monkeypatch):
    """transformers 5 reads such a folder as an empty tokenizer (every word unknown): every candidate would have
    been distilled on [UNK] rows. One error line, before the teacher loads, and no output folder."""
    import shutil

    import transformers

    folder, rows = saved_teacher
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, bare / name)
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **kw: loaded.append(a))
    assert main(cli_args((bare, rows), tmp_path / "never")) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: The teacher {str(bare)!r} holds no tokenizer files") and err.count("\n") == 1
    assert "Give --tokenizer" in err and loaded == [] and not (tmp_path / "never").exists()


def test_cli_refuses_a_tokenizer_folder_without_tokenizer_files_before_the_demo_teacher(saved_teacher, tmp_path,
                                                                                       capsys, monkeypatch):
    """Without a teacher folder, --tokenizer is read for the demo's teacher: before, an empty folder gave
    transformers 5's empty tokenizer, and the demo's teacher was fine-tuned on [UNK] rows."""
    from hf_distill.auto import command

    bare = tmp_path / "bare"
    bare.mkdir()
    reached = []
    monkeypatch.setattr(command, "_demo_teacher", lambda *a: reached.append(a) or pytest.fail("demo teacher reached"))
    argv = cli_args(saved_teacher, tmp_path / "never")
    argv = [argv[0], *argv[2:], "--tokenizer", str(bare)]  # no teacher folder
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer {str(bare)!r} holds no tokenizer files") and err.count("\n") == 1
    assert "Give --tokenizer a folder" in err and reached == [] and not (tmp_path / "never").exists()


def test_an_in_memory_teacher_loaded_without_its_head_is_warned_about(tmp_path, monkeypatch, caplog):
    """In memory the loading report is gone: a classifier whose config still names the base checkpoint's class gets
    a warning (it may have been fine-tuned since); one built or fine-tuned and saved as a classifier gets none."""
    import logging

    from helpers import bert_config
    from transformers import BertForSequenceClassification, BertModel

    BertModel(bert_config()).save_pretrained(tmp_path / "base")
    teacher().save_pretrained(tmp_path / "fine-tuned")
    fixed_latencies(monkeypatch, [0.010, 0.006, 0.008])  # the teacher, then the two candidates

    def warned(model) -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(ValueError, match="No candidate meets the budget"):  # stops after the warning
                auto_student(model, token_dataset(24), token_dataset(8, seed=1), budget_ms=1e-6,
                             args=args(tmp_path / "out"), data_collator=collate, candidates=POOL[2:], repeats=1,
                             output_dir=tmp_path / "out", progress=False)
        return any("initialised at random" in r.getMessage() for r in caplog.records)

    assert warned(BertForSequenceClassification.from_pretrained(tmp_path / "base"))
    assert not warned(BertForSequenceClassification.from_pretrained(tmp_path / "fine-tuned"))
    assert not warned(teacher())
