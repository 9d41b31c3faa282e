"""What a distillation run produced (`DistillationReport`), read once so that the card, the CLI and the plots agree.

`from_trainer` (a live trainer) and `from_folder` (a saved student) both read through `_run_facts`, with transformers'
training hyperparameters. A fact that could not be measured stays empty, and the card leaves it out.
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
from types import SimpleNamespace
from typing import Any

from ..base.recorded_names import recorded_name
from ..losses.registry import KindMap
from . import measure

REPORT_FILE = "distillation_report.json"
RESULTS_FILE = "results.json"
LOSS_PLOT = "loss_components.png"

_NOT_METRICS = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step", "loss", "jit_compilation_time")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# results.json keys (recipes, the demo) -> report fields of the same meaning; `training` keys -> hyperparameters
_RESULT_FIELDS = ("teacher", "method", "license", "augmentation", "dataset_name", "dataset_config", "dataset_split",
                  "speedup", "speedup_setup", "stages", "student_size_bytes", "teacher_size_bytes")
_RESULT_TRAINING = {"learning_rate": "learning_rate", "epochs": "num_epochs", "num_train_epochs": "num_epochs",
                    "seed": "seed", "batch_size": "train_batch_size", "per_device_train_batch_size": "train_batch_size",
                    "gradient_accumulation_steps": "gradient_accumulation_steps", "max_steps": "training_steps",
                    "train_steps": "steps", "epochs_trained": "epochs_trained"}


@dataclass
class DistillationReport:
    """The facts of one distillation run that a model card reports. Every field is optional."""

    model_name: str | None = None  # repo id or folder name: the card's title and model-index name
    teacher: str | None = None  # Hub id when known, else a name or a local folder's name
    method: str | None = None  # the card's method tag: distilbert, tinybert, minilm, gkd, logit-kd, ...
    architecture: str | None = None  # the student's class, e.g. BertForSequenceClassification
    pipeline_tag: str | None = None
    student_init: dict[str, Any] = field(default_factory=dict)  # student.config.distillation
    distillation: dict[str, Any] = field(default_factory=dict)  # distillation_facts(args)
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
    training: dict[str, Any] = field(default_factory=dict)  # transformers' hyperparameters + steps, epochs, precision
    eval_lines: list[dict[str, Any]] = field(default_factory=list)  # transformers' per-evaluation results table
    loss_plot: str | None = None  # file name, relative to the student folder
    adapter: dict[str, Any] = field(default_factory=dict)  # a PEFT student: type, rank, targets, base model
    initialised_from: str | None = None  # the student's starting checkpoint (`finetuned_from`), never the teacher
    early_exit: dict[str, Any] = field(default_factory=dict)  # students.early_exit: exits, speed sweep, plot
    auto: dict[str, Any] = field(default_factory=dict)  # hf_distill.auto: the latency budget and how the shape won
    routing: dict[str, Any] = field(default_factory=dict)  # named teachers (hf_distill.routing): name -> teacher, rows

    def __post_init__(self) -> None:
        # Local folders by name (or the Hub id of a cache snapshot), never a machine's absolute path: the card and
        # distillation_report.json are published (hf_distill.recorded_names).
        self.teacher = recorded_name(self.teacher) or None
        self.initialised_from = recorded_name(self.initialised_from) or None
        if self.adapter.get("base_model"):
            self.adapter = {**self.adapter, "base_model": recorded_name(self.adapter["base_model"])}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DistillationReport:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def updated(self, **fields: Any) -> DistillationReport:
        """A copy with the given fields replaced; None, {} and [] leave a field as it is."""
        _check_fields(fields)
        return dataclasses.replace(self, **{k: v for k, v in fields.items() if not _empty(v)})

    @classmethod
    def from_trainer(cls, trainer: Any, *, measure_speed: bool = False, speed_batches: int = 8,
                     **fields: Any) -> DistillationReport:
        """What a `DistillationTrainer` knows after training, `fields` over it. Nothing runs unless asked: the metrics
        are the last logged evaluation's and the last `trainer.evaluate_teacher()`'s (the card is written by one
        process, where a sharded teacher would wait forever); `measure_speed=True` times up to `speed_batches`
        batches here (`measure.trainer_speedup`)."""
        from ..features.heads import head_kind
        from ..features.taps import unwrap

        if "evaluate_teacher" in fields:
            raise TypeError("The card no longer evaluates the teacher (it is written on one process, where a sharded "
                            "teacher would deadlock). Call trainer.evaluate_teacher() on every process before writing "
                            "the card: its metrics are the card's teacher column.")
        _check_fields(fields)
        student, teacher, args, state = unwrap(trainer.model), trainer.teacher, trainer.args, trainer.state
        settings = getattr(getattr(trainer, "distiller", None), "settings", None)
        if settings is not None:  # the loss settings the run used (head defaults, schedules, stages)
            args = settings.record(args)
        peft_config = getattr(getattr(trainer.model, "peft_config", None), "get", lambda _: None)("default")
        found = _run_facts(getattr(student, "config", None), type(student).__name__, args, trainer,
                           {"log_history": state.log_history, "global_step": state.global_step, "epoch": state.epoch,
                            "best_global_step": state.best_global_step},
                           peft_config.to_dict() if peft_config is not None else None)
        if found["pipeline_tag"] != SPEECH_RECOGNITION:  # a head kind would take Whisper for a text seq2seq LM
            kind = head_kind(student)  # the model itself, also a subclass or a custom class no mapping names
            found["pipeline_tag"] = kind.facts.pipeline_tag if kind is not None else None
        found["model_name"] = getattr(trainer, "hub_model_id", None) or args.hub_model_id or Path(args.output_dir).name
        found["student_params"] = measure.count_parameters(student)
        if teacher is not None:
            t_path = getattr(teacher.config, "name_or_path", "") or ""
            found.update(teacher_shape=_shape(teacher.config), teacher_params=measure.count_parameters(teacher))
            found.update(teacher=t_path or found.get("teacher"),
                         teacher_size_bytes=measure.size_on_disk(t_path) or None if os.path.isdir(t_path) else None)
            evaluated = getattr(trainer, "teacher_metrics", None) or {}
            kept = {k: v for k, v in evaluated.items() if k in found.get("student_metrics", {})}
            found["teacher_metrics"] = lm_metrics(kept) if _perplexity(**found) else kept
        served = getattr(getattr(trainer, "distiller", None), "served", None)
        if teacher is None and served:  # a teacher behind a URL: the model name its server states (issue #42)
            found["teacher"] = found.get("teacher") or served[min(served)].name
        router = getattr(getattr(trainer, "distiller", None), "router", None)
        if router is not None:  # teachers routed per row by `teacher_id` (issue #42 item 6): each one and its rows
            found["routing"] = router.describe()
        if teacher is not None and measure_speed:
            found.update(measure.trainer_speedup(trainer, student, teacher, speed_batches))
        return cls.from_dict(_merge(found, fields))

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, **fields: Any) -> DistillationReport:
        """What a saved student folder says, later sources winning: config.json, adapter_config.json,
        training_args.bin, trainer_state.json (or the latest checkpoint's), the weights, distillation_report.json
        (the last card's), results.json (`read_results`); then `fields`."""
        _check_fields(fields)
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder.")
        config = _read_json(folder / "config.json")
        state_path = find_trainer_state(folder)
        found = _run_facts(config or None, (config.get("architectures") or [None])[0],
                           _load_training_args(folder / "training_args.bin"), None,
                           _read_json(state_path) if state_path else None,
                           _read_json(folder / "adapter_config.json") or None)
        found.update(model_name=folder.resolve().name, student_params=measure.stored_parameters(folder),
                     student_size_bytes=measure.size_on_disk(folder) or None)
        # The teacher's folder, when the caller or config.json names a local one: its facts are real too. config.json
        # records a local teacher by its folder name (hf_distill.recorded_names), looked for beside the student (as
        # a run keeps them: out/ and teacher/), inside it, and in the current folder.
        names = [str(t) for t in (fields.get("teacher"), found.get("teacher")) if t]
        local = [where / name for name in names for where in (Path(), folder.parent, folder)]
        teacher_dir = next((t for t in local if (t / "config.json").is_file()), None)
        if teacher_dir is not None:
            found.update(teacher_shape=_shape(_read_json(teacher_dir / "config.json")),
                         teacher_params=measure.stored_parameters(teacher_dir),
                         teacher_size_bytes=measure.size_on_disk(teacher_dir) or None)
        if (folder / LOSS_PLOT).is_file():
            found["loss_plot"] = LOSS_PLOT
        merged = _merge(_merge(found, _read_json(folder / REPORT_FILE)), read_results(folder / RESULTS_FILE))
        if "method" not in merged and merged.get("distillation"):
            merged["method"] = detect_method(merged["distillation"])
        if merged.get("pipeline_tag") == "text-generation":  # a results.json may give perplexity but no loss
            for key in ("student_metrics", "teacher_metrics"):
                if merged.get(key):
                    merged[key] = lm_metrics(merged[key])
        return cls.from_dict(_merge(merged, fields))


def _run_facts(config: Any, architecture: str | None, args: Any, trainer: Any, state: dict[str, Any] | None,
               adapter_config: dict[str, Any] | None) -> dict[str, Any]:
    """The facts a trainer and a saved folder both hold: config, training arguments, evaluations, steps."""
    from transformers.modelcard import extract_hyperparameters_from_trainer, parse_log_history

    found: dict[str, Any] = {"architecture": architecture, "pipeline_tag": pipeline_tag_for(architecture, config),
                             "student_shape": _shape(config)}
    init = _get(config, "distillation") if config is not None else None
    if isinstance(init, dict):
        found.update(student_init=dict(init), teacher=init.get("teacher_name_or_path") or None)
        if init.get("teacher_num_layers"):
            found["teacher_shape"] = {"layers": int(init["teacher_num_layers"])}
        stacks = {f"{s}_layers": init.get(f"teacher_num_{s}_layers") for s in ("encoder", "decoder")}
        if all(_number(v) for v in stacks.values()):  # an encoder-decoder student (students.from_teacher)
            found["teacher_shape"] = {k: int(v) for k, v in stacks.items()}
    if adapter_config:  # a PEFT student: its repository holds adapters
        targets, kind = adapter_config.get("target_modules"), adapter_config.get("peft_type")
        found["adapter"] = {"peft_type": getattr(kind, "value", kind), "r": adapter_config.get("r"),  # "LORA"
                            "lora_alpha": adapter_config.get("lora_alpha"), "target_modules": sorted(targets) if
                            isinstance(targets, list | set | tuple) else targets,
                            "base_model": adapter_config.get("base_model_name_or_path"),
                            "modules_to_save": sorted(adapter_config.get("modules_to_save") or [])}
    training: dict[str, Any] = {}
    if args is not None:
        training = extract_hyperparameters_from_trainer(trainer or SimpleNamespace(args=args))
        training.pop("mixed_precision_training", None)  # said by `precision`, bf16 included
        if "optimizer" in training and hasattr(args.optim, "value"):  # "adamw_torch", not "OptimizerNames.ADAMW_TORCH"
            training["optimizer"] = training["optimizer"].replace(str(args.optim), args.optim.value)
        training["weight_decay"] = args.weight_decay  # not among transformers' hyperparameters
        training["precision"] = _precision(getattr(args, "bf16", False), getattr(args, "fp16", False))
        if hasattr(args, "distillation_summary"):
            found["distillation"] = distillation_facts(args)
            found["method"] = detect_method(found["distillation"])
    if state:
        own_loss = _own_eval_loss(**found)
        best = state.get("best_global_step") if getattr(args, "load_best_model_at_end", False) else None
        metrics, found["eval_step"] = published_eval_metrics(state.get("log_history") or [], own_loss, best)
        # The task's metrics first (the model index's first metric is the one the Hub shows), then the losses.
        losses = [k for k in metrics if k == "loss" or k.endswith("_loss")]
        metrics = {**{k: v for k, v in metrics.items() if k not in losses}, **{k: metrics[k] for k in losses}}
        found["student_metrics"] = lm_metrics(metrics) if _perplexity(**found, training=training) else metrics
        found["eval_lines"] = parse_log_history(state.get("log_history") or [])[1] or []
        if state.get("global_step"):
            training["steps"] = state["global_step"]
            if _number(state.get("epoch")):
                training["epochs_trained"] = round(float(state["epoch"]), 4)
        if args is None and state.get("train_batch_size"):
            training["train_batch_size"] = state["train_batch_size"]
    found["training"] = training
    return found


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """A recipe's or the demo's results.json as report fields ({} when absent): metrics as `student_metrics` /
    `teacher_metrics` dicts, flat `student_<metric>` / `teacher_<metric>` numbers or `accuracy`, `f1`, `perplexity`."""
    data = _read_json(Path(path))
    if not data:
        return {}
    out: dict[str, Any] = {k: data[k] for k in _RESULT_FIELDS
                           if isinstance(data.get(k), (str, int, float, list)) and not isinstance(data[k], bool)}
    datasets = data.get("datasets", data.get("dataset"))
    if datasets:
        out["datasets"] = [datasets] if isinstance(datasets, str) else list(datasets)
    params = [data.get(k) for k in ("student_parameters", "params", "teacher_parameters", "teacher_params")]
    out["student_params"] = next((int(p) for p in params[:2] if _number(p)), None)
    out["teacher_params"] = next((int(p) for p in params[2:] if _number(p)), None)
    student = dict(data.get("student_metrics") or data.get("metrics") or {})
    teacher = dict(data.get("teacher_metrics") or {})
    for key, value in data.items():
        for prefix, target in (("student_", student), ("teacher_", teacher)):
            name = key[len(prefix):]
            if key.startswith(prefix) and _number(value) and name not in ("parameters", "params", "size_bytes",
                                                                          "layers", "metrics"):
                target[name] = float(value)
    for name in ("accuracy", "f1", "perplexity"):  # the flat metrics recipes and the demo write
        if _number(data.get(name)):
            student.setdefault(name, float(data[name]))
    out.update(student_metrics=student, teacher_metrics=teacher)
    if isinstance(data.get("distillation"), dict):
        out["distillation"] = data["distillation"]
    out["training"] = {name: data[key] for key, name in _RESULT_TRAINING.items()
                       if _number(data.get(key)) and not (name == "training_steps" and data[key] <= 0)}
    if isinstance(data.get("bf16"), bool) or isinstance(data.get("fp16"), bool):
        out["training"]["precision"] = _precision(data.get("bf16"), data.get("fp16"))
    return out


# ---------------------------------------------------------------------- detection helpers


def hub_id(name: str | None) -> str | None:
    """`name` if it reads as a Hub model id (`org/name`) and is not a local path."""
    if not name or os.path.exists(name) or not _HUB_ID.match(name) or ".." in name:
        return None
    return name


SPEECH_RECOGNITION = "automatic-speech-recognition"  # a speech seq2seq student's tag (AutoModelForSpeechSeq2Seq)


def pipeline_tag_for(architecture: str | None, config: Any = None) -> str | None:
    """The Hub pipeline tag of a student class, from its head kind (`features.heads.class_kind`: the task mapping
    that names the class, for `config`'s model_type when given). An encoder-decoder LM is text2text-generation,
    not a vision-language or speech `...ForConditionalGeneration` (see `features.heads.HEADS`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES

    from ..features.heads import class_kind

    if architecture in MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES.values():  # Whisper: audio in, text out
        return SPEECH_RECOGNITION
    kind = class_kind(architecture, config)
    return kind.facts.pipeline_tag if kind is not None else None


def distillation_facts(args: Any) -> dict[str, Any]:
    """`args.distillation_summary()` with `kd_token_mask` and `eval_with_teacher` (is `eval_loss` the student's own)."""
    facts = dict(args.distillation_summary())
    for name in ("kd_token_mask", "eval_with_teacher"):
        if getattr(args, name, None) is not None:
            facts.setdefault(name, getattr(args, name))
    return facts


_LANGUAGE_MODELS = ("text-generation", "text2text-generation")  # eval_loss: cross-entropy per predicted token


def _own_eval_loss(distillation: dict[str, Any] | None = None, **_: Any) -> bool:
    """Whether `eval_loss` is the student's own task loss, as a plain Trainer's (known only with
    `eval_with_teacher=False`; with the teacher it is the distillation loss, which the card does not show)."""
    return (distillation or {}).get("eval_with_teacher") is False


def _perplexity(pipeline_tag: str | None = None, training: dict[str, Any] | None = None, **facts: Any) -> bool:
    """Whether exp(`eval_loss`) is a perplexity: a language model's own token cross-entropy, not label-smoothed."""
    return (_own_eval_loss(**facts) and pipeline_tag in _LANGUAGE_MODELS
            and not (training or {}).get("label_smoothing_factor"))


def lm_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A language model's metrics with `<set>_perplexity` = exp(`<set>_loss`) beside each loss, and the reverse."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name.endswith("perplexity") and name[: -len("perplexity")] + "loss" in metrics:
            continue  # placed right after its loss below
        if name == "perplexity" or name.endswith("_perplexity"):
            if value > 0:
                out[name[: -len("perplexity")] + "loss"] = math.log(value)
            out[name] = value
            continue
        out[name] = value
        if name == "loss" or name.endswith("_loss"):
            ppl = name[: -len("loss")] + "perplexity"
            out[ppl] = metrics[ppl] if metrics.get(ppl) is not None else math.inf if value > 700 else math.exp(value)
    return out


_KD_METHODS = KindMap("method")  # kd_loss -> the card's method tag: each divergence's registry entry's (a live view)
_TERM_METHODS = (("attention_score_mse", "tinybert"), ("relation_kl", "minilm"), ("pkd_loss", "bert-pkd"),
                 ("cosine_loss", "distilbert"))


def detect_method(summary: dict[str, Any]) -> str:
    """The published method a loss configuration follows, named as the card's tag."""
    preset = summary.get("distill_preset") or ""
    if preset.startswith("tinybert"):
        return "tinybert"
    if preset in ("distilbert", "minilm", "minilmv2"):
        return preset
    terms = summary.get("distill_terms") or []
    losses = {t.get("loss") for t in terms}
    if {r for t in terms for r in t.get("relations") or []} & {"qq", "kk"} and "attention_score_mse" not in losses:
        return "minilmv2"
    found = next((method for loss, method in _TERM_METHODS if loss in losses), None)
    if found or losses:
        return found or "feature-kd"
    return _KD_METHODS.get(summary.get("kd_loss") or "", "logit-kd")


def latest_eval_metrics(log_history: list[dict[str, Any]], keep_loss: bool = False
                        ) -> tuple[dict[str, float], int | None]:
    """The last evaluation's metrics (of every evaluation set at that step, without the `eval_` prefix, timings and
    losses unless `keep_loss`) and its step."""
    skipped = tuple(f"_{k}" for k in _NOT_METRICS if k != "loss" or not keep_loss)  # eval_<name>, eval_<set>_<name>
    metrics: dict[str, float] = {}
    step = None
    for entry in reversed(log_history or []):
        found = {k[5:]: float(v) for k, v in entry.items()
                 if k.startswith("eval_") and _number(v) and not k.endswith(skipped)}
        if not found:
            continue
        if step is not None and entry.get("step") != step:
            break
        step = entry.get("step")
        metrics = {**found, **metrics}
    return metrics, step


def published_eval_metrics(log_history: list[dict[str, Any]], keep_loss: bool = False, best_step: int | None = None
                           ) -> tuple[dict[str, float], int | None]:
    """`latest_eval_metrics` of the weights a finished run hands over: the last evaluation's, except where
    `load_best_model_at_end` put back the checkpoint of `best_step` and nothing was evaluated after training (the
    entry with `train_runtime`): then that step's, not the last step's that the published weights no longer hold."""
    ends = [i for i, entry in enumerate(log_history or []) if "train_runtime" in entry]
    if best_step is not None and ends and not latest_eval_metrics(log_history[ends[-1] + 1:], keep_loss)[0]:
        return latest_eval_metrics([e for e in log_history[:ends[-1]] if e.get("step") == best_step], keep_loss)
    return latest_eval_metrics(log_history, keep_loss)


def find_trainer_state(folder: str | os.PathLike) -> Path | None:
    """`trainer_state.json` of the folder or of its checkpoints, whichever went furthest."""
    folder = Path(folder)
    candidates = [folder / "trainer_state.json", *folder.glob("checkpoint-*/trainer_state.json")]
    found = [(int(_read_json(p).get("global_step") or 0), p) for p in candidates if p.is_file()]
    return max(found, key=lambda item: (item[0], item[1] == candidates[0]))[1] if found else None


# ---------------------------------------------------------------------- internals


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
    """`update` over `base`, empty values skipped; `training` and `distillation` merged key by key."""
    out = dict(base)
    for key, value in update.items():
        if not _empty(value):
            merge = key in ("training", "distillation") and isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = {**out[key], **value} if merge else value
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
    keys = {"layers": ("num_hidden_layers", "n_layers", "num_layers"), "hidden": ("hidden_size", "dim", "d_model"),
            "heads": ("num_attention_heads", "n_heads")}
    if _get(config, "is_encoder_decoder"):  # two stacks (T5: num_layers / num_decoder_layers; BART: encoder_layers)
        del keys["layers"]
        keys = {"encoder_layers": ("encoder_layers", "num_layers"),
                "decoder_layers": ("decoder_layers", "num_decoder_layers"), **keys}
    shape = {}
    for name, candidates in keys.items():
        value = next((_get(config, k) for k in candidates if _number(_get(config, k))), None)
        if value is not None:
            shape[name] = int(value)
    return shape


def _precision(bf16: Any, fp16: Any) -> str:
    return "bf16 mixed precision" if bf16 else "fp16 mixed precision" if fp16 else "fp32"


def _load_training_args(path: Path) -> Any:
    """`training_args.bin` loaded weights-only, allowing classes of transformers, accelerate and hf_distill only;
    None when absent or foreign."""
    if not path.is_file():
        return None
    import torch

    try:
        allowed = []
        for name in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)):
            module, _, attr = name.rpartition(".")
            obj = getattr(importlib.import_module(module), attr, None) if module.split(".")[0] in (
                "transformers", "accelerate", "hf_distill") else None
            if not inspect.isclass(obj):
                return None
            allowed.append(obj)
        with torch.serialization.safe_globals(allowed):
            return torch.load(str(path), weights_only=True)
    except Exception:  # an unreadable or foreign file only means fewer facts on the card
        return None
