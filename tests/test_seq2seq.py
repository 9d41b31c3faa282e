"""Encoder-decoder students through the paths of transformers' run_summarization.py / run_translation.py.

Those scripts parse `Seq2SeqTrainingArguments` with HfArgumentParser, collate with `DataCollatorForSeq2Seq(tokenizer,
model=model, label_pad_token_id=-100)`, train with `Seq2SeqTrainer` (resuming from a checkpoint), save, and evaluate
and predict with `predict_with_generate=True`. These tests drive the same calls with `DistillationSeq2SeqArguments`
and `DistillationSeq2SeqTrainer`, on tiny random T5, BART and Marian models and a word-level tokenizer built here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers import bert, flat_params
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    MarianConfig,
    MarianMTModel,
    MBartConfig,
    MBartForConditionalGeneration,
    MT5Config,
    MT5ForConditionalGeneration,
    PegasusConfig,
    PegasusForConditionalGeneration,
    PreTrainedTokenizerFast,
    Seq2SeqTrainingArguments,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_distill import DistillationSeq2SeqArguments, DistillationSeq2SeqTrainer, DistillationTrainer, students
from hf_distill.features.taps import FeatureTaps, TapRequest

VOCAB = 48
PAD, EOS, UNK = 0, 1, 2


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `<pad> </s> <unk> w3 ... w47`, built in memory (no Hub)."""
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": UNK, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def t5(encoder=2, decoder=4, d_model=32, heads=4, seed=0, cls=T5ForConditionalGeneration, config=T5Config):
    torch.manual_seed(seed)
    return cls(config(vocab_size=VOCAB, d_model=d_model, d_kv=d_model // heads, d_ff=2 * d_model, num_layers=encoder,
                      num_decoder_layers=decoder, num_heads=heads, dropout_rate=0.0, pad_token_id=PAD,
                      eos_token_id=EOS, decoder_start_token_id=PAD, relative_attention_num_buckets=8))


def bart(encoder=2, decoder=4, d_model=32, heads=4, seed=0, cls=BartForConditionalGeneration, config=BartConfig):
    torch.manual_seed(seed)
    return cls(config(vocab_size=VOCAB, d_model=d_model, encoder_layers=encoder, decoder_layers=decoder,
                      encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * d_model,
                      decoder_ffn_dim=2 * d_model, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                      activation_dropout=0.0, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS,
                      decoder_start_token_id=EOS, forced_eos_token_id=None))


def marian(encoder=2, decoder=4, d_model=32, heads=4, seed=0):
    return bart(encoder, decoder, d_model, heads, seed, cls=MarianMTModel, config=MarianConfig)


BUILDERS = {"t5": t5, "bart": bart, "marian": marian}


