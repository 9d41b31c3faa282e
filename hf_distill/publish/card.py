"""Model cards of distilled students.

`model_card(report)` turns a `DistillationReport` into a Hub model card: YAML metadata (base model = the
teacher, tags, pipeline tag, datasets, license, model-index) and a body saying how the student was made and
what it keeps of the teacher. `write_model_card(folder)` writes it into a student folder;
`write_trainer_card(trainer)` is `Trainer.create_model_card` for a `DistillationTrainer`.

The card sets no `base_model_relation`: the values the Hub documents are adapter, merge, quantized and
finetune, huggingface_hub 2.4 defines none for distillation, and none of the four describes a student
correctly; without the field the Hub infers the relation itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..features.heads import HEADS, HeadKind, kind_for_task
from .measure import size_on_disk, stored_parameters
from .report import LOSS_PLOT, REPORT_FILE, DistillationReport, hub_id

CARD_FILE = "README.md"

METHODS = {  # tag -> (what the card calls it, BibTeX keys)
    "logit-kd": ("logit distillation (Hinton et al., 2015)", ["hinton2015distilling"]),
    "distilbert": ("DistilBERT distillation (Sanh et al., 2019)", ["sanh2019distilbert"]),
    "tinybert": ("TinyBERT transformer distillation (Jiao et al., 2020)", ["jiao2020tinybert"]),
    "minilm": ("MiniLM deep self-attention distillation (Wang et al., 2020)", ["wang2020minilm"]),
    "minilmv2": (
        "MiniLMv2 multi-head self-attention relation distillation (Wang et al., 2021)",
        ["wang2021minilmv2"],
    ),
    "bert-pkd": ("BERT-PKD patient knowledge distillation (Sun et al., 2019)", ["sun2019patient"]),
    "feature-kd": (
        "intermediate-feature distillation with FitNets-style hints (Romero et al., 2015)",
        ["romero2015fitnets"],
    ),
    "gkd": ("generalized JSD distillation (GKD, Agarwal et al., 2024)", ["agarwal2024gkd"]),
    "reverse-kl": ("reverse KL distillation (MiniLLM, Gu et al., 2024)", ["gu2024minillm"]),
    "distillm": ("skew KL distillation (DistiLLM, Ko et al., 2024)", ["ko2024distillm"]),
    "tvd-kd": ("total variation distance distillation (f-divergence KD, Wen et al., 2023)", ["wen2023fdivergence"]),
    "fastbert": ("FastBERT self-distilled early exits (Liu et al., 2020)", ["liu2020fastbert"]),
    "deebert": (
        "DeeBERT early-exit off-ramps (Xin et al., 2020), self-distilled as in FastBERT (Liu et al., 2020)",
        ["xin2020deebert", "liu2020fastbert"],
    ),
}

BIBTEX = {
    "hinton2015distilling": """@article{hinton2015distilling,
  title   = {Distilling the Knowledge in a Neural Network},
  author  = {Hinton, Geoffrey and Vinyals, Oriol and Dean, Jeff},
  journal = {arXiv preprint arXiv:1503.02531},
  year    = {2015}
}""",
    "sanh2019distilbert": """@article{sanh2019distilbert,
  title   = {{DistilBERT}, a distilled version of {BERT}: smaller, faster, cheaper and lighter},
  author  = {Sanh, Victor and Debut, Lysandre and Chaumond, Julien and Wolf, Thomas},
  journal = {arXiv preprint arXiv:1910.01108},
  year    = {2019}
}""",
    "jiao2020tinybert": """@inproceedings{jiao2020tinybert,
  title     = {{TinyBERT}: Distilling {BERT} for Natural Language Understanding},
  author    = {Jiao, Xiaoqi and Yin, Yichun and Shang, Lifeng and Jiang, Xin and Chen, Xiao and Li, Linlin
               and Wang, Fang and Liu, Qun},
  booktitle = {Findings of the Association for Computational Linguistics: EMNLP 2020},
  pages     = {4163--4174},
  year      = {2020},
  doi       = {10.18653/v1/2020.findings-emnlp.372}
}""",
    "wang2020minilm": """@inproceedings{wang2020minilm,
  title     = {{MiniLM}: Deep Self-Attention Distillation for Task-Agnostic Compression of Pre-Trained
               Transformers},
  author    = {Wang, Wenhui and Wei, Furu and Dong, Li and Bao, Hangbo and Yang, Nan and Zhou, Ming},
  booktitle = {Advances in Neural Information Processing Systems},
  volume    = {33},
  pages     = {5776--5788},
  year      = {2020}
}""",
    "wang2021minilmv2": """@inproceedings{wang2021minilmv2,
  title     = {{MiniLMv2}: Multi-Head Self-Attention Relation Distillation for Compressing Pretrained
               Transformers},
  author    = {Wang, Wenhui and Bao, Hangbo and Huang, Shaohan and Dong, Li and Wei, Furu},
  booktitle = {Findings of the Association for Computational Linguistics: ACL-IJCNLP 2021},
  pages     = {2140--2151},
  year      = {2021},
  doi       = {10.18653/v1/2021.findings-acl.188}
}""",
    "sun2019patient": """@inproceedings{sun2019patient,
  title     = {Patient Knowledge Distillation for {BERT} Model Compression},
  author    = {Sun, Siqi and Cheng, Yu and Gan, Zhe and Liu, Jingjing},
  booktitle = {Proceedings of the 2019 Conference on Empirical Methods in Natural Language Processing and the
               9th International Joint Conference on Natural Language Processing (EMNLP-IJCNLP)},
  pages     = {4323--4332},
  year      = {2019},
  doi       = {10.18653/v1/D19-1441}
}""",
    "romero2015fitnets": """@inproceedings{romero2015fitnets,
  title     = {{FitNets}: Hints for Thin Deep Nets},
  author    = {Romero, Adriana and Ballas, Nicolas and Kahou, Samira Ebrahimi and Chassang, Antoine
               and Gatta, Carlo and Bengio, Yoshua},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2015}
}""",
    "agarwal2024gkd": """@inproceedings{agarwal2024gkd,
  title     = {On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes},
  author    = {Agarwal, Rishabh and Vieillard, Nino and Zhou, Yongchao and Stanczyk, Piotr and Ramos, Sabela
               and Geist, Matthieu and Bachem, Olivier},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2024}
}""",
    "gu2024minillm": """@inproceedings{gu2024minillm,
  title     = {{MiniLLM}: Knowledge Distillation of Large Language Models},
  author    = {Gu, Yuxian and Dong, Li and Wei, Furu and Huang, Minlie},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2024}
}""",
    "ko2024distillm": """@inproceedings{ko2024distillm,
  title     = {{DistiLLM}: Towards Streamlined Distillation for Large Language Models},
  author    = {Ko, Jongwoo and Kim, Sungnyun and Chen, Tianyi and Yun, Se-Young},
  booktitle = {Proceedings of the 41st International Conference on Machine Learning (ICML)},
  series    = {Proceedings of Machine Learning Research},
  volume    = {235},
  year      = {2024}
}""",
    "wen2023fdivergence": """@inproceedings{wen2023fdivergence,
  title     = {f-Divergence Minimization for Sequence-Level Knowledge Distillation},
  author    = {Wen, Yuqiao and Li, Zichao and Du, Wenyu and Mou, Lili},
  booktitle = {Proceedings of the 61st Annual Meeting of the Association for Computational Linguistics (Volume 1:
               Long Papers)},
  pages     = {10817--10834},
  year      = {2023},
  doi       = {10.18653/v1/2023.acl-long.605}
}""",
    "men2024shortgpt": """@article{men2024shortgpt,
  title   = {{ShortGPT}: Layers in Large Language Models are More Redundant Than You Expect},
  author  = {Men, Xin and Xu, Mingyu and Zhang, Qingyu and Wang, Bingning and Lin, Hongyu and Lu, Yaojie
             and Han, Xianpei and Chen, Weipeng},
  journal = {arXiv preprint arXiv:2403.03853},
  year    = {2024}
}""",
    "xin2020deebert": """@inproceedings{xin2020deebert,
  title={{DeeBERT}: Dynamic Early Exiting for Accelerating {BERT} Inference},
  author={Xin, Ji and Tang, Raphael and Lee, Jaejun and Yu, Yaoliang and Lin, Jimmy},
  booktitle={Proceedings of the 58th Annual Meeting of the Association for Computational Linguistics},
  year={2020}
}""",
    "liu2020fastbert": """@inproceedings{liu2020fastbert,
  title={FastBERT: a Self-distilling BERT with Adaptive Inference Time},
  author={Liu, Weijie and Zhou, Peng and Zhao, Zhe and Wang, Zhiruo and Deng, Haotang and Ju, Qi},
  booktitle={Proceedings of the 58th Annual Meeting of the Association for Computational Linguistics},
  year={2020}
}""",
}

# Encoder-decoder LM tasks: transformers 5 has no pipeline for them, so the card shows `generate` instead.
_SEQ2SEQ_TASKS = HEADS[HeadKind.SEQ2SEQ_LM].tasks
_KD_LOSSES = {"kl": "KL divergence x T^2", "soft_ce": "soft cross-entropy", "mse": "MSE of logits",
              "reverse_kl": "reverse KL divergence x T^2", "jsd": "generalized JSD x T^2",
              "skew_kl": "skew KL divergence x T^2", "skew_reverse_kl": "skew reverse KL divergence x T^2",
              "tvd": "total variation distance x T^2"}
_TRAINING_ROWS = (
    ("learning_rate", "Learning rate"),
    ("epochs", "Epochs"),
    ("max_steps", "Max steps"),
    ("steps", "Optimizer steps done"),
    ("epochs_trained", "Epochs done"),
    ("per_device_train_batch_size", "Batch size per device"),
    ("gradient_accumulation_steps", "Gradient accumulation steps"),
    ("effective_batch_size", "Effective batch size"),
    ("precision", "Precision"),
    ("optimizer", "Optimizer"),
    ("lr_scheduler", "LR schedule"),
    ("warmup_steps", "Warm-up steps"),
    ("weight_decay", "Weight decay"),
    ("seed", "Seed"),
)


# The paper whose objective a logit loss is, when it is not Hinton et al.'s soft targets / forward KL.
_KD_PAPERS = {"jsd": "agarwal2024gkd", "reverse_kl": "gu2024minillm", "skew_kl": "ko2024distillm",
              "skew_reverse_kl": "ko2024distillm", "tvd": "wen2023fdivergence"}
# Token-level heads: the card says which of their tokens the logit loss covered (`kd_token_mask`).
_TOKEN_TASKS = tuple(task for facts in HEADS.values() if facts.token_level for task in facts.tasks)
# DistiLLM's skew divergences: what the card calls each, and what alpha mixes (P = teacher, Q = student).
_SKEW = {
    "skew_kl": ("skew KL", "KL(teacher || alpha teacher + (1 - alpha) student); 0 is the forward KL"),
    "skew_reverse_kl": ("skew reverse KL", "KL(student || alpha student + (1 - alpha) teacher); 0 is the reverse KL"),
}


def citations(report: DistillationReport) -> list[str]:
    """BibTeX keys of the papers the run follows: the method's, the logit loss's (Hinton et al.; GKD for the
    generalized JSD, MiniLLM for the reverse KL, DistiLLM for the skew KLs, Wen et al. for the total variation
    distance) and ShortGPT's for a depth-pruned student."""
    keys = list(METHODS.get(report.method or "", ("", []))[1])
    d = report.distillation
    if (d.get("kd_weight") or 0) > 0:
        keys.append(_KD_PAPERS.get(d.get("kd_loss") or "", "hinton2015distilling"))
    if report.student_init.get("init") == "prune_depth":
        keys.append("men2024shortgpt")
    return list(dict.fromkeys(keys))


