"""distil-whisper (Gandhi et al. 2023): pseudo-label, filter by WER, shrink the decoder, distil, evaluate.

    python recipes/distil_whisper.py --config recipes/configs/distil_whisper_espeak.yaml --output_dir runs/whisper
    python recipes/distil_whisper.py --config ... --stages pseudo_label filter      # some stages alone

Stages (`--stages`, in this order; each reads what the earlier ones left in `output_dir`, so any can run alone):
1. `teacher`: `--teacher` (a Whisper folder with its processor), or, when none is given, a small Whisper trained
   here on the teacher split (no Whisper weights can be downloaded on the machines this was written on), cached in
   `teacher_cache_dir/<hash of its settings and data>`;
2. `pseudo_label`: the teacher transcribes the distillation split, `pseudo_label_batch_size` rows per `generate`
   call, each finished batch appended to `output_dir/pseudo_labels/pseudo_labels.jsonl`: killed mid-way, the stage
   continues where it stopped (`hf_distill.data.asr.pseudo_label`);
3. `filter`: rows whose pseudo-label has a WER above `wer_threshold` against the split's own transcript (both
   normalised by Whisper's English normaliser, `hf_distill.data.wer`) are dropped (distil-whisper: 10%); the
   stages after `pseudo_label` read its labels back and refuse a folder that lacks some (they never generate);
4. `student`: the teacher's whole encoder, copied and frozen, and `student_decoder_layers` of its decoder (default
   the first and the last), saved in `output_dir/student_init` (`hf_distill.students.whisper_student`);
5. `distil`: `task_weight * CE(pseudo-labels) + kd_weight * T^2 * KL(teacher || student)` at `temperature` over the
   label positions, through `DistillationSeq2SeqTrainer`; saved in `output_dir`. distil-whisper's loss,
   `0.8 * CE + 1.0 * KL * T^2` at T = 2, is `task_weight 0.8, kd_weight 1.0, temperature 2, kd_loss kl,
   kd_token_mask labels` here (the package's `kl` carries the T^2, and both average over the label tokens);
6. `baseline`: the same initial student trained on the same rows with CE on the references only (no teacher);
7. `evaluate`: WER of the teacher and both students on the evaluation split(s), and batch-1 decode time (the
   teacher and the student interleaved clip by clip, at a fixed number of new tokens, so both do the same work);
   written to `output_dir/results.json`.

Data: `dataset_dir` (a `datasets.DatasetDict` saved with `save_to_disk`, splits `teacher_split`, `train_split` and
the `eval_splits`, with `audio_column` {"array", "sampling_rate"} and `text_column`), or, when unset, speech made
here by espeak-ng (`hf_distill.data.speech`): short sentences of `sentences_file` (with `vocabulary`, only those
made of its most frequent words) spoken by disjoint sets of voices (with `voices_per_sentence`, each sentence by that
many of its split's voices) for the teacher's training, the distillation set and the evaluation (seen sentences and
new sentences). The teacher trained here has its convolutions He-initialised (`_whisper_data.init_front_end`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from _whisper_data import build_splits, load_splits
from common import command_line, fail, parse_args, run_length, run_main, set_offline_defaults, write_results

from hf_distill import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer
from hf_distill.publish.report import distillation_facts

STAGES = ("teacher", "pseudo_label", "filter", "student", "distil", "baseline", "evaluate")


@dataclass
class WhisperRecipeArguments:
    """Stages, data, the teacher (given or trained here), the filter and the student."""

    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": f"Stages to run: {STAGES}."})
    teacher: str | None = field(default=None, metadata={"help": "Whisper teacher folder (model + processor). Unset: "
                                                        "train a small one here on the teacher split."})
    dataset_dir: str | None = field(default=None, metadata={"help": "A saved DatasetDict; unset: espeak-ng speech."})
    teacher_split: str = field(default="teacher", metadata={"help": "Split the teacher trained here learns from."})
    train_split: str = field(default="train", metadata={"help": "Split that is pseudo-labelled and distilled on."})
    eval_splits: list[str] = field(default_factory=lambda: ["eval_seen_text", "eval_new_text"],
                                   metadata={"help": "Splits WER is measured on."})
    audio_column: str = field(default="audio", metadata={"help": "Audio column: {'array', 'sampling_rate'}."})
    text_column: str = field(default="text", metadata={"help": "Reference transcript column."})
    sentences_file: str = field(default="../shared/data/sst2/train.tsv",
                                metadata={"help": "espeak-ng data: a TSV whose `sentence` column is read."})
    min_words: int = field(default=3, metadata={"help": "espeak-ng data: shortest sentence kept (words)."})
    vocabulary: int = field(default=0, metadata={"help": "espeak-ng data: keep only sentences made of this many most "
                                                 "frequent words (0: any), so held-out sentences reuse heard words."})
    max_words: int = field(default=8, metadata={"help": "espeak-ng data: longest sentence kept (words)."})
    num_sentences: int = field(default=400, metadata={"help": "espeak-ng data: sentences of teacher/train splits."})
    eval_new_sentences: int = field(default=50, metadata={"help": "espeak-ng data: held-out sentences."})
    eval_seen_sentences: int = field(default=50, metadata={"help": "espeak-ng data: training sentences, new voices."})
    teacher_voices: int = field(default=6, metadata={"help": "espeak-ng data: voices of the teacher split."})
    train_voices: int = field(default=3, metadata={"help": "espeak-ng data: other voices, the distillation split."})
    eval_voices: int = field(default=2, metadata={"help": "espeak-ng data: other voices again, the eval splits."})
    voices_per_sentence: int = field(default=0, metadata={"help": "espeak-ng data: voices of its split that speak "
                                                          "each sentence, drawn per sentence (0: all of them)."})
    voice_seed: int = field(default=0, metadata={"help": "espeak-ng data: seed of the voice draw."})
    wer_threshold: float = field(default=0.1, metadata={"help": "Drop pseudo-labels with a WER above this (0..1)."})
    student: str | None = field(default=None, metadata={"help": "A Whisper folder (model + processor) to start the "
                                                        "student from instead of copying the teacher's layers; its "
                                                        "feature extractor must be the teacher's."})
    student_decoder_layers: list[int] | None = field(default=None, metadata={"help": "Teacher decoder layers the "
                                                                             "student keeps; default first and last."})
    freeze_encoder: bool = field(default=True, metadata={"help": "Freeze the copied encoder (distil-whisper)."})
    pseudo_label_batch_size: int = field(default=32, metadata={"help": "Rows per teacher generate call."})
    transcript_max_tokens: int = field(default=40, metadata={"help": "Longest transcript generated (new tokens)."})
    speed_clips: int = field(default=20, metadata={"help": "Clips of the batch-1 decode timing."})
    speed_tokens: int = field(default=20, metadata={"help": "New tokens per clip in the decode timing."})
    # The teacher trained here when `teacher` is unset.
    teacher_cache_dir: str = field(default=".cache/hf_distill/whisper_teachers",
                                   metadata={"help": "Where trained teachers are kept, one folder per settings."})
    vocab_size: int = field(default=1000, metadata={"help": "Byte-level BPE vocabulary of the teacher trained here."})
    num_mel_bins: int = field(default=80, metadata={"help": "Log-mel bins of the teacher trained here."})
    chunk_length: int = field(default=6, metadata={"help": "Seconds of audio per input (padded or cut)."})
    teacher_d_model: int = field(default=192, metadata={"help": "Teacher width."})
    teacher_encoder_layers: int = field(default=4, metadata={"help": "Teacher encoder depth."})
    teacher_decoder_layers: int = field(default=6, metadata={"help": "Teacher decoder depth."})
    teacher_heads: int = field(default=4, metadata={"help": "Teacher attention heads."})
    teacher_ffn: int = field(default=768, metadata={"help": "Teacher feed-forward width."})
    teacher_epochs: float = field(default=10.0, metadata={"help": "Epochs of teacher training."})
    teacher_learning_rate: float = field(default=1e-3, metadata={"help": "Teacher peak learning rate."})
    teacher_batch_size: int = field(default=32, metadata={"help": "Teacher batch size."})


def check(recipe: WhisperRecipeArguments, args) -> None:
    """The settings a stage would refuse late, refused now (one line each)."""
    from hf_distill.data.wer import check_wer_threshold

    bad = [s for s in recipe.stages if s not in STAGES]
    if bad or not recipe.stages:
        fail(f"stages {bad or recipe.stages}: choose from {', '.join(STAGES)}")
    check_wer_threshold(recipe.wer_threshold)
    for name in ("vocabulary", "voices_per_sentence"):
        if getattr(recipe, name) < 0:
            fail(f"{name} must be >= 0 (0: no limit), got {getattr(recipe, name)}")
    if args.kd_loss not in ("kl", "soft_ce", "jsd", "reverse_kl"):
        fail(f"kd_loss must be a softmax loss (kl, soft_ce, jsd, reverse_kl) for Whisper, got {args.kd_loss!r}")
    if recipe.student and recipe.student_decoder_layers is not None:
        fail("student_decoder_layers: not used with --student (the given student keeps its own layers)")
    if recipe.student_decoder_layers is not None:  # the teacher's depth from its config.json, before it loads
        from hf_distill.students import check_decoder_layers

        depth = recipe.teacher_decoder_layers
        if recipe.teacher and (Path(recipe.teacher) / "config.json").is_file():
            depth = json.loads((Path(recipe.teacher) / "config.json").read_text())["decoder_layers"]
        check_decoder_layers(recipe.student_decoder_layers, depth)


def check_extractors(recipe: WhisperRecipeArguments, has_audio: bool) -> None:
    """A given student whose feature extractor is not the teacher's is refused before anything loads (both are
    read from their preprocessor files; the teacher trained here has the recipe's settings)."""
    from transformers import WhisperFeatureExtractor

    from hf_distill.data.asr import check_feature_extractors

    if not recipe.student:
        return
    try:
        theirs = WhisperFeatureExtractor.from_pretrained(recipe.student)
        ours = WhisperFeatureExtractor.from_pretrained(recipe.teacher) if recipe.teacher else \
            WhisperFeatureExtractor(feature_size=recipe.num_mel_bins, chunk_length=recipe.chunk_length)
    except OSError as err:
        fail(f"cannot read a feature extractor (teacher {recipe.teacher!r}, student {recipe.student!r}): {err}")
    check_feature_extractors(ours, theirs, has_audio)


