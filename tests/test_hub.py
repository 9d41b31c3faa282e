"""Publishing students: the model card, and pushes through a real HTTP round trip to a local fake Hub.

One tiny real `DistillationTrainer` run (random 4x32 BERT teacher -> 2x16 student, logit KD + hidden-state
MSE through a projection, checkpoints every 3 steps) is pushed with `trainer.push_to_hub()`; the checks read
what the server received.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import huggingface_hub.constants as hub_constants
import pytest
import torch
import yaml
from hub_server import FakeHub, online, tiny_run
from huggingface_hub import ModelCard
from safetensors.torch import load as load_safetensors

import hf_distill
from hf_distill import DistillationArguments, DistillationTrainer
from hf_distill.presets import PRESETS
from hf_distill.publish import measure
from hf_distill.publish.card import BIBTEX, citations, model_card, write_model_card
from hf_distill.publish.hub import HubPushError, push_student, upload_files
from hf_distill.publish.report import DistillationReport, detect_method

REPO = "fake-user/out"  # the fake Hub puts an un-namespaced repo under its user; output_dir is ".../out"
TEACHER_ID = "fake-org/tiny-bert-teacher"


# ---------------------------------------------------------------------- helpers


def front_matter(readme: str) -> dict:
    assert readme.startswith("---\n")
    return yaml.safe_load(readme.split("---\n", 2)[1])


def tables(markdown: str) -> list[list[list[str]]]:
    """Every markdown table as rows of cells (header first, the --- separator dropped)."""
    found, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(set(c) <= set("-: ") and c for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found


def table_with(markdown: str, header: list[str]) -> dict[str, list[str]]:
    """The table with this header, as {first cell: the other cells}."""
    for table in tables(markdown):
        if table[0] == header:
            return {row[0]: row[1:] for row in table[1:]}
    raise AssertionError(f"no table with header {header} in:\n{markdown}")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def teacher_accuracy(trainer) -> float:
    """The teacher's accuracy on the eval set, computed here independently of hf_distill.publish.report."""
    correct = total = 0
    with torch.no_grad():
        for row in trainer.eval_dataset:
            logits = trainer.teacher(input_ids=torch.tensor([row["input_ids"]])).logits
            correct += int(logits.argmax(-1).item() == row["label"])
            total += 1
    return correct / total


