"""What a distillation run produced, gathered once so that model cards, the CLI and plots agree.

`DistillationReport` holds the facts a model card states (teacher, method, losses, sizes, speed, metrics,
training settings). It is filled from a live `DistillationTrainer` (`from_trainer`), from a saved student
folder (`from_folder`: `config.json`, `trainer_state.json`, `training_args.bin`, `results.json`), or by
hand in a recipe. A field that could not be measured stays empty and the card leaves it out: the card
never shows a placeholder. The card is rendered by `hf_distill.publish.card`, the plots by `hf_distill.publish.plots`.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import measure

REPORT_FILE = "distillation_report.json"
RESULTS_FILE = "results.json"
LOSS_PLOT = "loss_components.png"

_NOT_METRICS = {
    "runtime",
    "samples_per_second",
    "steps_per_second",
    "epoch",
    "step",
    "loss",
    "jit_compilation_time",
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class DistillationReport:
    """The facts of one distillation run that a model card reports. Every field is optional."""

    model_name: str | None = None  # repo id or folder name: the card's title and model-index name
    teacher: str | None = None  # Hub id when known, else a name or a local path
    method: str | None = None  # distilbert, tinybert, minilm, minilmv2, bert-pkd, logit-kd, feature-kd
    architecture: str | None = None  # the student's class, e.g. BertForSequenceClassification
    pipeline_tag: str | None = None
    student_init: dict[str, Any] = field(default_factory=dict)  # student.config.distillation
    distillation: dict[str, Any] = field(default_factory=dict)  # DistillationArguments.distillation_summary()
    stages: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids
    dataset_name: str | None = None
    dataset_config: str | None = None
    dataset_split: str | None = None
    augmentation: str | None = None
    license: str | None = None
    language: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)  # extra tags on top of the card's own
    student_shape: dict[str, int] = field(default_factory=dict)  # layers, hidden size, heads
    teacher_shape: dict[str, int] = field(default_factory=dict)
    student_params: int | None = None
    teacher_params: int | None = None
    student_size_bytes: int | None = None
    teacher_size_bytes: int | None = None
    speedup: float | None = None
    speedup_setup: str | None = None  # how the speed-up was measured
    student_metrics: dict[str, float] = field(default_factory=dict)
    teacher_metrics: dict[str, float] = field(default_factory=dict)
    eval_step: int | None = None  # training step at which student_metrics were measured
    training: dict[str, Any] = field(default_factory=dict)
    loss_plot: str | None = None  # file name, relative to the student folder
    adapter: dict[str, Any] = field(default_factory=dict)  # a PEFT student: type, rank, targets, base model
    # The checkpoint the student started from (`create_model_card(finetuned_from=...)`), never the teacher.
    initialised_from: str | None = None
    early_exit: dict[str, Any] = field(default_factory=dict)  # hf_distill.students.early_exit: exits, speed sweep, plot

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillationReport:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def updated(self, **fields: Any) -> DistillationReport:
        """A copy with the given fields replaced; None, {} and [] leave a field as it is."""
        _check_fields(fields)
        values = {k: v for k, v in fields.items() if not _empty(v)}
        return dataclasses.replace(self, **values)

    @property
    def teacher_hub_id(self) -> str | None:
        """The teacher as a Hub model id, or None when it is a local path or a bare name."""
        return hub_id(self.teacher)

    # ------------------------------------------------------------------ sources

    @classmethod
    def from_trainer(
        cls,
        trainer: Any,
        *,
        measure_speed: bool = False,
        speed_batches: int = 8,
        **fields: Any,
    ) -> DistillationReport:
        """Everything a `DistillationTrainer` knows after training; `fields` override what it found.

        Nothing is run unless asked: the student's metrics are those of its last logged evaluation, the
        teacher's those of the last `trainer.evaluate_teacher()` (an all-process evaluation loop; the card is
        written by one process, where a sharded teacher's forward would wait for the others forever). With
        `measure_speed=True` the speed-up is timed on up to `speed_batches` evaluation batches (training
        batches when there is no evaluation set), in this process only: a replicated teacher only.
        """
        from ..features.heads import head_kind
        from ..features.taps import unwrap
        from ..placement import REPLICA, teacher_mode

        if "evaluate_teacher" in fields:
            raise TypeError(
                "The card no longer evaluates the teacher (it is written on one process, where a sharded "
                "teacher would deadlock). Call trainer.evaluate_teacher() on every process before writing the "
                "card: its metrics are the card's teacher column."
            )
        _check_fields(fields)
        student = unwrap(trainer.model)
        teacher = getattr(trainer, "teacher", None)
        peft_config = getattr(getattr(trainer.model, "peft_config", None), "get", lambda _: None)("default")
        args = trainer.args
        found: dict[str, Any] = _from_config(
            getattr(student, "config", None), student_class=type(student).__name__
        )
        kind = head_kind(student)  # the model itself, also a subclass or a custom class no mapping names
        found["pipeline_tag"] = kind.facts.pipeline_tag if kind is not None else None
        found["model_name"] = (
            getattr(trainer, "hub_model_id", None) or args.hub_model_id or Path(args.output_dir).name
        )
        if peft_config is not None:
            found["adapter"] = adapter_summary(peft_config.to_dict())
        if teacher is not None:
            t_config = getattr(teacher, "config", None)
            found["teacher_shape"] = _shape(t_config)
            found["teacher_params"] = measure.count_parameters(teacher)
            t_path = getattr(t_config, "_name_or_path", "") or ""
            if t_path:
                found["teacher"] = t_path
            if t_path and os.path.isdir(t_path):
                found["teacher_size_bytes"] = measure.size_on_disk(t_path) or None
        found["student_params"] = measure.count_parameters(student)
        if hasattr(args, "distillation_summary"):
            found["distillation"] = distillation_facts(args)
            found["method"] = detect_method(found["distillation"])
        found["training"] = _training_from_args(args, trainer.state)
        own_loss = _own_eval_loss(found.get("pipeline_tag"), found.get("distillation"))
        metrics, step = latest_eval_metrics(trainer.state.log_history, keep_loss=own_loss)
        found["student_metrics"], found["eval_step"] = lm_metrics(metrics) if own_loss else metrics, step
        evaluated = getattr(trainer, "teacher_metrics", None) or {}
        if teacher is not None and metrics:
            kept = {k: v for k, v in evaluated.items() if k in metrics}
            found["teacher_metrics"] = lm_metrics(kept) if own_loss else kept
        if teacher is not None and measure_speed:
            if getattr(trainer, "shared_base", False):
                raise ValueError(
                    "measure_speed=True has nothing to compare in self-distillation: the teacher is the student's "
                    "own base with its adapters off. Leave measure_speed off."
                )
            mode = teacher_mode(trainer.accelerator)
            if mode != REPLICA:
                raise ValueError(
                    f"measure_speed=True times the teacher in one process, but this teacher is {mode} across "
                    "processes, so its forward needs all of them. Measure the speed-up of the saved student "
                    "and teacher in a single process (hf_distill.publish.measure.speedup) and pass speedup= instead."
                )
            batches = _speed_batches(trainer, speed_batches)
            if batches:
                found["speedup"] = measure.speedup(teacher, student, batches, repeats=3)
                size = len(next(iter(batches[0].values())))
                device = next(student.parameters()).device
                found["speedup_setup"] = (
                    f"teacher time / student time over {len(batches)} batches of {size} "
                    f"{'evaluation' if trainer.eval_dataset is not None else 'training'} examples, "
                    f"no gradients, {device.type}, fp32, median of 3 interleaved passes"
                )
        return cls.from_dict(_merge(found, fields))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, **fields: Any) -> DistillationReport:
        """What a saved student folder says about its run; `fields` override it.

        Read, later sources winning: `config.json`, `trainer_state.json` (the folder's or its latest
        checkpoint's), `training_args.bin` and the weight files; then `distillation_report.json` (what the
        last card said, measured by the trainer); last `results.json` (a recipe's or the demo's
        measurements: `teacher`, `method`, `dataset(s)`, `license`, `speedup`, `student_parameters`/`params`,
        `teacher_parameters`, `*_size_bytes`, `student_metrics`/`teacher_metrics` dicts or flat
        `student_<metric>`/`teacher_<metric>` numbers, `accuracy`, `f1`, `perplexity`, `learning_rate`, `epochs`,
        `max_steps`, `train_steps`, `epochs_trained`, `seed`, `bf16`, `distillation`). A causal LM's loss and
        perplexity are completed from each other (`lm_metrics`).
        """

        _check_fields(fields)
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder.")
        found: dict[str, Any] = {"model_name": folder.resolve().name}
        config = _read_json(folder / "config.json")
        if config:
            arch = (config.get("architectures") or [None])[0]
            found.update(_from_config(config, student_class=arch))
        adapter_config = _read_json(folder / "adapter_config.json")
        if adapter_config:
            found["adapter"] = adapter_summary(adapter_config)
        targs = _load_training_args(folder / "training_args.bin")
        if targs is not None and hasattr(targs, "distillation_summary"):
            found["distillation"] = distillation_facts(targs)
        state_path = find_trainer_state(folder)
        if state_path is not None:
            state = _read_json(state_path)
            own_loss = _own_eval_loss(found.get("pipeline_tag"), found.get("distillation"))
            metrics, found["eval_step"] = latest_eval_metrics(state.get("log_history", []), keep_loss=own_loss)
            found["student_metrics"] = lm_metrics(metrics) if own_loss else metrics
            found["training"] = _training_from_state(state)
        if targs is not None:
            found["training"] = {**found.get("training", {}), **_training_from_args(targs, None)}
        found["student_params"] = measure.stored_parameters(folder)
        found["student_size_bytes"] = measure.size_on_disk(folder) or None
        # The teacher's folder, when config.json (or the caller) names a local one: its facts are real too.
        local = [Path(str(t)) for t in (found.get("teacher"), fields.get("teacher")) if t]
        teacher_dir = next((t for t in local if (t / "config.json").is_file()), None)
        if teacher_dir is not None:
            found["teacher_shape"] = _shape(_read_json(teacher_dir / "config.json"))
            found["teacher_params"] = measure.stored_parameters(teacher_dir)
            found["teacher_size_bytes"] = measure.size_on_disk(teacher_dir) or None
        if (folder / LOSS_PLOT).is_file():
            found["loss_plot"] = LOSS_PLOT
        merged: dict[str, Any] = {}
        results = _from_results(_read_json(folder / RESULTS_FILE))
        for layer in (found, _read_json(folder / REPORT_FILE), results):
            merged = _merge(merged, layer)
        if "method" not in merged and merged.get("distillation"):
            merged["method"] = detect_method(merged["distillation"])
        if merged.get("pipeline_tag") == "text-generation":  # a results.json may give perplexity but no loss
            for key in ("student_metrics", "teacher_metrics"):
                if merged.get(key):
                    merged[key] = lm_metrics(merged[key])
        return cls.from_dict(_merge(merged, fields))


# ---------------------------------------------------------------------- detection helpers


def hub_id(name: str | None) -> str | None:
    """`name` if it reads as a Hub model id (`org/name`) and is not a local path."""
    if not name or os.path.exists(name) or not _HUB_ID.match(name) or ".." in name:
        return None
    return name


def pipeline_tag_for(architecture: str | None, config: Any = None) -> str | None:
    """The Hub pipeline tag of a student class, from its head kind (`features.heads.class_kind`: the task mapping
    that names the class, for `config`'s model_type when given). An encoder-decoder LM is text2text-generation,
    not a vision-language or speech `...ForConditionalGeneration` (see `features.heads.HEADS`)."""
    from ..features.heads import class_kind

    kind = class_kind(architecture, config)
    return kind.facts.pipeline_tag if kind is not None else None


def distillation_facts(args: Any) -> dict[str, Any]:
    """`args.distillation_summary()` plus what a card needs to read the run right: which tokens the logit loss
    covered (`kd_token_mask`) and whether `eval_loss` was the student's own loss (`eval_with_teacher`)."""
    facts = dict(args.distillation_summary())
    for name in ("kd_token_mask", "eval_with_teacher"):
        value = getattr(args, name, None)
        if value is not None:
            facts.setdefault(name, value)
    return facts


def _own_eval_loss(pipeline_tag: str | None, distillation: dict[str, Any] | None) -> bool:
    """Whether a logged `eval_loss` is a causal-LM student's own next-token loss, of which perplexity is exp: only
    when it is known that the teacher did not join the evaluation (`eval_with_teacher=False`)."""
    known = distillation or {}
    return pipeline_tag == "text-generation" and known.get("eval_with_teacher") is False


def lm_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A language model's metrics with `perplexity` = exp(`loss`) beside each loss (`<set>_loss` gives
    `<set>_perplexity`), and the loss (log perplexity) beside a perplexity given alone."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name.endswith("perplexity") and name[: -len("perplexity")] + "loss" in metrics:
            continue  # placed right after its loss below
        if name == "perplexity" or name.endswith("_perplexity"):
            loss_name = name[: -len("perplexity")] + "loss"
            if value > 0:
                out[loss_name] = math.log(value)
            out[name] = value
            continue
        out[name] = value
        if name == "loss" or name.endswith("_loss"):
            ppl_name = name[: -len("loss")] + "perplexity"
            given = metrics.get(ppl_name)
            out[ppl_name] = given if given is not None else (math.inf if value > 700 else math.exp(value))
    return out


