"""PNG plots of distillation runs, as `hf-distill report` draws them.

`make_report(output_dir)` draws the loss components against steps (`loss_components.png`) and, when the folder
holds several runs, accuracy against parameter count (`accuracy_vs_params.png`, from each run's results.json as
`report.read_results` reads it). matplotlib is imported only to draw (`pip install 'hf-distill[plots]'`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .report import LOSS_PLOT, RESULTS_FILE, _number, _read_json, find_trainer_state, read_results

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
            f"fewer than two run folders with a {RESULTS_FILE} holding `accuracy` and `params`.")
    return written


def loss_series(log_history: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """{logged loss name: (steps, values)} for every key starting with `loss` (train logs only)."""
    series: dict[str, tuple[list[int], list[float]]] = {}
    for entry in log_history:
        for key, value in entry.items():
            if "step" in entry and key.startswith("loss") and _number(value):
                series.setdefault(key, ([], []))[0].append(entry["step"])
                series[key][1].append(float(value))
    return series


def plot_loss_components(trainer_state: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Every logged loss (`loss`, `loss_kd`, `loss_hidden`, ...) against the training step."""
    state = _read_json(Path(trainer_state))
    series = loss_series(state.get("log_history", []))
    if not series:  # e.g. 2 steps under the Trainer's default logging_steps=500: no training log was written
        steps, every = state.get("global_step"), state.get("logging_steps")
        raise ValueError(f"{trainer_state} logs no loss (global_step {steps}, logging_steps {every}): the Trainer "
                         "logs the loss every logging_steps steps; train with logging_steps at most the steps "
                         "trained to get a loss curve.")
    plt, fig, ax = _figure()
    for key in sorted(series, key=lambda k: (k != "loss", k)):
        steps, values = series[key]
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, linewidth=2 if key == "loss" else 1.2,
                label=key)
    folder = Path(trainer_state).resolve().parent
    run = folder.parent.name if folder.name.startswith("checkpoint-") else folder.name
    ax.set(xlabel="training step", ylabel="loss (unweighted components, weighted total)",
           title=f"Loss components: {run}")
    return _save(plt, fig, ax, out)


def collect_runs(output_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Runs below `output_dir` (one level) whose results.json has an accuracy and a parameter count."""
    runs = []
    for path in sorted(Path(output_dir).glob(f"*/{RESULTS_FILE}")):
        found = read_results(path)
        accuracy, params = found["student_metrics"].get("accuracy"), found["student_params"]
        if accuracy is not None and params is not None:
            runs.append({"name": path.parent.name, "accuracy": accuracy, "params": params,
                         "teacher_accuracy": found["teacher_metrics"].get("accuracy"),
                         "teacher_params": found["teacher_params"]})
    return runs


def plot_accuracy_vs_params(runs: list[dict[str, Any]], out: str | os.PathLike) -> Path:
    plt, fig, ax = _figure()
    ax.scatter([r["params"] / 1e6 for r in runs], [r["accuracy"] for r in runs], s=50, label="students", zorder=3)
    for r in runs:
        ax.annotate(r["name"], (r["params"] / 1e6, r["accuracy"]), textcoords="offset points", xytext=(5, 5),
                    fontsize=8)
    teachers = {(r["teacher_params"], r["teacher_accuracy"]) for r in runs
                if _number(r["teacher_params"]) and _number(r["teacher_accuracy"])}
    if teachers:
        ax.scatter([p / 1e6 for p, _ in teachers], [a for _, a in teachers], marker="*", s=200, color="tab:red",
                   label="teacher", zorder=3)
    ax.set_xscale("log")
    ax.set(xlabel="parameters (millions, log scale)", ylabel="accuracy", title="Accuracy against size")
    return _save(plt, fig, ax, out)


def plot_accuracy_vs_latency(rows: list[dict[str, Any]], setup: dict[str, Any], out: str | os.PathLike) -> Path:
    """`hf_distill.auto`'s candidates: proxy and final metric against measured latency, the budget as a line; the
    candidates over the budget (never trained) sit on the x axis as ticks."""
    plt, fig, ax = _figure()
    metric, teacher = setup["metric"], setup["teacher"]
    proxy = [r for r in rows if r.get("proxy_metric") is not None]
    ax.scatter([r["latency_ms"] for r in proxy], [r["proxy_metric"] for r in proxy], s=40, facecolors="none",
               edgecolors="tab:blue", label=f"after {setup['proxy_steps']} proxy steps", zorder=3)
    final = [r for r in rows if r.get("final_metric") is not None]
    ax.scatter([r["latency_ms"] for r in final], [r["final_metric"] for r in final], s=50, color="tab:green",
               label="fully distilled", zorder=3)
    for r in proxy:
        y = r["final_metric"] if r.get("final_metric") is not None else r["proxy_metric"]
        ax.annotate(r["name"] + (" (picked)" if r.get("picked") else ""), (r["latency_ms"], y),
                    textcoords="offset points", xytext=(5, 5), fontsize=8)
    over = [r["latency_ms"] for r in rows if not r.get("within_budget")]
    if over:
        ax.plot(over, [0] * len(over), "|", color="tab:gray", markersize=14, transform=ax.get_xaxis_transform(),
                label="over the budget (not trained)")
    if teacher.get("metric") is not None:
        ax.scatter([teacher["latency_ms"]], [teacher["metric"]], marker="*", s=200, color="tab:red", label="teacher",
                   zorder=3)
    ax.axvline(setup["budget_ms"], color="tab:red", linestyle="--", label=f"budget {setup['budget_ms']:g} ms")
    ax.set(xlabel=f"latency (ms; {setup['device']}, batch {setup['batch_size']} x {setup['seq_len']} tokens)",
           ylabel=metric, title=f"{metric} against latency")
    return _save(plt, fig, ax, out)


def _figure() -> tuple[Any, Any, Any]:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("Plots need matplotlib: pip install 'hf-distill[plots]'.") from None
    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    return (plt, *plt.subplots(figsize=(8, 5), dpi=100))


def _save(plt: Any, fig: Any, ax: Any, out: str | os.PathLike) -> Path:
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return Path(out)