def teacher_folder(recipe: WhisperRecipeArguments, splits, args, train: bool):
    """(folder of the teacher, how it was made): `--teacher`, or one trained here on the teacher split (cached)."""
    if recipe.teacher:
        return recipe.teacher, {"given": recipe.teacher}
    from hf_distill.data.asr import digest

    names = [f.name for f in dataclasses.fields(recipe) if f.name.startswith("teacher_") and f.name not in
             ("teacher_cache_dir", "teacher_split")] + ["vocab_size", "num_mel_bins", "chunk_length"]
    key = {n: getattr(recipe, n) for n in names}
    rows = splits[recipe.teacher_split]
    key.update(texts=digest(rows[recipe.text_column]), speakers=digest(rows["speaker"]) if "speaker" in
               rows.column_names else None, rows=len(rows), seed=args.seed,
               front_end_init="he")  # teachers cached before the convolutions' He init are not reused
    folder = Path(recipe.teacher_cache_dir) / hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    info = folder / "teacher_info.json"
    if info.is_file():
        print(f"teacher: reusing {folder}")
        return str(folder), json.loads(info.read_text())
    if not train:
        fail(f"no teacher: give --teacher, or run the teacher stage first (it trains one into {folder})")
    from _whisper_data import train_teacher

    return str(folder), train_teacher(recipe, key, rows, folder, args)