def method_name(report: DistillationReport) -> str | None:
    """What the card calls the method, with the settings that define it (GKD's beta, DistiLLM's alpha; a causal
    LM's forward KL is named as the objective on next-token distributions)."""
    if report.method not in METHODS:
        return None
    d = report.distillation
    if report.method == "gkd" and d.get("jsd_beta") is not None:
        return f"generalized JSD distillation (beta = {d['jsd_beta']:g}; GKD, Agarwal et al., 2024)"
    if report.method == "distillm" and d.get("kd_loss") in _SKEW:
        alpha = f"alpha = {d['skew_alpha']:g}; " if d.get("skew_alpha") is not None else ""
        return f"{_SKEW[d['kd_loss']][0]} distillation ({alpha}DistiLLM, Ko et al., 2024)"
    if report.method == "logit-kd" and report.pipeline_tag == "text-generation":
        kind = {"kl": "forward KL", "soft_ce": "soft cross-entropy"}.get(d.get("kd_loss") or "")
        if kind:
            return f"{kind} distillation of the next-token distributions (Hinton et al., 2015)"
    return METHODS[report.method][0]


def _library_and_base(r: DistillationReport) -> tuple[str, str | None, list[str]]:
    """`library_name`, `base_model` and extra tags. A PEFT student's repository holds adapters, so the card is
    PEFT's: `library_name: peft` and `base_model` the model the adapters load onto, tagged as PEFT tags it
    (`base_model:adapter:<id>`, `lora`, `transformers`); the teacher stays named in the body."""
    if not r.adapter:
        return "transformers", r.teacher_hub_id, []
    base = hub_id(r.adapter.get("base_model"))
    tags = ["transformers"]
    if r.adapter.get("peft_type") == "LORA":
        tags.append("lora")
    if base:
        tags.append(f"base_model:adapter:{base}")
    return "peft", base, tags