def detect_method(summary: dict[str, Any]) -> str:
    """The published method a loss configuration follows, named as the card's tag."""
    preset = summary.get("distill_preset") or ""
    if preset.startswith("tinybert"):
        return "tinybert"
    if preset in ("distilbert", "minilm", "minilmv2"):
        return preset
    terms = summary.get("distill_terms") or []
    losses = {t.get("loss") for t in terms}
    relations = {r for t in terms for r in t.get("relations") or []}
    if "attention_score_mse" in losses:
        return "tinybert"
    if relations & {"qq", "kk"}:
        return "minilmv2"
    if "relation_kl" in losses:
        return "minilm"
    if "pkd_loss" in losses:
        return "bert-pkd"
    if "cosine_loss" in losses:
        return "distilbert"
    if losses:
        return "feature-kd"
    # Logit distillation alone, named by its objective: GKD's generalized JSD, the reverse KL of MiniLLM, DistiLLM's
    # skew (reverse) KL, the total variation distance of Wen et al.'s f-divergence KD, or the forward KL / soft
    # targets of Hinton et al.
    return _KD_METHODS.get(summary.get("kd_loss") or "", "logit-kd")


_KD_METHODS = {"jsd": "gkd", "reverse_kl": "reverse-kl", "skew_kl": "distillm", "skew_reverse_kl": "distillm",
               "tvd": "tvd-kd"}