def sharpen(model):
    """A teacher whose next-token distributions are far from uniform, so KD carries real gradient."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model


def rows(n=16, seed=0) -> Dataset:
    """Source texts of 3-10 tokens, targets of 2-7: different encoder and decoder lengths in every batch."""
    g = torch.Generator().manual_seed(seed)
    tok = tokenizer()
    out = []
    for _ in range(n):
        src = torch.randint(3, VOCAB, (int(torch.randint(3, 11, (1,), generator=g)),), generator=g).tolist()
        tgt = torch.randint(3, VOCAB, (int(torch.randint(2, 8, (1,), generator=g)),), generator=g).tolist()
        enc = tok(" ".join(f"w{i}" for i in src))
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                    "labels": tok(text_target=" ".join(f"w{i}" for i in tgt))["input_ids"]})
    return Dataset.from_list(out)


def seq2seq_args(tmp_path, **kw) -> DistillationSeq2SeqArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                max_steps=3, learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                seed=0, disable_tqdm=True, dataloader_num_workers=0, temperature=2.0, kd_weight=1.0,
                task_weight=0.5)
    base.update(kw)
    return DistillationSeq2SeqArguments(**base)


def trainer_for(tmp_path, student, teacher, data=None, **kw):
    data = data if data is not None else rows()
    tok = tokenizer()
    return DistillationSeq2SeqTrainer(
        model=student, teacher_model=teacher, args=seq2seq_args(tmp_path, **kw), train_dataset=data,
        eval_dataset=rows(8, seed=1), processing_class=tok,
        data_collator=DataCollatorForSeq2Seq(tok, model=student, label_pad_token_id=-100),
    )


# ----------------------------------------------------------------------------------------------- the KD term


@pytest.mark.parametrize("family", ["t5", "bart"])
@pytest.mark.parametrize("token_mask", ["labels", "attention"])
def test_kd_is_the_decoder_token_kl_over_label_positions(tmp_path, family, token_mask):
    """T**2 * KL(teacher || student) at T=2 per decoder position, averaged over the positions whose label is not
    -100, against a float64 computation by hand on one collated batch (encoder and decoder lengths differ)."""
    teacher = sharpen(BUILDERS[family](seed=1))
    student = BUILDERS[family](decoder=2, seed=0)
    trainer = trainer_for(tmp_path, student, teacher, kd_weight=1.0, task_weight=0.0, kd_token_mask=token_mask)
    batch = trainer.data_collator([rows()[i] for i in range(4)])
    assert batch["input_ids"].shape[1] != batch["labels"].shape[1] and (batch["labels"] == -100).any()
    student.train()
    loss = trainer.compute_loss(student, dict(batch)).detach()
    expected = kd_by_hand(student, teacher, batch)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert expected > 0.05  # a real signal, not two equal models


def kd_by_hand(student, teacher, batch, temperature=2.0) -> float:
    """T**2 * KL(softmax(t/T) || softmax(s/T)) per decoder position, in float64, averaged over the labels != -100."""
    with torch.no_grad():
        feed = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}
        s = student(**feed).logits.double() / temperature
        t = teacher(**feed).logits.double() / temperature
    kl = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)
    return float(temperature**2 * kl[batch["labels"] != -100].mean())


def test_teacher_gets_decoder_inputs_when_the_collator_has_no_model(tmp_path):
    """DataCollatorForSeq2Seq without `model=` gives labels only: both models read the student's shift of them,
    also with task_weight=0 (the student is then not given the labels)."""
    teacher = sharpen(t5(seed=1))
    student = students.from_teacher(teacher, decoder_layers=[1, 3])
    tok = tokenizer()
    trainer = DistillationSeq2SeqTrainer(
        model=student, teacher_model=teacher, args=seq2seq_args(tmp_path, task_weight=0.0), train_dataset=rows(),
        data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=-100),
    )
    batch = trainer.data_collator([rows()[i] for i in range(4)])
    assert "decoder_input_ids" not in batch
    with_model = DataCollatorForSeq2Seq(tok, model=student, label_pad_token_id=-100)([rows()[i] for i in range(4)])
    student.train()
    without = float(trainer.compute_loss(student, dict(batch)).detach())
    assert without == pytest.approx(float(trainer.compute_loss(student, dict(with_model)).detach()), rel=1e-6)
    assert without > 0


@pytest.mark.slow
def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """The KD and task terms are means over the optimizer step's decoder positions (hf_distill.losses.normalise): one
    step over all 16 rows logs the decoder-token KD by hand, and accumulating 2 micro-batches of different target
    lengths gives that big batch's update."""
    teacher = sharpen(bart(seed=1))
    data = rows(16)
    full = DataCollatorForSeq2Seq(tokenizer(), model=teacher, label_pad_token_id=-100)([data[i] for i in range(16)])
    expected = kd_by_hand(bart(decoder=2, seed=2), teacher, full)
    runs = []
    for name, extra in (("big", dict(per_device_train_batch_size=16)),
                        ("acc", dict(per_device_train_batch_size=8, gradient_accumulation_steps=2))):
        student = bart(decoder=2, seed=2)
        terms = [{"loss": "hidden_mse", "layers": "last", "stack": "decoder"}]
        trainer = trainer_for(tmp_path / name, student, teacher, data=data, max_steps=1, optim="sgd",
                              learning_rate=0.5, distill_terms=terms, **extra)
        trainer.train()
        runs.append(trainer)
    assert runs[0].state.log_history[0]["loss_kd"] == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(flat_params(runs[1].model), flat_params(runs[0].model), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------- intermediate terms


@pytest.mark.parametrize(
    "make",
    [
        t5,
        lambda **kw: t5(cls=MT5ForConditionalGeneration, config=MT5Config, **kw),
        bart,
        marian,
        lambda **kw: bart(cls=MBartForConditionalGeneration, config=MBartConfig, **kw),
        lambda **kw: bart(cls=PegasusForConditionalGeneration, config=PegasusConfig, **kw),
    ],
    ids=["t5", "mt5", "bart", "marian", "mbart", "pegasus"],
)
def test_stack_taps_are_the_encoder_and_decoder_hidden_states(make):
    """The registry's paths: each stack's hooked features equal transformers' encoder_/decoder_hidden_states, every
    index from the embeddings (the first block's input) to the last (after the stack's final norm, if any)."""
    model = make().eval()
    request = TapRequest(stacks={"encoder": TapRequest(hidden={0, 1, 2}, q={1}),
                                 "decoder": TapRequest(hidden={0, 1, 2, 3, 4}, v={4})})
    taps = FeatureTaps(model, request, "student")
    batch = DataCollatorForSeq2Seq(tokenizer(), model=model)([rows()[i] for i in range(3)])
    with torch.no_grad():
        out, feats = taps.run(model, dict(batch))
        ref = model(**batch, output_hidden_states=True)
    for stack, states in (("encoder", ref.encoder_hidden_states), ("decoder", ref.decoder_hidden_states)):
        assert sorted(feats.stacks[stack].hidden) == list(range(len(states)))
        for i, h in enumerate(states):
            torch.testing.assert_close(feats.stacks[stack].hidden[i], h, atol=0, rtol=0)
    assert feats.stacks["encoder"].q[1].shape == (3, batch["input_ids"].shape[1], 32)
    assert feats.stacks["decoder"].v[4].shape == (3, batch["labels"].shape[1], 32)
    torch.testing.assert_close(out.logits, ref.logits)


def test_stack_terms_compare_each_stacks_layers_over_its_own_tokens(tmp_path):
    """hidden_mse on the encoder (real source tokens) and on the decoder (label positions), against the hidden
    states by hand; the uniform map is each stack's own (encoder 2 <- 2 layers, decoder 2 <- 4)."""
    teacher = bart(seed=1)
    student = students.from_teacher(teacher, decoder_layers=[1, 3])
    terms = [{"loss": "hidden_mse", "layers": "uniform", "stack": "encoder"},
             {"loss": "hidden_mse", "layers": "uniform", "stack": "decoder"}]
    trainer = trainer_for(tmp_path, student, teacher, kd_weight=0.0, task_weight=0.0, distill_terms=terms)
    assert [(t.name, pairs) for t, pairs, _ in trainer.intermediate.bound] == [
        ("encoder_hidden", [(0, 0), (1, 1), (2, 2)]), ("decoder_hidden", [(0, 0), (1, 2), (2, 4)])]
    batch = trainer.data_collator([rows()[i] for i in range(4)])
    student.train()
    trainer.compute_loss(student, dict(batch))
    logged = trainer.tracker.pop_means(trainer.accelerator)
    with torch.no_grad():
        s = student(**batch, output_hidden_states=True)
        t = teacher(**batch, output_hidden_states=True)

    def mse(a, b, mask):
        m = mask.bool()
        return float(((a.double() - b.double()) ** 2)[m].mean())

    enc = sum(mse(s.encoder_hidden_states[a], t.encoder_hidden_states[b], batch["attention_mask"])
              for a, b in [(0, 0), (1, 1), (2, 2)])
    dec = sum(mse(s.decoder_hidden_states[a], t.decoder_hidden_states[b], batch["labels"] != -100)
              for a, b in [(0, 0), (1, 2), (2, 4)])
    assert logged["encoder_hidden"] == pytest.approx(enc, rel=1e-5)
    assert logged["decoder_hidden"] == pytest.approx(dec, rel=1e-5)
    assert dec > 0


# ------------------------------------------------------------------------- the script's flow: train, generate


@pytest.mark.slow
@pytest.mark.parametrize("family", ["t5", "bart", "marian"])
def test_train_then_evaluate_and_predict_with_generate(tmp_path, family):
    """run_summarization's flow: train with KD and terms on both stacks, then evaluate and predict with
    predict_with_generate=True: compute_metrics gets the student's own generations (equal to student.generate)."""
    teacher = sharpen(BUILDERS[family](seed=1))
    student = students.from_teacher(teacher, decoder_layers=[0, 2])
    seen = {}

    def metrics(pred):
        seen["predictions"] = pred.predictions
        return {"gen_len": float(np.mean(np.count_nonzero(pred.predictions != PAD, axis=-1)))}

    terms = [{"loss": "hidden_mse", "layers": "uniform", "stack": "encoder"},
             {"loss": "relation_kl", "layers": "last", "stack": "decoder", "relations": ["qk", "vv"]}]
    trainer = trainer_for(tmp_path, student, teacher, distill_terms=terms, predict_with_generate=True,
                          generation_max_length=6, generation_num_beams=1)
    trainer.compute_metrics = metrics
    before = flat_params(student).clone()
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    for key in ("loss_kd", "loss_task", "loss_encoder_hidden", "loss_decoder_relation_qk", "loss_decoder_relation_vv"):
        assert all(np.isfinite(r[key]) for r in logged), key
    assert not torch.equal(before, flat_params(student))

    result = trainer.evaluate(max_length=6, num_beams=1)
    assert "eval_gen_len" in result and np.isfinite(result["eval_loss"])
    eval_rows = rows(8, seed=1)
    batch = DataCollatorForSeq2Seq(tokenizer(), model=student)([eval_rows[i] for i in range(4)])
    with torch.no_grad():
        own = student.eval().generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                      max_length=6, num_beams=1)
    np.testing.assert_array_equal(seen["predictions"][:4, : own.shape[1]], own.numpy())
    predicted = trainer.predict(eval_rows, max_length=6, num_beams=1)
    np.testing.assert_array_equal(predicted.predictions, seen["predictions"])


