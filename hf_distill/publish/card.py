"""Model cards of distilled students: transformers' `TrainingSummary` (metadata, model index, framework versions)
with base model = the teacher, the pipeline tag and a body saying how the student was made and what it keeps of
the teacher. No `base_model_relation`: none of the Hub's values (adapter, merge, quantized, finetune) describes a
student, and without it the Hub infers the relation itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from transformers import modelcard
from transformers.modelcard import TrainingSummary, make_markdown_table

from ..features.heads import HEADS, HeadKind, kind_for_task, registering_module
from ..losses.registry import UnknownDivergence, get_divergence
from .measure import size_on_disk, stored_parameters
from .report import _KD_METHODS, LOSS_PLOT, REPORT_FILE, SPEECH_RECOGNITION, DistillationReport, _empty, hub_id

CARD_FILE = "README.md"
BIBTEX = {m[1]: m[0] for m in re.finditer(r"^@\w+\{([^,]+),.*?^\}", Path(__file__).with_name("citations.bib")
                                          .read_text(encoding="utf-8"), re.M | re.S)}
METHODS = {  # tag -> (what the card calls it, BibTeX keys)
    "logit-kd": ("logit distillation (Hinton et al., 2015)", ["hinton2015distilling"]),
    "distilbert": ("DistilBERT distillation (Sanh et al., 2019)", ["sanh2019distilbert"]),
    "tinybert": ("TinyBERT transformer distillation (Jiao et al., 2020)", ["jiao2020tinybert"]),
    "minilm": ("MiniLM deep self-attention distillation (Wang et al., 2020)", ["wang2020minilm"]),
    "minilmv2": ("MiniLMv2 multi-head self-attention relation distillation (Wang et al., 2021)", ["wang2021minilmv2"]),
    "bert-pkd": ("BERT-PKD patient knowledge distillation (Sun et al., 2019)", ["sun2019patient"]),
    "feature-kd": ("intermediate-feature distillation with FitNets-style hints (Romero et al., 2015)",
                   ["romero2015fitnets"]),
    "gkd": ("generalized JSD distillation (GKD, Agarwal et al., 2024)", ["agarwal2024gkd"]),
    "reverse-kl": ("reverse KL distillation (MiniLLM, Gu et al., 2024)", ["gu2024minillm"]),
    "distillm": ("skew KL distillation (DistiLLM, Ko et al., 2024)", ["ko2024distillm"]),
    "tvd-kd": ("total variation distance distillation (f-divergence KD, Wen et al., 2023)", ["wen2023fdivergence"]),
    "fastbert": ("FastBERT self-distilled early exits (Liu et al., 2020)", ["liu2020fastbert"]),
    "deebert": ("DeeBERT early-exit off-ramps (Xin et al., 2020), self-distilled as in FastBERT (Liu et al., 2020)",
                ["xin2020deebert", "liu2020fastbert"]),
}
_SEQ2SEQ_TASKS = HEADS[HeadKind.SEQ2SEQ_LM].tasks  # no pipeline in transformers 5: the card shows `generate`
# Token-level heads: the card says which of their tokens the logit loss covered (`kd_token_mask`).
_IMAGE_TASKS = HEADS[HeadKind.IMAGE_CLASSIFICATION].tasks
IMAGE_WIDGET = "https://huggingface.co/datasets/mishig/sample_images/resolve/main/tiger.jpg"  # the Hub's own sample
_TOKEN_TASKS = tuple(task for facts in HEADS.values() if facts.token_level for task in facts.tasks)
# transformers indexes results only for the tasks of its own name table: the card's copy of its `create_model_index`
# reads that table extended with the student tasks it lacks (transformers' own table is left as it is).
_TASK_NAMES = {**modelcard.TASK_TAG_TO_NAME_MAPPING,
               **{t: t.replace("-", " ").title() for t in (*_SEQ2SEQ_TASKS, "feature-extraction")}}
_create_model_index = types.FunctionType(TrainingSummary.create_model_index.__code__,
                                         {**vars(modelcard), "TASK_TAG_TO_NAME_MAPPING": _TASK_NAMES})


def _kd_loss_label(d: dict[str, Any]) -> str:
    """What the loss table calls the run's `kd_loss`: its registry entry's label, with the value of its mixture
    parameter (`jsd_beta`, `skew_alpha`) when recorded and its temperature factor; an unknown kind as written."""
    kind = d.get("kd_loss")
    try:
        entry = get_divergence(kind)
    except UnknownDivergence:
        return kind
    return entry.card_label(d.get(entry.mixture.argument) if entry.mixture is not None else None)


def _skew(kind: str | None) -> tuple[str, str]:
    """DistiLLM's skew divergences (the kinds `skew_alpha` mixes): what the card calls one, and what alpha mixes;
    empty strings for any other kind."""
    try:
        entry = get_divergence(kind)
    except UnknownDivergence:
        return "", ""
    if entry.mixture is None or entry.mixture.argument != "skew_alpha":
        return "", ""
    return entry.label.removesuffix(" divergence"), entry.mixture.meaning
# Row labels of transformers' hyperparameter names (and of the run's own facts); others are written out.
_SETTINGS = {"total_train_batch_size": "Effective batch size",
             "num_epochs": "Epochs", "training_steps": "Max steps", "steps": "Optimizer steps done",
             "epochs_trained": "Epochs done", "lr_scheduler_type": "LR schedule",
             "lr_scheduler_warmup_steps": "Warm-up steps"}


def citations(report: DistillationReport) -> list[str]:
    """BibTeX keys of the method's papers, the logit loss's and ShortGPT's for a depth-pruned student."""
    keys = list(METHODS.get(report.method or "", ("", []))[1])
    if (report.distillation.get("kd_weight") or 0) > 0:
        keys.append(METHODS[_KD_METHODS.get(report.distillation.get("kd_loss") or "", "logit-kd")][1][0])
    if report.student_init.get("init") == "prune_depth":
        keys.append("men2024shortgpt")
    if report.student_init.get("init") == "prune_width":
        keys.extend(["muralidharan2024minitron", *(["men2024shortgpt"] if report.student_init.get("block_importance")
                                                  else [])])
    if report.auto:
        keys.append("yin2021autotinybert")
    return list(dict.fromkeys(keys))