def _is_metric(name: str, keep_loss: bool = False) -> bool:
    """A quality metric, not a loss or timing; `name` may carry an eval set's prefix (`b_loss`, `b_runtime`)."""
    if keep_loss and (name == "loss" or name.endswith("_loss")):
        return True
    return not any(name == k or name.endswith(f"_{k}") for k in _NOT_METRICS)


def latest_eval_metrics(
    log_history: list[dict[str, Any]], keep_loss: bool = False
) -> tuple[dict[str, float], int | None]:
    """The last evaluation's metrics (without the `eval_` prefix, losses and timings) and its step; with several
    evaluation sets (`eval_dataset={"a": ..., "b": ...}`, one log entry each) those of every set at that step.
    `keep_loss` keeps the losses too (a causal LM's eval loss is its quality measure: perplexity is its exp)."""
    metrics: dict[str, float] = {}
    step = None
    for entry in reversed(log_history or []):
        found = {
            k[len("eval_") :]: float(v)
            for k, v in entry.items()
            if k.startswith("eval_") and _number(v) and _is_metric(k[len("eval_") :], keep_loss)
        }
        if not found:
            continue
        if step is not None and entry.get("step") != step:
            break
        step = entry.get("step")
        metrics = {**found, **metrics}
    return metrics, step