def load_whisper(path: str, what: str):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    try:
        return WhisperForConditionalGeneration.from_pretrained(path), WhisperProcessor.from_pretrained(path)
    except OSError as err:
        fail(f"cannot load the {what} (model and processor) from {path!r}: {err}".splitlines()[0])


def train_student(student, teacher, rows, processor, args, out: str, kd: bool):
    """One `DistillationSeq2SeqTrainer` run: with the teacher (CE on pseudo-labels + KL) or without (CE alone)."""
    from hf_distill.data.asr import SpeechSeq2SeqCollator

    if not kd:
        args = dataclasses.replace(args, kd_weight=0.0, task_weight=1.0, output_dir=out)
    collate = SpeechSeq2SeqCollator(processor, text_column="target", decoder_start_token_id=
                                    student.config.decoder_start_token_id)
    # processing_class: the teacher's vocabulary is checked against the student's, and the processor saved with it
    trainer = DistillationSeq2SeqTrainer(model=student, teacher_model=teacher if kd else None, args=args,
                                         train_dataset=rows, data_collator=collate, processing_class=processor)
    result = trainer.train()
    trainer.save_model(out)
    trainer.save_state()
    return trainer, result


def decode_speed(teacher, student, rows, processor, recipe) -> dict:
    """Batch-1 greedy decoding of the same clips, teacher and student interleaved (so load on a shared machine hits
    both alike), each forced to generate `speed_tokens` new tokens (the same work whatever it transcribes)."""
    import torch

    from hf_distill.data.asr import SpeechSeq2SeqCollator

    collate = SpeechSeq2SeqCollator(processor, audio_column=recipe.audio_column)
    times = {"teacher": 0.0, "student": 0.0}
    n = min(recipe.speed_clips, len(rows))
    gen = {"max_new_tokens": recipe.speed_tokens, "min_new_tokens": recipe.speed_tokens}
    for model in (teacher, student):  # one warm-up call each
        model.eval()
        with torch.no_grad():
            model.generate(input_features=collate.features([rows[0]]), **gen)
    for i in range(n):
        features = collate.features([rows[i]])
        pair = [("teacher", teacher), ("student", student)]
        for name, model in pair if i % 2 == 0 else pair[::-1]:
            start = time.perf_counter()
            with torch.no_grad():
                model.generate(input_features=features, **gen)
            times[name] += time.perf_counter() - start
    return {"speed_clips": n, "speed_tokens": recipe.speed_tokens, "teacher_s_per_clip": times["teacher"] / n,
            "student_s_per_clip": times["student"] / n, "decode_speedup": times["teacher"] / times["student"]}


