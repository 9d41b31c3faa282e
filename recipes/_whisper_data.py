"""The distil_whisper recipe's data and its teacher trained here: espeak-ng speech from short sentences (disjoint
voices per split), a saved DatasetDict instead, and a small Whisper trained from scratch when no teacher is given.
Imported by recipes/distil_whisper.py (underscored, so `hf-distill run` does not list it as a recipe)."""

from __future__ import annotations

import csv
import json
import re
import time
from collections import Counter
from pathlib import Path

from common import fail

_WORD = re.compile(r"[a-z']+")


def sentences(path: str, min_words: int, max_words: int, vocabulary: int = 0) -> list[str]:
    """Distinct sentences of a TSV's `sentence` column, lower-cased, letters and apostrophes only (what a listener
    can hear: SST-2's tokenised punctuation is not spoken), with min_words..max_words words, in file order. With
    `vocabulary` > 0, only the sentences made entirely of the `vocabulary` most frequent words of those (ties in
    order of first use): held-out sentences then reuse words the teacher heard, so their WER measures recognition,
    not the spelling of words it never met."""
    if not Path(path).is_file():
        fail(f"sentences_file {path!r} does not exist")
    seen, kept = set(), []
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE):
            words = [w for w in _WORD.findall((row.get("sentence") or "").lower()) if w.strip("'")]
            text = " ".join(words)
            if min_words <= len(words) <= max_words and text not in seen:
                seen.add(text)
                kept.append(text)
    if vocabulary > 0:
        common = {w for w, _ in Counter(w for text in kept for w in text.split()).most_common(vocabulary)}
        kept = [text for text in kept if all(w in common for w in text.split())]
    return kept


def _spoken(texts: list[str], pool: list, per_sentence: int, seed: int):
    """Each text spoken by `per_sentence` voices of `pool` drawn for it (every voice of the pool when 0, or when the
    pool holds no more than that): many voices overall without a clip for every (text, voice) pair."""
    import numpy as np
    from datasets import Dataset

    from hf_distill.data import speech

    if not 0 < per_sentence < len(pool):
        return speech.spoken_dataset(texts, pool)
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {"audio": [], "text": [], "speaker": []}
    for text in texts:
        for i in sorted(rng.choice(len(pool), per_sentence, replace=False)):
            rows["audio"].append({"array": speech.speak(text, pool[i]), "sampling_rate": speech.SAMPLING_RATE})
            rows["text"].append(text)
            rows["speaker"].append(pool[i].key())
    return Dataset.from_dict(rows)


def build_splits(recipe) -> dict:
    """espeak-ng speech: `num_sentences` sentences spoken by the teacher's voices (split `teacher`) and by other
    voices (split `train`, the distillation set); evaluation by other voices again, on `eval_seen_sentences` of
    those sentences (`eval_seen_text`) and on `eval_new_sentences` held-out ones (`eval_new_text`). With
    `voices_per_sentence`, each sentence of a split is spoken by that many of the split's voices, drawn per
    sentence. Clips longer than `chunk_length` are dropped (the feature extractor would cut them), and counted."""
    from hf_distill.data import speech

    speech.require_espeak()
    pool = sentences(recipe.sentences_file, recipe.min_words, recipe.max_words, recipe.vocabulary)
    need = recipe.num_sentences + recipe.eval_new_sentences
    if len(pool) < need:
        within = f" within its {recipe.vocabulary} most frequent words" if recipe.vocabulary else ""
        fail(f"sentences_file has {len(pool)} sentences of {recipe.min_words}-{recipe.max_words} words{within}, "
             f"{need} needed (num_sentences + eval_new_sentences)")
    counts = (recipe.teacher_voices, recipe.train_voices, recipe.eval_voices)
    drawn = speech.voices(sum(counts), seed=recipe.voice_seed)
    teacher_v, train_v, eval_v = drawn[:counts[0]], drawn[counts[0]:sum(counts[:2])], drawn[sum(counts[:2]):]
    seen, new = pool[: recipe.num_sentences], pool[recipe.num_sentences : need]
    plan = {"teacher": (seen, teacher_v), "train": (seen, train_v),
            "eval_seen_text": (seen[: recipe.eval_seen_sentences], eval_v), "eval_new_text": (new, eval_v)}
    limit = recipe.chunk_length * speech.SAMPLING_RATE
    splits = {}
    for k, (name, (texts, voices)) in enumerate(plan.items()):
        rows = _spoken(texts, voices, recipe.voices_per_sentence, recipe.voice_seed + k)
        fits = [i for i, a in enumerate(rows["audio"]) if len(a["array"]) <= limit]
        if len(fits) < len(rows):
            print(f"data: {name}: dropped {len(rows) - len(fits)} clips longer than {recipe.chunk_length} s")
        splits[name] = rows.select(fits)
    return splits