def model_card(report: DistillationReport) -> Any:
    """The `huggingface_hub.ModelCard` of a student: metadata and a body made only of known facts."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    from .. import __version__

    eval_results = []
    if report.pipeline_tag and report.datasets and report.student_metrics:
        eval_results = [
            EvalResult(
                task_type=report.pipeline_tag,
                dataset_type=report.datasets[0],
                dataset_name=report.dataset_name or report.datasets[0],
                dataset_config=report.dataset_config,
                dataset_split=report.dataset_split,
                metric_type=name,
                metric_value=round(value, 6),
            )
            for name, value in report.student_metrics.items()
        ]
    library, base_model, library_tags = _library_and_base(report)
    tags = ["distillation", "hf-distill", *([report.method] if report.method else []), *library_tags, *report.tags]
    data = ModelCardData(
        base_model=base_model,
        library_name=library,
        pipeline_tag=report.pipeline_tag,
        tags=list(dict.fromkeys(tags)),
        datasets=report.datasets or None,
        license=report.license,
        language=report.language or None,
        model_name=(report.model_name or "student") if eval_results else None,
        eval_results=eval_results or None,
    )
    sections = [
        _title(report),
        _made(report),
        _comparison(report),
        _training(report),
        _early_exit(report),
        _usage(report),
        _citation(report),
        f"Distilled with hf_distill {__version__}.",
    ]
    body = "\n\n".join(s for s in sections if s)
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}\n")


def write_model_card(
    folder: str | os.PathLike, report: DistillationReport | None = None, **fields: Any
) -> Path:
    """Write `README.md` (and `distillation_report.json`, to refresh it later) into a student folder.

    Without `report` the facts are read from the folder (`DistillationReport.from_folder`); `fields`
    override them. Size, stored parameters and the loss plot are filled from the folder when missing.
    """
    folder = Path(folder)
    if report is None:
        report = DistillationReport.from_folder(folder, **fields)
    elif fields:
        report = report.updated(**fields)
    fill: dict[str, Any] = {}
    if report.student_size_bytes is None:
        fill["student_size_bytes"] = size_on_disk(folder) or None
    if report.student_params is None:
        fill["student_params"] = stored_parameters(folder)
    if report.loss_plot is None and (folder / LOSS_PLOT).is_file():
        fill["loss_plot"] = LOSS_PLOT
    report = report.updated(**fill)
    if report.loss_plot and not (folder / report.loss_plot).is_file():
        report = dataclasses.replace(report, loss_plot=None)
    path = folder / CARD_FILE
    model_card(report).save(path)
    (folder / REPORT_FILE).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def _title(r: DistillationReport) -> str:
    name = r.model_name or "Distilled student"
    what = f"a {r.student_shape['layers']}-layer " if r.student_shape.get("layers") else "a "
    what += f"`{r.architecture}`" if r.architecture else "student model"
    if r.student_shape.get("encoder_layers") and r.student_shape.get("decoder_layers"):
        what += f" ({r.student_shape['encoder_layers']} encoder and {r.student_shape['decoder_layers']} decoder layers)"
    sentence = f"This model is {what} distilled"
    if r.teacher:
        sentence += f" from {_teacher_link(r)}"
    if method_name(r):
        sentence += f" with {method_name(r)}"
    if r.datasets or r.dataset_name:
        sentence += f" on {r.dataset_name or ', '.join(r.datasets)}"
    return f"# {name}\n\n{sentence}."


def _teacher_link(r: DistillationReport) -> str:
    return _model_link(r.teacher)


def _model_link(name: str | None) -> str:
    if hub_id(name):
        return f"[{name}](https://huggingface.co/{name})"
    return f"`{Path(name).name or name}`" if name else ""


def _tokens(r: DistillationReport) -> str:
    """Which tokens the logit loss averaged over (`kd_token_mask`), in the words of the student's task."""
    mask = r.distillation.get("kd_token_mask")
    if r.pipeline_tag in _SEQ2SEQ_TASKS:  # the decoder's logits are distilled: its tokens, not the source text's
        if mask == "attention":
            return ("every real target token: decoder positions with decoder_attention_mask = 1, or whose label is "
                    "not -100 when the batch has no decoder_attention_mask (`kd_token_mask=attention`)")
        if mask == "labels":
            return "target tokens only: decoder positions whose label is not -100 (`kd_token_mask=labels`)"
        return ""
    if mask == "attention":
        prompt = ", prompt tokens included" if r.pipeline_tag == "text-generation" else ""
        return f"every real token (attention_mask = 1){prompt} (`kd_token_mask=attention`)"
    if mask == "labels":
        which = {
            "text-generation": "completion tokens only: positions whose label is not -100, prompt and padding "
            "excluded",
            "fill-mask": "masked tokens only: positions whose label is not -100",
        }.get(r.pipeline_tag or "", "labelled tokens only: positions whose label is not -100")
        return f"{which} (`kd_token_mask=labels`)"
    return ""


