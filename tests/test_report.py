"""Plots of a run (`hf_distill.publish.report`), drawn from real short DistillationTrainer runs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hub_server import tiny_run

from hf_distill.publish import measure
from hf_distill.publish.card import write_model_card
from hf_distill.publish.hub import upload_files
from hf_distill.publish.plots import ACCURACY_PLOT, LOSS_PLOT, loss_series, make_report, plot_loss_components
from hf_distill.publish.report import find_trainer_state, latest_eval_metrics


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real runs in one sweep folder: logit KD + hidden MSE (6 steps), and logit KD alone (4 steps)."""
    sweep = tmp_path_factory.mktemp("sweep")
    trainers = [
        tiny_run(sweep / "work_a", output_dir=str(sweep / "kd_hidden"), max_steps=6, logging_steps=1),
        tiny_run(
            sweep / "work_b",
            output_dir=str(sweep / "kd_only"),
            hidden_term=False,
            max_steps=4,
            logging_steps=1,
        ),
    ]
    for trainer in trainers:
        trainer.save_model()
        accuracy = latest_eval_metrics(trainer.state.log_history)[0]["accuracy"]
        results = {
            "accuracy": accuracy,
            "params": measure.count_parameters(trainer.model),
            "teacher_accuracy": 0.5,
            "teacher_parameters": measure.count_parameters(trainer.teacher),
        }
        Path(trainer.args.output_dir, "results.json").write_text(json.dumps(results))
    return sweep, trainers


@pytest.mark.slow
def test_trainer_state_comes_from_the_latest_checkpoint(runs):
    _, (trainer, _) = runs
    out = Path(trainer.args.output_dir)
    assert find_trainer_state(out) == out / "checkpoint-6" / "trainer_state.json"
    trainer.save_state()  # a top-level state of the same step wins over the checkpoint's
    assert find_trainer_state(out) == out / "trainer_state.json"


def test_every_loss_component_is_a_series(runs):
    _, (trainer, _) = runs
    series = loss_series(trainer.state.log_history)
    assert set(series) == {"loss", "loss_kd", "loss_task", "loss_hidden"}
    logged = [e for e in trainer.state.log_history if "loss" in e]
    for name, (steps, values) in series.items():
        assert steps == [1, 2, 3, 4, 5, 6]
        assert values == pytest.approx([e[name] for e in logged])


def test_loss_plot_is_a_real_png(runs):
    _, (trainer, _) = runs
    out = Path(trainer.args.output_dir)
    written = make_report(out)
    assert written == {"loss_components": out / LOSS_PLOT}  # one run here: no accuracy-vs-size plot
    width, height = png_size(out / LOSS_PLOT)
    assert width >= 400 and height >= 300
    assert (out / LOSS_PLOT).stat().st_size > 10_000


def test_accuracy_vs_params_over_the_sweep(runs):
    sweep, _ = runs
    written = make_report(sweep)
    assert written == {"accuracy_vs_params": sweep / ACCURACY_PLOT}  # no trainer_state.json at the top
    width, height = png_size(sweep / ACCURACY_PLOT)
    assert width >= 400 and height >= 300
    assert (sweep / ACCURACY_PLOT).stat().st_size > 10_000


def test_card_embeds_the_loss_plot_and_the_push_takes_it_along(runs):
    _, (trainer, _) = runs
    out = Path(trainer.args.output_dir)
    make_report(out)
    write_model_card(out)
    readme = (out / "README.md").read_text()
    assert f"![Loss components against training steps]({LOSS_PLOT})" in readme
    assert LOSS_PLOT in upload_files(out)
    (out / "README.md").write_text(readme.replace(LOSS_PLOT, "elsewhere.png"))
    assert LOSS_PLOT not in upload_files(out)  # a plot the card does not show is not published


def test_nothing_to_plot_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="Nothing to plot"):
        make_report(tmp_path)
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 2, "log_history": [{"eval_loss": 0.5, "step": 2}]}))
    with pytest.raises(ValueError, match="logs no loss"):
        plot_loss_components(state, tmp_path / "x.png")


def test_no_loss_logged_names_the_steps_and_logging_steps(tmp_path):
    # a 2-step run under the default logging_steps=500 logs no loss: the message said "logging_steps > 0"
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"global_step": 2, "logging_steps": 500, "log_history": [{"train_loss": 1.0}]}))
    with pytest.raises(ValueError, match=r"global_step 2, logging_steps 500\).*at most the steps trained"):
        plot_loss_components(state, tmp_path / "x.png")


