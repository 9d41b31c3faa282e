"""The Trainer's own model machinery: `model_init` (and `hyperparameter_search`, which uses it) swaps the model in
`train()`, `torch_compile=True` compiles it there. The loss must act on that model, never on the one the trainer
was built with, on every head and path."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import (
    VOCAB,
    args,
    bert,
    bert_config,
    collate,
    flat_params,
    labelled_collate,
    llama,
    qa_collate,
    sft_rows,
    token_dataset,
)
from helpers import teacher as make_teacher
from transformers import BertForQuestionAnswering, BertForTokenClassification, LlamaForCausalLM, TrainerCallback

from hf_distill import DistillationTrainer

TERMS = {"distill_terms": [{"loss": "hidden_mse", "layers": "uniform"}]}


def _token_model(seed, layers=2):
    torch.manual_seed(seed)
    return BertForTokenClassification(bert_config(layers=layers, labels=3))


def _token_rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(4, 11, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": torch.randint(0, 3, (length,), generator=g).tolist()})
    return Dataset.from_list(rows)


def _qa_model(seed, layers=2):
    torch.manual_seed(seed)
    return BertForQuestionAnswering(bert_config(layers=layers))


def _qa_rows(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 13, (1,), generator=g))
        start = int(torch.randint(1, length - 1, (1,), generator=g))
        ids = torch.randint(5, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "start_positions": start, "end_positions": start + 1})
    return Dataset.from_list(rows)


def _lora_llama():
    from peft import LoraConfig, get_peft_model

    return get_peft_model(llama(0), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


# name: (student builder, teacher builder, rows, collator, extra arguments)
PATHS = {
    "sequence": (lambda: bert(2), make_teacher, lambda: token_dataset(8), collate, {}),
    "sequence-one-block": (lambda: bert(1), make_teacher, lambda: token_dataset(8), collate, {}),
    "sequence-terms": (lambda: bert(2, hidden=16), make_teacher, lambda: token_dataset(8), collate, TERMS),
    "token": (lambda: _token_model(0), lambda: _token_model(1, 4), _token_rows, labelled_collate, {}),
    "qa": (lambda: _qa_model(0), lambda: _qa_model(1, 4), _qa_rows, qa_collate, {}),
    "causal-direct": (lambda: llama(0), lambda: llama(1, layers=3), lambda: sft_rows(8), labelled_collate,
                      {"kd_chunk_size": 4}),
    "causal-module": (lambda: llama(0), lambda: llama(1, layers=3), lambda: sft_rows(8), labelled_collate,
                      {"kd_chunk_size": 4, "route": "module"}),
    "causal-whole-terms": (lambda: llama(0), lambda: llama(1, layers=4), lambda: sft_rows(8), labelled_collate,
                           {"kd_token_mask": "labels", **TERMS, "label_smoothing_factor": 0.1}),
    "peft-causal": (_lora_llama, lambda: llama(1), lambda: sft_rows(8), labelled_collate, {"kd_chunk_size": 4}),
}


HEADS = [p for p in PATHS if p != "sequence-one-block"]


def _trainer(tmp_path, path, *, init: bool, evaluate: bool = False, **kw):
    student, teacher, rows, collator, extra = PATHS[path]
    extra = {**extra, **kw}
    # the loss head's module route (the one DeepSpeed and FSDP take) on a CPU trainer
    route = extra.pop("route", None)
    model = {"model_init": student} if init else {"model": student()}
    trainer = DistillationTrainer(
        **model, teacher_model=teacher(),
        args=args(tmp_path, **{"max_steps": 3, "per_device_train_batch_size": 4, "optim": "sgd", "learning_rate": 0.5,
                               **extra}),
        train_dataset=rows(), eval_dataset=rows() if evaluate else None, data_collator=collator,
    )
    if route is not None:
        trainer._loss_head_route = lambda: route
    return trainer


def _losses(trainer) -> dict[str, float]:
    """Every logged loss component of every step, as `{"<step>/<name>": value}`."""
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {f"{r['step']}/{k}": v for r in logs for k, v in r.items() if k.startswith("loss")}


# ---------------------------------------------------------------- model_init


@pytest.mark.parametrize("path", HEADS)
def test_model_init_run_ends_on_the_weights_of_the_model_run(tmp_path, path):
    """Cases 1-2 of issue 28: the LM head never trained under model_init (its logits came from the model the
    trainer was built with), and intermediate terms crashed (taps hooked to that model)."""
    plain = _trainer(tmp_path / "model", path, init=False)
    start = {n: p.detach().clone() for n, p in plain.model.named_parameters() if p.requires_grad}
    plain.train()
    swapped = _trainer(tmp_path / "init", path, init=True)
    built_with = swapped.model
    swapped.train()
    assert swapped.model is not built_with  # the Trainer really trained a fresh model
    torch.testing.assert_close(flat_params(swapped.model), flat_params(plain.model), atol=1e-6, rtol=0)
    trained = dict(swapped.model.named_parameters())
    unchanged = [n for n, p in start.items() if torch.equal(trained[n], p)]
    # the heads and adapters trained (under model_init the LM head used to stay put: its gradient went to a head
    # the loss never used)
    assert not [n for n in unchanged if "lm_head" in n or "classifier" in n or "qa_outputs" in n or "lora" in n]
    assert _losses(swapped) == pytest.approx(_losses(plain), rel=1e-5)
    if swapped.intermediate is not None and swapped.intermediate.projections is not None:
        for a, b in zip(swapped.intermediate.projections.parameters(), plain.intermediate.projections.parameters(),
                        strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class _KeepFinalWeights(TrainerCallback):
    def __init__(self):
        self.runs = []

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.runs.append((args.learning_rate, flat_params(model)))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["sequence-terms", "causal-direct"])
def test_hyperparameter_search_trials_equal_fresh_model_runs(tmp_path, path):
    """Each optuna trial trains a new model from model_init: its weights equal a `model=` run with the trial's
    learning rate (the projections restart with every trial, the taps and LM head follow the new model)."""
    trainer = _trainer(tmp_path / "search", path, init=True, evaluate=True)  # a trial's objective: eval_loss
    keep = _KeepFinalWeights()
    trainer.add_callback(keep)

    def space(trial):
        return {"learning_rate": trial.suggest_float("learning_rate", 0.1, 0.9)}

    best = trainer.hyperparameter_search(hp_space=space, backend="optuna", n_trials=2, direction="minimize")
    assert best is not None and len(keep.runs) == 2
    assert keep.runs[0][0] != keep.runs[1][0]
    for lr, weights in keep.runs:
        plain = _trainer(tmp_path / f"plain-{lr}", path, init=False, learning_rate=lr)
        plain.train()
        torch.testing.assert_close(weights, flat_params(plain.model), atol=1e-6, rtol=0)


def test_model_init_returning_another_shape_is_refused_with_the_reason(tmp_path):
    sizes = iter([16, 32])
    trainer = DistillationTrainer(model_init=lambda: bert(2, hidden=next(sizes)), teacher_model=make_teacher(),
                                  args=args(tmp_path, **TERMS), train_dataset=token_dataset(8), data_collator=collate)
    with pytest.raises(ValueError, match=r"model_init must return students of one architecture"):
        trainer.train()


def test_model_init_returning_another_label_set_is_refused_with_the_reason(tmp_path):
    labels = iter([2, 3])
    trainer = DistillationTrainer(model_init=lambda: bert(2, labels=next(labels)), teacher_model=make_teacher(),
                                  args=args(tmp_path), train_dataset=token_dataset(8), data_collator=collate)
    with pytest.raises(ValueError, match=r"3 labels\) is not the kind of model this trainer was built with"):
        trainer.train()


def test_under_deepspeed_the_projections_move_into_the_student_model_init_builds(tmp_path):
    """DeepSpeed prepares the projections inside the student (`_projections_attached`): a student built by model_init
    in train() must carry them, and neither student keeps them afterwards."""
    from accelerate.utils import DistributedType

    trainer = _trainer(tmp_path, "sequence-terms", init=True)
    proj = trainer.intermediate.projections
    trainer.accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    first = trainer.model
    with trainer._projections_attached():
        assert first.hf_distill_projections is proj
        trainer.model = trainer.call_model_init()  # what Trainer.train() does under model_init
        assert trainer.model.hf_distill_projections is proj
        assert not hasattr(first, "hf_distill_projections")
    assert not hasattr(trainer.model, "hf_distill_projections") and not hasattr(first, "hf_distill_projections")


def test_projections_restart_from_the_seed_with_every_model_init(tmp_path):
    trainer = _trainer(tmp_path, "sequence-terms", init=True)
    start = flat_params(trainer.intermediate.projections)
    trainer.train()
    assert not torch.equal(flat_params(trainer.intermediate.projections), start)  # they trained
    trainer.call_model_init()
    assert torch.equal(flat_params(trainer.intermediate.projections), start)


# ---------------------------------------------------------------- torch_compile


def test_unwrap_sees_through_torch_compile_ddp_style_wrappers_and_peft():
    from hf_distill.features.heads import Head, static_head
    from hf_distill.features.taps import unwrap

    student = bert(2)
    wrapper = torch.nn.Module()
    wrapper.module = torch.compile(student)  # what accelerate prepares: a compiled model, possibly inside DDP
    assert unwrap(torch.compile(student)) is student and unwrap(torch.compile(wrapper)) is student
    assert static_head(torch.compile(student)) is Head.SEQUENCE
    lora = _lora_llama()
    assert unwrap(torch.compile(lora)) is lora.get_base_model()


def _padded(collator, width=12):
    """Every batch padded to `width` tokens, so the compiled graph is traced once (each new length recompiles)."""

    def collate_fixed(features):
        batch = collator(features)
        pad = width - batch["input_ids"].shape[1]
        return {k: F.pad(v, (0, pad), value=-100 if k == "labels" else 0) if v.dim() == 2 else v
                for k, v in batch.items()}

    return collate_fixed


def _compiled_pair(tmp_path, path, init=False, **compile_kw):
    """An eager `model=` run and a compiled one (model_init when `init`), 2 steps on fixed-length batches."""
    runs = []
    for compiled in (False, True):
        trainer = _trainer(tmp_path / str(compiled), path, init=init and compiled, max_steps=2,
                           **({"torch_compile": True, **compile_kw} if compiled else {}))
        trainer.data_collator = type(trainer.data_collator)(_padded(PATHS[path][3]))
        trainer.train()
        runs.append(trainer)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("path", HEADS)
def test_compiled_student_trains_as_the_eager_one(tmp_path, path):
    """Case 3 of issue 28: torch_compile=True (the Trainer compiles the model in train(); its `_orig_mod` is the
    model) crashed in the head lookup. aot_eager traces and differentiates through dynamo and AOTAutograd as
    inductor does, without generating C++ (inductor itself: the next test)."""
    eager, compiled = _compiled_pair(tmp_path, path, torch_compile_backend="aot_eager")
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=1e-4)
    torch.testing.assert_close(flat_params(compiled.model), flat_params(eager.model), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_compiled_classifier_with_inductor_trains_as_the_eager_one(tmp_path):
    """The issue's reproduction: a classifier with torch_compile=True and the default (inductor) backend (a one-block
    student: inductor's C++ build of every kernel takes most of the time)."""
    eager, compiled = _compiled_pair(tmp_path, "sequence-one-block")
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=1e-4)
    torch.testing.assert_close(flat_params(compiled.model), flat_params(eager.model), atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_model_init_and_torch_compile_together(tmp_path):
    """A compiled model from model_init (what a compiled hyperparameter search trains) equals the eager model= run."""
    eager, both = _compiled_pair(tmp_path, "sequence-terms", init=True, torch_compile_backend="aot_eager")
    assert _losses(both) == pytest.approx(_losses(eager), rel=1e-4)
    torch.testing.assert_close(flat_params(both.model), flat_params(eager.model), atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- no model runs at construction (case 16)


def _count_forwards():
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    return calls, handle


def test_building_a_causal_lm_trainer_runs_no_model(tmp_path):
    calls, handle = _count_forwards()
    try:
        trainer = DistillationTrainer(model=llama(0), teacher_model=llama(1), args=args(tmp_path),
                                      train_dataset=sft_rows(4), data_collator=labelled_collate)
    finally:
        handle.remove()
    assert calls == []
    assert trainer.distiller._chunk is not None  # chunking is still chosen, and the logits check runs at the first step


class DoubledLlamaForCausalLM(LlamaForCausalLM):
    """A causal LM whose logits are post-processed in a way hf_distill cannot rebuild from its hidden states."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                              logits_to_keep=logits_to_keep, **kwargs)
        if out.logits is not None:
            out.logits = out.logits * 2
        return out


def _doubled(seed):
    model = llama(seed)
    doubled = DoubledLlamaForCausalLM(model.config)
    doubled.load_state_dict(model.state_dict())
    return doubled


def test_logits_that_cannot_be_rebuilt_are_refused_at_the_first_step_when_chunks_were_asked(tmp_path):
    trainer = DistillationTrainer(model=_doubled(0), teacher_model=llama(1), args=args(tmp_path, kd_chunk_size=4),
                                  train_dataset=sft_rows(4), data_collator=labelled_collate)
    with pytest.raises(ValueError, match=r"The student \(DoubledLlamaForCausalLM\) computes its logits in a way"):
        trainer.train()


@pytest.mark.slow
def test_logits_that_cannot_be_rebuilt_are_computed_whole_by_default(tmp_path, caplog):
    trainer = DistillationTrainer(model=_doubled(0), teacher_model=llama(1), args=args(tmp_path, max_steps=1),
                                  train_dataset=sft_rows(8), data_collator=labelled_collate)
    whole = DistillationTrainer(model=_doubled(0), teacher_model=llama(1), args=args(tmp_path / "w", max_steps=1),
                                train_dataset=sft_rows(8), data_collator=labelled_collate)
    whole.distiller._chunk = None
    caplog.clear()  # decided on the model being trained, at its first step: not when the trainer is built
    with caplog.at_level(logging.WARNING, logger="hf_distill"):
        trainer.train()
    whole.train()
    assert "computed whole" in caplog.text
    assert _losses(trainer) == pytest.approx(_losses(whole), rel=1e-6)
