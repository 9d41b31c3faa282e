"""Tiny random decoder-only causal LMs of every registered decoder family (shared by the decoder tests)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

VOCAB = 128
DECODERS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt2")
ROTARY = tuple(f for f in DECODERS if f != "gpt2")


def decoder_config(family: str, layers: int = 3, **kw):
    """4 query heads, 2 K/V heads (grouped-query attention) wherever the family supports it."""
    if family == "gpt2":
        base = dict(vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, n_inner=64,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
        base.update(kw)
        return GPT2Config(**base)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma": GemmaConfig, "gemma2": Gemma2Config, "phi3": Phi3Config}[family]
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "phi3":
        base.update(partial_rotary_factor=0.5)  # Phi-3's partial rotary: half of each head is rotated
    if family == "gemma2":
        # eager attention then equals softmax(QKᵀ/sqrt(head_dim)): no extra scalar, no logit soft-capping
        base.update(query_pre_attn_scalar=8, attn_logit_softcapping=None, final_logit_softcapping=None)
    base.update(kw)
    return cls(**base)


def decoder(family: str, layers: int = 3, seed: int = 0, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(decoder_config(family, layers, **kw))
    with torch.no_grad():  # some families initialise norms/biases to constants; make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def lm_batch(b: int = 3, t: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch (row i has t - i real tokens) with causal-LM labels (-100 on padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    for i in range(b):
        mask[i, t - i :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