def test_eval_with_teacher_reports_the_distillation_loss_when_generating(tmp_path):
    """With predict_with_generate, Seq2SeqTrainer's eval_loss is the student's cross-entropy; eval_with_teacher=True
    makes it the distillation loss, as in evaluation without generation."""
    teacher = sharpen(t5(seed=1))
    student = students.from_teacher(teacher, decoder_layers=[0, 2])
    results = {}
    for generate in (False, True):
        trainer = trainer_for(tmp_path / str(generate), student, teacher, eval_with_teacher=True,
                              predict_with_generate=generate, generation_max_length=5)
        results[generate] = trainer.evaluate()["eval_loss"]
    plain = trainer_for(tmp_path / "plain", student, teacher, predict_with_generate=True, generation_max_length=5)
    assert results[True] == pytest.approx(results[False], rel=1e-5)
    assert plain.evaluate()["eval_loss"] != pytest.approx(results[True], rel=1e-3)


def test_rows_without_labels_when_generating(tmp_path):
    """predict_with_generate on rows without labels: with decoder_input_ids, eval_with_teacher's loss is the
    distillation loss over them, as without generation (Seq2SeqTrainer reported none); with neither
    (DataCollatorForSeq2Seq's labels=None), the student's generations and no loss, not Seq2SeqTrainer's failing
    forward (transformers#19714)."""
    teacher, student = sharpen(t5(seed=1)), t5(decoder=2, seed=0)
    trainer = trainer_for(tmp_path, student, teacher, eval_with_teacher=True, task_weight=0.0, generation_max_length=9)
    targets = rows(4, seed=1)
    primed = targets.map(lambda r: {"decoder_input_ids": ([PAD, *r["labels"]] + [PAD] * 6)[:6]})
    primed = primed.remove_columns(["labels"])
    batch = trainer.data_collator(list(primed))
    expected = kd_by_hand(student.eval(), teacher, dict(batch, labels=torch.zeros_like(batch["decoder_input_ids"])))
    for generate in (False, True):
        trainer.args.predict_with_generate = generate
        assert trainer.predict(primed).metrics["test_loss"] == pytest.approx(expected, rel=1e-5), generate
    out = trainer.predict(targets.remove_columns(["labels"]))
    assert "test_loss" not in out.metrics and out.label_ids is None
    with torch.no_grad():
        own = student.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_length=9)
    np.testing.assert_array_equal(out.predictions[:, : own.shape[1]], own.numpy())