# ---------------------------------------------------------------------- the push of a real run


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Train, leave decoys a careless upload would take along, then `trainer.push_to_hub()`."""
    root = tmp_path_factory.mktemp("hub")
    trainer = tiny_run(root, weight_decay=0.01)
    out = Path(trainer.args.output_dir)
    trainer.teacher.save_pretrained(out / "teacher")  # a user keeping the teacher next to the student
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1").write_bytes(b"logs")
    torch.save({"w": torch.zeros(2)}, out / "distill_projections.pt")
    torch.save({"state": {}}, out / "optimizer.pt")
    trainer.evaluate_teacher()  # every process, before the card: its metrics are the card's teacher column
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        url = trainer.push_to_hub(
            teacher=TEACHER_ID,  # the teacher was loaded from a folder: named by its Hub id
            dataset_tags="nyu-mll/glue",
            dataset="GLUE SST-2",
            dataset_args="sst2",
            license="apache-2.0",
            measure_speed=True,
        )
    return trainer, hub, url


def test_push_uploads_exactly_the_student_files(pushed, tmp_path):
    trainer, hub, url = pushed
    out = Path(trainer.args.output_dir)
    trainer.processing_class.save_pretrained(tmp_path / "tok")
    tokenizer_files = {p.name for p in (tmp_path / "tok").iterdir()}
    assert set(hub.repos) == {REPO}
    assert set(hub.files(REPO)) == {"config.json", "model.safetensors", "README.md"} | tokenizer_files
    # Training artefacts exist locally but stayed there.
    assert (out / "training_args.bin").is_file() and (out / "checkpoint-6" / "optimizer.pt").is_file()
    assert (out / "checkpoint-6" / "distill_projections.pt").is_file()
    for name, data in hub.files(REPO).items():
        assert data == (out / name).read_bytes(), name
    commit = hub.repos[REPO]["commits"][-1]
    assert url == f"{hub.endpoint}/{REPO}/commit/{commit['oid']}"
    assert commit["summary"] == "End of training"
    assert trainer.hub_model_id == REPO


def test_pushed_weights_are_the_student_not_the_teacher(pushed):
    trainer, hub, _ = pushed
    weights = load_safetensors(hub.files(REPO)["model.safetensors"])
    student = trainer.model.state_dict()
    assert set(weights) == set(student)
    for key, tensor in weights.items():
        assert torch.equal(tensor, student[key]), key
    assert weights["bert.embeddings.word_embeddings.weight"].shape[1] == 16  # the teacher's width is 32
    assert not any(key.startswith(("projections", "teacher")) for key in weights)
    config = json.loads(hub.files(REPO)["config.json"])
    assert config["num_hidden_layers"] == 2 and config["distillation"]["init"] == "shrink"


def test_pushed_card_metadata(pushed):
    trainer, hub, _ = pushed
    meta = front_matter(hub.files(REPO)["README.md"].decode())
    assert meta["base_model"] == TEACHER_ID
    assert "base_model_relation" not in meta  # the Hub defines no value for distillation
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-classification"
    assert meta["license"] == "apache-2.0"
    assert meta["datasets"] == ["nyu-mll/glue"]
    assert {"distillation", "hf-distill", "feature-kd"} <= set(meta["tags"])
    (index,) = meta["model-index"]
    assert index["name"] == REPO
    (result,) = index["results"]
    assert result["task"]["type"] == "text-classification"
    assert result["dataset"] == {"name": "GLUE SST-2", "type": "nyu-mll/glue", "config": "sst2"}
    last_eval = [e for e in trainer.state.log_history if "eval_accuracy" in e][-1]
    # transformers' model index names each metric too ({"name", "type", "value"}): the type and value are checked
    accuracy = pytest.approx(last_eval["eval_accuracy"])
    loss = pytest.approx(last_eval["eval_loss"])  # the student's own (issue #39 case 18)
    assert {m["type"]: m["value"] for m in result["metrics"]} == {"accuracy": accuracy, "loss": loss}
    # huggingface_hub itself reads it back.
    card = ModelCard(hub.files(REPO)["README.md"].decode())
    assert card.data.eval_results[0].metric_value == pytest.approx(last_eval["eval_accuracy"])


def test_pushed_card_tables(pushed):
    trainer, hub, _ = pushed
    readme = hub.files(REPO)["README.md"].decode()
    student_params = measure.count_parameters(trainer.model)
    teacher_params = measure.count_parameters(trainer.teacher)
    sizes = table_with(readme, ["", "Teacher", "Student", "Student / teacher"])
    assert sizes["Parameters"] == [
        f"{teacher_params:,}",
        f"{student_params:,}",
        f"{student_params / teacher_params:.1%}",
    ]
    assert sizes["Layers"][:2] == ["4", "2"] and sizes["Hidden size"][:2] == ["32", "16"]
    student_bytes = len(hub.files(REPO)["model.safetensors"])
    teacher_bytes = (Path(trainer.args.output_dir).parent / "teacher" / "model.safetensors").stat().st_size
    assert sizes["Size on disk (weights)"] == [
        f"{teacher_bytes / 1e3:.2f} kB",
        f"{student_bytes / 1e3:.2f} kB",
        f"{student_bytes / teacher_bytes:.1%}",
    ]
    report = json.loads((Path(trainer.args.output_dir) / "distillation_report.json").read_text())
    assert report["speedup"] > 0
    assert sizes["Inference speed-up"][:2] == ["1.00x", f"{report['speedup']:.2f}x"]
    metrics = table_with(readme, ["Metric", "Teacher", "Student", "% of teacher"])
    student_acc = [e for e in trainer.state.log_history if "eval_accuracy" in e][-1]["eval_accuracy"]
    teacher_acc = teacher_accuracy(trainer)
    assert metrics["accuracy"] == [
        f"{teacher_acc:.4f}",
        f"{student_acc:.4f}",
        f"{student_acc / teacher_acc:.1%}",
    ]
    losses = table_with(readme, ["Term", "Loss", "Weight", "Layers (student -> teacher)"])
    assert losses["kd"][1:] == ["0.5", "output logits"] and "T = 2" in losses["kd"][0]
    assert losses["hidden"] == ["hidden_mse", "0.5", "uniform map"]
    assert losses["task"][1] == "0.5"
    training = table_with(readme, ["Setting", "Value"])
    assert training["Learning rate"] == ["0.005"] and training["Seed"] == ["0"]
    assert training["Optimizer steps done"] == ["6"] and training["Precision"] == ["fp32"]
    assert training["Weight decay"] == ["0.01"]


def test_pushed_card_body(pushed):
    _, hub, _ = pushed
    readme = hub.files(REPO)["README.md"].decode()
    assert f"[{TEACHER_ID}](https://huggingface.co/{TEACHER_ID})" in readme
    assert "Initialisation**: random, a smaller configuration" in readme
    assert f'AutoModelForSequenceClassification.from_pretrained("{REPO}")' in readme
    assert "@inproceedings{romero2015fitnets" in readme and "@article{hinton2015distilling" in readme
    assert f"Distilled with hf_distill {hf_distill.__version__}." in readme
    assert "More information needed" not in readme and "None" not in readme


def test_refreshing_the_card_from_the_folder_is_lossless(pushed, tmp_path):
    trainer, hub, _ = pushed
    out = Path(trainer.args.output_dir)
    copy = tmp_path / "out"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("checkpoint-*", "teacher", "runs"))
    write_model_card(copy)
    assert (copy / "README.md").read_text() == hub.files(REPO)["README.md"].decode()


def test_card_from_files_alone(pushed, tmp_path):
    """Without the report a card wrote, the folder's own files still give the card its facts."""
    trainer, _, _ = pushed
    out = Path(trainer.args.output_dir)
    folder = tmp_path / "student"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("teacher", "runs", "README.md"))
    shutil.copytree(out.parent / "teacher", tmp_path / "teacher")  # beside the student, as tiny_run keeps them
    (folder / "distillation_report.json").unlink()
    write_model_card(folder, teacher=TEACHER_ID, license="mit")
    readme = (folder / "README.md").read_text()
    meta = front_matter(readme)
    assert meta["base_model"] == TEACHER_ID and meta["license"] == "mit" and "feature-kd" in meta["tags"]
    training = table_with(readme, ["Setting", "Value"])  # from training_args.bin and trainer_state.json
    assert training["Learning rate"] == ["0.005"] and training["Optimizer steps done"] == ["6"]
    assert training["Weight decay"] == ["0.01"]
    sizes = table_with(readme, ["", "Teacher", "Student", "Student / teacher"])
    # Parameter counts from the safetensors headers; the teacher's from its folder named in config.json (by its
    # name, found beside the student: config.json holds no absolute path).
    assert sizes["Parameters"][:2] == [
        f"{measure.count_parameters(trainer.teacher):,}",
        f"{measure.count_parameters(trainer.model):,}",
    ]
    assert table_with(readme, ["Metric", "Student"])["accuracy"]  # no teacher metrics without the report
    assert "Inference speed-up" not in readme  # not measured: absent, not made up