def main() -> None:
    set_offline_defaults()
    recipe, args, config = parse_args([WhisperRecipeArguments, DistillationSeq2SeqArguments],
                                      __doc__.split("\n\n")[0])
    check(recipe, args)
    start = time.time()
    from transformers import set_seed

    from hf_distill import students
    from hf_distill.data.asr import (
        check_audio,
        check_clip_lengths,
        check_feature_extractors,
        check_input_features,
        pseudo_label,
        transcribe,
    )
    from hf_distill.data.wer import english_normaliser, wer, wer_filter

    out = Path(args.output_dir)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    results.update(recipe="distil_whisper", command=command_line(), config=config, stages_run=recipe.stages)
    if not recipe.dataset_dir:
        check_extractors(recipe, has_audio=True)  # espeak-ng speech: raw audio, before it is synthesised
    splits = load_splits(recipe) if recipe.dataset_dir else build_splits(recipe)
    if recipe.dataset_dir:
        check_extractors(recipe, has_audio=all(recipe.audio_column in rows.column_names for rows in splits.values()))
    extractor = _teacher_extractor(recipe)
    for rows in splits.values():
        if recipe.audio_column in rows.column_names:
            check_audio(rows, recipe.audio_column, extractor.sampling_rate)
            check_clip_lengths(rows, recipe.audio_column, extractor)
        else:  # precomputed input_features
            check_input_features(rows, extractor)
    results["rows"] = {name: len(rows) for name, rows in splits.items()}

    # 1. The teacher (and its processor), given or trained here.
    path, results["teacher_training"] = teacher_folder(recipe, splits, args, train="teacher" in recipe.stages)
    teacher, processor = load_whisper(path, "teacher")
    results["teacher"] = path
    norm = english_normaliser(processor.tokenizer)
    gen = {"max_new_tokens": recipe.transcript_max_tokens}
    train = splits[recipe.train_split]
    labels_dir = out / "pseudo_labels"

    # 2-3. Pseudo-labels (resumable) and the WER filter.
    # a stage after pseudo_label reads the labels back and never generates them (that is pseudo_label's work)
    labelling = "pseudo_label" in recipe.stages
    if labelling or "filter" in recipe.stages:
        t0 = time.time()
        labels = pseudo_label(teacher, processor, train, labels_dir, batch_size=recipe.pseudo_label_batch_size,
                              audio_column=recipe.audio_column, generate=labelling, **gen)
        results["pseudo_label_s"] = time.time() - t0
        results["pseudo_label_wer"] = wer(train[recipe.text_column], labels, norm)
    if "filter" in recipe.stages:
        kept, scores = wer_filter(train[recipe.text_column], labels, recipe.wer_threshold, norm)
        (labels_dir / "filter.json").write_text(json.dumps({"wer_threshold": recipe.wer_threshold, "kept": kept,
                                                            "wer": scores}) + "\n")
        results.update(wer_threshold=recipe.wer_threshold, kept_rows=len(kept), kept_share=len(kept) / len(train))
        print(f"filter: kept {len(kept)} of {len(train)} pseudo-labels (WER <= {recipe.wer_threshold})")

    # 4. The student: whole encoder (frozen) + chosen decoder layers.
    init_dir = out / "student_init"
    if "student" in recipe.stages:
        if recipe.student:
            student = load_whisper(recipe.student, "student")[0]
            results["student_decoder_layers"] = f"given: {recipe.student}"
        else:
            student = students.whisper_student(teacher, recipe.student_decoder_layers, recipe.freeze_encoder)
            results["student_decoder_layers"] = student.config.distillation["teacher_decoder_layers"]
        student.save_pretrained(init_dir)
        processor.save_pretrained(init_dir)

    # what a trained student comes from (teacher, student_init, filter): hashed once, for the stages below
    made_from = functools.cache(lambda: _inputs_digest(teacher, init_dir, labels_dir / "filter.json"))

    # 5-6. Distillation on the kept pseudo-labels, and the CE-only baseline on the same rows' references.
    if "distil" in recipe.stages or "baseline" in recipe.stages:
        filtered = labels_dir / "filter.json"
        if not filtered.is_file() or not (init_dir / "config.json").is_file():
            fail(f"distil/baseline need the filter and student stages' outputs in {out} (run them first)")
        kept = json.loads(filtered.read_text())["kept"]
        if not kept:
            fail(f"the WER filter kept no row (wer_threshold {recipe.wer_threshold}): raise it or check the teacher")
        labels = pseudo_label(teacher, processor, train, labels_dir, batch_size=recipe.pseudo_label_batch_size,
                              audio_column=recipe.audio_column, generate=labelling, **gen)
        rows = train.select(kept)
        initial, init_processor = load_whisper(str(init_dir), "initial student")
        check_feature_extractors(processor.feature_extractor, init_processor.feature_extractor,
                                 has_audio=recipe.audio_column in train.column_names)
        if recipe.freeze_encoder:
            initial.model.encoder.requires_grad_(False)
        if "distil" in recipe.stages:
            set_seed(args.seed)
            student = copy.deepcopy(initial)
            trainer, done = train_student(student, teacher, rows.add_column("target", [labels[i] for i in kept]),
                                          processor, args, str(out), kd=True)
            results.update(distillation=distillation_facts(args), train_runtime_s=done.metrics.get("train_runtime"),
                           student_from=made_from(), **run_length(args, trainer.state))
        if "baseline" in recipe.stages:
            set_seed(args.seed)
            _, done = train_student(copy.deepcopy(initial), None, rows.add_column("target", rows[recipe.text_column]),
                                    processor, args, str(out / "baseline"), kd=False)
            results.update(baseline_train_runtime_s=done.metrics.get("train_runtime"), baseline_steps=done.global_step,
                           baseline_from=made_from())

    # 7. WER and decode speed.
    if "evaluate" in recipe.stages:
        models = {"teacher": teacher}
        for name, folder in (("student", out), ("baseline", out / "baseline")):
            if (folder / "config.json").is_file():
                models[name] = load_whisper(str(folder), name)[0]
        if "student" not in models:
            fail(f"evaluate needs the distilled student in {out} (run the distil stage first)")
        for name, key in (("student", "student_from"), ("baseline", "baseline_from")):
            if name in models and results.get(key) not in (None, made_from()):
                stage = "distil" if name == "student" else "baseline"
                fail(f"the {name} in {out} was trained from another teacher, student_init or filter than the ones "
                     f"now (a stage ran since, or --teacher changed): run the {stage} stage again before evaluate, or "
                     "use another output_dir")
        for split in recipe.eval_splits:
            rows = splits[split]
            for name, model in models.items():
                hyps = transcribe(model, processor, rows, batch_size=recipe.pseudo_label_batch_size,
                                  audio_column=recipe.audio_column, **gen)
                results[f"{name}_wer_{split}"] = wer(rows[recipe.text_column], hyps, norm)
        results.update(decode_speed(teacher, models["student"], splits[recipe.eval_splits[0]], processor, recipe))
        results.update(teacher_params=teacher.num_parameters(), params=models["student"].num_parameters())
    results["wall_s"] = time.time() - start
    write_results(str(out), results)


def _inputs_digest(teacher, init_dir: Path, filtered: Path) -> str:
    """A short hash of what a trained student came from: the teacher, student_init's weights and the WER filter's
    rows (which the teacher's pseudo-labels chose)."""
    from hf_distill.data.cache_key import teacher_fingerprint

    digest = hashlib.sha256(teacher_fingerprint(teacher).encode())
    for path in (init_dir / "model.safetensors", filtered):
        if path.is_file():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
    return digest.hexdigest()[:16]


def _teacher_extractor(recipe: WhisperRecipeArguments):
    """The teacher's feature extractor, read before the model loads (the one trained here: the recipe's settings)."""
    from transformers import WhisperFeatureExtractor

    if recipe.teacher is None:
        return WhisperFeatureExtractor(feature_size=recipe.num_mel_bins, chunk_length=recipe.chunk_length)
    try:
        return WhisperFeatureExtractor.from_pretrained(recipe.teacher)
    except OSError as err:
        fail(f"cannot read the teacher's feature extractor from {recipe.teacher!r}: {err}".splitlines()[0])


if __name__ == "__main__":
    run_main(main)