@pytest.mark.slow
def test_checkpoint_and_exact_resume_with_stack_projections(tmp_path):
    """A narrower student (per-layer projections keyed by stack) stopped at a checkpoint and resumed by a fresh
    trainer ends on the same weights and projections as the uninterrupted run."""
    teacher = sharpen(t5(seed=1))
    terms = [{"loss": "hidden_mse", "layers": "last", "stack": "encoder"},
             {"loss": "hidden_mse", "layers": "uniform", "stack": "decoder"}]

    def run(out, **kw):
        student = students.shrink(teacher, num_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                  seed=3)
        trainer = trainer_for(out, student, teacher, max_steps=4, save_strategy="steps", save_steps=2,
                              distill_terms=terms, projection="per_layer", **kw)
        return trainer

    full = run(tmp_path / "full")
    assert sorted(full.intermediate.projections.maps) == [
        "layer_decoder_0", "layer_decoder_1", "layer_decoder_2", "layer_encoder_2"]
    full.train()
    resumed = run(tmp_path / "full")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-2"))
    torch.testing.assert_close(flat_params(resumed.model), flat_params(full.model), atol=1e-6, rtol=0)
    torch.testing.assert_close(flat_params(resumed.intermediate.projections),
                               flat_params(full.intermediate.projections), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- students


@pytest.mark.parametrize("family", ["t5", "bart", "marian"])
@pytest.mark.parametrize("kept", [dict(decoder_layers=[0, 2]), dict(decoder_layers=[1, 3], encoder_layers=[1])])
def test_distilbart_student_copies_the_kept_layers_bit_exactly(family, kept):
    teacher = BUILDERS[family](encoder=2, decoder=4, seed=1)
    student = students.from_teacher(teacher, **kept)
    enc = kept.get("encoder_layers", [0, 1])
    dec = kept["decoder_layers"]
    t_state, s_state = teacher.state_dict(), student.state_dict()
    block = "block" if family == "t5" else "layers"
    prefix = "" if family == "t5" else "model."
    mapped = {}
    for key in s_state:
        new = key
        for stack, kept_layers in (("encoder", enc), ("decoder", dec)):
            head = f"{prefix}{stack}.{block}."
            if key.startswith(head):
                index, _, rest = key[len(head):].partition(".")
                new = f"{head}{kept_layers[int(index)]}.{rest}"
                if "relative_attention_bias" in rest:  # T5: the stack's bias lives in its first block
                    new = f"{head}0.{rest}"
        mapped[key] = new
    assert set(mapped.values()) <= set(t_state)
    for key, source in mapped.items():
        assert torch.equal(s_state[key], t_state[source]), key
    assert len([k for k in s_state if f"decoder.{block}." in k]) < len([k for k in t_state if f"decoder.{block}." in k])
    cfg = student.config
    layers_field = {"t5": ("num_layers", "num_decoder_layers")}.get(family, ("encoder_layers", "decoder_layers"))
    assert (getattr(cfg, layers_field[0]), getattr(cfg, layers_field[1])) == (len(enc), len(dec))
    assert cfg.distillation["teacher_decoder_layers"] == dec and cfg.distillation["teacher_encoder_layers"] == enc
    # the student runs and generates like any model of its class
    batch = DataCollatorForSeq2Seq(tokenizer(), model=student)([rows()[i] for i in range(2)])
    assert student(**batch).loss.isfinite()


def test_shrink_gives_both_stacks_the_sizes():
    student = students.shrink(bart(encoder=2, decoder=4), num_layers=1, hidden_size=16, num_attention_heads=2,
                              intermediate_size=24)
    cfg = student.config
    assert (cfg.encoder_layers, cfg.decoder_layers, cfg.decoder_attention_heads, cfg.decoder_ffn_dim) == (1, 1, 2, 24)
    assert len(student.model.decoder.layers) == 1


# ---------------------------------------------------------------------------------------------- arguments


def test_hf_argument_parser_reads_seq2seq_and_distillation_flags(tmp_path):
    (parsed,) = HfArgumentParser(DistillationSeq2SeqArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--predict_with_generate", "--generation_num_beams", "2", "--temperature",
         "3", "--distill_terms", "loss=hidden_mse,layers=last,stack=decoder"])
    assert parsed.predict_with_generate and parsed.generation_num_beams == 2 and parsed.temperature == 3.0
    assert parsed.distill_terms == [{"loss": "hidden_mse", "layers": "last", "weight": 1.0,
                                     "name": "decoder_hidden", "stack": "decoder"}]


