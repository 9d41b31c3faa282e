"""The architecture registry: where each model family keeps its blocks, embeddings and Q/K/V.

One entry per `config.model_type` serves both the feature taps (hooks on the embedding output, block
outputs and Q/K/V projections) and the student builders (which layers to copy, which config fields hold
the sizes). Paths are dotted, relative to `model.base_model` for `layers`/`embeddings`/`rotary`/`final_norm` and
to one block for `query`/`key`/`value`/`qkv`, so one entry covers the base model and every task head.
Another family takes one call:

    from hf_distill.features.families import register_family
    register_family("my-encoder", layers="blocks", embeddings=("embed",), query="attn.q", key="attn.k",
                    value="attn.v", num_layers_field="n_layer", hidden_size_field="d_model",
                    num_heads_field="n_head", intermediate_size_field="d_ff")

A decoder with a fused Q|K|V projection, grouped-query attention and rotary positions:

    register_family("my-decoder", layers="layers", embeddings=("embed_tokens",), qkv="self_attn.Wqkv",
                    num_kv_heads_field="num_key_value_heads", head_dim_field="head_dim", rotary="rotary_emb",
                    final_norm="norm", causal=True)

Width pruning (`students.prune_width`) also reads, per block, the attention's output projection, the MLP's
input and output projections and the norms (`attention_output`, `mlp_input`, `mlp_output`, `norms`; BERT's paths
by default): a decoder with a Llama-like block adds `attention_output="self_attn.o_proj",
mlp_input=("mlp.gate_proj", "mlp.up_proj"), mlp_output="mlp.down_proj", norms=("input_layernorm",
"post_attention_layernorm")`.

An encoder-decoder model registers each stack (terms name one with `stack=encoder|decoder`):

    register_encoder_decoder("my-seq2seq", encoder={"layers": "encoder.layers", "num_layers_field": "encoder_layers"},
                             decoder={"layers": "decoder.layers", "num_layers_field": "decoder_layers"},
                             query="self_attn.q_proj", key="self_attn.k_proj", value="self_attn.v_proj",
                             hidden_size_field="d_model", embeddings=(), embeddings_from_block_input=True)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# Config lists with one entry per layer (transformers 5): they must shrink with the layer stack.
PER_LAYER_FIELDS = ("layer_types", "mlp_layer_types")


@dataclass(frozen=True)
class Family:
    """Where an architecture keeps things, and what its config calls the sizes.

    `embeddings` lists candidate modules whose output is `hidden_states[0]`; the first that exists wins
    (ELECTRA projects narrow embeddings up with `embeddings_project`). `follows_hidden_size` names config
    fields that `students.shrink` moves with the hidden size when the teacher had them equal to it.
    """

    layers: str
    embeddings: tuple[str, ...] = ("embeddings",)
    query: str = "attention.self.query"
    key: str = "attention.self.key"
    value: str = "attention.self.value"
    num_layers_field: str = "num_hidden_layers"
    hidden_size_field: str = "hidden_size"
    num_heads_field: str = "num_attention_heads"
    intermediate_size_field: str = "intermediate_size"
    per_layer_fields: tuple[str, ...] = PER_LAYER_FIELDS
    follows_hidden_size: tuple[str, ...] = ()
    # Decoders. `qkv`: one fused projection whose output is Q|K|V concatenated (GPT-2 `c_attn`, Phi-3
    # `qkv_proj`), split into num_heads*head_dim, num_kv_heads*head_dim, num_kv_heads*head_dim; when set,
    # `query`/`key`/`value` are ignored. `rotary`: the module (relative to model.base_model) whose output is
    # the rotary (cos, sin) applied to Q and K after the projections. `final_norm`: the module whose output is
    # the last entry of `output_hidden_states` (transformers 5 returns it after the final norm). `causal`: a
    # query never attends to a later key, so attention/relation terms mask future keys.
    qkv: str | None = None
    num_kv_heads_field: str | None = None
    head_dim_field: str | None = None
    # The config field holding the attention's total width (all heads) when it is not the hidden size:
    # MobileBERT's `true_hidden_size`, the bottleneck width its Q/K/V project to.
    attention_size_field: str | None = None
    rotary: str | None = None
    final_norm: str | None = None
    causal: bool = False
    # Encoder-decoder models. `stacks`: ("encoder", Family), ("decoder", Family), each with its own block list, Q/K/V
    # paths (self-attention only) and config fields, paths relative to model.base_model; a distill term names its
    # stack (`stack=encoder|decoder`). The entry's own fields describe its encoder (see register_encoder_decoder).
    # `embeddings_from_block_input`: hidden_states[0] is the first block's input (read with a forward pre-hook),
    # because the stack scales, normalises or drops out its embeddings in its own forward, outside any module
    # whose output would be that tensor. `first_block_only`: parameters (paths relative to a block) that only the
    # first block holds and the whole stack uses (T5's relative position bias): a student copied from other blocks
    # takes them from the teacher's first block. `score_bias`: the attention adds a bias that Q and K do not carry
    # and does not scale by 1/sqrt(head_dim) (T5), so its pre-softmax scores cannot be rebuilt from Q and K.
    stacks: tuple[tuple[str, Family], ...] = ()
    embeddings_from_block_input: bool = False
    first_block_only: tuple[str, ...] = ()
    score_bias: bool = False
    # Width pruning (`students.prune_width`), paths relative to one block (defaults: BERT's). `attention_output`:
    # the Linear/Conv1D reading the heads' concatenated outputs (its input columns are heads). `mlp_input`: the
    # modules whose output rows are the MLP's intermediate channels (gate and up of a gated MLP, kept together);
    # `mlp_input_chunks`: how many intermediate-wide chunks one of them stacks (Phi-3's fused gate|up: 2).
    # `mlp_output`: the module reading the intermediate channels. `norms`: the block's norms whose outputs rank
    # the hidden channels (Minitron reads the norms in front of attention and MLP). `projections`: the Q, K, V
    # projections when `query`/`key`/`value` tap something else (Qwen3's q_norm/k_norm); `qkv` when fused.
    attention_output: str = "attention.output.dense"
    mlp_input: tuple[str, ...] = ("intermediate.dense",)
    mlp_input_chunks: int = 1
    mlp_output: str = "output.dense"
    norms: tuple[str, ...] = ("attention.output.LayerNorm", "output.LayerNorm")
    projections: tuple[str, str, str] | None = None
    # Audio encoders (hf_distill.features.families_audio). `fixed_hidden`: why prune_width cannot remove hidden
    # channels (wav2vec2's grouped positional convolution), refused with that reason. `layerdrop_field`: the config
    # field of LayerDrop, which skips whole blocks in training, so a student tapped for terms must set it to 0.
    # `frames_from_samples`: the config fields (kernels, strides) of a conv feature encoder that turns a sample-level
    # attention mask into the frame-level one the hidden states have.
    fixed_hidden: str | None = None
    layerdrop_field: str | None = None
    frames_from_samples: tuple[str, str] | None = None
    # Vision families (issue #43, hf_distill.features.families_vision). `channels_first`: its hidden states are
    # (B, C, H, W) feature maps (ConvNeXt, ResNet stages), compared as (B, H*W, C); stage widths and the pairs a
    # hidden-state term may compare: families_vision.stage_width. `refuse_attention` / `refuse_pruning` /
    # `refuse_width`: why Q/K/V terms, student building (from_teacher, shrink, prune_depth) or prune_width do not
    # apply; empty: they do.
    channels_first: bool = False
    refuse_attention: str = ""
    refuse_pruning: str = ""
    refuse_width: str = ""

    def stack(self, name: str) -> Family | None:
        """The family of one stack of an encoder-decoder model (None when it has no such stack)."""
        return dict(self.stacks).get(name)


STACKS = ("encoder", "decoder")
"""The stacks of an encoder-decoder model a distill term can name."""

FAMILIES: dict[str, Family] = {}

REGISTER_HINT = (
    "Register the family with hf_distill.features.families.register_family(model_type, layers=..., embeddings=(...,), "
    "query=..., key=..., value=...) (or qkv=... for a fused projection), giving paths relative to "
    "model.base_model (see that module's docstring)."
)


def register_family(model_type: str, layers: str, *, overwrite: bool = False, **spec: Any) -> Family:
    """Add `model_type` to the registry. Re-registering an identical entry is a no-op; changing an
    existing one needs `overwrite=True`, so a typo cannot silently break a built-in family."""
    known = {f.name for f in fields(Family)} - {"layers"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"register_family: unknown field(s) {unknown}. Known: {', '.join(sorted(known))}.")
    spec = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
    if isinstance(spec.get("stacks"), dict):
        spec["stacks"] = tuple(spec["stacks"].items())
    bad = [name for name, _ in spec.get("stacks", ()) if name not in STACKS]
    if bad:
        raise ValueError(f"register_family: unknown stack(s) {bad}. Known: {', '.join(STACKS)}.")
    family = Family(layers=layers, **spec)
    existing = FAMILIES.get(model_type)
    if existing is not None and existing != family and not overwrite:
        raise ValueError(
            f"model_type {model_type!r} is already registered as {existing}; "
            "pass overwrite=True to register_family to replace it."
        )
    FAMILIES[model_type] = family
    return family


def register_encoder_decoder(
    model_type: str, encoder: dict[str, Any], decoder: dict[str, Any], *, overwrite: bool = False, **common: Any
) -> Family:
    """Add an encoder-decoder family: `encoder` and `decoder` are the `register_family` fields of each stack (its
    `layers`, config fields, ...), `common` the fields both share (Q/K/V paths, hidden size field). The decoder
    stack is causal. The entry itself describes the encoder, so code that knows one stack only sees that one."""
    stacks = {
        "encoder": Family(**{**common, **encoder}),
        "decoder": Family(**{"causal": True, **common, **decoder}),
    }
    return register_family(model_type, overwrite=overwrite, stacks=stacks, **{**common, **encoder})


def get_family(model_type: str | None) -> Family | None:
    return FAMILIES.get(model_type) if model_type else None


for _model_type in ("bert", "roberta", "xlm-roberta", "camembert"):
    register_family(_model_type, "encoder.layer")
register_family(
    "electra", "encoder.layer", embeddings=("embeddings_project", "embeddings"), follows_hidden_size=("embedding_size",)
)
# MobileBERT (Sun et al. 2020): blocks and hidden states at the inter-block width (`hidden_size`); Q and K read
# the block's bottleneck, V its input, and all three project to the bottleneck width `true_hidden_size`.
register_family("mobilebert", "encoder.layer", attention_size_field="true_hidden_size")
register_family(
    "distilbert",
    "transformer.layer",
    query="attention.q_lin",
    key="attention.k_lin",
    value="attention.v_lin",
    num_layers_field="n_layers",
    hidden_size_field="dim",
    num_heads_field="n_heads",
    intermediate_size_field="hidden_dim",
    attention_output="attention.out_lin",
    mlp_input=("ffn.lin1",),
    mlp_output="ffn.lin2",
    norms=("sa_layer_norm", "output_layer_norm"),
)

# Decoder-only causal LMs (transformers 5 layout: model.layers, model.embed_tokens, model.norm, model.rotary_emb).
# The embedding module's output is hidden_states[0] (Gemma's sqrt(hidden) scaling lives inside its
# `embed_tokens` in transformers 5); the last hidden state is the final norm's output, as `output_hidden_states`.
_DECODER = {
    "embeddings": ("embed_tokens",),
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "num_kv_heads_field": "num_key_value_heads",
    "head_dim_field": "head_dim",
    "rotary": "rotary_emb",
    "final_norm": "norm",
    "causal": True,
    "attention_output": "self_attn.o_proj",
    "mlp_input": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp_output": "mlp.down_proj",
    "norms": ("input_layernorm", "post_attention_layernorm"),
}
for _model_type in ("llama", "mistral", "qwen2", "gemma"):
    register_family(_model_type, "layers", **_DECODER)
# Gemma-2 normalises both sides of attention and MLP; the norms in front of them rank the hidden channels.
register_family("gemma2", "layers", **{**_DECODER, "norms": ("input_layernorm", "pre_feedforward_layernorm")})
# Qwen3 normalises Q and K per head (q_norm/k_norm) before the rotary embedding: those are its real Q and K.
register_family(
    "qwen3",
    "layers",
    **{**_DECODER, "query": "self_attn.q_norm", "key": "self_attn.k_norm",
       "projections": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
)
register_family(
    "phi3",
    "layers",
    **{**_DECODER, "qkv": "self_attn.qkv_proj", "mlp_input": ("mlp.gate_up_proj",), "mlp_input_chunks": 2},
)
# GPT-2: learned absolute positions (no rotary), added in the model forward: hidden_states[0] is `drop`'s output.
register_family(
    "gpt2",
    "h",
    embeddings=("drop",),
    qkv="attn.c_attn",
    num_layers_field="n_layer",
    hidden_size_field="n_embd",
    num_heads_field="n_head",
    intermediate_size_field="n_inner",
    final_norm="ln_f",
    causal=True,
    attention_output="attn.c_proj",
    mlp_input=("mlp.c_fc",),
    mlp_output="mlp.c_proj",
    norms=("ln_1", "ln_2"),
)

# Encoder-decoder models (T5, mT5; BART, mBART, Marian, Pegasus). Each stack applies dropout (T5) or a scale, a norm
# and dropout (BART-like) to its embeddings inside its own forward, so hidden_states[0] is read at the first block's
# input; the last entry is the stack's final norm where it has one (T5 `final_layer_norm`, mBART/Pegasus
# `layer_norm`). Only self-attention is tapped: cross-attention Q/K/V are not features a term can name.
_T5 = {
    "query": "layer.0.SelfAttention.q",
    "key": "layer.0.SelfAttention.k",
    "value": "layer.0.SelfAttention.v",
    "hidden_size_field": "d_model",
    "num_heads_field": "num_heads",
    "intermediate_size_field": "d_ff",
    "head_dim_field": "d_kv",
    "embeddings": (),
    "embeddings_from_block_input": True,
    "first_block_only": ("layer.0.SelfAttention.relative_attention_bias.weight",),
    "score_bias": True,
}
for _model_type in ("t5", "mt5"):
    register_encoder_decoder(
        _model_type,
        encoder={"layers": "encoder.block", "num_layers_field": "num_layers", "final_norm": "encoder.final_layer_norm"},
        decoder={
            "layers": "decoder.block",
            "num_layers_field": "num_decoder_layers",
            "final_norm": "decoder.final_layer_norm",
        },
        **_T5,
    )
_BART = {
    "query": "self_attn.q_proj",
    "key": "self_attn.k_proj",
    "value": "self_attn.v_proj",
    "hidden_size_field": "d_model",
    "embeddings": (),
    "embeddings_from_block_input": True,
}
# Whisper: the same layout, its encoder reading log-mel frames through two convolutions (they and the positions sit
# outside the blocks, so hidden_states[0] is read at the first block's input here too).
for _model_type, _norm in (("bart", None), ("marian", None), ("mbart", "layer_norm"), ("pegasus", "layer_norm"),
                           ("whisper", "layer_norm")):
    register_encoder_decoder(
        _model_type,
        encoder={
            "layers": "encoder.layers",
            "num_layers_field": "encoder_layers",
            "num_heads_field": "encoder_attention_heads",
            "intermediate_size_field": "encoder_ffn_dim",
            "final_norm": f"encoder.{_norm}" if _norm else None,
        },
        decoder={
            "layers": "decoder.layers",
            "num_layers_field": "decoder_layers",
            "num_heads_field": "decoder_attention_heads",
            "intermediate_size_field": "decoder_ffn_dim",
            "final_norm": f"decoder.{_norm}" if _norm else None,
        },
        **_BART,
    )
