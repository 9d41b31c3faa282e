"""Loss settings of published recipes, as `DistillationArguments` values.

The rule: a preset fills only the fields you did not give. A value given as a Python keyword, a command-line
flag or a YAML key always wins, whatever it is, the field's default included: `--distill_preset
tinybert_prediction --temperature 2` trains at T = 2, and `distill_terms: []` removes the preset's terms.
`DistillationArguments` tells "not given" from "given" by a None default that `__post_init__` resolves, so
`dataclasses.replace(args, ...)` keeps every value of `args` and does not apply the preset again (to switch
presets, build new arguments). Each preset's docstring cites where its numbers come from and says where we
deliberately differ.
"""

from __future__ import annotations

from typing import Any


def distilbert() -> dict[str, Any]:
    """DistilBERT pre-training loss (Sanh et al. 2019; HF `research_projects/distillation` README command
    `--alpha_ce 5.0 --alpha_mlm 2.0 --alpha_cos 1.0 --temperature 2.0`): T**2-scaled KL on the logits of every
    real token (weight 5), the student's MLM loss (weight 2) and a cosine loss between the last hidden
    states (weight 1). Differences: none in the loss; the cosine term averages over real tokens as
    `CosineEmbeddingLoss` does on the selected positions. For task distillation use the same terms with the
    task head's logits (the recipe sets the weights)."""
    return {
        "kd_loss": "kl",
        "temperature": 2.0,
        "kd_weight": 5.0,
        "task_weight": 2.0,
        "distill_terms": [{"loss": "cosine_loss", "layers": "last", "weight": 1.0}],
    }


def tinybert_intermediate() -> dict[str, Any]:
    """TinyBERT intermediate-layer step (Jiao et al. 2020; huawei-noah TinyBERT `task_distill.py` and
    `general_distill.py`): MSE between hidden states with the uniform map m <- m*k including the embeddings
    (m = 0), through one shared projection (`fit_dense`), plus MSE between pre-softmax attention scores of
    blocks m and m*k, unweighted and summed over layers; no logit or label loss. Difference: padded
    positions are masked out of the attention-score mean instead of being zeroed and counted (the
    reference's `where(A <= -100, 0, A)`), so the loss does not depend on how much a batch is padded."""
    return {
        "kd_weight": 0.0,
        "task_weight": 0.0,
        "projection": "shared",
        "distill_terms": [
            {"loss": "hidden_mse", "layers": "uniform", "weight": 1.0},
            {"loss": "attention_score_mse", "layers": "uniform", "weight": 1.0},
        ],
    }


def tinybert_prediction() -> dict[str, Any]:
    """TinyBERT prediction-layer step (`task_distill.py --pred_distill`): soft cross-entropy between
    student and teacher logits at temperature 1, no T**2, no label loss. Difference: the reference takes
    `.mean()` over batch x classes, i.e. divides by the number of labels (huawei-noah issue #176); we sum
    over classes as the cross-entropy is defined. Only the scale differs (by num_labels)."""
    return {"kd_loss": "soft_ce", "temperature": 1.0, "kd_weight": 1.0, "task_weight": 0.0}


def minilm() -> dict[str, Any]:
    """MiniLM v1 (Wang et al. 2020): KL between the teacher's and student's last-layer self-attention
    distributions softmax(QKᵀ/√d) and value relations softmax(VVᵀ/√d), per head (head counts must match),
    averaged over heads and tokens; no logit or label loss. The official code was never released; this
    follows the paper's formulas. Difference: none known."""
    return {
        "kd_weight": 0.0,
        "task_weight": 0.0,
        "distill_terms": [{"loss": "relation_kl", "layers": "last", "relations": ["qk", "vv"], "weight": 1.0}],
    }


def minilmv2() -> dict[str, Any]:
    """MiniLMv2 (Wang et al. 2021): KL between Q-Q, K-K and V-V self-attention relations of the teacher's
    chosen layer and the student's last layer, with heads concatenated and re-split into relation heads so
    head counts may differ; weight 1 each. 48 relation heads as in `bloomberg/minilmv2.bb` `run.sh` for a
    BERT-base teacher. The preset uses the teacher's last layer; for large teachers the paper picks an
    upper-middle layer: give `layers` as `M:L` pairs then."""
    return {
        "kd_weight": 0.0,
        "task_weight": 0.0,
        "distill_terms": [
            {"loss": "relation_kl", "layers": "last", "relations": ["qq", "kk", "vv"], "relation_heads": 48,
             "weight": 1.0}
        ],
    }


PRESETS = {
    "distilbert": distilbert,
    "tinybert_intermediate": tinybert_intermediate,
    "tinybert_prediction": tinybert_prediction,
    "minilm": minilm,
    "minilmv2": minilmv2,
}


def preset_values(name: str) -> dict[str, Any]:
    """The field values of preset `name` (a fresh dict); `DistillationArguments` uses them for the fields the
    user did not give."""
    if name not in PRESETS:
        raise ValueError(f"DistillationArguments.distill_preset={name!r} is unknown. Known: {', '.join(PRESETS)}.")
    return PRESETS[name]()