def test_seq2seq_training_arguments_are_upgraded_with_every_field(tmp_path):
    teacher = t5(seed=1)
    plain = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=7,
                                     use_cpu=True, report_to=[])
    trainer = DistillationSeq2SeqTrainer(model=students.from_teacher(teacher, decoder_layers=[0]),
                                         teacher_model=teacher, args=plain)
    assert isinstance(trainer.args, DistillationSeq2SeqArguments)
    assert trainer.args.predict_with_generate and trainer.args.generation_max_length == 7


# ---------------------------------------------------------------------------------------------- refusals


def test_a_term_on_an_encoder_decoder_must_name_its_stack(tmp_path):
    teacher = t5(seed=1)
    with pytest.raises(ValueError, match="stack=encoder or stack=decoder"):
        trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0, 2]), teacher,
                    distill_terms=[{"loss": "hidden_mse", "layers": "last"}])


def test_a_stack_on_an_encoder_only_model_is_refused(tmp_path):
    from helpers import args

    with pytest.raises(ValueError, match="is not one"):
        DistillationTrainer(model=bert(layers=2), teacher_model=bert(layers=4, seed=1),
                            args=args(tmp_path, distill_terms=[{"loss": "hidden_mse", "stack": "encoder"}]))


def test_an_unknown_stack_is_refused(tmp_path):
    with pytest.raises(ValueError, match="stack='middle' is unknown"):
        seq2seq_args(tmp_path, distill_terms=[{"loss": "hidden_mse", "stack": "middle"}])