def test_create_model_card_writes_the_distillation_card(pushed):
    trainer, _, _ = pushed
    readme = Path(trainer.args.output_dir) / "README.md"
    pushed_card = readme.read_bytes()
    readme.unlink()
    try:
        trainer.create_model_card()
        text = readme.read_text()
    finally:
        readme.write_bytes(pushed_card)
    assert "## How it was distilled" in text and "hf-distill" in front_matter(text)["tags"]
    assert "Inference speed-up" not in text and "More information needed" not in text
    teacher_acc = f"{teacher_accuracy(trainer):.4f}"  # from the fixture's evaluate_teacher(), not re-run
    assert table_with(text, ["Metric", "Teacher", "Student", "% of teacher"])["accuracy"][0] == teacher_acc


def _count_forwards(monkeypatch, *models) -> list[int]:
    """How many times each model's forward runs from now on."""
    counts = [0] * len(models)
    for i, model in enumerate(models):
        forward = model.forward

        def counted(*a, _i=i, _forward=forward, **k):
            counts[_i] += 1
            return _forward(*a, **k)

        monkeypatch.setattr(model, "forward", counted)
    return counts


def test_writing_the_card_runs_no_model_by_default(tmp_path, monkeypatch):
    """create_model_card, save_model and push_to_hub with default arguments neither evaluate nor time the
    teacher or the student: under a sharded teacher a forward on the card-writing process alone would hang."""
    trainer = tiny_run(tmp_path, max_steps=2, eval_strategy="no", save_strategy="no", hidden_term=False)
    trainer.evaluate()  # the student's metrics are logged: the old card then evaluated the teacher itself
    counts = _count_forwards(monkeypatch, trainer.teacher, trainer.model)
    trainer.create_model_card()
    trainer.save_model()
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        trainer.push_to_hub()
    assert counts == [0, 0]
    readme = hub.files(REPO)["README.md"].decode()
    assert table_with(readme, ["Metric", "Student"])["accuracy"]  # no teacher column: it was not evaluated
    assert "Inference speed-up" not in readme