def _initialisation(r: DistillationReport) -> str:
    """How the student was made (hf_distill.students records it in `config.distillation`)."""
    init = r.student_init
    kind = init.get("init")
    layers = init.get("teacher_layers")
    causal = r.pipeline_tag == "text-generation"
    of = f" of its {init['teacher_num_layers']}" if init.get("teacher_num_layers") else ""
    if kind == "from_teacher" and init.get("teacher_encoder_layers") is not None:  # an encoder-decoder student
        stacks = []
        for stack in ("encoder", "decoder"):
            total = init.get(f"teacher_num_{stack}_layers")
            stacks.append(f"{stack} layers {init.get(f'teacher_{stack}_layers')}{f' of its {total}' if total else ''}")
        return f"teacher {' and '.join(stacks)} (0-based), copied with the rest of its weights (embeddings, LM head)"
    if kind == "prune_depth" and layers is not None:
        blocks = "decoder blocks" if causal else "layers"
        with_ = "the embeddings, final norm and LM head" if causal else "the embeddings and head"
        removed = ""
        if init.get("teacher_num_layers"):
            gone = sorted(set(range(int(init["teacher_num_layers"]))) - set(layers))
            removed = f", removed {gone}" if gone else ""
        tokens = f" on {init['calibration_tokens']:,} calibration tokens" if init.get("calibration_tokens") else ""
        return (
            f"depth pruning of the teacher: kept {blocks} {layers} (0-based){of}{removed}, the {len(layers)} most "
            f"important by block importance (1 - mean cosine between a block's input and output, ShortGPT, "
            f"Men et al., 2024){tokens}; the kept blocks copied bit-exactly with {with_}"
        )
    if kind == "from_teacher" and layers is not None:
        if causal:
            return f"teacher decoder blocks {layers} (0-based){of}, copied with the embeddings, final norm and LM head"
        return (
            f"teacher encoder layers {layers} (0-based){of}, copied with the embeddings, pooler and head "
            "(DistilBERT-style)"
        )
    if kind == "shrink":
        return "random, a smaller configuration of the teacher's architecture (TinyBERT-style)"
    return ""