def test_attention_scores_of_t5_are_refused(tmp_path):
    """T5 adds a relative position bias and does not scale its scores: they cannot be rebuilt from Q and K."""
    teacher = t5(seed=1)
    with pytest.raises(ValueError, match="relative position bias"):
        trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0, 2]), teacher,
                    distill_terms=[{"loss": "attention_score_mse", "layers": "last", "stack": "decoder"}])


def test_a_decoder_only_teacher_for_a_seq2seq_student_is_refused(tmp_path):
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=64))
    with pytest.raises(ValueError, match="between two encoder-decoder LMs"):
        trainer_for(tmp_path, t5(), llama)


def test_different_decoder_start_tokens_are_refused(tmp_path):
    teacher = bart(seed=1)
    student = students.from_teacher(teacher, decoder_layers=[0])
    student.config.decoder_start_token_id = PAD
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        trainer_for(tmp_path, student, teacher)


def test_from_teacher_names_the_stacks(tmp_path):
    teacher = t5()
    with pytest.raises(ValueError, match="decoder_layers=\\[...\\] and/or encoder_layers"):
        students.from_teacher(teacher, [0, 1])
    with pytest.raises(ValueError, match="decoder_layers=\\[...\\] and/or encoder_layers"):
        students.from_teacher(teacher)
    with pytest.raises(ValueError, match="decoder_layers: layers \\[0, 7\\] has out-of-range index 7"):
        students.from_teacher(teacher, decoder_layers=[0, 7])
    # the stack named and its own count (3 encoder / 4 decoder layers), not "4 encoder layers"
    with pytest.raises(ValueError, match=r"decoder_layers: .*index 5: the teacher has 4 decoder layers, .*0\.\.3"):
        students.from_teacher(t5(encoder=3, decoder=4), decoder_layers=[5])
    with pytest.raises(ValueError, match=r"encoder_layers: .*index 3: the teacher has 3 encoder layers, .*0\.\.2"):
        students.from_teacher(t5(encoder=3, decoder=4), encoder_layers=[3])
    with pytest.raises(ValueError, match="encoder-decoder models"):
        students.from_teacher(bert(layers=2), decoder_layers=[0])
    with pytest.raises(ValueError, match="two layer stacks"):
        students.prune_depth(teacher, 1, [])


