"""PNG plots of distillation runs, as `hf-distill report` draws them.

`make_report(output_dir)` draws the loss components against steps (`loss_components.png`) and, when the
folder holds several runs, accuracy against parameter count (`accuracy_vs_params.png`). matplotlib is
imported only when a plot is drawn (`pip install 'hf-distill[plots]'`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import LOSS_PLOT, RESULTS_FILE, _number, _read_json, find_trainer_state

ACCURACY_PLOT = "accuracy_vs_params.png"


def make_report(output_dir: str | os.PathLike) -> dict[str, Path]:
    """Write the run's plots into `output_dir`; returns {plot name: path}."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        raise FileNotFoundError(f"{output_dir} is not a folder.")
    written: dict[str, Path] = {}
    state = find_trainer_state(output_dir)
    if state is not None:
        written["loss_components"] = plot_loss_components(state, output_dir / LOSS_PLOT)
    runs = collect_runs(output_dir)
    if len(runs) >= 2:
        written["accuracy_vs_params"] = plot_accuracy_vs_params(runs, output_dir / ACCURACY_PLOT)
    if not written:
        raise FileNotFoundError(
            f"Nothing to plot in {output_dir}: no trainer_state.json (in it or a checkpoint-* folder) and "
            f"fewer than two run folders with a {RESULTS_FILE} holding `accuracy` and `params`."
        )
    return written


def loss_series(log_history: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """{logged loss name: (steps, values)} for every key starting with `loss` (train logs only)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        if "step" not in entry:
            continue
        for key, value in entry.items():
            if key.startswith("loss") and _number(value):
                steps, values = series.setdefault(key, ([], []))
                steps.append(entry["step"])
                values.append(float(value))
    return series


def plot_loss_components(trainer_state: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Every logged loss (`loss`, `loss_kd`, `loss_hidden`, ...) against the training step."""
    series = loss_series(_read_json(Path(trainer_state)).get("log_history", []))
    if not series:
        raise ValueError(f"{trainer_state} logs no loss: train with logging_steps > 0 to get a loss curve.")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for key in sorted(series, key=lambda k: (k != "loss", k)):
        steps, values = series[key]
        ax.plot(
            steps,
            values,
            marker="o" if len(steps) < 30 else None,
            linewidth=2 if key == "loss" else 1.2,
            label=key,
        )
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (unweighted components, weighted total)")
    folder = Path(trainer_state).resolve().parent
    run = folder.parent.name if folder.name.startswith("checkpoint-") else folder.name
    ax.set_title(f"Loss components: {run}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, plt, out)


def collect_runs(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Runs below `output_dir` (one level) whose results.json has an accuracy and a parameter count."""
    runs = []
    for path in sorted(Path(output_dir).glob(f"*/{RESULTS_FILE}")):
        data = _read_json(path)
        accuracy = data.get("accuracy", data.get("student_accuracy"))
        params = data.get("params", data.get("student_parameters"))
        if _number(accuracy) and _number(params):
            runs.append(
                {
                    "name": path.parent.name,
                    "accuracy": float(accuracy),
                    "params": int(params),
                    "teacher_accuracy": data.get("teacher_accuracy"),
                    "teacher_params": data.get("teacher_params", data.get("teacher_parameters")),
                }
            )
    return runs


def plot_accuracy_vs_params(runs: list[dict[str, Any]], out: str | os.PathLike) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.scatter(
        [r["params"] / 1e6 for r in runs], [r["accuracy"] for r in runs], s=50, label="students", zorder=3
    )
    for r in runs:
        ax.annotate(
            r["name"],
            (r["params"] / 1e6, r["accuracy"]),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
        )
    teachers = {
        (r["teacher_params"], r["teacher_accuracy"])
        for r in runs
        if _number(r["teacher_params"]) and _number(r["teacher_accuracy"])
    }
    if teachers:
        ax.scatter(
            [p / 1e6 for p, _ in teachers],
            [a for _, a in teachers],
            marker="*",
            s=200,
            color="tab:red",
            label="teacher",
            zorder=3,
        )
    ax.set_xscale("log")
    ax.set_xlabel("parameters (millions, log scale)")
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, plt, out)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("Plots need matplotlib: pip install 'hf-distill[plots]'.") from None
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    return plt


def _save(fig, plt, out: str | os.PathLike) -> Path:
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