def _layer_map(layers: Any) -> str:
    if isinstance(layers, str):
        return {"uniform": "uniform map", "last": "last layer to last layer"}.get(layers, layers)
    return ", ".join(f"{s} -> {t}" for s, t in layers)


def _made(r: DistillationReport) -> str:
    lines = []
    if r.method:
        name = method_name(r) or r.method
        sampled = ""
        if r.method in ("gkd", "reverse-kl", "distillm", "tvd-kd"):
            # the papers also train on sequences the student samples; this run did not
            sampled = ", on the training sequences (no student-generated samples)"
        lines.append(f"- **Method**: {name[0].upper()}{name[1:]}{sampled}")
    if r.teacher:
        lines.append(f"- **Teacher**: {_teacher_link(r)}")
    if r.student_shape:
        labels = {"layers": "{} layers", "encoder_layers": "{} encoder layers", "decoder_layers": "{} decoder layers",
                  "hidden": "hidden size {}", "heads": "{} attention heads"}
        parts = [labels[k].format(v) for k, v in r.student_shape.items() if k in labels]
        lines.append(f"- **Student**: {r.architecture or 'model'}, {', '.join(parts)}")
    if r.adapter:
        a = r.adapter
        rank = f", rank {a['r']}" if a.get("r") else ""
        on = f" on {', '.join(a['target_modules'])}" if isinstance(a.get("target_modules"), list) else ""
        base = f" for the base model `{a['base_model']}`" if a.get("base_model") else ""
        lines.append(
            f"- **Adapters**: this repository holds {a.get('peft_type') or 'PEFT'} adapters{rank}{on}{base}; only "
            "the adapters were trained and are published"
        )
    if _initialisation(r):
        lines.append(f"- **Initialisation**: {_initialisation(r)}")
    if r.initialised_from:
        lines.append(f"- **Initialised from**: {_model_link(r.initialised_from)} (the student's starting checkpoint)")
    d = r.distillation
    rows = []
    if (d.get("task_weight") or 0) > 0:
        rows.append(("task", "the student's own loss on the labels", d["task_weight"], ""))
    if (d.get("kd_weight") or 0) > 0:
        kind = _KD_LOSSES.get(d.get("kd_loss"), d.get("kd_loss"))
        if d.get("kd_loss") == "jsd" and d.get("jsd_beta") is not None:
            kind = f"generalized JSD (beta = {d['jsd_beta']:g}) x T^2"
        if d.get("kd_loss") in _SKEW and d.get("skew_alpha") is not None:
            kind = f"{_SKEW[d['kd_loss']][0]} divergence (alpha = {d['skew_alpha']:g}) x T^2"
        temp = f", T = {d['temperature']:g}" if d.get("kd_loss") != "mse" and d.get("temperature") else ""
        rows.append(
            ("kd", f"{kind} between student and teacher logits{temp}", d["kd_weight"], "output logits")
        )
    for term in d.get("distill_terms") or []:
        if (term.get("weight") or 0) <= 0:
            continue
        detail = term["loss"]
        if term.get("relations"):
            heads = f", {term['relation_heads']} relation heads" if term.get("relation_heads") else ""
            detail += f" ({'/'.join(x.upper() for x in term['relations'])}{heads})"
        rows.append(
            (term.get("name") or term["loss"], detail, term["weight"], _layer_map(term.get("layers")))
        )
    if rows:
        lines.append("- **Loss**: the weighted sum of the terms below (layer 0 is the embedding output)\n")
        lines.append("| Term | Loss | Weight | Layers (student -> teacher) |\n| --- | --- | ---: | --- |")
        lines.extend(f"| {n} | {loss} | {w:g} | {layers} |" for n, loss, w, layers in rows)
        lines.append("")
    if d.get("temperature") and (d.get("kd_weight") or 0) > 0 and d.get("kd_loss") != "mse":
        lines.append(f"- **Temperature**: {d['temperature']:g}")
    if (d.get("kd_weight") or 0) > 0 and d.get("kd_loss") == "jsd" and d.get("jsd_beta") is not None:
        lines.append(
            f"- **Beta** (generalized JSD): {d['jsd_beta']:g} (0 is the forward KL, 1 the reverse KL; TRL's GKD "
            "convention)"
        )
    if (d.get("kd_weight") or 0) > 0 and d.get("kd_loss") in _SKEW and d.get("skew_alpha") is not None:
        name, mixes = _SKEW[d["kd_loss"]]
        lines.append(f"- **Alpha** ({name}): {d['skew_alpha']:g} ({mixes}; DistiLLM's default is 0.1)")
    if (d.get("kd_weight") or 0) > 0 and r.pipeline_tag in _TOKEN_TASKS and _tokens(r):
        lines.append(f"- **Distilled tokens**: {_tokens(r)}")
    if d.get("distill_terms") and d.get("projection"):
        lines.append(f"- **Projections** (student -> teacher width, not published): {d['projection']}")
    if r.stages:
        lines.append("- **Stages**:\n" + "\n".join(f"  {i}. {s}" for i, s in enumerate(r.stages, 1)))
    data = ", ".join(f"[{x}](https://huggingface.co/datasets/{x})" for x in r.datasets)
    if data or r.dataset_name:
        extra = ", ".join(x for x in (r.dataset_config, r.dataset_split) if x)
        lines.append(f"- **Data**: {data or r.dataset_name}{f' ({extra})' if extra else ''}")
    if r.augmentation:
        lines.append(f"- **Augmentation**: {r.augmentation}")
    return "## How it was distilled\n\n" + "\n".join(lines) if lines else ""