def test_evaluate_teacher_returns_the_teachers_metrics(pushed):
    trainer, _, _ = pushed
    student_eval = [e for e in trainer.state.log_history if "eval_accuracy" in e][-1]
    metrics = trainer.evaluate_teacher()
    assert metrics["teacher_accuracy"] == pytest.approx(teacher_accuracy(trainer))
    assert not any(k.startswith("eval_") for k in metrics) and "teacher_runtime" in metrics
    with torch.no_grad():  # the teacher's own loss, averaged over the evaluation set as evaluate() does it
        losses = [trainer.teacher(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["label"]])).loss
                  for r in trainer.eval_dataset]
    assert metrics["teacher_loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert trainer.teacher_metrics["accuracy"] == metrics["teacher_accuracy"]
    assert [e for e in trainer.state.log_history if "eval_accuracy" in e][-1] == student_eval


_TEACHER_EVAL_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
from helpers import args, bert, collate, leave_distributed_run, teacher, token_dataset
from hf_distill import DistillationTrainer

def metrics(pred):
    logits, labels = pred
    return {{"accuracy": float((logits.argmax(-1) == labels).mean()), "rows": float(len(labels)),
             "logit_sum": float(logits.sum())}}

out = Path(sys.argv[1])
a = args(out.parent, per_device_eval_batch_size=4)
trainer = DistillationTrainer(model=bert(2), teacher_model=teacher(), args=a,
                              eval_dataset=token_dataset(15, seed=4), data_collator=collate, compute_metrics=metrics)
result = trainer.evaluate_teacher()
if trainer.is_world_process_zero():
    out.write_text(json.dumps({{"metrics": result, "world": trainer.args.world_size}}))
leave_distributed_run()  # no interpreter teardown, where a gloo rank can abort under load after a correct run
"""


@pytest.mark.distributed
def test_evaluate_teacher_runs_on_every_process_under_ddp(tmp_path):
    """Every rank evaluates its share with the teacher and the metrics are gathered: the same as one process
    (15 rows, so the last batch is uneven and the gather must drop the padding)."""
    script = tmp_path / "teacher_eval.py"
    script.write_text(_TEACHER_EVAL_SCRIPT.format(tests=str(Path(__file__).parent)))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    root = str(Path(__file__).parents[1])  # this checkout's hf_distill, not an installed one
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    runs = {}
    for name, launcher in (("single", []), ("ddp", ["-m", "torch.distributed.run", "--nproc_per_node", "2",
                                                    "--master_port", port])):
        out = tmp_path / name / "result.json"
        out.parent.mkdir()
        proc = subprocess.run([sys.executable, *launcher, str(script), str(out)], env=env, capture_output=True,
                              text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = json.loads(out.read_text())
    assert (runs["single"]["world"], runs["ddp"]["world"]) == (1, 2)
    single, ddp = runs["single"]["metrics"], runs["ddp"]["metrics"]
    assert single["teacher_rows"] == ddp["teacher_rows"] == 15
    for key in ("teacher_accuracy", "teacher_logit_sum"):
        assert ddp[key] == pytest.approx(single[key], rel=1e-5), key
    # The loss is a mean of batch means, as in Trainer.evaluate: uneven batches weigh rows differently.
    assert ddp["teacher_loss"] > 0


def test_card_options_that_would_run_a_model_on_one_process_are_refused(pushed, monkeypatch):
    trainer, _, _ = pushed
    with pytest.raises(TypeError, match=r"trainer.evaluate_teacher\(\)"):
        trainer.create_model_card(evaluate_teacher=True)
    with pytest.raises(ValueError, match="metric_key_prefix='eval'"):
        trainer.evaluate_teacher(metric_key_prefix="eval")
    monkeypatch.setattr("hf_distill.placement.teacher_mode", lambda accelerator: "fsdp_sharded")
    with pytest.raises(ValueError, match="fsdp_sharded across processes"):
        trainer.create_model_card(measure_speed=True)


def test_card_of_a_run_without_evaluation_set(pushed, monkeypatch):
    """Speed is then measured on training batches; the teacher column is the recorded evaluate_teacher()'s."""
    trainer, _, _ = pushed
    readme = Path(trainer.args.output_dir) / "README.md"
    pushed_card = readme.read_bytes()
    monkeypatch.setattr(trainer, "eval_dataset", None)
    try:
        trainer.create_model_card(model_name="me/no-eval", measure_speed=True)
        text = readme.read_text()
    finally:
        readme.write_bytes(pushed_card)
    assert "batches of 8 training examples" in text
    metrics = table_with(text, ["Metric", "Teacher", "Student", "% of teacher"])
    assert metrics["accuracy"][0] == f"{trainer.teacher_metrics['accuracy']:.4f}"


def test_non_blocking_push_returns_a_future(pushed):
    trainer, _, _ = pushed
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        future = trainer.push_to_hub(commit_message="async", blocking=False)
        url = future.result(timeout=30)
        assert url == f"{hub.endpoint}/{REPO}/commit/{hub.repos[REPO]['commits'][-1]['oid']}"
        assert hub.repos[REPO]["commits"][-1]["summary"] == "async"


# ---------------------------------------------------------------------- push_student and its failures


@pytest.fixture()
def student_dir(pushed, tmp_path) -> Path:
    folder = tmp_path / "student"
    folder.mkdir()
    for name in upload_files(pushed[0].args.output_dir):
        shutil.copy(Path(pushed[0].args.output_dir) / name, folder / name)
    shutil.copy(Path(pushed[0].args.output_dir) / "training_args.bin", folder)
    return folder


def test_push_student_private_branch_and_token(student_dir):
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, "http://127.0.0.1:9")  # the explicit endpoint wins over the configured one
        url = push_student(
            student_dir,
            "fake-org/tiny",
            private=True,
            revision="v1",
            token="hf_test",
            commit_message="first",
            endpoint=hub.endpoint,
        )
    repo = hub.repos["fake-org/tiny"]
    assert repo["private"] is True
    assert set(hub.files("fake-org/tiny", "v1")) == set(upload_files(student_dir))
    assert "training_args.bin" not in hub.files("fake-org/tiny", "v1")
    assert hub.files("fake-org/tiny", "main") == {}
    assert url.endswith(repo["commits"][-1]["oid"]) and repo["commits"][-1]["summary"] == "first"
    api_calls = [r for r in hub.requests if r[1] != "/api/agent-harnesses"]
    assert api_calls and all(auth == "Bearer hf_test" for _, _, auth in api_calls)


def test_server_error_on_commit_is_reported_and_folder_is_untouched(student_dir):
    before = snapshot(student_dir)
    with FakeHub(fail={"commit": 500}) as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint, xet=False)
        with pytest.raises(HubPushError) as caught:
            push_student(student_dir, "fake-user/broken")
    message = str(caught.value)
    assert message.startswith(f"Could not push {student_dir} to fake-user/broken at {hub.endpoint}: ")
    assert "500" in message and "simulated commit failure" in message
    assert hub.files("fake-user/broken") == {}
    assert snapshot(student_dir) == before


def test_refused_connection_is_reported_and_folder_is_untouched(student_dir):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    before = snapshot(student_dir)
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        online(mp, endpoint)
        with pytest.raises(HubPushError, match=rf"to fake-user/nowhere at {endpoint}: ConnectError"):
            push_student(student_dir, "fake-user/nowhere")
    assert time.perf_counter() - start < 10
    assert snapshot(student_dir) == before


