"""The recipes run end to end on tiny models, list their options, and reject malformed configs in one line.

Each recipe runs as `python recipes/<name>.py` runs it, on a tiny BERT teacher with a WordPiece tokenizer
built from a small vocabulary, a few dozen rows of SST-2-like and sentence-pair TSVs, and a short
text corpus, all written into tmp_path: in this process (`run`: the script's `__main__`, as `hf-distill run` runs
it), or as a real subprocess (`run_subprocess`) where the test reads everything the process printed (a refusal is
one line of stderr) or is about the subprocess itself; `test_distilbert_task` trains in one, as a user runs it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from helpers import run_script

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
WORDS = ("the a movie film is was good bad great awful fun dull plot acting story it not very and but "
         "love hate boring funny sad best worst of to in this that with".split())
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NLI_TEACHER_CLASSES = ["not_entailment", "entailment"]


def _tiny_bert(folder: Path, tokenizer, layers: int, hidden: int, heads: int, seed: int, mlm: bool = False,
               class_names: list[str] | None = None) -> None:
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    torch.manual_seed(seed)
    labels = {"num_labels": 2} if class_names is None else {
        "id2label": dict(enumerate(class_names)), "label2id": {n: i for i, n in enumerate(class_names)}}
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=2 * hidden, max_position_embeddings=64, **labels)
    model = (BertForMaskedLM if mlm else BertForSequenceClassification)(cfg)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, Path]:
    """Tiny teachers (4 layers, hidden 32, 4 heads; `nli_teacher` names its classes), data files and a corpus.

    The GLUE-style files carry string labels as GLUE distributes them: RTE (index, sentence1, sentence2, label)
    and QNLI (index, question, sentence, label) with entailment / not_entailment."""
    from transformers import BertTokenizer

    tmp = tmp_path_factory.mktemp("recipes")
    (tmp / "vocab").mkdir()
    (tmp / "vocab" / "vocab.txt").write_text("\n".join(SPECIAL + WORDS) + "\n")
    # transformers 5: BertTokenizerFast(vocab_file=...) ignores the file; from_pretrained on the folder reads it.
    tok = BertTokenizer.from_pretrained(str(tmp / "vocab"))
    assert len(tok) == len(SPECIAL) + len(WORDS)
    _tiny_bert(tmp / "teacher", tok, layers=4, hidden=32, heads=4, seed=0)
    _tiny_bert(tmp / "mlm_teacher", tok, layers=4, hidden=32, heads=4, seed=0, mlm=True)
    # Not the sorted order of the names: ids taken from a sorted label set would contradict this teacher.
    _tiny_bert(tmp / "nli_teacher", tok, layers=4, hidden=32, heads=4, seed=0, class_names=NLI_TEACHER_CLASSES)
    g = torch.Generator().manual_seed(0)

    def sentence() -> str:
        n = int(torch.randint(3, 10, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)) + " "

    for name, rows in (("train", 48), ("validation", 16)):
        lines = ["sentence\tlabel"] + [f"{sentence()}\t{i % 2}" for i in range(rows)]
        (tmp / f"sst_{name}.tsv").write_text("\n".join(lines) + "\n")
        pair = ["sentence1\tsentence2\tlabel"] + [f"{sentence()}\t{sentence()}\t{i % 2}" for i in range(rows)]
        (tmp / f"pair_{name}.tsv").write_text("\n".join(pair) + "\n")
        nli = ("entailment", "not_entailment")
        rte = ["index\tsentence1\tsentence2\tlabel"] + [f"{i}\t{sentence()}\t{sentence()}\t{nli[i % 2]}"
                                                         for i in range(rows)]
        (tmp / f"rte_{name}.tsv").write_text("\n".join(rte) + "\n")
        qnli = ["index\tquestion\tsentence\tlabel"] + [f"{i}\t{sentence()}\t{sentence()}\t{nli[i % 3 > 0]}"
                                                        for i in range(rows)]
        (tmp / f"qnli_{name}.tsv").write_text("\n".join(qnli) + "\n")
    corpus = tmp / "corpus.raw"
    corpus.write_text("\n".join(" = Title = " if i % 10 == 0 else sentence() * 3 for i in range(60)) + "\n")
    return {"tmp": tmp, "teacher": tmp / "teacher", "mlm_teacher": tmp / "mlm_teacher", "corpus": corpus,
            "nli_teacher": tmp / "nli_teacher"}


def run(recipe: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The recipe in this process: its exit code and what it printed (the Trainer's logs included)."""
    return run_script(RECIPES / f"{recipe}.py", *args, cwd=cwd)