def load_splits(recipe) -> dict:
    """The splits of a saved DatasetDict; every split the stages read must be there."""
    from datasets import load_from_disk

    if not Path(recipe.dataset_dir).is_dir():
        fail(f"dataset_dir {recipe.dataset_dir!r}: no such folder (a DatasetDict saved with save_to_disk)")
    data = load_from_disk(recipe.dataset_dir)
    wanted = {recipe.train_split, *recipe.eval_splits} | ({recipe.teacher_split} if not recipe.teacher else set())
    missing = sorted(wanted - set(data))
    if missing:
        fail(f"dataset_dir {recipe.dataset_dir!r} lacks split(s) {missing} (it has {sorted(data)})")
    for name in wanted:
        cols = data[name].column_names
        if recipe.text_column not in cols:
            fail(f"dataset_dir split {name!r} has no column {recipe.text_column!r} (text_column)")
        if recipe.audio_column not in cols and "input_features" not in cols:
            fail(f"dataset_dir split {name!r} has neither {recipe.audio_column!r} (audio_column) nor input_features")
    return {name: data[name] for name in wanted}


def init_front_end(model) -> None:
    """He-normal weights and zero biases for the encoder's two convolutions (GELU after each). Whisper's own init
    (normal, std 0.02) makes what the audio adds to the encoder's input about 70 times smaller than the sinusoidal
    positions it is summed with; a model trained from scratch then learns a language model of the transcripts
    first and hears the audio hundreds of steps later (on a CPU budget: never). Checkpoints are unaffected."""
    import torch

    for conv in (model.model.encoder.conv1, model.model.encoder.conv2):
        torch.nn.init.kaiming_normal_(conv.weight, nonlinearity="relu")
        torch.nn.init.zeros_(conv.bias)


def new_teacher(recipe, processor, longest: int):
    """The untrained teacher: a Whisper of the recipe's sizes over `processor`'s vocabulary and features, its
    convolutions He-initialised, generating with the English-only prompt (`<|startoftranscript|><|notimestamps|>`)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    tok = processor.tokenizer
    sot, eot = tok.convert_tokens_to_ids("<|startoftranscript|>"), tok.eos_token_id
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=recipe.num_mel_bins, d_model=recipe.teacher_d_model,
        encoder_layers=recipe.teacher_encoder_layers, decoder_layers=recipe.teacher_decoder_layers,
        encoder_attention_heads=recipe.teacher_heads, decoder_attention_heads=recipe.teacher_heads,
        encoder_ffn_dim=recipe.teacher_ffn, decoder_ffn_dim=recipe.teacher_ffn,
        max_source_positions=processor.feature_extractor.nb_max_frames // 2,
        max_target_positions=max(64, 2 * longest + recipe.transcript_max_tokens), pad_token_id=eot, bos_token_id=eot,
        eos_token_id=eot, decoder_start_token_id=sot, suppress_tokens=[], begin_suppress_tokens=None)
    model = WhisperForConditionalGeneration(config)
    init_front_end(model)
    model.generation_config.no_timestamps_token_id = tok.convert_tokens_to_ids("<|notimestamps|>")
    model.generation_config.is_multilingual = False
    model.generation_config.forced_decoder_ids = None
    return model


def train_teacher(recipe, key: dict, rows, folder: Path, args) -> dict:
    """A Whisper trained from scratch on `rows` (CE on the references), saved with its processor in `folder`."""
    import torch
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    from hf_distill.data.asr import SpeechSeq2SeqCollator, whisper_processor

    t0 = time.time()
    texts = list(rows[recipe.text_column])
    processor = whisper_processor(texts, recipe.vocab_size, recipe.num_mel_bins, recipe.chunk_length)
    tok = processor.tokenizer
    sot = tok.convert_tokens_to_ids("<|startoftranscript|>")
    torch.manual_seed(args.seed)
    model = new_teacher(recipe, processor, longest=max(len(tok(t).input_ids) for t in texts))
    targs = Seq2SeqTrainingArguments(
        output_dir=str(folder / "trainer"), num_train_epochs=recipe.teacher_epochs,
        learning_rate=recipe.teacher_learning_rate, per_device_train_batch_size=recipe.teacher_batch_size,
        lr_scheduler_type="cosine", warmup_steps=0.05, weight_decay=0.01, use_cpu=args.use_cpu, seed=args.seed,
        logging_steps=args.logging_steps, save_strategy="no", report_to="none", disable_tqdm=args.disable_tqdm,
        remove_unused_columns=False, dataloader_num_workers=0)
    collate = SpeechSeq2SeqCollator(processor, text_column=recipe.text_column, audio_column=recipe.audio_column,
                                    decoder_start_token_id=sot)
    result = Seq2SeqTrainer(model=model, args=targs, train_dataset=rows, data_collator=collate).train()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    info = {"settings": key, "train_rows": len(rows), "train_loss": result.training_loss,
            "train_steps": result.global_step, "train_s": time.time() - t0}
    (folder / "teacher_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