def test_cached_teacher_columns_are_refused_for_seq2seq_students(tmp_path):
    data = rows(4).add_column("teacher_logits", [[0.0] * VOCAB] * 4)
    teacher = t5(seed=1)
    with pytest.raises(ValueError, match="does not cache encoder-decoder teachers"):
        trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0]), teacher, data=data)


def test_batch_counts_of_an_encoder_decoder_batch_count_the_decoder():
    """KD and decoder-stack terms count decoder positions (labels != -100, or a decoder_attention_mask), not the
    encoder's attention mask."""
    from hf_distill.losses.normalise import COUNT_KINDS, batch_counts

    batch = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
        "labels": torch.tensor([[4, 5, 6], [7, -100, -100]]),
    }
    counts = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", "attention", False, True).tolist(), strict=True))
    assert (counts["tokens"], counts["labels"], counts["kd"]) == (7, 4, 4)
    assert (counts["decoder_tokens"], counts["decoder_causal_pairs"]) == (4, 6 + 1)
    batch["decoder_attention_mask"] = torch.tensor([[1, 1, 1], [1, 1, 0]])
    counts = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", "attention", False, True).tolist(), strict=True))
    assert (counts["kd"], counts["decoder_tokens"], counts["labels"]) == (5, 5, 4)
    counts = dict(zip(COUNT_KINDS, batch_counts(batch, "labels", "labels", False, True).tolist(), strict=True))
    assert counts["kd"] == 4


# ----------------------------------------------------------------------------------------------- the model card


def _card_sections(card: str) -> tuple[dict, str]:
    import yaml

    meta = yaml.safe_load(card.split("---\n", 2)[1])
    code = card.split("## How to use", 1)[1].split("```python\n", 1)[1].split("\n```", 1)[0]
    return meta, code


def _table(card: str, header: str) -> dict[str, list[str]]:
    """The markdown table whose header row starts with `header`, as {first cell: the other cells}."""
    lines = card.split(header, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}


@pytest.mark.slow
@pytest.mark.parametrize(("family", "token_mask"), [("t5", "labels"), ("marian", "attention")])
def test_seq2seq_card_shows_both_stacks_the_seq2seq_task_and_the_decoder_tokens(tmp_path, monkeypatch, family,
                                                                                 token_mask):
    """The card of a T5 (num_layers / num_decoder_layers) or Marian (encoder_layers / decoder_layers) student
    whose decoder went 4 -> 2: both depths, text2text-generation, which decoder tokens were distilled, and a
    "How to use" that loads the LM head and generates, run as written on the saved student. The same from the
    saved folder alone."""
    teacher = sharpen(BUILDERS[family](seed=1))
    trainer = trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0, 2]), teacher, max_steps=1,
                          kd_token_mask=token_mask)
    trainer.train()
    trainer.create_model_card()
    folder = tmp_path / "out"
    first = (folder / "README.md").read_text()
    trainer.save_model()
    trainer.save_state()
    (folder / "distillation_report.json").unlink()  # what the trainer measured: the folder alone must say the same
    from hf_distill.publish.card import write_model_card

    tokens = {
        "labels": "- **Distilled tokens**: target tokens only: decoder positions whose label is not -100 "
                  "(`kd_token_mask=labels`)",
        "attention": "- **Distilled tokens**: every real target token: decoder positions with decoder_attention_mask"
                     " = 1, or whose label is not -100 when the batch has no decoder_attention_mask "
                     "(`kd_token_mask=attention`)",
    }[token_mask]
    arch = type(teacher).__name__
    for card in (first, write_model_card(folder).read_text()):
        meta, code = _card_sections(card)
        assert meta["pipeline_tag"] == "text2text-generation"
        assert f"This model is a `{arch}` (2 encoder and 2 decoder layers) distilled" in card
        assert f"- **Student**: {arch}, 2 encoder layers, 2 decoder layers, hidden size 32" in card
        assert "teacher encoder layers [0, 1] of its 2 and decoder layers [0, 2] of its 4 (0-based)" in card
        shape = _table(card, "| | Teacher | Student |")
        assert shape["Encoder layers"][:2] == ["2", "2"] and shape["Decoder layers"][:2] == ["4", "2"]
        assert "Layers" not in shape
        assert tokens in card
        assert 'AutoModelForSeq2SeqLM.from_pretrained("out")' in code and "AutoModel," not in code
        # The snippet runs as written where the repository is a folder: it loads the LM head and generates.
        monkeypatch.chdir(tmp_path)
        printed = []
        exec(code, {"print": printed.append})  # noqa: S102 - the card's own example
        assert len(printed) == 1 and isinstance(printed[0], list) and len(printed[0]) == 1