def run_subprocess(recipe: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    # PYTHONPATH: the recipes import this checkout's hf_distill, not whichever copy is installed (editable or not).
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": path}
    return subprocess.run([sys.executable, str(RECIPES / f"{recipe}.py"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def common_flags(env, out: Path, task: str = "sst", teacher: str = "teacher", cache: bool = True) -> list[str]:
    flags = ["--teacher", env[teacher], "--output_dir", out, "--train_file", env["tmp"] / f"{task}_train.tsv",
             "--validation_file", env["tmp"] / f"{task}_validation.tsv", "--per_device_train_batch_size", "8",
             "--num_train_epochs", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
             "--bf16", "false", "--logging_steps", "1"]
    if cache:  # pkd.py runs its teacher online (the patient loss needs its hidden states): no cache_dir
        flags += ["--cache_dir", env["tmp"] / "cache"]
    if task in ("pair", "rte"):
        flags += ["--text_column", "sentence1", "--text_pair_column", "sentence2"]
    if task == "qnli":
        flags += ["--text_column", "question", "--text_pair_column", "sentence"]
    return flags


def check_results(out: Path) -> dict:
    results = json.loads((out / "results.json").read_text())
    assert 0.0 <= results["accuracy"] <= 1.0
    assert results["params"] > 0 and results["wall_s"] > 0 and "recipes/" in results["command"]
    assert "teacher_accuracy" in results
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    # trainer_state.json as Trainer.save_state() writes it: `hf-distill report` plots the run
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] > 0
    return results


@pytest.mark.slow
def test_distilbert_task(env, tmp_path):
    out = tmp_path / "out"
    proc = run_subprocess("distilbert", "--config", RECIPES / "configs" / "distilbert_sst2.yaml",
                          *common_flags(env, out), "--student", env["teacher"], "--student_layers", "0", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["params"] < results["teacher_params"]
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def card_rows(text: str) -> dict[str, list[str]]:
    """Every row of every markdown table of a card, as {first cell: the other cells} (first occurrence wins)."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows.setdefault(cells[0], cells[1:])
    return rows


@pytest.mark.slow
def test_results_and_card_state_the_steps_run_and_keep_every_metric(env, tmp_path):
    """`--max_steps 2` of a 6-step epoch (48 rows, batches of 8): results.json and the card say 2 steps and a third
    of an epoch, not the configured epochs, and the card keeps the student's f1 beside its accuracy."""
    out = tmp_path / "out"
    proc = run("distilbert", "--config", RECIPES / "configs" / "distilbert_sst2.yaml", *common_flags(env, out),
               "--student", env["teacher"], "--student_layers", "0", "2", "--max_steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["train_steps"] == 2 and results["max_steps"] == 2 and "epochs" not in results
    assert results["epochs_trained"] == pytest.approx(2 / 6, abs=1e-4)
    assert results["student_metrics"] == {"accuracy": results["accuracy"], "f1": results["f1"]}
    from hf_distill.publish.card import write_model_card

    rows = card_rows(write_model_card(out).read_text())
    assert rows["Optimizer steps done"] == ["2"] and rows["Epochs done"] == ["0.3333"] and rows["Max steps"] == ["2"]
    assert "Epochs" not in rows
    for metric in ("accuracy", "f1"):
        assert rows[metric][:2] == [f"{results[f'teacher_{metric}']:.4f}", f"{results[metric]:.4f}"], metric


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "layers", "pairs"), [("skip", ["0", "1"], [[1, 2]]),
                                                        ("last", ["0", "1", "2"], [[1, 2], [2, 3]])])
def test_pkd_skip_and_last(env, tmp_path, strategy, layers, pairs):
    """The tiny teacher has 4 layers: skip maps a 2-layer student's layer 1 onto teacher layer 2; last maps a
    3-layer student's layers 1, 2 onto teacher layers 2, 3 (the ones below the top)."""
    out = tmp_path / "out"
    proc = run("pkd", "--config", RECIPES / "configs" / "pkd_sst2.yaml", *common_flags(env, out, cache=False),
               "--student", env["teacher"], "--student_layers", *layers, "--strategy", strategy)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["strategy"] == strategy and results["layer_map"] == pairs
    summary = results["distillation"]
    assert summary["kd_loss"] == "kl" and summary["temperature"] == 20.0
    assert summary["kd_weight"] == pytest.approx(0.2 / 2) and summary["task_weight"] == pytest.approx(0.8)
    term = summary["distill_terms"][0]
    assert term["loss"] == "pkd_loss" and term["weight"] == pytest.approx(1.0 / (len(pairs) * 32))
    assert "'loss_pkd'" in proc.stdout  # the patient term was computed and logged


@pytest.mark.parametrize(("flags", "message"), [
    (["--student_layers", "0", "1", "2", "--strategy", "skip"], "strategy skip needs the teacher's depth (4)"),
    (["--student_layers", "0", "1", "--strategy", "middle"], "strategy must be skip or last"),
    (["--student_layers", "0", "1", "--pkd_alpha", "1.5"], "pkd_alpha must be in [0, 1]"),
    (["--student_layers", "0", "--strategy", "last"], "a 1-layer student has none"),
])
def test_pkd_bad_input_is_one_line(env, tmp_path, monkeypatch, capsys, flags, message):
    _refused("pkd", ["--config", RECIPES / "configs" / "pkd_sst2.yaml",
                     *common_flags(env, tmp_path / "out", cache=False), "--student", env["teacher"], *flags],
             message, tmp_path / "out", monkeypatch, capsys)


@pytest.mark.slow
def test_bilstm_kd_on_augmented_rows_then_reload(env, tmp_path):
    """Tang et al.: copies of the rows (masking, n-grams), labelled by the teacher; MSE + CE; saved as a
    transformers model that the Auto class loads back once hf_distill.students.bilstm is imported."""
    out = tmp_path / "out"
    proc = run("bilstm", "--config", RECIPES / "configs" / "bilstm_sst2.yaml", *common_flags(env, out),
               "--n_iter", "3", "--augment_rows", "20", "--p_mask", "0.3", "--lstm_hidden_size", "8",
               "--classifier_size", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    aug = results["augment"]
    assert aug["rows_in"] == 48 and aug["rows_augmented"] == 20 and 48 < aug["rows_out"] <= 48 + 3 * 20
    assert results["train_rows"] == aug["rows_out"] and results["copies_relabelled_by_teacher"] == aug["rows_out"] - 48
    summary = results["distillation"]
    assert summary["kd_loss"] == "mse" and summary["kd_weight"] == 1.0 and summary["task_weight"] == 0.5
    assert results["optimizer"].startswith("adadelta")
    logs = proc.stdout + proc.stderr
    assert "loss_kd" in logs and "loss_task" in logs
    from transformers import AutoModelForSequenceClassification

    from hf_distill.students.bilstm import BiLSTMForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model) is BiLSTMForSequenceClassification and model.config.hidden_size == 8


def test_bilstm_training_rows_carry_the_right_labels(env, tmp_path, monkeypatch):
    """Through augmentation, shuffle, tokenisation and the teacher cache, each original row keeps its gold label
    and each copy takes the teacher's class (the recipe's main() in process, stopped before training; the cache
    replaced by a stand-in teacher)."""
    import importlib

    import numpy as np
    from transformers import AutoTokenizer

    monkeypatch.syspath_prepend(str(RECIPES))
    recipe = importlib.import_module("bilstm")
    seen = {}

    def fake_cache(teacher, train, *args, **kwargs):  # a "teacher" whose class varies with the row (the tiny
        # random one predicts one class everywhere), so a relabel that mixed rows up would show
        return train.map(lambda r: {"teacher_logits": [0.0, 1.0] if sum(r["input_ids"]) % 3 else [1.0, 0.0]})

    monkeypatch.setattr(recipe, "cache_task_logits", fake_cache)
    monkeypatch.setattr(recipe, "train_and_report", lambda trainer, *a, **kw: seen.update(kw))
    monkeypatch.setattr(sys, "argv", ["recipes/bilstm.py", "--config", str(RECIPES / "configs" / "bilstm_sst2.yaml"),
                                      *map(str, common_flags(env, tmp_path / "out")), "--n_iter", "4",
                                      "--augment_rows", "30", "--p_mask", "0.3", "--lstm_hidden_size", "8",
                                      "--classifier_size", "6"])
    recipe.main()
    train = seen["train"]
    tok = AutoTokenizer.from_pretrained(env["teacher"])
    lines = (env["tmp"] / "sst_train.tsv").read_text().splitlines()[1:]
    gold = {tuple(tok(text.strip())["input_ids"]): int(label) for text, label in (ln.split("\t") for ln in lines)}
    predicted = np.asarray(train["teacher_logits"]).argmax(-1)
    originals = copies = 0
    for ids, label, p in zip(train["input_ids"], train["labels"], predicted):
        if tuple(ids) in gold:
            originals += 1
            assert label == gold[tuple(ids)]
        else:
            copies += 1
            assert label == p
    assert originals == 48 and copies == len(train) - 48 > 30
    # The teacher disagrees with the gold label on some rows and varies, so a misaligned relabel would show.
    assert len(set(predicted.tolist())) == 2 and 0 < sum(
        int(p) != gold[tuple(i)] for i, p in zip(train["input_ids"], predicted) if tuple(i) in gold) < 48


def test_bilstm_augments_a_file_with_fewer_rows_than_augment_rows(env, tmp_path, monkeypatch):
    """augment_rows 3000 (the SST-2 config's) of a 48-row file: every row is augmented. Before, selecting the
    rows left over, none, raised datasets' IndexError after the augmentation had run."""
    import importlib

    monkeypatch.syspath_prepend(str(RECIPES))
    recipe = importlib.import_module("bilstm")
    seen = {}
    monkeypatch.setattr(recipe, "cache_task_logits",
                        lambda teacher, train, *a, **kw: train.map(lambda r: {"teacher_logits": [0.0, 1.0]}))
    monkeypatch.setattr(recipe, "train_and_report", lambda trainer, results, *a, **kw: seen.update(results))
    monkeypatch.setattr(sys, "argv", ["recipes/bilstm.py", "--config", str(RECIPES / "configs" / "bilstm_sst2.yaml"),
                                      *map(str, common_flags(env, tmp_path / "out")), "--n_iter", "2",
                                      "--p_mask", "0.3", "--lstm_hidden_size", "8", "--classifier_size", "6"])
    recipe.main()
    aug = seen["augment"]
    assert aug["rows_in"] == aug["rows_augmented"] == 48 and 48 < aug["rows_out"] <= 48 * 3


@pytest.mark.slow
def test_bilstm_baseline_without_teacher_or_copies(env, tmp_path):
    out = tmp_path / "out"
    proc = run("bilstm", "--config", RECIPES / "configs" / "bilstm_sst2.yaml", *common_flags(env, out),
               "--n_iter", "0", "--kd_weight", "0", "--task_weight", "1", "--embedding_init", "random",
               "--lstm_hidden_size", "8", "--classifier_size", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert "augment" not in results and results["train_rows"] == 48 and results["copies_relabelled_by_teacher"] == 0
    assert "loss_kd" not in proc.stdout + proc.stderr


def test_bilstm_relabel_copies_takes_the_teachers_class():
    import datasets

    sys.path.insert(0, str(RECIPES))
    try:
        from bilstm import relabel_copies
    finally:
        sys.path.remove(str(RECIPES))
    rows = datasets.Dataset.from_dict({"labels": [1, 1, 0, 0], "teacher_logits": [[2.0, 1.0], [0.0, 3.0],
                                                                                  [0.5, 0.4], [-1.0, 1.0]]})
    assert relabel_copies(rows, [1, 0, 1, 0])["labels"] == [0, 1, 0, 0]  # copies: argmax; originals: gold


@pytest.mark.parametrize(("flags", "message"), [
    (["--p_pos", "0.1"], "p_pos > 0 needs a POS tagger"),
    (["--text_column", "sentence1", "--text_pair_column", "sentence2"], "sentence pairs need the paper's siamese"),
    (["--student_layers", "0", "1"], "student_layers: not used by the BiLSTM recipe"),
    (["--distill_terms", "loss=hidden_mse,layers=last"], "distill_terms cannot apply"),
    (["--n_iter", "2", "--cache_teacher", "false"], "augmentation needs cache_teacher true"),
    (["--p_mask", "1.5"], "p_mask must be in [0, 1]"),
    (["--augment_rows", "0"], "augment_rows must be >= 1"),
    (["--weight_decay", "0.01"], "the recipe's Adadelta has no weight decay"),
])
def test_bilstm_bad_input_is_one_line(env, tmp_path, monkeypatch, capsys, flags, message):
    _refused("bilstm", ["--config", RECIPES / "configs" / "bilstm_sst2.yaml", *common_flags(env, tmp_path / "out"),
                        *flags], message, tmp_path / "out", monkeypatch, capsys)


@pytest.mark.slow
def test_minilm_general_then_task(env, tmp_path):
    out = tmp_path / "out"
    proc = run("minilm", "--config", RECIPES / "configs" / "minilm_sst2.yaml", *common_flags(env, out),
               "--general_teacher", env["teacher"], "--student_layers", "0", "2", "--relation_heads", "8",
               "--corpus_files", env["corpus"], "--corpus_block_size", "24", "--general_epochs", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["general_epochs"] == 1 and (out / "general" / "config.json").is_file()
    assert "loss_relation_qq" in proc.stdout + proc.stderr


MOBILEBERT_SHAPE = ["--bottleneck_size", "16", "--ffn_size", "16", "--num_ffn", "2", "--embedding_size", "16"]


@pytest.mark.slow
def test_mobilebert_progressive_then_task_kd(env, tmp_path):
    """A MobileBERT student shaped by the 4-layer teacher: 4 progressive stages on the corpus, then logit KD."""
    out = tmp_path / "out"
    proc = run("mobilebert", "--config", RECIPES / "configs" / "mobilebert_sst2.yaml", *common_flags(env, out),
               "--general_teacher", env["teacher"], *MOBILEBERT_SHAPE, "--corpus_files", env["corpus"],
               "--corpus_block_size", "24", "--max_corpus_blocks", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert [s.split(":")[0] for s in results["stages"]] == ["block 1", "block 2", "block 3", "block 4"]
    assert "frozen: bert.embeddings" not in results["stages"][1]
    assert "frozen: mobilebert.embeddings, mobilebert.encoder.layer.0" in results["stages"][1]
    shape = results["student_shape"]
    assert shape["num_hidden_layers"] == 4 and shape["hidden_size"] == 32 and shape["true_hidden_size"] == 16
    assert json.loads((out / "progressive" / "config.json").read_text())["model_type"] == "mobilebert"
    logs = proc.stdout + proc.stderr
    assert "'loss_hidden_4'" in logs and "'loss_attention_4_qk'" in logs and "'loss_kd'" in logs
    assert results["distillation"]["kd_weight"] == 0.5


@pytest.mark.slow
def test_mobilebert_baseline_skips_the_progressive_stage(env, tmp_path):
    out = tmp_path / "out"
    proc = run("mobilebert", "--config", RECIPES / "configs" / "mobilebert_sst2.yaml", *common_flags(env, out),
               "--general_teacher", env["teacher"], *MOBILEBERT_SHAPE, "--progressive_epochs", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert "stages" not in results and not (out / "progressive").exists()
    assert "loss_hidden" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (["--bottleneck_size", "18"], "must be divisible by the teacher's 4 heads"),
    ([], "progressive_epochs > 0 needs corpus_files"),
    (["--student_layers", "0", "1"], "student_layers: not used by the MobileBERT recipe"),
])
def test_mobilebert_bad_input_is_one_line(env, tmp_path, monkeypatch, capsys, flags, message):
    config = tmp_path / "no_corpus.yaml"  # the shipped config without its corpus
    lines = (RECIPES / "configs" / "mobilebert_sst2.yaml").read_text().splitlines()
    config.write_text("\n".join(line for line in lines if not line.startswith("corpus_files")) + "\n")
    corpus = [] if not flags else ["--corpus_files", env["corpus"]]
    _refused("mobilebert", ["--config", config, *common_flags(env, tmp_path / "out"), "--general_teacher",
                            env["teacher"], *MOBILEBERT_SHAPE[2:], *corpus, *flags], message, tmp_path / "out",
             monkeypatch, capsys)


@pytest.mark.slow
def test_minilm_teacher_assistant_chain(env, tmp_path):
    """teacher (4 layers) -> assistant (teacher layers 0, 2, 3) -> student (teacher layers 0 and 3, i.e. the
    assistant's layers 0 and 2). At a vanishing learning rate nothing moves, so where each layer came from shows."""
    from safetensors.torch import load_file

    def chain(out, lr):
        proc = run("minilm", "--config", RECIPES / "configs" / "minilm_sst2.yaml", *common_flags(env, out),
                   "--general_teacher", env["teacher"], "--student_layers", "0", "3", "--assistant_layers", "0", "2",
                   "3", "--relation_heads", "8", "--corpus_files", env["corpus"], "--corpus_block_size", "24",
                   "--general_epochs", "1", "--general_learning_rate", lr)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return (proc, load_file(out / "assistant" / "model.safetensors"),
                load_file(out / "general" / "model.safetensors"))

    key = "bert.encoder.layer.{}.attention.self.query.weight"
    t = load_file(env["teacher"] / "model.safetensors")
    _, a, g = chain(tmp_path / "still", "1e-12")
    for layer in (0, 1, 2):  # the assistant is teacher layers 0, 2, 3
        torch.testing.assert_close(a[key.format(layer)], t[key.format((0, 2, 3)[layer])], atol=1e-6, rtol=0)
    torch.testing.assert_close(g[key.format(1)], a[key.format(2)], atol=1e-6, rtol=0)  # student 1 = assistant 2
    proc, a, g = chain(tmp_path / "out", "1e-3")
    results = check_results(tmp_path / "out")
    assert results["assistant"]["layers"] == [0, 2, 3] and results["general_epochs"] == 1
    assert len(a) > len(g) and key.format(2) in a and key.format(2) not in g  # 3 layers, then 2
    assert not torch.equal(a[key.format(0)], t[key.format(0)])  # the assistant was trained
    assert not torch.equal(g[key.format(1)], a[key.format(2)])  # and the student against it
    assert (proc.stdout + proc.stderr).count("'loss_relation_qq'") >= 2  # both general steps logged


@pytest.mark.parametrize(("flags", "message"), [
    (["--student_layers", "0", "2", "--assistant_layers", "0", "1"], "must hold every student layer"),
    (["--student_layers", "0", "2", "--assistant_layers", "0", "2"], "must hold every student layer"),
    (["--student_layers", "0", "2", "--assistant_layers", "2", "0", "1"], "increasing without repeats"),
    (["--student_layers", "0", "2", "--assistant_layers", "0", "1", "2", "--general_epochs", "0"],
     "assistant_layers chains general distillation"),
])
def test_minilm_bad_assistant_is_one_line(env, tmp_path, monkeypatch, capsys, flags, message):
    _refused("minilm", ["--config", RECIPES / "configs" / "minilm_sst2.yaml", *common_flags(env, tmp_path / "out"),
                        "--general_teacher", env["teacher"], "--corpus_files", env["corpus"], "--general_epochs", "1",
                        *flags], message, tmp_path / "out", monkeypatch, capsys)


@pytest.mark.slow
def test_tinybert_general_augment_two_stages_on_pairs(env, tmp_path):
    """One command: general distillation, MLM-head fit + augmentation of a pair task, two task stages."""
    out = tmp_path / "out"
    proc = run("tinybert", "--config", RECIPES / "configs" / "tinybert_pair.yaml", *common_flags(env, out, "pair"),
               "--general_teacher", env["teacher"], "--student", "", "--student_num_layers", "2",
               "--student_hidden_size", "16", "--student_num_heads", "4", "--student_intermediate_size", "32",
               "--hidden_layer_map", "0:0;1:2;2:4", "--attention_layer_map", "1:2;2:4",
               "--corpus_files", env["corpus"], "--corpus_block_size", "24", "--general_epochs", "1",
               "--augment_mlm", env["teacher"], "--mlm_head_steps", "3", "--augment_n", "1", "--augment_rows", "8",
               "--intermediate_epochs", "1", "--num_train_epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["augmented_rows"] > 48 and len(results["stages"]) == 3  # general, intermediate, prediction
    assert results["stages"][0].startswith("general:") and len(results["general_stages"]) == 1
    assert "incremental_epochs" not in results and "loss_incremental" not in proc.stdout + proc.stderr
    assert results["cached_teacher_logits"] == results["train_rows"]  # stage 2 read the teacher's logits
    assert "MLM head step" in proc.stdout
    logs = proc.stdout + proc.stderr
    assert "loss_hidden" in logs and "loss_attention" in logs and "loss_kd" in logs
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 16


def _log_records(text: str) -> list[dict]:
    """The Trainer's printed log dicts (one per logging step)."""
    import ast

    return [ast.literal_eval(line.strip()) for line in text.splitlines() if line.strip().startswith("{'loss'")]


@pytest.mark.slow
def test_tinybert_incremental_general_phase(env, tmp_path):
    """General distillation, then the incremental phase (hidden + attention + 0.5 x incremental_mse, fresh linear
    schedule) in the same run through the stage switch; recorded in results.json's stages (the card's list)."""
    out = tmp_path / "out"
    proc = run("tinybert", "--config", RECIPES / "configs" / "tinybert_sst2.yaml", *common_flags(env, out),
               "--general_teacher", env["teacher"], "--student", "", "--student_num_layers", "2",
               "--student_hidden_size", "16", "--student_num_heads", "4", "--student_intermediate_size", "32",
               "--hidden_layer_map", "0:0;1:2;2:4", "--attention_layer_map", "1:2;2:4",
               "--corpus_files", env["corpus"], "--corpus_block_size", "24", "--general_epochs", "1",
               "--incremental_epochs", "1", "--incremental_weight", "0.5", "--augment_n", "0",
               "--intermediate_epochs", "0", "--max_train_rows", "16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["incremental_epochs"] == 1 and results["incremental_weight"] == 0.5
    assert results["stages"] == results["general_stages"] and len(results["stages"]) == 2
    assert results["stages"][1].startswith("general_incremental:") and "weight_incremental=0.5" in results["stages"][1]
    assert "fresh optimizer state" in results["stages"][1]
    from hf_distill.publish.card import write_model_card

    readme = write_model_card(out).read_text()  # the card of the folder lists both phases as its stages
    assert "- **Stages**:" in readme and all(f"{i}. {line}" in readme for i, line in enumerate(results["stages"], 1))
    general = [r for r in _log_records(proc.stdout + proc.stderr) if "loss_hidden" in r]
    first = [r for r in general if r["distill_stage"] == 0]
    second = [r for r in general if r["distill_stage"] == 1]
    assert first and second and len(first) == len(second)  # one epoch each over the same corpus
    assert not any("loss_incremental" in r for r in first)
    assert all("loss_incremental" in r and "loss_attention" in r for r in second)
    for r in second:  # logged values are rounded to 4 significant digits
        parts = float(r["loss_hidden"]) + float(r["loss_attention"]) + 0.5 * float(r["loss_incremental"])
        assert float(r["loss"]) == pytest.approx(parts, rel=2e-3)
    # Each phase has its own warm-up and linear decay over its own steps: the same lr sequence twice.
    lr_first, lr_second = ([float(r["learning_rate"]) for r in rs] for rs in (first, second))
    assert lr_first == lr_second and lr_first[-1] < max(lr_first)
    assert (out / "general" / "config.json").is_file()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--incremental_weight", "-0.1"], "incremental_weight (lambda) must be >= 0"),
        (["--incremental_weight", "0.5"], "incremental_epochs is 0"),
        ([], "it needs corpus_files and general_epochs > 0"),
        (["--corpus_files", "c.txt", "--general_epochs", "1", "--hidden_layer_map", "4:6"],
         "hidden_layer_map '4:6' cannot drive incremental_mse"),
    ],
)
def test_tinybert_bad_incremental_phase_is_one_line(flags, message, monkeypatch, capsys):
    argv = ["--teacher", "nowhere", *flags]
    if "--incremental_weight" not in flags or "-0.1" in flags:
        argv += ["--incremental_epochs", "1"]
    assert _recipe_main("tinybert", argv, monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.parametrize("has_head", [True, False])
def test_distilbert_general_mlm(env, tmp_path, has_head):
    """General distillation: KL + MLM + cosine with an MLM teacher; without a trained MLM head, KL is dropped."""
    out = tmp_path / "out"
    proc = run("distilbert", "--config", RECIPES / "configs" / "distilbert_general.yaml", "--teacher",
               env["mlm_teacher" if has_head else "teacher"], "--student_layers", "0", "2", "--output_dir", out,
               "--corpus_files", env["corpus"], "--corpus_block_size", "24", "--general_epochs", "1",
               "--per_device_train_batch_size", "4", "--logging_steps", "1", "--bf16", "false", "--report_to", "none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert "loss_task" in logs and "loss_cosine" in logs
    assert ("loss_kd" in logs) == has_head and ("KL term is dropped" in logs) != has_head
    assert (out / "general" / "config.json").is_file() and (out / "results.json").is_file()


# ------------------------------------------------------------------------- string labels (GLUE files as shipped)


def check_teacher_labels(out: Path, names: list[str]) -> None:
    """The saved student numbers its classes as the teacher does, and results.json says how."""
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {str(i): n for i, n in enumerate(names)}
    assert config["label2id"] == {n: i for i, n in enumerate(names)}
    assert json.loads((out / "results.json").read_text())["id2label"] == {str(i): n for i, n in enumerate(names)}


@pytest.mark.slow
def test_distilbert_rte_string_labels(env, tmp_path):
    out = tmp_path / "out"
    proc = run("distilbert", "--config", RECIPES / "configs" / "distilbert_pair.yaml",
               *common_flags(env, out, "rte", teacher="nli_teacher"), "--student_layers", "0", "2",
               "--max_length", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_results(out)
    check_teacher_labels(out, NLI_TEACHER_CLASSES)
    assert "'entailment' -> 1" in proc.stdout and "'not_entailment' -> 0" in proc.stdout


@pytest.mark.slow
def test_tinybert_rte_string_labels_augmented(env, tmp_path):
    """Augmented copies keep their string label, which maps through the teacher like the original rows."""
    out = tmp_path / "out"
    proc = run("tinybert", "--config", RECIPES / "configs" / "tinybert_pair.yaml",
               *common_flags(env, out, "rte", teacher="nli_teacher"), "--student", "", "--student_num_layers", "2",
               "--student_hidden_size", "16", "--student_num_heads", "4", "--student_intermediate_size", "32",
               "--hidden_layer_map", "0:0;1:2;2:4", "--attention_layer_map", "1:2;2:4", "--max_length", "32",
               "--augment_mlm", env["mlm_teacher"], "--augment_n", "1", "--augment_rows", "4",
               "--intermediate_epochs", "1", "--num_train_epochs", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = check_results(out)
    assert results["augmented_rows"] > 48
    check_teacher_labels(out, NLI_TEACHER_CLASSES)


@pytest.mark.slow
def test_minilm_qnli_string_labels_with_kd(env, tmp_path):
    out = tmp_path / "out"
    proc = run("minilm", "--config", RECIPES / "configs" / "minilm_pair.yaml",
               *common_flags(env, out, "qnli", teacher="nli_teacher"), "--student", "", "--student_layers", "0", "2",
               "--kd_weight", "0.5", "--task_weight", "0.5", "--max_length", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_results(out)
    check_teacher_labels(out, NLI_TEACHER_CLASSES)
    assert "loss_kd" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_minilm_without_teacher_numbers_string_labels_in_sorted_order(env, tmp_path):
    """Plain fine-tuning (no teacher to agree with): the sorted names number the classes, as stated on stdout."""
    out = tmp_path / "out"
    flags = [f for f in common_flags(env, out, "rte") if f != "--teacher" and f != env["teacher"]]
    proc = run("minilm", "--config", RECIPES / "configs" / "minilm_pair.yaml", *flags, "--teacher", "",
               "--general_teacher", env["teacher"], "--student", env["teacher"], "--kd_weight", "0",
               "--max_length", "32", "--evaluate_teacher", "false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sorted order" in proc.stdout
    check_teacher_labels(out, ["entailment", "not_entailment"])


@pytest.mark.slow
def test_class_names_name_the_classes_of_a_teacher_without_names(env, tmp_path):
    """A teacher saved with LABEL_0/LABEL_1 only: string labels are refused until class_names gives its order."""
    out = tmp_path / "out"
    flags = ["--config", RECIPES / "configs" / "distilbert_pair.yaml", *common_flags(env, out, "rte"),
             "--student_layers", "0", "2", "--max_length", "32"]
    refused = run_subprocess("distilbert", *flags)
    one_line_error(refused, "class_names", "LABEL_0", "'entailment'", "'not_entailment'")
    proc = run("distilbert", *flags, "--class_names", "entailment", "not_entailment")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_results(out)
    check_teacher_labels(out, ["entailment", "not_entailment"])


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """As a user sees a refusal: exit code 2, one `error:` line naming what is wrong, last, and no traceback
    (data loading and model loading print progress bars on stderr before it)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.slow
def test_unknown_string_label_is_refused(env, tmp_path):
    """MNLI's `contradiction` in the validation file of a 2-class (RTE) teacher: refused, naming both sides."""
    text = (env["tmp"] / "rte_validation.tsv").read_text().splitlines()
    text[3] = text[3].rsplit("\t", 1)[0] + "\tcontradiction"
    (tmp_path / "validation.tsv").write_text("\n".join(text) + "\n")
    proc = run_subprocess("distilbert", "--config", RECIPES / "configs" / "distilbert_pair.yaml",
                          *common_flags(env, tmp_path / "out", "rte", teacher="nli_teacher"),
                          "--student_layers", "0", "2", "--validation_file", tmp_path / "validation.tsv")
    one_line_error(proc, "'contradiction'", "validation", "'not_entailment'", "'entailment'")
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tinybert", "minilm"])
def test_out_of_range_integer_label_is_refused(env, tmp_path, recipe):
    """Label 2 for a 2-class teacher is refused with its value before anything trains."""
    lines = (env["tmp"] / "sst_train.tsv").read_text().splitlines()
    lines[5] = lines[5].rsplit("\t", 1)[0] + "\t2"
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    proc = run_subprocess(recipe, *common_flags(env, tmp_path / "out"), "--train_file", tmp_path / "train.tsv",
               "--student_layers", "0", "2")
    one_line_error(proc, "label 2", "2 labels", "train")


# ------------------------------------------------------------------- bad paths and layer lists (issue #28)


def _recipe_run_main(recipe: str, argv: list, monkeypatch) -> int:
    """A recipe as `python recipes/<recipe>.py` runs it (through common.run_main), in this process."""
    import importlib

    monkeypatch.syspath_prepend(str(RECIPES))
    module = importlib.import_module(recipe)
    monkeypatch.setattr(sys, "argv", [f"recipes/{recipe}.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module("common").run_main(module.main)
    return exit_info.value.code


def _refused(recipe: str, argv: list, message: str, out: Path, monkeypatch, capsys) -> None:
    """Bad input, run in this process (as `run_main` runs the script; `test_out_of_range_student_layers_in_a_subprocess`
    covers the real subprocess): exit 2, one `error:` line holding `message`, nothing written."""
    assert _recipe_run_main(recipe, argv, monkeypatch) == 2
    line = _one_error_line(capsys)
    assert message in line, line
    assert not (out / "results.json").exists()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in err, err[-3000:]
    return errors[0]


ALL_RECIPES = ["distilbert", "tinybert", "minilm", "pkd", "bilstm", "mobilebert", "fastbert", "causal_lm",
               "distil_whisper"]


@pytest.mark.parametrize("recipe", ALL_RECIPES)
@pytest.mark.parametrize("bad", ["missing", "file", "not_a_model"])
def test_a_bad_teacher_path_is_one_line_in_every_recipe(env, tmp_path, monkeypatch, capsys, recipe, bad):
    """A missing folder, a file, a folder without config.json: named with its field before anything loads
    (transformers would read the path as a Hub id and answer "Repo id must use alphanumeric chars")."""
    path, needle = {"missing": (tmp_path / "no" / "such", "no such folder"),
                    "file": (env["teacher"] / "config.json", "is a file"),
                    "not_a_model": (env["tmp"], "without config.json")}[bad]
    assert _recipe_run_main(recipe, ["--teacher", path, "--output_dir", tmp_path / "out"], monkeypatch) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: teacher {str(path)!r}") and needle in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", ["distilbert", "tinybert", "minilm", "pkd"])
def test_out_of_range_student_layers_are_one_line(env, tmp_path, monkeypatch, capsys, recipe):
    """--student_layers 0 9 of a 4-layer teacher: the library's ValueError, as one line (was a 68-line traceback)."""
    flags = common_flags(env, tmp_path / "out", cache=recipe != "pkd")
    assert _recipe_run_main(recipe, [*flags, "--student_layers", "0", "9"], monkeypatch) == 2
    line = _one_error_line(capsys)
    assert "out-of-range index 9" in line and "valid indices are 0..3" in line, line
    assert not (tmp_path / "out" / "results.json").exists()


def test_a_teacher_folder_without_tokenizer_files_is_one_line(env, tmp_path, monkeypatch, capsys):
    """transformers 5 builds an empty tokenizer from such a folder (the demo's cached teacher is one): the teacher
    then read every word as unknown and scored chance in results.json, with no error."""
    import shutil

    bare = tmp_path / "bare_teacher"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(env["teacher"] / name, bare / name)
    flags = common_flags(env, tmp_path / "out")
    flags[flags.index("--teacher") + 1] = bare
    _refused("distilbert", flags, "holds no tokenizer files", tmp_path / "out", monkeypatch, capsys)


def test_a_hub_id_that_cannot_be_loaded_is_one_line(env, tmp_path, monkeypatch, capsys):
    """A name that could be a Hub id goes to the loader; offline, its error is one line saying so."""
    flags = common_flags(env, tmp_path / "out")
    flags[flags.index("--teacher") + 1] = "nobody/no-such-teacher"
    assert _recipe_run_main("distilbert", [*flags, "--student_layers", "0", "1"], monkeypatch) == 2
    line = _one_error_line(capsys)
    assert "'nobody/no-such-teacher' (not a local folder, so read as a Hub id)" in line, line


def test_resume_from_checkpoint_is_refused(env, tmp_path, monkeypatch, capsys):
    """TrainingArguments leaves resume_from_checkpoint to the script; the recipes never resumed, silently."""
    flags = [*common_flags(env, tmp_path / "out"), "--resume_from_checkpoint", tmp_path / "checkpoint-2"]
    assert _recipe_run_main("distilbert", flags, monkeypatch) == 2
    assert "resume_from_checkpoint: the recipes do not resume" in _one_error_line(capsys)


@pytest.mark.slow
def test_out_of_range_student_layers_in_a_subprocess(env, tmp_path):
    """As a user sees it: exit code 2, one `error:` line, no traceback."""
    proc = run_subprocess("distilbert", *common_flags(env, tmp_path / "out"), "--student_layers", "0", "9")
    one_line_error(proc, "out-of-range index 9")


@pytest.mark.slow
def test_run_main_reports_setup_errors_in_one_line_and_keeps_crashes(tmp_path, monkeypatch, capsys):
    """Raised while building or in on_train_begin: one `error:` line, exit code 2. Raised inside a model's forward
    or the Trainer's training loop: the exception itself, traceback and all."""
    import helpers
    from transformers import TrainerCallback

    from hf_distill import DistillationTrainer

    common = _common(monkeypatch)

    def setup():
        raise FileNotFoundError("data file x.tsv does not exist\nsecond line")

    with pytest.raises(SystemExit) as exit_info:
        common.run_main(setup)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: data file x.tsv does not exist second line\n"

    class Broken(torch.nn.Module):
        def forward(self, x):
            raise ValueError("a bug in a forward")

    with pytest.raises(ValueError, match="a bug in a forward"):
        common.run_main(lambda: Broken()(torch.zeros(1)))

    class RaiseAt(TrainerCallback):
        def __init__(self, event):
            self.event = event

        def on_train_begin(self, *args, **kwargs):
            if self.event == "begin":
                raise ValueError("a setting the callback refuses")

        def on_step_begin(self, *args, **kwargs):
            if self.event == "step":
                raise ValueError("a crash during training")

    def train(event):
        trainer = DistillationTrainer(model=helpers.bert(layers=2), args=helpers.args(tmp_path, kd_weight=0.0),
                                      train_dataset=helpers.token_dataset(8), data_collator=helpers.collate,
                                      callbacks=[RaiseAt(event)])
        return lambda: trainer.train()

    with pytest.raises(ValueError, match="a crash during training"):
        common.run_main(train("step"))
    with pytest.raises(SystemExit) as exit_info:
        common.run_main(train("begin"))
    assert exit_info.value.code == 2 and capsys.readouterr().err.endswith("error: a setting the callback refuses\n")


# --------------------------------------------------------------- fastbert's labels and the report (issue #28)


@pytest.mark.slow
def test_fastbert_reads_class_name_labels_through_the_teacher(env, tmp_path):
    """RTE's entailment / not_entailment, a sentence pair, with a teacher that names its classes in another order
    than the sorted one: the names map through its label2id (the final head's accuracy on them is the teacher's)."""
    out = tmp_path / "out"
    proc = run("fastbert", "--config", RECIPES / "configs" / "fastbert_sst2.yaml",
               *common_flags(env, out, "rte", teacher="nli_teacher", cache=False), "--max_steps", "2",
               "--speeds", "0.0", "1.0", "--max_length", "32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'entailment' -> 1" in proc.stdout and "'not_entailment' -> 0" in proc.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["id2label"] == {"0": "not_entailment", "1": "entailment"}
    assert json.loads((out / "config.json").read_text())["label2id"] == {"not_entailment": 0, "entailment": 1}
    # The labels the sweep scores against are the ones the branch metrics score against: the teacher's ids.
    assert results["sweep"][0]["accuracy"] == results["teacher_accuracy"]
    assert results["branch_metrics"]["eval_final_accuracy"] == pytest.approx(results["teacher_accuracy"])
    rows = [line.split("\t") for line in (env["tmp"] / "rte_validation.tsv").read_text().splitlines()[1:]]
    assert 0 < results["teacher_accuracy"] < 1 and results["eval_rows"] == len(rows)


@pytest.mark.slow
def test_fastbert_class_names_a_teacher_cannot_map_are_one_line(env, tmp_path):
    """A teacher named only LABEL_0/LABEL_1 and string labels: refused before anything trains, with the fix."""
    proc = run_subprocess("fastbert", "--config", RECIPES / "configs" / "fastbert_sst2.yaml",
                          *common_flags(env, tmp_path / "out", "rte", cache=False), "--max_steps", "2")
    one_line_error(proc, "class_names", "LABEL_0", "'entailment'")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_report_plots_a_recipe_run(env, tmp_path, capsys):
    """`hf-distill report <recipe output dir>` draws the loss components from the trainer_state.json the recipe
    wrote (it said "Nothing to plot")."""
    from hf_distill.cli import main

    out = tmp_path / "out"
    proc = run("distilbert", "--config", RECIPES / "configs" / "distilbert_sst2.yaml", *common_flags(env, out),
               "--student", env["teacher"], "--student_layers", "0", "2", "--max_steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and sum("loss_kd" in h for h in state["log_history"]) == 3
    assert any("eval_accuracy" in h for h in state["log_history"])  # written after the final evaluation
    assert main(["report", str(out)]) == 0
    assert f"Wrote {out / 'loss_components.png'}" in capsys.readouterr().out
    assert (out / "loss_components.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _common(monkeypatch):
    import importlib

    monkeypatch.syspath_prepend(str(RECIPES))
    return importlib.import_module("common")


def test_model_seed_varies_the_student_and_data_seed_the_order(env, monkeypatch):
    """Seed repeats (issue #16): model_seed draws new student weights and heads, data_seed a new row order;
    neither set means the run's seed, as before."""
    import dataclasses

    from transformers import AutoModelForSequenceClassification

    common = _common(monkeypatch)
    teacher = AutoModelForSequenceClassification.from_pretrained(env["teacher"])
    random_student = common.ModelArguments(student_num_layers=2, student_hidden_size=16, student_num_heads=4,
                                           student_intermediate_size=32)
    copied = common.ModelArguments(student=str(env["teacher"]), student_layers=[0, 2])

    def weights(margs, seed=42, **kw):
        torch.manual_seed(seed)  # the recipes' set_seed(args.seed)
        model = common.build_student(margs, teacher, AutoModelForSequenceClassification, seed, **kw)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    # A random student, and a copied one that gets a new 3-class head: model_seed draws both.
    for margs, kw in ((random_student, {}), (copied, {"num_labels": 3, "ignore_mismatched_sizes": True})):
        base = weights(margs, **kw)
        assert torch.equal(weights(dataclasses.replace(margs, model_seed=42), **kw), base)
        assert torch.equal(weights(dataclasses.replace(margs, model_seed=7), **kw), weights(margs, seed=7, **kw))
        assert not torch.equal(weights(dataclasses.replace(margs, model_seed=7), **kw), base)
    # Nothing random in a copy that keeps the teacher's head.
    assert torch.equal(weights(dataclasses.replace(copied, model_seed=7)), weights(copied))

    class Args:
        seed, data_seed = 42, None

    assert common.order_seed(Args) == 42
    Args.data_seed = 3
    assert common.order_seed(Args) == 3


def test_task_labels_map_through_the_teacher(monkeypatch):
    """MNLI's three names map to the teacher's ids (its order, its capitals); a Hub ClassLabel column maps by
    name too; without a teacher the sorted names number the classes; integer labels stay as they are."""
    import datasets
    from transformers import BertConfig

    common = _common(monkeypatch)
    data = common.DataArguments(text_column="premise", text_pair_column="hypothesis")
    teacher = types.SimpleNamespace(config=BertConfig(id2label={0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"},
                                                      label2id={"CONTRADICTION": 0, "NEUTRAL": 1, "ENTAILMENT": 2}))
    mnli = datasets.Dataset.from_dict({"label": ["neutral", "entailment", "contradiction", "entailment"]})
    labels = common.task_labels(mnli, None, data, teacher)
    assert labels.lookup == {"contradiction": 0, "neutral": 1, "entailment": 2}
    assert labels.id2label == {0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}
    names = datasets.ClassLabel(names=["entailment", "neutral", "contradiction"])  # the Hub's glue/mnli order
    hub = datasets.Dataset.from_dict({"label": [0, 1, 2]}, features=datasets.Features({"label": names}))
    assert common.task_labels(hub, None, data, teacher).lookup == {0: 2, 1: 1, 2: 0}
    alone = common.task_labels(mnli, None, data, None)
    assert alone.id2label == {0: "contradiction", 1: "entailment", 2: "neutral"}
    ints = datasets.Dataset.from_dict({"label": [2, 0, 1]})
    assert common.task_labels(ints, None, data, teacher).lookup == {0: 0, 1: 1, 2: 2}

    class Tok:
        def __call__(self, text, pair, truncation, max_length):
            return {"input_ids": [[1]] * len(text)}

    rows = datasets.Dataset.from_dict({"premise": ["a"] * 4, "hypothesis": ["b"] * 4, "label": mnli["label"]})
    assert common.tokenize_task(rows, Tok(), data, labels)["labels"] == [1, 2, 0, 2]


def _recipe_main(recipe: str, argv: list, monkeypatch):
    """Run a recipe's main() in this process (parsing only: these calls exit before anything loads)."""
    import importlib

    monkeypatch.syspath_prepend(str(RECIPES))
    module = importlib.import_module(recipe)
    monkeypatch.setattr(sys, "argv", [f"recipes/{recipe}.py", *map(str, argv)])
    with pytest.raises(SystemExit) as exit_info:
        module.main()
    return exit_info.value.code


@pytest.mark.parametrize("recipe", ["distilbert", "tinybert", "minilm", "pkd", "bilstm", "mobilebert"])
def test_help_lists_every_option(recipe, monkeypatch, capsys):
    assert _recipe_main(recipe, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--teacher", "--student_layers", "--train_file", "--text_pair_column", "--max_length",
                 "--corpus_files", "--temperature", "--kd_weight", "--distill_terms", "--learning_rate", "--bf16",
                 "--class_names"):
        assert flag in out, flag
    specific = {"distilbert": "--mlm_smoothing", "tinybert": "--augment_n", "minilm": "--relation_heads",
                "pkd": "--pkd_beta", "bilstm": "--p_ng", "mobilebert": "--freeze_lower"}[recipe]
    assert specific in out


@pytest.mark.slow
def test_help_through_the_cli():
    proc = subprocess.run([sys.executable, "-m", "hf_distill.cli", "run", "tinybert", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0 and "--augment_n" in proc.stdout and "--intermediate_epochs" in proc.stdout


@pytest.mark.parametrize("line, key", [("learning_rte: 0.1", "learning_rte"), ("kd_weight: lots", "kd_weight"),
                                       ("student_layers: 3", "student_layers"), ("augment_n: 2.5", "augment_n")])
def test_malformed_config_is_one_line(tmp_path, monkeypatch, capsys, line, key):
    config = tmp_path / "bad.yaml"
    config.write_text(f"teacher: nowhere\n{line}\n")
    assert _recipe_main("tinybert", ["--config", config], monkeypatch) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and key in lines[0], err


@pytest.mark.slow
def test_malformed_config_in_a_subprocess(tmp_path):
    """As a user sees it: exit code 2, one line on stderr, no traceback."""
    config = tmp_path / "bad.yaml"
    config.write_text("teacher: nowhere\ntemprature: 2\n")
    proc = run_subprocess("minilm", "--config", config)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "temprature" in lines[0], proc.stderr


@pytest.mark.parametrize("recipe", ["distilbert", "distil_whisper"])
def test_fp16_on_a_cpu_is_one_line_before_anything_loads(tmp_path, monkeypatch, capsys, recipe):
    """The trainers refuse fp16 on a CPU: distil_whisper reached that refusal after pseudo-labelling (and training
    a teacher)."""
    data = ["--dataset_dir", tmp_path / "none", "--teacher_cache_dir", tmp_path / "t"] if recipe == "distil_whisper" \
        else []
    assert _recipe_main(recipe, ["--output_dir", tmp_path / "out", "--fp16", "true", "--use_cpu", "true", *data],
                        monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: fp16=True") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "t").exists()


def test_invalid_value_is_one_line(tmp_path, monkeypatch, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("teacher: nowhere\ntemperature: -1\n")
    assert _recipe_main("distilbert", ["--config", config], monkeypatch) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "temperature" in err and len(err.splitlines()) == 1


# ------------------------------------------------------------------------------------------------ causal LM


def _causal_corpus(path: Path, lines: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    text = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (12,), generator=g)) + " ."
            for _ in range(lines)]
    path.write_text(" = Title = \n" + "\n".join(text) + "\n")
    return path


def _causal_flags(tmp: Path, out: Path) -> list:
    """Tiny everything: a 2-layer hidden-32 teacher on a 300-token BPE and 16 blocks of 16 tokens; the students
    distil on the first 8 blocks, 2 epochs of 1 step."""
    return ["--config", RECIPES / "configs" / "causal_lm_wikitext.yaml", "--output_dir", out,
            "--train_file", _causal_corpus(tmp / "train.raw", 40, 0),
            "--eval_file", _causal_corpus(tmp / "test.raw", 8, 1),
            "--teacher_cache_dir", tmp / "teachers", "--vocab_size", "300", "--teacher_layers", "2",
            "--teacher_hidden_size", "32", "--teacher_heads", "4", "--teacher_kv_heads", "2",
            "--teacher_intermediate_size", "64", "--teacher_epochs", "1", "--teacher_batch_size", "8",
            "--block_size", "16", "--max_train_blocks", "16", "--max_eval_blocks", "4", "--calibration_batches", "1",
            "--per_device_train_batch_size", "8", "--logging_steps", "1", "--disable_tqdm", "true",
            "--student_train_blocks", "8", "--num_train_epochs", "2"]


@pytest.mark.slow
def test_causal_lm_recipe_trains_teacher_prunes_distils_and_compares(tmp_path):
    out = tmp_path / "out"
    proc = run("causal_lm", *_causal_flags(tmp_path, out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["teacher_layers"] == 2 and results["student_layers"] == 1 and len(results["kept_blocks"]) == 1
    assert results["params"] < results["teacher_params"] and results["train_steps"] == results["baseline_steps"] == 2
    # the teacher trained on every block, the students on the first student_train_blocks
    assert results["teacher_training"]["train_blocks"] == 16 and results["train_blocks"] == 8
    assert results["distillation"]["kd_loss"] == "jsd" and results["distillation"]["jsd_beta"] == 0.5
    for key in ("teacher_perplexity", "perplexity", "baseline_perplexity"):
        assert 1.0 < results[key] < 1e4, (key, results[key])
    ratio = results["perplexity"] / results["baseline_perplexity"]
    assert results["kd_over_baseline_perplexity"] == pytest.approx(ratio)
    # The KD run really distilled: its logged loss has a KD part; the baseline's run did not (kd_weight 0).
    assert "loss_kd" in proc.stdout + proc.stderr
    assert (out / "model.safetensors").is_file() and (out / "baseline" / "model.safetensors").is_file()
    teacher = Path(results["teacher"])
    assert teacher.parent == tmp_path / "teachers" and (teacher / "tokenizer.json").is_file()
    # The card of the folder: GKD with its beta, the kept blocks, perplexities, the steps and epochs run.
    from hf_distill.publish.card import write_model_card

    text = write_model_card(out).read_text()
    assert "(beta = 0.5; GKD, Agarwal et al., 2024)" in text and "Hinton" not in text
    assert f"kept decoder blocks {results['kept_blocks']} (0-based) of its 2" in text
    rows = card_rows(text)
    assert rows["perplexity"][:2] == [f"{results['teacher_perplexity']:.4f}", f"{results['perplexity']:.4f}"]
    assert rows["loss"][1] == f"{math.log(results['perplexity']):.4f}"
    assert rows["Optimizer steps done"] == ["2"] and rows["Epochs done"] == ["2.0"] and rows["Epochs"] == ["2.0"]

    # Same settings: the trained teacher is reused; --teacher loads a given one (tokenizer and model) instead.
    again = run("causal_lm", *_causal_flags(tmp_path, tmp_path / "again"), "--run_baseline", "false")
    assert again.returncode == 0 and f"teacher: reusing {teacher}" in again.stdout, again.stderr[-3000:]
    given = run("causal_lm", *_causal_flags(tmp_path, tmp_path / "given"), "--teacher", teacher,
                "--run_baseline", "false", "--teacher_cache_dir", tmp_path / "unused")
    assert given.returncode == 0, given.stderr[-3000:]
    assert json.loads((tmp_path / "given" / "results.json").read_text())["teacher_perplexity"] == pytest.approx(
        results["teacher_perplexity"])
    assert not (tmp_path / "unused").exists()


@pytest.mark.slow
def test_causal_lm_bad_kd_loss_is_one_line(tmp_path):
    proc = run_subprocess("causal_lm", *_causal_flags(tmp_path, tmp_path / "out"), "--kd_loss", "mse")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "kd_loss" in lines[0], proc.stderr[-2000:]


@pytest.mark.slow
def test_causal_lm_bad_student_train_blocks_is_one_line(tmp_path):
    proc = run_subprocess("causal_lm", *_causal_flags(tmp_path, tmp_path / "out"), "--student_train_blocks", "0")
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "student_train_blocks" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow
def test_causal_lm_readme_example_runs(tmp_path, monkeypatch):
    """The SFT example of recipes/README.md, run as written on a tiny Llama teacher: prompt tokens are masked."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = (RECIPES / "README.md").read_text()
    code = text.split("<!-- causal-lm-example -->\n```python\n", 1)[1].split("```", 1)[0]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", pad_token="</s>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    pairs = [(f"Question {i}: is the movie good?", "the plot was fun" if i % 2 else "it was dull") for i in range(8)]
    scope = {"teacher_path": str(tmp_path / "t"), "pairs": pairs}
    exec(compile(code, "recipes/README.md", "exec"), scope)
    assert scope["student"].config.num_hidden_layers == 2 and len(scope["pruning"].kept) == 2
    prompt_len = len(scope["tok"](pairs[0][0])["input_ids"])
    assert scope["rows"][0]["labels"][:prompt_len] == [-100] * prompt_len
    assert scope["rows"][0]["labels"][prompt_len:] == scope["rows"][0]["input_ids"][prompt_len:]
    assert (tmp_path / "out").is_dir()