def _format_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _ratio(student: float | None, teacher: float | None, fmt: Callable[[float], str]) -> str:
    return fmt(student / teacher) if student is not None and teacher else ""


def _comparison(r: DistillationReport) -> str:
    rows = []

    def row(label: str, teacher: Any, student: Any, fmt: Callable[[Any], str], ratio: str = "") -> None:
        if student is not None or teacher is not None:
            rows.append(
                f"| {label} | {fmt(teacher) if teacher is not None else ''} | "
                f"{fmt(student) if student is not None else ''} | {ratio} |"
            )

    row(
        "Parameters",
        r.teacher_params,
        r.student_params,
        "{:,}".format,
        _ratio(r.student_params, r.teacher_params, _pct),
    )
    row("Layers", r.teacher_shape.get("layers"), r.student_shape.get("layers"), str)
    row("Encoder layers", r.teacher_shape.get("encoder_layers"), r.student_shape.get("encoder_layers"), str)
    row("Decoder layers", r.teacher_shape.get("decoder_layers"), r.student_shape.get("decoder_layers"), str)
    row("Hidden size", r.teacher_shape.get("hidden"), r.student_shape.get("hidden"), str)
    row(
        "Size on disk (weights)",
        r.teacher_size_bytes,
        r.student_size_bytes,
        _format_bytes,
        _ratio(r.student_size_bytes, r.teacher_size_bytes, _pct),
    )
    if r.speedup is not None:
        rows.append(f"| Inference speed-up | 1.00x | {r.speedup:.2f}x | |")
    parts = []
    if rows:
        table = "| | Teacher | Student | Student / teacher |\n| --- | ---: | ---: | ---: |\n" + "\n".join(
            rows
        )
        parts.append(table + (f"\n\nSpeed-up measured as {r.speedup_setup}." if r.speedup_setup else ""))
    if r.student_metrics:
        with_teacher = any(k in r.teacher_metrics for k in r.student_metrics)
        head = (
            "| Metric | Teacher | Student | % of teacher |\n| --- | ---: | ---: | ---: |"
            if with_teacher
            else "| Metric | Student |\n| --- | ---: |"
        )
        lines = []
        for name, value in r.student_metrics.items():
            if with_teacher:
                t = r.teacher_metrics.get(name)
                lines.append(
                    f"| {name} | {'' if t is None else f'{t:.4f}'} | {value:.4f} | {_ratio(value, t, _pct)} |"
                )
            else:
                lines.append(f"| {name} | {value:.4f} |")
        where = " on " + (r.dataset_name or ", ".join(r.datasets)) if (r.dataset_name or r.datasets) else ""
        split = f" ({r.dataset_split})" if r.dataset_split else ""
        step = f", student evaluated at step {r.eval_step}" if r.eval_step else ""
        note = ""
        if r.pipeline_tag == "text-generation" and any(
            n == "perplexity" or n.endswith("_perplexity") for n in r.student_metrics
        ):
            note = (
                "\n\n`loss` is the model's own next-token cross-entropy on the evaluation set (nats per predicted "
                "token), `perplexity` its exp."
            )
        parts.append(f"Evaluation{where}{split}{step}:\n\n{head}\n" + "\n".join(lines) + note)
    return "## Teacher vs student\n\n" + "\n\n".join(parts) if parts else ""