def method_name(report: DistillationReport) -> str | None:
    """What the card calls the method, with the settings that define it (GKD's beta, DistiLLM's alpha; a causal
    LM's forward KL is named as the objective on next-token distributions)."""
    d, method = report.distillation, report.method
    if method not in METHODS:
        return None
    if method == "gkd" and d.get("jsd_beta") is not None:
        return f"generalized JSD distillation (beta = {d['jsd_beta']:g}; GKD, Agarwal et al., 2024)"
    if method == "distillm" and _skew(d.get("kd_loss"))[0]:
        alpha = f"alpha = {d['skew_alpha']:g}; " if d.get("skew_alpha") is not None else ""
        return f"{_skew(d['kd_loss'])[0]} distillation ({alpha}DistiLLM, Ko et al., 2024)"
    kind = {"kl": "forward KL", "soft_ce": "soft cross-entropy"}.get(d.get("kd_loss") or "")
    if method == "logit-kd" and report.pipeline_tag == "text-generation" and kind:
        return f"{kind} distillation of the next-token distributions (Hinton et al., 2015)"
    return METHODS[method][0]


@dataclass
class DistillationSummary(TrainingSummary):
    """transformers' `TrainingSummary` of a distilled student, filled from a `DistillationReport` (`from_report`).

    A PEFT student's card is PEFT's: `library_name: peft`, `base_model` the model the adapters load onto (tagged
    `base_model:adapter:<id>`, `lora`, `transformers`). Every metric is indexed, not only those transformers knows."""

    report: DistillationReport = dataclasses.field(default_factory=DistillationReport)

    def __post_init__(self) -> None:
        """No Hub lookup of the base model's license: a card is the same offline and online."""

    @classmethod
    def from_report(cls, r: DistillationReport) -> DistillationSummary:
        extra_tags, base = [], hub_id(r.teacher)
        if r.adapter:
            base = hub_id(r.adapter.get("base_model"))
            extra_tags = ["transformers", *(["lora"] if r.adapter.get("peft_type") == "LORA" else []),
                          *([f"base_model:adapter:{base}"] if base else [])]
        indexed = bool(r.pipeline_tag and r.datasets and r.student_metrics)
        dataset_metadata = {k: v for k, v in (("config", r.dataset_config), ("split", r.dataset_split)) if v}
        return cls(model_name=r.model_name or "student", language=r.language or None, license=r.license,
                   tags=list(dict.fromkeys(["distillation", "hf-distill", *([r.method] if r.method else []),
                                            *extra_tags, *r.tags])),
                   finetuned_from=base, tasks=r.pipeline_tag, dataset_tags=r.datasets or None,
                   dataset=[r.dataset_name or r.datasets[0]] if r.datasets else None,
                   dataset_metadata=[dataset_metadata], eval_results=r.student_metrics if indexed else None,
                   eval_lines=r.eval_lines or None, hyperparameters=r.training or None, source="trainer", report=r)

    def create_model_index(self, metric_mapping: dict[str, str]) -> list[dict[str, Any]]:
        return _create_model_index(self, {name: name for name in self.eval_results or {}})

    def create_metadata(self) -> dict[str, Any]:
        meta = super().create_metadata()
        if not meta["model-index"][0]["results"]:
            del meta["model-index"]
        if self.report.adapter:
            meta["library_name"] = "peft"
        if self.tasks in _IMAGE_TASKS:  # the Hub's image widget needs an image to classify (issue #43)
            meta["widget"] = [{"src": IMAGE_WIDGET, "example_title": "Tiger"}]
        return {"pipeline_tag": self.tasks, **meta} if self.tasks else meta

    def to_model_card(self) -> str:
        from .. import __version__

        r = self.report
        versions = super().to_model_card().partition("### Framework versions\n\n")[2].strip()
        sections = [_title(r), _made(r), _auto(r), _comparison(r), _training(r), _early_exit(r), _usage(r),
                    _citation(r),
                    f"Distilled with hf_distill {__version__}." + (f"\n\n{versions}" if versions else "")]
        body = "\n\n".join(s for s in sections if s)
        return f"---\n{yaml.dump(self.create_metadata(), sort_keys=False)}---\n\n{body}\n"