def find_trainer_state(folder: str | os.PathLike) -> Path | None:
    """`trainer_state.json` of the folder or of its checkpoints, whichever went furthest."""
    folder = Path(folder)
    candidates = [folder / "trainer_state.json", *folder.glob("checkpoint-*/trainer_state.json")]
    found = [(int(_read_json(p).get("global_step") or 0), p) for p in candidates if p.is_file()]
    return max(found, key=lambda item: (item[0], item[1] == candidates[0]))[1] if found else None


# ---------------------------------------------------------------------- collection internals


def adapter_summary(config: dict[str, Any]) -> dict[str, Any]:
    """What a card says about a PEFT student (the repository then holds adapters, not a full model)."""
    targets = config.get("target_modules")
    peft_type = config.get("peft_type")
    return {
        "peft_type": getattr(peft_type, "value", peft_type),  # "LORA", not PeftType.LORA (str() of the enum)
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": sorted(targets) if isinstance(targets, list | set | tuple) else targets,
        "base_model": config.get("base_model_name_or_path"),
    }


def _check_fields(fields: dict[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(DistillationReport)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"Unknown DistillationReport field(s) {unknown}. Known: {', '.join(sorted(known))}.")


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (dict, list, tuple, str)) and len(value) == 0)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if _empty(value):
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key in ("training", "distillation"):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _get(config: Any, key: str) -> Any:
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _shape(config: Any) -> dict[str, int]:
    if config is None:
        return {}
    keys = {
        "layers": ("num_hidden_layers", "n_layers", "num_layers"),
        "hidden": ("hidden_size", "dim", "d_model"),
        "heads": ("num_attention_heads", "n_heads"),
    }
    if _get(config, "is_encoder_decoder"):
        # Two stacks, each with its own depth (T5: num_layers / num_decoder_layers; BART, Marian: encoder_layers /
        # decoder_layers); num_hidden_layers is only the encoder's there.
        keys = {"encoder_layers": ("encoder_layers", "num_layers"),
                "decoder_layers": ("decoder_layers", "num_decoder_layers"), **keys}
        del keys["layers"]
    shape = {}
    for name, candidates in keys.items():
        value = next((_get(config, k) for k in candidates if _number(_get(config, k))), None)
        if value is not None:
            shape[name] = int(value)
    return shape


