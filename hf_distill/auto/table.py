"""What `auto_student` writes: the Pareto table (markdown and json), its plot, and the picked student's card facts."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

TABLE_MD, TABLE_JSON, TABLE_PLOT = "pareto.md", "pareto.json", "pareto.png"


def pareto_flags(rows: list[dict[str, Any]], greater_is_better: bool = True) -> None:
    """Mark each row with a proxy metric `pareto`: no other such row is as fast and as good, and better in one."""
    sign = 1.0 if greater_is_better else -1.0
    scored = [r for r in rows if r.get("proxy_metric") is not None]
    for r in rows:
        r["pareto"] = r in scored and not any(
            o is not r and o["latency_ms"] <= r["latency_ms"] and sign * o["proxy_metric"] >= sign * r["proxy_metric"]
            and (o["latency_ms"] < r["latency_ms"] or sign * o["proxy_metric"] > sign * r["proxy_metric"])
            for o in scored)


def setup_text(setup: dict[str, Any]) -> str:
    n = setup.get("threads")
    threads = f", {n} thread{'s' if n != 1 else ''}" if n else ""
    return (f"{setup['device']}{threads}, batch {setup['batch_size']} x {setup['seq_len']} tokens, no gradients, "
            f"fp32, median of {setup['repeats']} interleaved runs")


def _number(value: Any, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]], setup: dict[str, Any]) -> str:
    """The table, fastest first, with the setup above it."""
    metric, teacher = setup["metric"], setup["teacher"]
    lines = [
        f"# Students within {setup['budget_ms']:g} ms",
        "",
        f"Latency: {setup_text(setup)}. Teacher ({teacher['name']}): {teacher['latency_ms']:.3f} ms, "
        f"{teacher['params']:,} parameters" + (f", {metric} {teacher['metric']:.4f}" if teacher.get("metric")
                                               is not None else "") + ".",
        f"Proxy: {setup['proxy_steps']} distillation steps per candidate within the budget, ranked by {metric} "
        f"({'higher' if setup['greater_is_better'] else 'lower'} is better); the top {setup['top_n']} distilled "
        "fully.",
        "",
        f"| candidate | kind | layers | heads | intermediate | hidden | params | latency (ms) | within budget | "
        f"proxy {metric} | final {metric} | Pareto | picked |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: r["latency_ms"]):
        lines.append(
            f"| {r['name']} | {r['kind']} | {r['num_layers']} | {r['num_attention_heads']} | {r['intermediate_size']} "
            f"| {r['hidden_size']} | {r['params'] / 1e6:.2f} M | {r['latency_ms']:.3f} | "
            f"{'yes' if r['within_budget'] else 'no'} | {_number(r['proxy_metric'], '.4f')} | "
            f"{_number(r['final_metric'], '.4f')} | {'yes' if r.get('pareto') else ''} | "
            f"{'**yes**' if r['picked'] else ''} |")
    return "\n".join(lines) + "\n"


def write_pareto(folder: Path, rows: list[dict[str, Any]], setup: dict[str, Any], student_dir: str
                 ) -> dict[str, Path]:
    """pareto.md, pareto.json and (with matplotlib) pareto.png in `folder`."""
    from ..publish.plots import plot_accuracy_vs_latency

    pareto_flags(rows, setup["greater_is_better"])
    picked = next(r["name"] for r in rows if r["picked"])
    files = {"md": folder / TABLE_MD, "json": folder / TABLE_JSON}
    files["md"].write_text(markdown(rows, setup), encoding="utf-8")
    data = {**setup, "picked": picked, "student_dir": student_dir, "candidates": rows}
    files["json"].write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    try:
        files["png"] = plot_accuracy_vs_latency(rows, setup, folder / TABLE_PLOT)
    except ImportError as err:  # the run is done: a missing plotting library costs the plot, not the student
        warnings.warn(f"{err} The Pareto table is in {files['md']}; no plot drawn.", stacklevel=2)
    return files


def card_facts(row: dict[str, Any], rows: list[dict[str, Any]], setup: dict[str, Any]) -> dict[str, Any]:
    """The `auto` facts of a student's model card (publish.card's "How the shape was chosen" section)."""
    keep = ("name", "kind", "num_layers", "num_attention_heads", "intermediate_size", "hidden_size", "params",
            "latency_ms", "proxy_metric", "final_metric", "picked")
    return {"budget_ms": setup["budget_ms"], "latency_ms": row["latency_ms"], "setup": setup_text(setup),
            "teacher_latency_ms": setup["teacher"]["latency_ms"], "candidates": len(rows),
            "within_budget": sum(r["within_budget"] for r in rows), "proxy_steps": setup["proxy_steps"],
            "metric": setup["metric"], "top_n": setup["top_n"], "name": row["name"], "kind": row["kind"],
            "picked": row["picked"], "proxy_rank": row["proxy_rank"], "table": TABLE_MD,
            "rows": [{k: r[k] for k in keep} for r in rank_order(rows)]}


def rank_order(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted((r for r in rows if r["proxy_rank"] is not None), key=lambda r: r["proxy_rank"])


def write_card(trainer: Any, folder: Path, row: dict[str, Any], rows: list[dict[str, Any]],
               setup: dict[str, Any]) -> Path:
    """The model card of a fully distilled candidate, with how it was chosen."""
    from ..publish.card import write_model_card
    from ..publish.report import DistillationReport

    report = DistillationReport.from_trainer(trainer, teacher=setup["teacher"]["name"],
                                             auto=card_facts(row, rows, setup))
    return write_model_card(folder, report.updated(model_name=trainer.args.hub_model_id or row["name"]))