def test_offline_mode_is_reported(student_dir):
    assert hub_constants.HF_HUB_OFFLINE  # conftest sets HF_HUB_OFFLINE=1
    with pytest.raises(HubPushError, match=r"fake-user/x at .*offline mode is enabled"):
        push_student(student_dir, "fake-user/x", endpoint="http://127.0.0.1:9")


def test_a_folder_that_is_not_a_student_is_refused_before_any_request(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with FakeHub() as hub, pytest.raises(HubPushError, match="no config.json"):
        push_student(tmp_path, "fake-user/x", endpoint=hub.endpoint)
    assert hub.requests == []
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(HubPushError, match="no safetensors weights"):
        upload_files(tmp_path)


def test_sharded_weights_are_published_by_their_index(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in [*shards, "model-00003-of-00003.safetensors"]:  # the last one is a stale shard
        (tmp_path / name).write_bytes(b"x")
    weight_map = {"a": shards[0], "b": shards[1]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert upload_files(tmp_path) == ["config.json", "model.safetensors.index.json", *shards]


# ---------------------------------------------------------------------- the card on its own


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_preset_cites_its_paper(preset, tmp_path):
    args = DistillationArguments(output_dir=str(tmp_path), distill_preset=preset, report_to=[])
    summary = args.distillation_summary()
    method = detect_method(summary)
    expected = {
        "distilbert": "sanh2019distilbert",
        "tinybert_intermediate": "jiao2020tinybert",
        "tinybert_prediction": "jiao2020tinybert",
        "minilm": "wang2020minilm",
        "minilmv2": "wang2021minilmv2",
    }[preset]
    report = DistillationReport(method=method, distillation=summary, model_name="x/y")
    assert citations(report)[0] == expected
    text = str(model_card(report))
    assert f"@{'article' if expected.startswith('sanh') else 'inproceedings'}{{{expected}," in text
    assert method in front_matter(text)["tags"]


def test_logit_kd_and_pkd_citations():
    assert citations(DistillationReport(method="logit-kd", distillation={"kd_weight": 0.5})) == [
        "hinton2015distilling"
    ]
    pkd = {"kd_weight": 0.5, "distill_terms": [{"loss": "pkd_loss", "layers": "uniform", "weight": 1.0}]}
    assert detect_method(pkd) == "bert-pkd"
    assert citations(DistillationReport(method="bert-pkd", distillation=pkd)) == [
        "sun2019patient",
        "hinton2015distilling",
    ]


@pytest.mark.parametrize("key", sorted(BIBTEX))
def test_bibtex_entries_are_well_formed(key):
    entry = BIBTEX[key]
    assert entry.startswith(("@article{" + key + ",", "@inproceedings{" + key + ","))
    depth = 0
    for char in entry:
        depth += {"{": 1, "}": -1}.get(char, 0)
        assert depth >= 0
    assert depth == 0
    fields = {line.split("=")[0].strip() for line in entry.splitlines()[1:-1] if "=" in line}
    assert {"title", "author", "year"} <= fields


def test_card_of_a_layer_copied_student_with_a_hub_teacher():
    report = DistillationReport(
        model_name="me/student",
        teacher="org/teacher-base",
        architecture="BertForTokenClassification",
        pipeline_tag="token-classification",
        student_init={"init": "from_teacher", "teacher_layers": [0, 2, 4], "teacher_num_layers": 6},
        distillation={
            "kd_loss": "kl",
            "temperature": 4.0,
            "kd_weight": 1.0,
            "task_weight": 0.0,
            "distill_terms": [{"loss": "cosine_loss", "layers": [[3, 6]], "weight": 1.0, "name": "cos"}],
        },
        stages=["general distillation on Wikipedia", "task distillation on CoNLL-2003"],
        augmentation="none",
    )
    text = str(model_card(report))
    meta = front_matter(text)
    assert meta["base_model"] == "org/teacher-base" and meta["pipeline_tag"] == "token-classification"
    assert "model-index" not in meta  # no metrics, no dataset: nothing to index
    assert "teacher encoder layers [0, 2, 4] (0-based) of its 6" in text
    losses = table_with(text, ["Term", "Loss", "Weight", "Layers (student -> teacher)"])
    assert set(losses) == {"kd", "cos"} and losses["cos"] == ["cosine_loss", "1", "3 -> 6"]
    assert "1. general distillation on Wikipedia" in text and "AutoModelForTokenClassification" in text


def test_local_teacher_is_named_but_not_a_base_model(tmp_path):
    report = DistillationReport(teacher=str(tmp_path / "my-teacher"))
    (tmp_path / "my-teacher").mkdir()
    text = str(model_card(report))
    assert "base_model" not in front_matter(text) and "`my-teacher`" in text


def test_empty_report_gives_a_card_without_placeholders():
    text = str(model_card(DistillationReport()))
    assert "## Teacher vs student" not in text and "## Training" not in text and "## Citation" not in text
    assert "None" not in text and "More information" not in text
    assert front_matter(text) == {"library_name": "transformers", "tags": ["distillation", "hf-distill"]}


def test_results_json_in_the_demo_format_feeds_the_card(student_dir):
    results = {
        "produced_by": "hf_distill.demo",
        "teacher_accuracy": 0.8727,
        "student_accuracy": 0.8716,
        "retained_percent": 99.87,
        "teacher_parameters": 22713216,
        "student_parameters": 17390000,
        "speedup": 1.94,
        "student_layers": [0, 2, 4],
        "epochs": 3.0,
        "learning_rate": 5e-5,
        "bf16": True,
        "seed": 42,
        "teacher_reused_from_cache": False,
    }
    (student_dir / "results.json").write_text(json.dumps(results))
    report = DistillationReport.from_folder(student_dir)
    assert report.student_metrics["accuracy"] == 0.8716 and report.teacher_metrics == {"accuracy": 0.8727}
    assert (report.teacher_params, report.student_params, report.speedup) == (22713216, 17390000, 1.94)
    assert report.training["precision"] == "bf16 mixed precision" and report.training["seed"] == 42
    text = str(model_card(report))
    assert table_with(text, ["Metric", "Teacher", "Student", "% of teacher"])["accuracy"] == [
        "0.8727",
        "0.8716",
        "99.9%",
    ]


def test_card_parses_back_with_huggingface_hub(student_dir):
    card = ModelCard.load(student_dir / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert card.data.base_model is None  # the last push named no teacher id, and a local path is not one
    assert card.text.lstrip().startswith(f"# {REPO}\n")


def test_a_student_of_a_local_teacher_publishes_no_absolute_path(tmp_path):
    """tiny_run loads its teacher from an absolute folder and shrinks it: config.json records the teacher by its
    folder name, the card names it so, and no uploaded file holds the machine's path (issue #39 case 17)."""
    trainer = tiny_run(tmp_path, max_steps=2, eval_strategy="no", save_strategy="no", hidden_term=False)
    assert trainer.teacher.config._name_or_path == str(tmp_path / "teacher")
    trainer.evaluate()
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        trainer.push_to_hub()
    files = hub.files(REPO)
    assert json.loads(files["config.json"])["distillation"]["teacher_name_or_path"] == "teacher"
    assert "distilled from `teacher`" in files["README.md"].decode()
    for root in {str(tmp_path), str(tmp_path.resolve())}:
        for name, data in files.items():
            assert root.encode() not in data, name


# ---------------------------------------------------------------------- pushes during training (hub_strategy)


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint"])
def test_pushes_during_training_send_the_student_files_only(tmp_path, strategy):
    """The Trainer's own save-time push uploads all of `output_dir` (training_args.bin, logs, whatever a user
    keeps there); ours sends the checkpoint's student files to the repo root, and the resumable checkpoint
    (optimizer state, projections) only where `hub_strategy` asks for it."""
    push = DistillationTrainer._push_from_checkpoint

    def push_and_wait(self, checkpoint_folder):
        # A save-time push is skipped while the previous one is still in flight (as in the Trainer), so which
        # saves get a commit depends on timing; waiting for each push before training goes on makes every save
        # push, deterministically. The push itself is untouched.
        push(self, checkpoint_folder)
        self._finish_current_push()

    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        mp.setattr(DistillationTrainer, "_push_from_checkpoint", push_and_wait)
        out = tmp_path / "out"
        out.mkdir()
        (out / "notes.txt").write_text("a user's own file")
        trainer = tiny_run(tmp_path, push_to_hub=True, hub_strategy=strategy, eval_strategy="no")
        commits = [c["summary"] for c in hub.repos[REPO]["commits"]]
        files = set(hub.files(REPO))
    trainer.processing_class.save_pretrained(tmp_path / "tok")
    student = {"config.json", "model.safetensors"} | {p.name for p in (tmp_path / "tok").iterdir()}
    pushes = ["Training in progress, step 3", "Training in progress, step 6"]
    if strategy == "checkpoint":
        pushes += [f"{p}, checkpoint" for p in pushes]
    assert sorted(commits) == sorted(pushes)
    root = {name for name in files if "/" not in name}
    assert root == student
    assert (out / "notes.txt").is_file() and (out / "checkpoint-6" / "training_args.bin").is_file()
    if strategy == "checkpoint":
        nested = {name.split("/", 1)[1] for name in files if name.startswith("last-checkpoint/")}
        assert {"optimizer.pt", "distill_projections.pt", "model.safetensors"} <= nested
    else:
        assert files == root


# ---------------------------------------------------------------------- causal-LM, PEFT and example-script cards


def _causal_run(root: Path, **overrides):
    """A real run of a causal-LM student pruned from a 4-block tiny Llama teacher (prune_depth keeps 2 blocks) on
    prompt + completion rows, with an evaluation set and the teacher evaluated on it, then its card."""
    from helpers import args, labelled_collate, llama, sft_rows

    from hf_distill import students

    teacher = llama(seed=1, layers=4)
    teacher.config._name_or_path = "fake-org/tiny-llama"  # as from_pretrained("fake-org/tiny-llama") names it
    calibration = [labelled_collate([sft_rows(4, seed=7)[i] for i in range(4)])]
    student, pruning = students.prune_depth(teacher, 2, calibration)
    settings = dict(kd_loss="jsd", temperature=1.0, kd_token_mask="labels", kd_weight=0.5,
                    task_weight=0.5, max_steps=2, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    settings.update(overrides)
    if settings["kd_loss"] == "jsd":  # beta belongs to the JSD only (DistillationArguments refuses it elsewhere)
        settings.setdefault("jsd_beta", 0.5)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args(root, **settings),
                                  train_dataset=sft_rows(16), eval_dataset=sft_rows(8, seed=9),
                                  data_collator=labelled_collate)
    trainer.train()
    trainer.evaluate_teacher()
    trainer.create_model_card()
    return trainer, pruning, (Path(trainer.args.output_dir) / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kd_loss", "tag", "named", "paper"),
    [
        ("jsd", "gkd", "Generalized JSD distillation (beta = 0.5; GKD, Agarwal et al., 2024)", "agarwal2024gkd"),
        ("reverse_kl", "reverse-kl", "Reverse KL distillation (MiniLLM, Gu et al., 2024)", "gu2024minillm"),
        ("kl", "logit-kd", "Forward KL distillation of the next-token distributions (Hinton et al., 2015)",
         "hinton2015distilling"),
    ],
)
def test_causal_lm_card_names_the_objective_tokens_pruning_and_perplexity(tmp_path, kd_loss, tag, named, paper):
    """The card of a causal-LM run names its logit objective as the literature does (not "logit distillation" for
    a JSD or a reverse KL), with beta and T, which tokens were distilled, the blocks prune_depth kept, and the
    student's and teacher's evaluation loss with its exp, the perplexity."""
    trainer, pruning, text = _causal_run(tmp_path, kd_loss=kd_loss)
    meta = front_matter(text)
    assert tag in meta["tags"] and (tag == "logit-kd") == ("logit-kd" in meta["tags"])
    assert f"- **Method**: {named}" in text
    assert ("- **Beta** (generalized JSD): 0.5" in text) == (kd_loss == "jsd")
    assert "- **Temperature**: 1" in text
    assert "- **Distilled tokens**: completion tokens only" in text and "`kd_token_mask=labels`" in text
    assert f"kept decoder blocks {pruning.kept} (0-based) of its 4, removed {pruning.removed}" in text
    assert "ShortGPT, Men et al., 2024" in text
    keys = citations(DistillationReport.from_dict(json.loads(
        (Path(trainer.args.output_dir) / "distillation_report.json").read_text())))
    assert paper in keys and "men2024shortgpt" in keys
    assert ("hinton2015distilling" in keys) == (kd_loss == "kl")
    student_loss = [e for e in trainer.state.log_history if "eval_loss" in e][-1]["eval_loss"]
    teacher_loss = trainer.teacher_metrics["loss"]
    metrics = table_with(text, ["Metric", "Teacher", "Student", "% of teacher"])
    assert metrics["loss"][:2] == [f"{teacher_loss:.4f}", f"{student_loss:.4f}"]
    assert metrics["perplexity"][:2] == [f"{math.exp(teacher_loss):.4f}", f"{math.exp(student_loss):.4f}"]
    assert "its exp" in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "tag", "named", "loss", "alpha", "paper"),
    [
        (dict(kd_loss="skew_kl", skew_alpha=0.3), "distillm",
         "Skew KL distillation (alpha = 0.3; DistiLLM, Ko et al., 2024)", "skew KL divergence (alpha = 0.3) x T^2",
         "- **Alpha** (skew KL): 0.3 (KL(teacher || alpha teacher + (1 - alpha) student); 0 is the forward KL",
         "ko2024distillm"),
        (dict(kd_loss="skew_reverse_kl"), "distillm",
         "Skew reverse KL distillation (alpha = 0.1; DistiLLM, Ko et al., 2024)",
         "skew reverse KL divergence (alpha = 0.1) x T^2",
         "- **Alpha** (skew reverse KL): 0.1 (KL(student || alpha student + (1 - alpha) teacher); 0 is the reverse KL",
         "ko2024distillm"),
        (dict(kd_loss="tvd"), "tvd-kd",
         "Total variation distance distillation (f-divergence KD, Wen et al., 2023)", "total variation distance x T^2",
         None, "wen2023fdivergence"),
    ],
    ids=["skew_kl", "skew_reverse_kl", "tvd"],
)
def test_causal_lm_card_names_distillm_and_tvd_objectives(tmp_path, settings, tag, named, loss, alpha, paper):
    """DistiLLM's skew KLs and the total variation distance are named, tagged and cited as their papers (not as
    Hinton et al.'s logit distillation), with the skew's alpha (the default 0.1 when unset) and T, also when the
    card is written later from the saved folder alone (training_args.bin)."""
    trainer, _, text = _causal_run(tmp_path, **settings)
    folder = Path(trainer.args.output_dir)
    trainer.save_model()
    trainer.save_state()
    (folder / "distillation_report.json").unlink()
    for card in (text, write_model_card(folder).read_text()):
        meta = front_matter(card)
        assert tag in meta["tags"] and "logit-kd" not in meta["tags"]
        assert f"- **Method**: {named}, on the training sequences (no student-generated samples)" in card
        rows = table_with(card, ["Term", "Loss", "Weight", "Layers (student -> teacher)"])
        assert rows["kd"] == [f"{loss} between student and teacher logits, T = 1", "0.5", "output logits"]
        assert "- **Temperature**: 1" in card
        assert ("- **Alpha**" in card) == (alpha is not None) and (alpha is None or alpha in card)
        assert BIBTEX[paper] in card and "hinton2015distilling" not in card
        assert "- **Distilled tokens**: completion tokens only" in card


@pytest.mark.slow
def test_causal_lm_card_from_the_folder_alone_and_with_the_teacher_in_evaluation(tmp_path):
    """From saved files only (training_args.bin, trainer_state.json) the card still shows beta, the tokens and
    the perplexity; when the teacher joined evaluation (eval_with_teacher) eval_loss is the distillation loss,
    of which no perplexity is given."""
    trainer, pruning, _ = _causal_run(tmp_path / "own")
    folder = Path(trainer.args.output_dir)
    trainer.save_model()
    trainer.save_state()
    (folder / "distillation_report.json").unlink()
    text = write_model_card(folder).read_text()
    student_loss = [e for e in trainer.state.log_history if "eval_loss" in e][-1]["eval_loss"]
    metrics = table_with(text, ["Metric", "Student"])
    assert metrics["loss"] == [f"{student_loss:.4f}"] and metrics["perplexity"] == [f"{math.exp(student_loss):.4f}"]
    assert "- **Beta** (generalized JSD): 0.5" in text and "completion tokens only" in text
    assert f"kept decoder blocks {pruning.kept}" in text

    with_teacher, _, text = _causal_run(tmp_path / "with_teacher", eval_with_teacher=True)
    assert [e for e in with_teacher.state.log_history if "eval_loss" in e]
    assert "perplexity" not in text and "| loss |" not in text


def test_peft_student_card_is_a_peft_card(tmp_path):
    """A PEFT student's repository holds adapters: the card says `library_name: peft` and names the model the
    adapters load onto as `base_model` (with PEFT's own tags), while the teacher stays the teacher."""
    peft = pytest.importorskip("peft")
    from helpers import args, bert, collate, token_dataset
    from helpers import teacher as make_teacher

    base = bert(2)
    base.name_or_path = base.config._name_or_path = "fake-org/bert-base-for-adapters"  # as from_pretrained sets them
    student = peft.get_peft_model(base, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                                        target_modules=["query", "value"]))
    teacher = make_teacher()
    teacher.config._name_or_path = TEACHER_ID
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path, max_steps=2),
                                  train_dataset=token_dataset(16), data_collator=collate)
    trainer.train()
    trainer.save_model()
    trainer.create_model_card()
    out = Path(trainer.args.output_dir)
    from_trainer = (out / "README.md").read_text()
    (out / "distillation_report.json").unlink()  # then the card of the folder (adapter_config.json) + the teacher's id
    for text in (from_trainer, write_model_card(out, teacher=TEACHER_ID).read_text()):
        meta = front_matter(text)
        assert meta["library_name"] == "peft"
        assert meta["base_model"] == "fake-org/bert-base-for-adapters"
        assert {"lora", "transformers", "base_model:adapter:fake-org/bert-base-for-adapters"} <= set(meta["tags"])
        assert f"- **Teacher**: [{TEACHER_ID}](https://huggingface.co/{TEACHER_ID})" in text
        assert ModelCard(text).data.library_name == "peft"


