"""Tiny random Whisper models and an offline WhisperProcessor (shared by the speech-recognition tests)."""

from __future__ import annotations

import numpy as np
import torch
from datasets import Dataset
from transformers import WhisperConfig, WhisperForConditionalGeneration

from hf_distill.data.asr import whisper_processor

TEXTS = ("the movie was great fun", "a dull and tedious film", "one two three four five", "not bad at all")


def processor(num_mel_bins: int = 16, chunk_length: int = 1):
    """A WhisperProcessor built here: a 300-entry BPE over TEXTS, `num_mel_bins` mel bins, 1 s inputs."""
    return whisper_processor(list(TEXTS) * 4, vocab_size=300, num_mel_bins=num_mel_bins, chunk_length=chunk_length)


def tiny_whisper(proc, decoder_layers: int = 4, seed: int = 0, d_model: int = 16) -> WhisperForConditionalGeneration:
    tok = proc.tokenizer
    fe = proc.feature_extractor
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=fe.feature_size, d_model=d_model, encoder_layers=1,
        decoder_layers=decoder_layers, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, max_source_positions=fe.nb_max_frames // 2, max_target_positions=32,
        pad_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"), suppress_tokens=[],
        begin_suppress_tokens=None)
    model = WhisperForConditionalGeneration(config)
    model.generation_config.no_timestamps_token_id = tok.convert_tokens_to_ids("<|notimestamps|>")
    model.generation_config.is_multilingual = False
    model.generation_config.forced_decoder_ids = None
    with torch.no_grad():  # peaked next-token distributions, so KD carries real gradient
        model.proj_out.weight.mul_(8.0)
    return model


def noise_rows(n: int, rate: int = 16_000, seconds: float = 0.5, seed: int = 0) -> Dataset:
    """`n` rows of quiet noise and a transcript from TEXTS (the audio column as the Hub's decoded audio)."""
    rng = np.random.default_rng(seed)
    audio = [{"array": (0.1 * rng.standard_normal(int(rate * seconds))).astype(np.float32), "sampling_rate": rate}
             for _ in range(n)]
    return Dataset.from_dict({"audio": audio, "text": [TEXTS[i % len(TEXTS)] for i in range(n)]})