@pytest.mark.slow
def test_seq2seq_card_indexes_the_students_evaluation(tmp_path):
    """A seq2seq student's evaluation metric is in the card's model index (transformers' own index code knows no
    text2text-generation task), with the value the trainer logged."""
    teacher = sharpen(t5(seed=1))
    trainer = trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0, 2]), teacher, max_steps=1,
                          predict_with_generate=True, generation_max_length=6, generation_num_beams=1)
    trainer.compute_metrics = lambda pred: {"gen_len": float(np.mean(np.count_nonzero(pred.predictions != PAD, -1)))}
    trainer.train()
    evaluated = trainer.evaluate(max_length=6, num_beams=1)
    logged, loss = evaluated["eval_gen_len"], evaluated["eval_loss"]
    trainer.create_model_card(dataset_tags="wmt/wmt16", dataset="WMT16", dataset_args="de-en")
    meta, _ = _card_sections((tmp_path / "out" / "README.md").read_text())
    (result,) = meta["model-index"][0]["results"]
    assert result["task"]["type"] == "text2text-generation"
    assert result["dataset"]["type"] == "wmt/wmt16" and result["dataset"]["config"] == "de-en"
    # every metric is indexed: the evaluation loss and its exp too (issue #39 case 18)
    assert {m["type"]: m["value"] for m in result["metrics"]} == {
        "gen_len": pytest.approx(logged), "loss": pytest.approx(loss), "perplexity": pytest.approx(np.exp(loss))}


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_seq2seq_card_shows_the_evaluation_loss_and_perplexity(tmp_path, smoothing):
    """transformers' run_summarization/run_translation log eval_loss (the student's own loss: the teacher does not
    run in evaluation); the card shows it with the teacher's, and its exp as the perplexity unless the loss is
    label-smoothed (then it is not a perplexity)."""
    teacher = sharpen(t5(seed=1))
    trainer = trainer_for(tmp_path, students.from_teacher(teacher, decoder_layers=[0, 2]), teacher, max_steps=1,
                          label_smoothing_factor=smoothing)
    trainer.train()
    student = trainer.evaluate()["eval_loss"]
    trainer.evaluate_teacher()
    teacher_loss = trainer.teacher_metrics["loss"]
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    metrics = _table(card, "| Metric | Teacher | Student |")
    assert metrics["loss"][:2] == [f"{teacher_loss:.4f}", f"{student:.4f}"]
    if smoothing:
        assert "perplexity" not in metrics and "label-smoothed (0.1)" in card
    else:
        assert metrics["perplexity"][:2] == [f"{np.exp(teacher_loss):.4f}", f"{np.exp(student):.4f}"]
        assert "`loss` is the model's own cross-entropy of the target tokens" in card