def test_example_script_finetuned_from_is_the_students_start_not_the_teacher(tmp_path):
    """transformers' example scripts end with `create_model_card(finetuned_from=model_args.model_name_or_path)`
    or `push_to_hub(finetuned_from=..., tasks=...)`: that is the student's starting checkpoint. The card, its
    report and the published card name the teacher the trainer distilled from, and show the start as such."""
    trainer = tiny_run(tmp_path, max_steps=2, eval_strategy="no", save_strategy="no", hidden_term=False)
    trainer.teacher.config._name_or_path = TEACHER_ID  # as from_pretrained(TEACHER_ID) names it
    start = "fake-user/bert-qa-student-init"
    out = Path(trainer.args.output_dir)
    trainer.save_model()
    trainer.create_model_card(finetuned_from=start, tasks="text-classification")
    report = json.loads((out / "distillation_report.json").read_text())
    assert report["teacher"] == TEACHER_ID and report["initialised_from"] == start
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        trainer.push_to_hub(finetuned_from=start, tasks="text-classification")
    for text in ((out / "README.md").read_text(), hub.files(REPO)["README.md"].decode()):
        assert front_matter(text)["base_model"] == TEACHER_ID
        assert f"distilled from [{TEACHER_ID}](https://huggingface.co/{TEACHER_ID})" in text
        assert f"- **Teacher**: [{TEACHER_ID}]" in text
        assert f"- **Initialised from**: [{start}](https://huggingface.co/{start}) (the student's starting" in text
        assert f"distilled from [{start}]" not in text and f"**Teacher**: [{start}]" not in text
        sizes = table_with(text, ["", "Teacher", "Student", "Student / teacher"])
        assert sizes["Parameters"][0] == f"{measure.count_parameters(trainer.teacher):,}"