def _from_config(config: Any, student_class: str | None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "architecture": student_class,
        "pipeline_tag": pipeline_tag_for(student_class, config),
        "student_shape": _shape(config),
    }
    init = _get(config, "distillation") if config is not None else None
    if isinstance(init, dict):
        found["student_init"] = dict(init)
        found["teacher"] = init.get("teacher_name_or_path") or None
        if init.get("teacher_num_layers"):
            found["teacher_shape"] = {"layers": int(init["teacher_num_layers"])}
        stacks = {f"{s}_layers": init.get(f"teacher_num_{s}_layers") for s in ("encoder", "decoder")}
        if all(_number(v) for v in stacks.values()):  # an encoder-decoder student (students.from_teacher)
            found["teacher_shape"] = {k: int(v) for k, v in stacks.items()}
    return found


def _precision(bf16: Any, fp16: Any) -> str:
    if bf16:
        return "bf16 mixed precision"
    if fp16:
        return "fp16 mixed precision"
    return "fp32"


def _training_from_args(args: Any, state: Any) -> dict[str, Any]:
    per_device = args.per_device_train_batch_size
    ga = args.gradient_accumulation_steps
    world = getattr(args, "world_size", 1) or 1
    training = {
        "learning_rate": args.learning_rate,
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": ga,
        "effective_batch_size": per_device * ga * world,
        "precision": _precision(getattr(args, "bf16", False), getattr(args, "fp16", False)),
        "seed": args.seed,
        "optimizer": str(getattr(args.optim, "value", args.optim)),
        "lr_scheduler": str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)),
        "weight_decay": args.weight_decay,
    }
    if args.max_steps and args.max_steps > 0:
        training["max_steps"] = args.max_steps
    else:
        training["epochs"] = args.num_train_epochs
    warmup = getattr(args, "warmup_steps", 0) or 0
    if warmup:
        training["warmup_steps"] = warmup
    if state is not None and getattr(state, "global_step", 0):
        training["steps"] = state.global_step
        training["epochs_trained"] = round(float(state.epoch or 0), 4)
    return training


def _training_from_state(state: dict[str, Any]) -> dict[str, Any]:
    training = {}
    if state.get("global_step"):
        training["steps"] = state["global_step"]
    if _number(state.get("epoch")):
        training["epochs_trained"] = round(float(state["epoch"]), 4)
    if state.get("train_batch_size"):
        training["per_device_train_batch_size"] = state["train_batch_size"]
    return training


def _load_training_args(path: Path) -> Any:
    """`training_args.bin` without running arbitrary pickled code: weights-only loading, allowing only
    classes from transformers, accelerate and hf_distill. None when the file is absent or foreign."""
    if not path.is_file():
        return None
    import torch

    try:
        allowed = []
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
            module, _, attr = name.rpartition(".")
            if module.split(".")[0] not in ("transformers", "accelerate", "hf_distill"):
                return None
            obj = getattr(importlib.import_module(module), attr, None)
            if not inspect.isclass(obj):
                return None
            allowed.append(obj)
        with torch.serialization.safe_globals(allowed):
            return torch.load(str(path), weights_only=True)
    except Exception:  # an unreadable or foreign file only means fewer facts on the card
        return None