def _training(r: DistillationReport) -> str:
    rows = [
        f"| {label} | {r.training[key]} |" for key, label in _TRAINING_ROWS if r.training.get(key) is not None
    ]
    parts = []
    if rows:
        parts.append("| Setting | Value |\n| --- | --- |\n" + "\n".join(rows))
    if r.loss_plot:
        parts.append(f"![Loss components against training steps]({r.loss_plot})")
    return "## Training\n\n" + "\n\n".join(parts) if parts else ""


def _early_exit(r: DistillationReport) -> str:
    """Speed-accuracy table of an early-exit model (hf_distill.students.early_exit): one row per exit threshold."""
    if not r.early_exit:
        return ""
    e = r.early_exit
    kind = {"deebert": "DeeBERT off-ramps"}.get(e.get("branch", "fastbert"), "FastBERT branches")
    parts = [f"Early exits after each of the {e.get('num_exits')} blocks ({kind}); load with "
             "`hf_distill.students.early_exit.EarlyExitModel.from_pretrained` (the backbone alone loads with "
             "AutoModel...)."]
    rows = e.get("sweep") or []
    if rows:
        lines = ["| speed | accuracy | mean exit layer | speed-up (batch 1) | FLOPs ratio |",
                 "| --- | --- | --- | --- | --- |"]
        for row in rows:
            b1 = row.get("speedup_b1")
            lines.append(f"| {row['speed']:g} | {_pct(row['accuracy'])} | {row['mean_exit_layer']:.2f} | "
                         f"{'' if b1 is None else f'{b1:.2f}x'} | {row['flops_ratio']:.2f} |")
        parts.append("\n".join(lines))
    if e.get("plot"):
        parts.append(f"![Accuracy against speed-up]({e['plot']})")
    return "## Early exit\n\n" + "\n\n".join(parts)