def model_card(report: DistillationReport) -> str:
    """The card of a student (YAML metadata and markdown body), made only of known facts."""
    return DistillationSummary.from_report(report).to_model_card()


def write_model_card(folder: str | os.PathLike, report: DistillationReport | None = None, **fields: Any) -> Path:
    """Write `README.md` and `distillation_report.json` (to refresh the card later) into a student folder: the
    facts are `report`'s or the folder's (`DistillationReport.from_folder`), `fields` over them."""
    folder = Path(folder)
    report = DistillationReport.from_folder(folder, **fields) if report is None else report.updated(**fields)
    report = report.updated(student_size_bytes=report.student_size_bytes or size_on_disk(folder) or None,
                            student_params=report.student_params or stored_parameters(folder),
                            loss_plot=report.loss_plot or (LOSS_PLOT if (folder / LOSS_PLOT).is_file() else None))
    if report.loss_plot and not (folder / report.loss_plot).is_file():
        report = dataclasses.replace(report, loss_plot=None)
    (folder / CARD_FILE).write_text(model_card(report), encoding="utf-8")
    (folder / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return folder / CARD_FILE


_Names = str | list[str] | None


def write_trainer_card(trainer: Any, *, language: _Names = None, license: str | None = None, tags: _Names = None,
                       model_name: str | None = None, finetuned_from: str | None = None, tasks: _Names = None,
                       dataset_tags: _Names = None, dataset: _Names = None, dataset_args: _Names = None,
                       **fields: Any) -> Path:
    """`Trainer.create_model_card` of a `DistillationTrainer`: its arguments as `DistillationReport` fields, plus
    any such field (`teacher=` names a teacher loaded from a folder by its Hub id) and `from_trainer`'s options.

    The teacher is the one distilled from; `finetuned_from` (the student's starting checkpoint in transformers'
    example scripts) is shown as "initialised from". `dataset_tags` are Hub ids (else the id-like `dataset`
    values), `dataset` the display name, `dataset_args` its configuration."""

    def listed(value: Any) -> list[str]:
        return [value] if isinstance(value, str) else list(value or [])

    mapped = {"language": listed(language), "license": license, "tags": listed(tags), "model_name": model_name,
              "initialised_from": finetuned_from, "pipeline_tag": (listed(tasks) or [None])[0],
              "datasets": listed(dataset_tags) or [d for d in listed(dataset) if " " not in d],
              "dataset_name": (listed(dataset) or [None])[0], "dataset_config": (listed(dataset_args) or [None])[0]}
    report = DistillationReport.from_trainer(trainer, **{k: v for k, v in mapped.items() if v}, **fields)
    return write_model_card(trainer.args.output_dir, report)


# ---------------------------------------------------------------------- sections


def _title(r: DistillationReport) -> str:
    what = f"a {r.student_shape['layers']}-layer " if r.student_shape.get("layers") else "a "
    what += f"`{r.architecture}`" if r.architecture else "student model"
    if r.student_shape.get("encoder_layers") and r.student_shape.get("decoder_layers"):
        what += f" ({r.student_shape['encoder_layers']} encoder and {r.student_shape['decoder_layers']} decoder layers)"
    sentence = f"This model is {what} distilled" + (f" from {_model_link(r.teacher)}" if r.teacher else "")
    sentence += f" with {method_name(r)}" if method_name(r) else ""
    sentence += f" on {r.dataset_name or ', '.join(r.datasets)}" if r.datasets or r.dataset_name else ""
    return f"# {r.model_name or 'Distilled student'}\n\n{sentence}."


def _model_link(name: str | None) -> str:
    if hub_id(name):
        return f"[{name}](https://huggingface.co/{name})"
    return f"`{Path(name).name or name}`" if name else ""


def _tokens(r: DistillationReport) -> str:
    """Which tokens the logit loss averaged over (`kd_token_mask`), in the words of the student's task."""
    mask, task = r.distillation.get("kd_token_mask"), r.pipeline_tag or ""
    if task in _SEQ2SEQ_TASKS:  # the decoder's logits are distilled: its tokens, not the source text's
        which = {"attention": "every real target token: decoder positions with decoder_attention_mask = 1, or whose "
                              "label is not -100 when the batch has no decoder_attention_mask",
                 "labels": "target tokens only: decoder positions whose label is not -100"}.get(mask)
    elif mask == "attention":
        which = "every real token (attention_mask = 1)" + (", prompt tokens included" if task == "text-generation"
                                                           else "")
    else:
        which = {"text-generation": "completion tokens only: positions whose label is not -100, prompt and padding "
                                    "excluded",
                 "fill-mask": "masked tokens only: positions whose label is not -100",
                 }.get(task, "labelled tokens only: positions whose label is not -100") if mask == "labels" else None
    return f"{which} (`kd_token_mask={mask}`)" if which else ""


def _initialisation(r: DistillationReport) -> str:
    """How the student was made (hf_distill.students records it in `config.distillation`)."""
    init, causal = r.student_init, r.pipeline_tag == "text-generation"
    kind, layers, total = init.get("init"), init.get("teacher_layers"), init.get("teacher_num_layers")
    of = f" of its {total}" if total else ""
    if kind == "from_teacher" and init.get("teacher_encoder_layers") is not None:  # an encoder-decoder student
        stacks = [f"{s} layers {init.get(f'teacher_{s}_layers')}" + (f" of its {n}" if (
            n := init.get(f"teacher_num_{s}_layers")) else "") for s in ("encoder", "decoder")]
        return f"teacher {' and '.join(stacks)} (0-based), copied with the rest of its weights (embeddings, LM head)"
    if kind == "prune_depth" and layers is not None:
        gone = sorted(set(range(int(total))) - set(layers)) if total else []
        tokens = f" on {init['calibration_tokens']:,} calibration tokens" if init.get("calibration_tokens") else ""
        return (f"depth pruning of the teacher: kept {'decoder blocks' if causal else 'layers'} {layers} (0-based)"
                f"{of}{f', removed {gone}' if gone else ''}, the {len(layers)} most important by block importance "
                f"(1 - mean cosine between a block's input and output, ShortGPT, Men et al., 2024){tokens}; the kept "
                f"blocks copied bit-exactly with "
                f"{'the embeddings, final norm and LM head' if causal else 'the embeddings and head'}")
    if kind == "prune_width" and init.get("teacher_shape"):
        t = init["teacher_shape"]
        depth = (f", its {len(layers)} most important blocks of {total} by block importance (ShortGPT, Men et al., "
                 "2024)") if layers is not None and total else ""
        return (f"width pruning of the teacher ({t.get('num_layers')} layers, {t.get('num_attention_heads')} heads, "
                f"MLP {t.get('intermediate_size')}, hidden {t.get('hidden_size')}): the heads, MLP channels and hidden "
                "channels of largest activation on calibration text kept (Minitron, Muralidharan et al., 2024)"
                f"{depth}, their weights copied")
    if kind == "from_teacher" and layers is not None:
        if causal:
            return f"teacher decoder blocks {layers} (0-based){of}, copied with the embeddings, final norm and LM head"
        return (f"teacher encoder layers {layers} (0-based){of}, copied with the embeddings, pooler and head "
                "(DistilBERT-style)")
    return "random, a smaller configuration of the teacher's architecture (TinyBERT-style)" if kind == "shrink" else ""


def _loss_rows(d: dict[str, Any]) -> list[str]:
    """A table row (term, loss, weight, layers) for every loss term with a positive weight."""
    rows = [("task", "the student's own loss on the labels", d["task_weight"], "")] if (
        d.get("task_weight") or 0) > 0 else []
    if (d.get("kd_weight") or 0) > 0:
        kind = _kd_loss_label(d)
        temp = f", T = {d['temperature']:g}" if d.get("kd_loss") != "mse" and d.get("temperature") else ""
        rows.append(("kd", f"{kind} between student and teacher logits{temp}", d["kd_weight"], "output logits"))
    for term in d.get("distill_terms") or []:
        if (term.get("weight") or 0) > 0:
            detail, layers = term["loss"], term.get("layers")
            if term.get("relations"):
                heads = f", {term['relation_heads']} relation heads" if term.get("relation_heads") else ""
                detail += f" ({'/'.join(x.upper() for x in term['relations'])}{heads})"
            if isinstance(layers, str):
                layers = {"uniform": "uniform map", "last": "last layer to last layer"}.get(layers, layers)
            else:
                layers = ", ".join(f"{s} -> {t}" for s, t in layers)
            rows.append((term.get("name") or term["loss"], detail, term["weight"], layers))
    return [f"| {name} | {loss} | {weight:g} | {layers} |" for name, loss, weight, layers in rows]


def _made(r: DistillationReport) -> str:
    d, a = r.distillation, r.adapter
    kd, name, init, rows = (d.get("kd_weight") or 0) > 0, method_name(r) or r.method, _initialisation(r), _loss_rows(d)
    if r.early_exit and rows:  # trained by the Trainer: labelled rows were refused, each branch learnt the final head
        rows = _loss_rows({**d, "task_weight": 0}) + [
            f"| exit_{i} | KL divergence of branch {i} from the final head (self-distillation) | 1 | block {i} -> "
            "final head |" for i in range(1, (r.early_exit.get("num_exits") or 1))]
    # the papers of these methods also train on sequences the student samples; this run did not
    sampled = ", on the training sequences (no student-generated samples)" if r.method in (
        "gkd", "reverse-kl", "distillm", "tvd-kd") else ""
    data = ", ".join(f"[{x}](https://huggingface.co/datasets/{x})" for x in r.datasets) or r.dataset_name
    extra = ", ".join(x for x in (r.dataset_config, r.dataset_split) if x)
    shape = {"layers": "{} layers", "encoder_layers": "{} encoder layers", "decoder_layers": "{} decoder layers",
             "hidden": "hidden size {}", "heads": "{} attention heads"}
    skew = _skew(d.get("kd_loss"))
    lines = [
        name and f"- **Method**: {name[0].upper()}{name[1:]}{sampled}",
        r.teacher and f"- **Teacher**: {_model_link(r.teacher)}",
        r.routing and "- **Teachers, routed per row by `teacher_id`**: " + "; ".join(
            f"`{name}` = {t['teacher']} ({t['rows']} rows)" for name, t in r.routing.items()),
        r.student_shape and f"- **Student**: {r.architecture or 'model'}, "
                            + ", ".join(shape[k].format(v) for k, v in r.student_shape.items() if k in shape),
        a and f"- **Adapters**: this repository holds {a.get('peft_type') or 'PEFT'} adapters"
              + (f", rank {a['r']}" if a.get("r") else "")
              + (f" on {', '.join(a['target_modules'])}" if isinstance(a.get("target_modules"), list) else "")
              + (f" for the base model `{a['base_model']}`" if a.get("base_model") else "")
              + ("; only the adapters were trained and are published" if not a.get("modules_to_save") else
                 "; the adapters were trained and are published, with whichever of "
                 + ", ".join(f"`{m}`" for m in a["modules_to_save"])
                 + " the model has (PEFT's `modules_to_save`, trained in full)"),
        init and f"- **Initialisation**: {init}",
        r.initialised_from and f"- **Initialised from**: {_model_link(r.initialised_from)} (the student's starting "
                               "checkpoint)",
        rows and "- **Loss**: the weighted sum of the terms below (layer 0 is the embedding output)\n\n"
                 "| Term | Loss | Weight | Layers (student -> teacher) |\n| --- | --- | ---: | --- |\n"
                 + "\n".join(rows) + "\n",
        kd and d.get("temperature") and d.get("kd_loss") != "mse" and f"- **Temperature**: {d['temperature']:g}",
        kd and d.get("kd_loss") == "jsd" and d.get("jsd_beta") is not None
        and f"- **Beta** (generalized JSD): {d['jsd_beta']:g} (0 is the forward KL, 1 the reverse KL; TRL's GKD "
            "convention)",
        kd and skew[0] and d.get("skew_alpha") is not None
        and f"- **Alpha** ({skew[0]}): {d['skew_alpha']:g} ({skew[1]}; DistiLLM's default is 0.1)",
        kd and r.pipeline_tag in _TOKEN_TASKS and _tokens(r) and f"- **Distilled tokens**: {_tokens(r)}",
        d.get("distill_terms") and d.get("projection")
        and f"- **Projections** (student -> teacher width, not published): {d['projection']}",
        r.stages and "- **Stages**:\n" + "\n".join(f"  {i}. {s}" for i, s in enumerate(r.stages, 1)),
        data and f"- **Data**: {data}{f' ({extra})' if extra else ''}",
        r.augmentation and f"- **Augmentation**: {r.augmentation}",
    ]
    lines = [line for line in lines if line]
    return "## How it was distilled\n\n" + "\n".join(lines) if lines else ""


def _bytes(n: int) -> str:
    return next((f"{n / size:.2f} {unit}" for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if n >= size),
                f"{n} B")


def _ratio(student: float | None, teacher: float | None) -> str:
    return f"{student / teacher:.1%}" if student is not None and teacher else ""


def _comparison(r: DistillationReport) -> str:
    rows, parts = [], []

    def row(label: str, teacher: Any, student: Any, fmt: Callable[[Any], str] = str, ratio: bool = False) -> None:
        if student is not None or teacher is not None:
            cells = ["" if v is None else fmt(v) for v in (teacher, student)]
            rows.append(f"| {label} | {cells[0]} | {cells[1]} | {_ratio(student, teacher) if ratio else ''} |")

    row("Parameters", r.teacher_params, r.student_params, "{:,}".format, ratio=True)
    for key, label in (("layers", "Layers"), ("encoder_layers", "Encoder layers"),
                       ("decoder_layers", "Decoder layers"), ("hidden", "Hidden size")):
        row(label, r.teacher_shape.get(key), r.student_shape.get(key))
    row("Size on disk (weights)", r.teacher_size_bytes, r.student_size_bytes, _bytes, ratio=True)
    if r.speedup is not None:
        rows.append(f"| Inference speed-up | 1.00x | {r.speedup:.2f}x | |")
    if rows:
        setup = f"\n\nSpeed-up measured as {r.speedup_setup}." if r.speedup_setup else ""
        parts.append("| | Teacher | Student | Student / teacher |\n| --- | ---: | ---: | ---: |\n" + "\n".join(rows)
                     + setup)
    if r.student_metrics:
        both = any(k in r.teacher_metrics for k in r.student_metrics)
        head = "| Metric | Teacher | Student | % of teacher |\n| --- | ---: | ---: | ---: |" if both else (
            "| Metric | Student |\n| --- | ---: |")
        lines = []
        for name, value in r.student_metrics.items():
            t = r.teacher_metrics.get(name)
            cells = [("" if t is None else f"{t:.4f}"), f"{value:.4f}", _ratio(value, t)] if both else [f"{value:.4f}"]
            lines.append(f"| {name} | {' | '.join(cells)} |")
        where = " on " + (r.dataset_name or ", ".join(r.datasets)) if (r.dataset_name or r.datasets) else ""
        split = f" ({r.dataset_split})" if r.dataset_split else ""
        step = f", student evaluated at step {r.eval_step}" if r.eval_step else ""
        parts.append(f"Evaluation{where}{split}{step}:\n\n{head}\n" + "\n".join(lines) + _loss_note(r))
    return "## Teacher vs student\n\n" + "\n\n".join(parts) if parts else ""


def _loss_note(r: DistillationReport) -> str:
    """What the evaluation table's `loss` (the Trainer's eval_loss, the model's own: the teacher does not run in
    evaluation) and `perplexity` (its exp, for language models) are."""
    if not any(n == "loss" or n.endswith("_loss") for n in r.student_metrics):
        return ""
    perplexity = any(n == "perplexity" or n.endswith("_perplexity") for n in r.student_metrics)
    what = {"text-generation": "next-token cross-entropy on the evaluation set (nats per predicted token)",
            "text2text-generation": "cross-entropy of the target tokens on the evaluation set (nats per token)"}
    if perplexity and r.pipeline_tag in what:
        return f"\n\n`loss` is the model's own {what[r.pipeline_tag]}, `perplexity` its exp."
    smoothing = r.training.get("label_smoothing_factor")
    return ("\n\n`loss` is the model's own task loss on the evaluation set (the Trainer's `eval_loss`; the teacher "
            "does not run in evaluation)" + (f", label-smoothed ({smoothing})" if smoothing else "") + ".")


def _training(r: DistillationReport) -> str:
    rows = [f"| {_SETTINGS.get(k, k.replace('_', ' ').capitalize())} | {v} |" for k, v in r.training.items()
            if not _empty(v)]
    parts = [
        rows and "| Setting | Value |\n| --- | --- |\n" + "\n".join(rows),
        r.eval_lines and "Evaluations during training:\n\n" + make_markdown_table(r.eval_lines).strip(),
        r.loss_plot and f"![Loss components against training steps]({r.loss_plot})",
    ]
    return "## Training\n\n" + "\n\n".join(p for p in parts if p) if any(parts) else ""


def _auto(r: DistillationReport) -> str:
    """How `hf_distill.auto` chose the student's shape for a latency budget: its latency and the ranked candidates."""
    a = r.auto
    if not a:
        return ""
    how = "the most accurate" if a.get("picked") else f"number {a.get('proxy_rank')} by the proxy"
    text = (f"Chosen by `hf-distill auto` ({a['kind']} candidate `{a['name']}`) as {how} of the students that answer "
            f"within a latency budget of **{a['budget_ms']:g} ms** ({a['setup']}): this student takes "
            f"**{a['latency_ms']:.3f} ms**, the teacher {a['teacher_latency_ms']:.3f} ms. {a['candidates']} candidate "
            f"shapes were built (pruned depth x width, layer copies, shrunk models) and timed; {a['within_budget']} "
            f"met the budget, each was distilled for {a['proxy_steps']} steps and ranked by evaluation "
            f"{a['metric']}, and the best {a['top_n']} distilled fully (the best final {a['metric']} is the pick).")
    rows = [f"| {x['name']}{' (this model)' if x['name'] == a['name'] else ''} | {x['num_layers']} | "
            f"{x['num_attention_heads']} | {x['intermediate_size']} | {x['hidden_size']} | {x['params']:,} | "
            f"{x['latency_ms']:.3f} | {'' if x['proxy_metric'] is None else format(x['proxy_metric'], '.4f')} | "
            f"{'' if x['final_metric'] is None else format(x['final_metric'], '.4f')} |" for x in a.get("rows") or []]
    head = (f"| Candidate | Layers | Heads | Intermediate | Hidden | Parameters | Latency (ms) | Proxy {a['metric']} "
            f"| Final {a['metric']} |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    table = head + "\n".join(rows) if rows else ""
    return "## How the shape was chosen\n\n" + "\n\n".join(p for p in (text, table) if p)


def _early_exit(r: DistillationReport) -> str:
    """Speed-accuracy table of an early-exit model (hf_distill.students.early_exit): one row per exit threshold."""
    e = r.early_exit
    if not e:
        return ""
    kind = {"deebert": "DeeBERT off-ramps"}.get(e.get("branch", "fastbert"), "FastBERT branches")
    rows = [f"| {x['speed']:g} | {x['accuracy']:.1%} | {x['mean_exit_layer']:.2f} | "
            f"{'' if x.get('speedup_b1') is None else format(x['speedup_b1'], '.2f') + 'x'} | {x['flops_ratio']:.2f} |"
            for x in e.get("sweep") or []]
    parts = [f"Early exits after each of the {e.get('num_exits')} blocks ({kind}); load with "
             "`hf_distill.students.early_exit.EarlyExitModel.from_pretrained` (the backbone alone loads with "
             "AutoModel...).",
             rows and "| speed | accuracy | mean exit layer | speed-up (batch 1) | FLOPs ratio |\n"
                      "| --- | --- | --- | --- | --- |\n" + "\n".join(rows),
             e.get("plot") and f"![Accuracy against speed-up]({e['plot']})"]
    return "## Early exit\n\n" + "\n\n".join(p for p in parts if p)


def _usage(r: DistillationReport) -> str:
    repo, kind = r.model_name or "path/to/student", kind_for_task(r.pipeline_tag)
    auto = kind.facts.auto_class if kind is not None else "AutoModel"
    if r.early_exit:  # the Auto classes would load the backbone alone, without its exits
        code = ("from transformers import AutoTokenizer\n\n"
                "from hf_distill.students.early_exit import EarlyExitModel\n\n"
                f'model = EarlyExitModel.from_pretrained("{repo}")\n'
                f'tokenizer = AutoTokenizer.from_pretrained("{repo}")\n'
                'print(model.predict(["Your text"], tokenizer, speed=0.5))  # label, score and exit layer per text')
    elif r.pipeline_tag == SPEECH_RECOGNITION and not r.adapter:  # no text seq2seq LM: AutoModelForSeq2SeqLM refuses it
        code = ("from transformers import AutoModelForSpeechSeq2Seq, AutoProcessor, pipeline\n\n"
                f'model = AutoModelForSpeechSeq2Seq.from_pretrained("{repo}")\n'
                f'processor = AutoProcessor.from_pretrained("{repo}")\n\n# or\n'
                f'pipe = pipeline("{SPEECH_RECOGNITION}", model="{repo}")\nprint(pipe("audio.flac")["text"])')
    elif r.adapter:
        peft = kind.facts.peft_class if kind is not None else "AutoPeftModel"
        code = f'from peft import {peft}\n\nmodel = {peft}.from_pretrained("{repo}")  # base + adapters'
    elif r.pipeline_tag in _IMAGE_TASKS:  # an image processor, not a tokenizer (issue #43)
        code = (f'from transformers import {auto}, AutoImageProcessor, pipeline\n\n'
                f'model = {auto}.from_pretrained("{repo}")\n'
                f'image_processor = AutoImageProcessor.from_pretrained("{repo}")\n\n# or\n'
                f'pipe = pipeline("{r.pipeline_tag}", model="{repo}")\nprint(pipe("{IMAGE_WIDGET}"))')
    else:
        processor = kind.facts.processor if kind is not None else "AutoTokenizer"
        name = "tokenizer" if processor == "AutoTokenizer" else "feature_extractor"
        code = (f'from transformers import {auto}, {processor}\n\nmodel = {auto}.from_pretrained("{repo}")\n'
                f'{name} = {processor}.from_pretrained("{repo}")')
        if r.pipeline_tag in _SEQ2SEQ_TASKS:
            code += ('\n\ninputs = tokenizer(["Your source text"], return_tensors="pt")\n'
                     "outputs = model.generate(**inputs, max_new_tokens=64)\n"
                     "print(tokenizer.batch_decode(outputs, skip_special_tokens=True))")
        elif kind is not None:
            code += '\n\n# or\nfrom transformers import pipeline\n\n'
            code += f'pipe = pipeline("{r.pipeline_tag}", model="{repo}")'
    if (module := registering_module(architecture=r.architecture)) is not None:  # hf_distill's own class
        code = f"import {module}  # registers {r.architecture} with the Auto classes\n{code}"
    return f"## How to use\n\n```python\n{code}\n```"


def _citation(r: DistillationReport) -> str:
    keys = citations(r)
    return "## Citation\n\n```bibtex\n" + "\n\n".join(BIBTEX[k] for k in keys) + "\n```" if keys else ""