def _from_results(data: dict[str, Any]) -> dict[str, Any]:
    """Map a results.json (recipe, demo) onto report fields; see `DistillationReport.from_folder`."""
    if not data:
        return {}
    out: dict[str, Any] = {}
    copied = (  # results.json keys that are report fields of the same name
        "teacher",
        "method",
        "license",
        "augmentation",
        "dataset_name",
        "dataset_config",
        "dataset_split",
        "speedup",
        "speedup_setup",
        "stages",
        "student_size_bytes",
        "teacher_size_bytes",
    )
    for key in copied:
        if isinstance(data.get(key), (str, int, float, list)) and not isinstance(data.get(key), bool):
            out[key] = data[key]
    datasets = data.get("datasets", data.get("dataset"))
    if datasets:
        out["datasets"] = [datasets] if isinstance(datasets, str) else list(datasets)
    for key in ("student_parameters", "params"):
        if _number(data.get(key)):
            out["student_params"] = int(data[key])
            break
    if _number(data.get("teacher_parameters", data.get("teacher_params"))):
        out["teacher_params"] = int(data.get("teacher_parameters", data.get("teacher_params")))
    student = dict(data.get("student_metrics") or data.get("metrics") or {})
    teacher = dict(data.get("teacher_metrics") or {})
    skip = {"parameters", "params", "size_bytes", "layers", "metrics"}
    for key, value in data.items():
        for prefix, target in (("student_", student), ("teacher_", teacher)):
            if key.startswith(prefix) and _number(value) and key[len(prefix) :] not in skip:
                target[key[len(prefix) :]] = float(value)
    for name in ("accuracy", "f1", "perplexity"):  # the flat metrics recipes and the demo write
        if _number(data.get(name)):
            student.setdefault(name, float(data[name]))
    out["student_metrics"], out["teacher_metrics"] = student, teacher
    if isinstance(data.get("distillation"), dict):
        out["distillation"] = data["distillation"]
    training = {}
    for key, name in (
        ("learning_rate", "learning_rate"),
        ("epochs", "epochs"),
        ("num_train_epochs", "epochs"),
        ("seed", "seed"),
        ("batch_size", "per_device_train_batch_size"),
        ("per_device_train_batch_size", "per_device_train_batch_size"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("max_steps", "max_steps"),
        ("train_steps", "steps"),  # what the trainer state says was run (recipes.common.run_length)
        ("epochs_trained", "epochs_trained"),
    ):
        if _number(data.get(key)) and not (name == "max_steps" and data[key] <= 0):
            training[name] = data[key]
    if isinstance(data.get("bf16"), bool) or isinstance(data.get("fp16"), bool):
        training["precision"] = _precision(data.get("bf16"), data.get("fp16"))
    out["training"] = training
    return out


def _batches(trainer: Any, limit: int | None, dataset: Any) -> list[dict[str, Any]]:
    """Batches of `dataset` as the trainer collates them, on its device, in one process (no sharding)."""
    from torch.utils.data import DataLoader

    if dataset is None or isinstance(dataset, dict) or not hasattr(dataset, "__len__"):
        return []
    if trainer.args.remove_unused_columns and hasattr(dataset, "column_names"):
        dataset = trainer._remove_unused_columns(dataset, description="model card")
    loader = DataLoader(
        dataset,
        batch_size=trainer.args.per_device_eval_batch_size,
        collate_fn=trainer.data_collator,
        shuffle=False,
    )
    batches = []
    for batch in loader:
        batches.append(trainer._prepare_inputs(batch))
        if limit is not None and len(batches) >= limit:
            break
    return batches


def _speed_batches(trainer: Any, limit: int) -> list[dict[str, Any]]:
    dataset = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    batches = _batches(trainer, limit, dataset)
    # Labels and cached teacher outputs would make the forward compute a loss: time inference only.
    return [{k: v for k, v in b.items() if k != "labels" and not k.startswith("teacher_")} for b in batches]