def _usage(r: DistillationReport) -> str:
    repo = r.model_name or "path/to/student"
    kind = kind_for_task(r.pipeline_tag)
    auto = kind.facts.auto_class if kind is not None else "AutoModel"
    if r.adapter:
        peft_auto = kind.facts.peft_class if kind is not None else "AutoPeftModel"
        code = f'from peft import {peft_auto}\n\nmodel = {peft_auto}.from_pretrained("{repo}")  # base + adapters'
        return f"## How to use\n\n```python\n{code}\n```"
    code = (
        f'from transformers import {auto}, AutoTokenizer\n\nmodel = {auto}.from_pretrained("{repo}")\n'
        f'tokenizer = AutoTokenizer.from_pretrained("{repo}")'
    )
    if r.pipeline_tag in _SEQ2SEQ_TASKS:
        code += (
            '\n\ninputs = tokenizer(["Your source text"], return_tensors="pt")\n'
            "outputs = model.generate(**inputs, max_new_tokens=64)\n"
            "print(tokenizer.batch_decode(outputs, skip_special_tokens=True))"
        )
    elif kind is not None:
        code += "\n\n# or\nfrom transformers import pipeline\n\n"
        code += f'pipe = pipeline("{r.pipeline_tag}", model="{repo}")'
    return f"## How to use\n\n```python\n{code}\n```"


def _citation(r: DistillationReport) -> str:
    keys = citations(r)
    if not keys:
        return ""
    return "## Citation\n\n```bibtex\n" + "\n\n".join(BIBTEX[k] for k in keys) + "\n```"


# ---------------------------------------------------------------------- from a trainer


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def _as_list(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def write_trainer_card(
    trainer: Any,
    *,
    language: str | list[str] | None = None,
    license: str | None = None,
    tags: str | list[str] | None = None,
    model_name: str | None = None,
    finetuned_from: str | None = None,
    tasks: str | list[str] | None = None,
    dataset_tags: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
    dataset_args: str | list[str] | None = None,
    **fields: Any,
) -> Path:
    """`Trainer.create_model_card`'s arguments mapped onto a `DistillationReport`, card written to output_dir.

    The teacher is the one the trainer distilled from. `finetuned_from` is what transformers' example scripts
    pass it, the student's starting checkpoint (`model_name_or_path`): the card shows it as "initialised from",
    never as the teacher (give `teacher=` to name a teacher loaded from a folder by its Hub id).
    `dataset_tags` are the Hub dataset ids (`dataset` is used when they are missing), `dataset` its display
    name, `dataset_args` its configuration; any `DistillationReport` field (e.g. `stages`, `augmentation`,
    `teacher_metrics`) and `from_trainer`'s options may be given too.
    """
    # A display name such as "GLUE SST-2" is no Hub id: only id-like `dataset` values replace dataset_tags.
    dataset_ids = _as_list(dataset_tags) or [d for d in _as_list(dataset) if " " not in d]
    mapped = {
        "language": _as_list(language),
        "license": license,
        "tags": _as_list(tags),
        "model_name": model_name,
        "initialised_from": finetuned_from,
        "pipeline_tag": _first(tasks),
        "datasets": dataset_ids,
        "dataset_name": _first(dataset),
        "dataset_config": _first(dataset_args),
    }
    options = {k: fields.pop(k) for k in ("measure_speed", "speed_batches") if k in fields}
    report = DistillationReport.from_trainer(
        trainer, **options, **{k: v for k, v in mapped.items() if v}, **fields
    )
    return write_model_card(trainer.args.output_dir, report)