def test_latest_eval_metrics_merge_every_eval_set_and_drop_prefixed_losses_and_timings():
    from hf_distill.publish.report import latest_eval_metrics

    history = [
        {"eval_a_accuracy": 0.1, "step": 1},
        {"loss": 0.5, "step": 2},
        {"eval_a_accuracy": 0.7, "eval_a_loss": 0.3, "eval_a_runtime": 1.0, "step": 2},
        {"eval_b_accuracy": 0.9, "eval_b_loss": 0.2, "eval_b_samples_per_second": 9.0, "step": 2},
    ]
    assert latest_eval_metrics(history) == ({"a_accuracy": 0.7, "b_accuracy": 0.9}, 2)
    assert latest_eval_metrics([{"eval_accuracy": 0.5, "eval_loss": 0.1, "step": 3}]) == ({"accuracy": 0.5}, 3)


def test_the_card_reports_the_evaluation_of_the_best_checkpoint_load_best_model_at_end_put_back():
    """The weights handed over are the best checkpoint's: its evaluation, not the last one, unless the model was
    evaluated again after training (then that evaluation is of the restored weights)."""
    from hf_distill.publish.report import published_eval_metrics

    history = [{"eval_accuracy": 0.9, "step": 1}, {"loss": 0.5, "step": 2}, {"eval_accuracy": 0.6, "step": 2},
               {"train_runtime": 1.0, "train_loss": 0.5, "step": 2}]
    assert published_eval_metrics(history, best_step=1) == ({"accuracy": 0.9}, 1)
    assert published_eval_metrics(history) == ({"accuracy": 0.6}, 2)  # no best checkpoint restored
    again = [*history, {"eval_accuracy": 0.88, "step": 2}]  # trainer.evaluate() after training
    assert published_eval_metrics(again, best_step=1) == ({"accuracy": 0.88}, 2)
    assert published_eval_metrics(history[:3], best_step=1) == ({"accuracy": 0.6}, 2)  # a run still going


def test_pipeline_tag_of_encoder_decoder_lms_is_text2text_generation():
    """AutoModelForSeq2SeqLM's classes (T5/BART/Pegasus ...ForConditionalGeneration, MarianMTModel) are
    text2text-generation; MarianMTModel is no feature extractor for its "Model" suffix, and vision-language or
    speech `...ForConditionalGeneration` classes are not text-to-text models."""
    from hf_distill.publish.report import pipeline_tag_for

    for name in ("T5ForConditionalGeneration", "BartForConditionalGeneration", "MarianMTModel",
                 "PegasusForConditionalGeneration", "MT5ForConditionalGeneration"):
        assert pipeline_tag_for(name) == "text2text-generation", name
    assert pipeline_tag_for("LlavaForConditionalGeneration") != "text2text-generation"
    assert pipeline_tag_for("WhisperForConditionalGeneration") != "text2text-generation"
    assert pipeline_tag_for("LlamaForCausalLM") == "text-generation"
    assert pipeline_tag_for("BertModel") == "feature-extraction"


@pytest.mark.parametrize("task", ["text2text-generation", "translation", "summarization", "feature-extraction",
                                  "text-classification"])
def test_model_index_holds_the_results_of_every_student_task(task):
    """transformers' model index names only the tasks of its own table (no seq2seq, no feature extraction): the
    card extends that table for itself, so every student's metrics are indexed, and transformers' table is left
    as it was."""
    import yaml
    from huggingface_hub import ModelCard
    from transformers.modelcard import TASK_TAG_TO_NAME_MAPPING

    from hf_distill.publish.card import model_card
    from hf_distill.publish.report import DistillationReport

    table = dict(TASK_TAG_TO_NAME_MAPPING)
    report = DistillationReport(model_name="me/student", pipeline_tag=task, datasets=["wmt/wmt16"],
                                dataset_name="WMT16", dataset_config="de-en", dataset_split="validation",
                                student_metrics={"bleu": 12.5, "gen_len": 6.25})
    card = model_card(report)
    (index,) = yaml.safe_load(card.split("---\n", 2)[1])["model-index"]
    (result,) = index["results"]
    assert index["name"] == "me/student" and result["task"]["type"] == task and result["task"]["name"]
    assert result["dataset"] == {"name": "WMT16", "type": "wmt/wmt16", "config": "de-en", "split": "validation"}
    assert [(m["type"], m["value"]) for m in result["metrics"]] == [("bleu", 12.5), ("gen_len", 6.25)]
    assert [(r.task_type, r.metric_value) for r in ModelCard(card).data.eval_results] == [(task, 12.5), (task, 6.25)]
    assert TASK_TAG_TO_NAME_MAPPING == table
