"""Build student models from a teacher: layer extraction (DistilBERT) or a smaller random copy (TinyBERT).

Two ways to make a student:

* :func:`from_teacher` keeps a subset of the teacher's encoder layers and copies every kept weight bit-exactly
  (embeddings, pooler, task head included). DistilBERT initialised its 6-layer student this way from BERT-base
  layers ``[0, 2, 4, 7, 9, 11]``; the benchmarks use a 3-layer student from layers ``[0, 2, 4]``.
* :func:`shrink` builds a randomly initialised model of the same family, head and label space with a smaller
  depth / width (TinyBERT's general student: 4 layers, hidden 312, 12 heads, FFN 1200).
* :func:`prune_depth` (in :mod:`hf_distill.students.prune`) keeps the teacher's most important blocks,
  importance being how much a block changes its input (ShortGPT's Block Influence, Men et al. 2024; Minitron's
  depth pruning, Muralidharan et al. 2024), and copies them as :func:`from_teacher` does.

Decoder-only causal LMs (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma-2, Phi-3, GPT-2) work with all three: the
final norm, rotary embedding, ``lm_head`` (tied or not) and per-layer config lists (``layer_types``) are kept
right, and ``shrink`` handles grouped-query attention (``num_key_value_heads``) and ``head_dim``.

Encoder-decoder models (T5, mT5, BART, mBART, Marian, Pegasus) have two stacks: :func:`from_teacher` takes
``decoder_layers=`` and/or ``encoder_layers=`` (a stack not named is kept whole). DistilBART ("shrink and
fine-tune", Shleifer & Rush 2020) keeps the whole encoder and alternating decoder layers, e.g. ``[0, 2, 4, 7, 9,
11]`` of BART-large's 12 for a 6-layer decoder. T5's relative position bias lives in each stack's first block and
serves them all: a student without the teacher's first block gets it from there. ``shrink`` gives both stacks the
same depth and sizes; ``prune_depth`` is for encoder-only and decoder-only models.

Both record their provenance in ``student.config.distillation`` so that it survives ``save_pretrained`` and a
model card can cite the teacher later.

Model families come from the shared registry in :mod:`hf_distill.features.families` (BERT, RoBERTa, XLM-RoBERTa,
CamemBERT, ELECTRA, DistilBERT and the decoders above are registered); ``register_family`` is re-exported here
for convenience::

    from hf_distill.students import register_family

    register_family("data2vec-text", layers="encoder.layer")
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PreTrainedConfig, PreTrainedModel

from ..base.recorded_names import recorded_name
from ..compat import attn_implementation, model_from_config
from ..features import families
from ..features.families import Family, register_family
from .sentence import is_sentence_transformer, rebuild

__all__ = [
    "encoder_layers",
    "from_teacher",
    "get_family",
    "register_family",
    "shrink",
]
def get_family(config: PreTrainedConfig) -> Family:
    """Registry lookup with an error that says how to register the missing family."""
    model_type = getattr(config, "model_type", None)
    family = families.get_family(model_type)
    if family is None:
        raise ValueError(
            f"No model family is registered for model_type {model_type!r} "
            f"(registered: {sorted(families.FAMILIES)}). Register it with "
            f"hf_distill.features.families.register_family({model_type!r}, layers=...), where layers is the "
            "dotted path of the encoder-layer nn.ModuleList relative to model.base_model "
            "(e.g. 'encoder.layer' for BERT-like models)."
        )
    if family.refuse_pruning:  # issue #43: stage-wise vision models
        raise ValueError(f"hf_distill.students cannot build a student of {model_type!r} from its teacher's blocks: "
                         f"{family.refuse_pruning}")
    return family


def encoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    """The model's encoder-layer list, wherever its family keeps it (also useful for layer-wise KD hooks)."""
    family = get_family(model.config)
    if family.stacks:
        raise ValueError(
            f"{type(model).__name__} is an encoder-decoder model with two layer stacks (encoder and decoder); this "
            "function works on one-stack models. Name the stacks where it matters (students.from_teacher("
            "teacher, decoder_layers=..., encoder_layers=...))."
        )
    try:
        layers = model.base_model.get_submodule(family.layers)
    except AttributeError as err:
        raise ValueError(
            f"layers {family.layers!r} registered for model_type {model.config.model_type!r} does "
            f"not exist on {type(model.base_model).__name__}; fix it with "
            "register_family(..., overwrite=True)."
        ) from err
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"layers {family.layers!r} for model_type {model.config.model_type!r} points to a "
            f"{type(layers).__name__}, not an nn.ModuleList; fix it with "
            "register_family(..., overwrite=True)."
        )
    return layers


def _reject_heterogeneous(config: PreTrainedConfig) -> None:
    # transformers 5 configs may carry `per_layer_config` overrides keyed by layer index; renumbering them is
    # not something any registered family needs, so refuse rather than silently mis-assign them.
    if getattr(config, "is_heterogeneous", False):
        raise ValueError(
            "Configs with per_layer_config (heterogeneous layers) are not supported by hf_distill.students."
        )


def _check_layers(layers: Sequence[int], num_teacher_layers: int, stack: str = "encoder") -> list[int]:
    """Normalise to plain ints (the list is written to config.json) and reject anything ambiguous; `stack` names
    the teacher's stack the indices refer to ("encoder" or "decoder"), for the message."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"layers must be a sequence of ints, got {type(layers).__name__}.")
    if len(layers) == 0:
        raise ValueError(
            f"layers is empty; name at least one teacher layer (valid indices 0..{num_teacher_layers - 1})."
        )
    checked = []
    for index in layers:
        if isinstance(index, bool):
            raise TypeError(f"layers must contain ints, got {index!r}.")
        try:
            checked.append(operator.index(index))
        except TypeError as err:
            raise TypeError(f"layers must contain ints, got {index!r} ({type(index).__name__}).") from err
    bad = [i for i in checked if not 0 <= i < num_teacher_layers]
    if bad:
        raise ValueError(
            f"layers {checked} has out-of-range index {bad[0]}: the teacher has {num_teacher_layers} {stack} "
            f"layers, so valid indices are 0..{num_teacher_layers - 1} (negative indices are not accepted)."
        )
    if any(a >= b for a, b in zip(checked, checked[1:])):
        raise ValueError(
            f"layers must be strictly increasing (no repeats, in teacher order), got {checked}; "
            f"did you mean {sorted(set(checked))}?"
        )
    return checked


def from_teacher(
    teacher: PreTrainedModel,
    layers: Sequence[int] | None = None,
    *,
    encoder_layers: Sequence[int] | None = None,
    decoder_layers: Sequence[int] | None = None,
    distillation_token: bool = False,
) -> PreTrainedModel:
    """Student of the teacher's class keeping only the blocks ``layers`` (0-based, strictly increasing): encoder
    layers, or decoder layers of a causal LM (its final norm, rotary embedding and ``lm_head`` are kept, tied to
    the input embeddings exactly when the teacher's are; per-layer config lists such as ``layer_types`` follow
    the kept layers).

    Encoder-decoder teachers take ``encoder_layers`` and/or ``decoder_layers`` instead of ``layers`` (a stack not
    named keeps all its blocks; DistilBART keeps the encoder and alternating decoder layers). A student that can
    generate gets a copy of the teacher's generation config, so it generates with the same settings.

    ``distillation_token=True`` (a ViT or DeiT teacher): a transformers ``DeiTForImageClassificationWithTeacher`` with
    the kept blocks, both heads copied from the teacher's classifier (hf_distill.students.distillation_token).

    The student is built fresh from the reduced config, exactly as ``from_pretrained`` would build it (so
    per-layer state such as ``layer_idx`` is renumbered and tied weights are tied), then filled from the
    teacher's state dict. Nothing is shared with the teacher, the teacher's ``requires_grad`` flags are not
    inherited (a frozen teacher still gives a trainable student), and the student ends up on the teacher's
    (first) device, in its dtype and train/eval mode. A SentenceTransformer teacher gives a SentenceTransformer
    student: its other modules (tokenizer, Pooling, Normalize) are copied around the student transformer.
    """
    if is_sentence_transformer(teacher):  # its Pooling/Normalize kept around the student transformer
        return rebuild(teacher, lambda auto: from_teacher(auto, layers, encoder_layers=encoder_layers,
                                                                   decoder_layers=decoder_layers))
    if not isinstance(teacher, PreTrainedModel):
        raise TypeError(f"teacher must be a transformers PreTrainedModel, got {type(teacher).__name__}.")
    if distillation_token:  # issue #43: a DeiT student with class and distillation heads (students.distillation_token)
        from .distillation_token import token_student_from_teacher

        if layers is None:
            raise TypeError("from_teacher(..., distillation_token=True) needs layers=[...]: the blocks it keeps.")
        return token_student_from_teacher(teacher, layers)
    _reject_heterogeneous(teacher.config)
    family = get_family(teacher.config)
    if family.stacks:
        if layers is not None:
            raise ValueError(
                f"{type(teacher).__name__} is an encoder-decoder model: name the layers of each stack with "
                "decoder_layers=[...] and/or encoder_layers=[...] (DistilBART keeps the encoder and alternating "
                "decoder layers) instead of layers=."
            )
        return _from_encoder_decoder(teacher, family, encoder_layers, decoder_layers)
    if encoder_layers is not None or decoder_layers is not None:
        raise ValueError(
            f"encoder_layers/decoder_layers are for encoder-decoder models; {type(teacher).__name__} has one stack of "
            "blocks: pass layers=[...]."
        )
    if layers is None:
        raise TypeError("from_teacher() needs layers=[...]: the teacher blocks the student keeps.")
    return _from_one_stack(teacher, family, layers)


def _from_one_stack(teacher: PreTrainedModel, family: Family, layers: Sequence[int]) -> PreTrainedModel:
    """`from_teacher` for encoder-only and decoder-only models (one stack of blocks)."""
    teacher_layers = encoder_layers(teacher)
    num_teacher_layers = len(teacher_layers)
    layers = _check_layers(layers, num_teacher_layers, "decoder" if family.causal else "encoder")

    config = copy.deepcopy(teacher.config)
    setattr(config, family.num_layers_field, len(layers))
    for field in family.per_layer_fields:
        values = getattr(config, field, None)
        if isinstance(values, (list, tuple)) and len(values) == num_teacher_layers:
            setattr(config, field, [values[i] for i in layers])
    config.distillation = {
        "init": "from_teacher",
        "teacher_layers": list(layers),
        "teacher_name_or_path": recorded_name(teacher.config.name_or_path),
        "teacher_num_layers": num_teacher_layers,
    }
    # The student is not the teacher checkpoint; keep its name out of places (e.g. Trainer model cards) that
    # would otherwise present it as one. The teacher's name lives in `distillation` instead.
    config.name_or_path = ""
    config.validate()

    student = model_from_config(type(teacher), config, dtype=teacher.dtype)
    prefix = next(name for name, module in teacher.named_modules() if module is teacher_layers) + "."
    new_index = {old: new for new, old in enumerate(layers)}
    state = {}
    for key, tensor in teacher.state_dict().items():
        if key.startswith(prefix):
            old, _, rest = key[len(prefix) :].partition(".")
            if int(old) not in new_index:
                continue
            key = f"{prefix}{new_index[int(old)]}.{rest}"
        state[key] = tensor
    # strict: every student parameter and persistent buffer must come from the teacher, none may be left over.
    student.load_state_dict(state, strict=True)
    if student.can_generate() and getattr(teacher, "generation_config", None) is not None:
        # generate as the teacher does (its stop ids, its KV cache even where config.use_cache is off)
        student.generation_config = copy.deepcopy(teacher.generation_config)
    student.to(teacher.device)
    student.train(teacher.training)
    return student


def _from_encoder_decoder(
    teacher: PreTrainedModel, family: Family, encoder: Sequence[int] | None, decoder: Sequence[int] | None
) -> PreTrainedModel:
    """`from_teacher` for two stacks: each keeps the named blocks (all when None), renumbered from 0; parameters
    only a stack's first block holds (`Family.first_block_only`) come from the teacher's first block."""
    if encoder is None and decoder is None:
        raise ValueError(
            f"{type(teacher).__name__} is an encoder-decoder model: name the blocks the student keeps with "
            "decoder_layers=[...] and/or encoder_layers=[...] (a stack not named is kept whole)."
        )
    config = copy.deepcopy(teacher.config)
    teacher_state = teacher.state_dict()
    plans = []  # (state-dict prefix of the stack's blocks, {old: new}, its family)
    record: dict[str, Any] = {"init": "from_teacher",
                              "teacher_name_or_path": recorded_name(teacher.config.name_or_path)}
    for name, wanted in (("encoder", encoder), ("decoder", decoder)):
        stack = family.stack(name)
        blocks = teacher.base_model.get_submodule(stack.layers)
        total = len(blocks)
        try:
            kept = list(range(total)) if wanted is None else _check_layers(wanted, total, name)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}_layers: {err}") from None
        setattr(config, stack.num_layers_field, len(kept))
        prefix = next(n for n, module in teacher.named_modules() if module is blocks) + "."
        plans.append((prefix, {old: new for new, old in enumerate(kept)}, stack))
        record[f"teacher_{name}_layers"] = kept
        record[f"teacher_num_{name}_layers"] = total
    config.distillation = record
    config.name_or_path = ""  # see from_teacher: the student is not the teacher checkpoint
    config.validate()

    student = model_from_config(type(teacher), config, dtype=teacher.dtype)
    state = {}
    for key, tensor in teacher_state.items():
        plan = next((p for p in plans if key.startswith(p[0])), None)
        if plan is not None:
            prefix, new_index, _ = plan
            old, _, rest = key[len(prefix) :].partition(".")
            if int(old) not in new_index:
                continue
            key = f"{prefix}{new_index[int(old)]}.{rest}"
        state[key] = tensor
    for prefix, new_index, stack in plans:
        for path in stack.first_block_only:
            if 0 not in new_index:  # the student's first block is another teacher block, without this parameter
                state[f"{prefix}0.{path}"] = teacher_state[f"{prefix}0.{path}"]
    student.load_state_dict(state, strict=True)
    student.generation_config = copy.deepcopy(teacher.generation_config)
    student.to(teacher.device)
    student.train(teacher.training)
    return student


def _build(model_class: Any, config: PreTrainedConfig) -> PreTrainedModel:
    # Auto classes expose `from_config`; concrete classes only the (dtype/attention aware) `_from_config`.
    if hasattr(model_class, "from_config"):
        return model_class.from_config(config)
    return model_from_config(model_class, config)


def shrink(
    teacher_or_config: PreTrainedModel | PreTrainedConfig,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    intermediate_size: int,
    *,
    num_key_value_heads: int | None = None,
    model_class: Any = None,
    seed: int | None = None,
    distillation_token: bool = False,
    **config_overrides: Any,
) -> PreTrainedModel:
    """Randomly initialised, smaller model of the teacher's family, head and label space.

    Everything not named here (vocabulary, max positions, token types, labels, problem type, dropout,
    activation, ...) is taken from the teacher's config; ``config_overrides`` may change any existing config
    field. The model class is the teacher's class when given a model, ``AutoModel`` when given a config, or
    ``model_class`` (an ``AutoModelFor...`` or a concrete class) when passed. Weights come from the model's
    own ``_init_weights``; ``seed`` makes them reproducible without touching the caller's global RNG state.

    Decoders with grouped-query attention: ``num_key_value_heads`` defaults to the teacher's when it divides
    ``num_attention_heads`` (and to ``num_attention_heads`` when the teacher has as many K/V heads as heads);
    ``head_dim`` follows ``hidden_size // num_attention_heads`` unless the teacher set it apart from its own
    ratio (Gemma), in which case the teacher's value is kept (override it with ``head_dim=...``). A SentenceTransformer
    teacher gives a SentenceTransformer student (its modules copied, Pooling following ``hidden_size``).

    ``distillation_token=True`` (a ViT or DeiT teacher): a random transformers ``DeiTForImageClassificationWithTeacher``
    of the teacher's image and label space, trained by ``distillation_token`` (hf_distill.students.distillation_token).
    """
    if is_sentence_transformer(teacher_or_config):  # Pooling follows hidden_size; Normalize kept
        return rebuild(teacher_or_config, lambda auto: shrink(
            auto, num_layers, hidden_size, num_attention_heads, intermediate_size,
            num_key_value_heads=num_key_value_heads, model_class=model_class, seed=seed, **config_overrides),
            width=hidden_size)
    if isinstance(teacher_or_config, PreTrainedModel):
        teacher_config = teacher_or_config.config
        model_class = model_class if model_class is not None else type(teacher_or_config)
    elif isinstance(teacher_or_config, PreTrainedConfig):
        teacher_config = teacher_or_config
        model_class = model_class if model_class is not None else AutoModel
    else:
        raise TypeError(
            "teacher_or_config must be a transformers PreTrainedModel or PreTrainedConfig, "
            f"got {type(teacher_or_config).__name__}."
        )
    if distillation_token:  # issue #43: a DeiT student with class and distillation heads (students.distillation_token)
        from .distillation_token import token_student_shrink

        return token_student_shrink(teacher_config, seed, num_hidden_layers=num_layers, hidden_size=hidden_size,
                                    num_attention_heads=num_attention_heads, intermediate_size=intermediate_size,
                                    **config_overrides)
    _reject_heterogeneous(teacher_config)
    family = get_family(teacher_config)

    sizes = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_attention_heads": num_attention_heads,
        "intermediate_size": intermediate_size,
    }
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}.")
    head_dim_field = family.head_dim_field
    head_dim_field = head_dim_field if head_dim_field and hasattr(teacher_config, head_dim_field) else None
    teacher_heads = getattr(teacher_config, family.num_heads_field)
    teacher_head_dim = getattr(teacher_config, head_dim_field, None) if head_dim_field else None
    # A head_dim equal to the teacher's hidden / heads is derived and follows the new sizes; any other is explicit.
    explicit_head_dim = teacher_head_dim is not None and teacher_head_dim != (
        getattr(teacher_config, family.hidden_size_field) // teacher_heads
    )
    keep_head_dim = explicit_head_dim or (head_dim_field is not None and head_dim_field in config_overrides)
    if hidden_size % num_attention_heads and not keep_head_dim:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads}); "
            f"e.g. use num_attention_heads={_largest_divisor_at_most(hidden_size, num_attention_heads)}."
        )

    # Normalise override names through attribute_map (DistilBERT's `hidden_size` -> `dim`) before checking.
    attribute_map = getattr(teacher_config, "attribute_map", {})
    overrides = {attribute_map.get(key, key): value for key, value in config_overrides.items()}
    size_fields = {
        family.num_layers_field: "num_layers",
        family.hidden_size_field: "hidden_size",
        family.num_heads_field: "num_attention_heads",
        family.intermediate_size_field: "intermediate_size",
    }
    if family.num_kv_heads_field:
        size_fields[family.num_kv_heads_field] = "num_key_value_heads"
    for _, stack in family.stacks:
        size_fields.update({stack.num_layers_field: "num_layers", stack.num_heads_field: "num_attention_heads",
                            stack.intermediate_size_field: "intermediate_size"})
    for key in overrides:
        if key in size_fields:
            raise ValueError(
                f"Config override {key!r} duplicates shrink's {size_fields[key]} argument; "
                "pass it there instead."
            )
        if not hasattr(teacher_config, key):
            raise ValueError(
                f"Config override {key!r} is not a field of {type(teacher_config).__name__}; check the "
                "spelling, or set custom attributes on student.config after shrink returns."
            )

    values = teacher_config.to_dict()
    if "stage_names" in values:  # a backbone config (BEiT): its stages follow the depth, picked again by the config
        for key in ("stage_names", "out_features", "out_indices"):
            values.pop(key)
    # Encoder-decoder models: every stack gets the depth and sizes (fields may differ: BART's encoder_*/decoder_*).
    for _, stack in family.stacks:
        values.update({stack.num_layers_field: num_layers, stack.num_heads_field: num_attention_heads,
                       stack.intermediate_size_field: intermediate_size})
    for field in family.follows_hidden_size:
        if field in values and values[field] == getattr(teacher_config, family.hidden_size_field):
            values[field] = hidden_size
    for field in family.per_layer_fields:
        per_layer = values.get(field)
        if isinstance(per_layer, (list, tuple)) and len(per_layer) != num_layers and field not in overrides:
            # Let the config class derive the pattern for the new depth (or leave it unset).
            values.pop(field)
    if "num_labels" in overrides and "id2label" not in overrides:
        values.pop("id2label", None)
        values.pop("label2id", None)
    values.pop("_name_or_path", None)
    values.update(
        {
            family.num_layers_field: num_layers,
            family.hidden_size_field: hidden_size,
            family.num_heads_field: num_attention_heads,
            family.intermediate_size_field: intermediate_size,
        }
    )
    kv_sizes = _kv_heads(family, teacher_config, num_attention_heads, num_key_value_heads)
    values.update(kv_sizes)
    if head_dim_field is not None and not keep_head_dim:
        values[head_dim_field] = hidden_size // num_attention_heads
    values.update(overrides)
    extra = {}
    if attn_implementation(teacher_config) is not None:
        extra["attn_implementation"] = attn_implementation(teacher_config)
    # Rebuilding through the config class (not deepcopy + setattr) re-runs its validation and derived fields.
    config = type(teacher_config)(**values, **extra)
    config.distillation = {"init": "shrink", "teacher_name_or_path": recorded_name(teacher_config.name_or_path)}

    if seed is None:
        return _build(model_class, config)
    # torch.manual_seed also reseeds every CUDA device, so fork those too, not only the CPU generator.
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda_devices):
        torch.manual_seed(seed)
        return _build(model_class, config)


def _kv_heads(
    family: Family, config: PreTrainedConfig, num_heads: int, num_kv_heads: int | None
) -> dict[str, int]:
    """The student's K/V head count under grouped-query attention (empty for families without one)."""
    field = family.num_kv_heads_field
    if field is None or not hasattr(config, field):
        if num_kv_heads is not None:
            raise ValueError(
                f"num_key_value_heads={num_kv_heads} given, but {config.model_type} has no grouped-query attention "
                "(every head has its own K and V); leave num_key_value_heads unset."
            )
        return {}
    if num_kv_heads is None:
        teacher_kv = getattr(config, field) or getattr(config, family.num_heads_field)
        if teacher_kv == getattr(config, family.num_heads_field):
            return {field: num_heads}  # multi-head attention stays multi-head
        if num_heads % teacher_kv:
            raise ValueError(
                f"The teacher's num_key_value_heads ({teacher_kv}) does not divide num_attention_heads "
                f"({num_heads}); pass num_key_value_heads= a divisor of {num_heads}, e.g. "
                f"num_key_value_heads={_largest_divisor_at_most(num_heads, teacher_kv)}."
            )
        return {field: teacher_kv}
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_key_value_heads must be a positive int, got {num_kv_heads!r}.")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads}): each K/V head "
            "serves a whole group of query heads."
        )
    return {field: num_kv_heads}


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return next(d for d in range(min(n, limit), 0, -1) if n % d == 0)
