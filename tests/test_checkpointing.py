"""`gradient_checkpointing` with distillation (hf_distill.features.checkpointing): the non-reentrant kind (transformers'
default) trains exactly as without it, taps and the causal-LM loss head included; the reentrant kind, whose
checkpointed blocks run without gradients in the forward where the taps read, is refused wherever a tap sits inside
one (the term's value would be right and its gradient lost)."""

from __future__ import annotations

import pytest
import torch
from helpers import args, flat_params, labelled_collate, llama, sft_rows

from hf_distill import DistillationTrainer

TERMS = ["loss=hidden_mse,layers=uniform,weight=1", "loss=attention_score_mse,layers=uniform,weight=2"]
REENTRANT = {"use_reentrant": True}


def _trainer(tmp_path, student, terms=TERMS, **kw):
    return DistillationTrainer(
        model=student, teacher_model=llama(1, layers=4), train_dataset=sft_rows(8), data_collator=labelled_collate,
        args=args(tmp_path, max_steps=1, optim="sgd", learning_rate=1.0, distill_terms=terms, **kw),
    )


def _trained(tmp_path, **kw):
    student = llama(0)
    trainer = _trainer(tmp_path, student, **kw)
    trainer.train()
    return flat_params(student), next(r for r in trainer.state.log_history if "loss" in r)


def _gradients(tmp_path, terms, checkpointing=None):
    """One loss and backward on the student as a user's own code would run them, checkpointing turned on by hand."""
    student = llama(0).train()
    if checkpointing is not None:
        student.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    trainer = _trainer(tmp_path, student, terms=terms)
    rows = sft_rows(8)
    trainer.compute_loss(student, labelled_collate([rows[i] for i in range(8)])).backward()
    return torch.cat([p.grad.reshape(-1) for p in student.parameters()])


def test_non_reentrant_checkpointing_trains_as_without_it(tmp_path):
    """Hidden-state and attention-score taps inside the checkpointed blocks, through the causal-LM loss head."""
    plain, plain_log = _trained(tmp_path)
    checkpointed, log = _trained(tmp_path, activation_checkpointing=True,
                                 activation_checkpointing_kwargs={"use_reentrant": False})
    assert {"loss_hidden", "loss_attention"} <= set(log)
    assert log == pytest.approx(plain_log, rel=1e-6)
    torch.testing.assert_close(checkpointed, plain, rtol=0, atol=1e-6)


def test_reentrant_checkpointing_with_taps_in_its_blocks_is_refused_when_the_trainer_is_built(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)use_reentrant.*model\.layers\.0.*use_reentrant': False"):
        _trainer(tmp_path, llama(0), gradient_checkpointing=True, gradient_checkpointing_kwargs=REENTRANT)
    with pytest.raises(ValueError, match="use_reentrant"):  # use_reentrant not given: torch reads it as True
        _trainer(tmp_path, llama(0), gradient_checkpointing=True,
                 gradient_checkpointing_kwargs={"preserve_rng_state": True})


def test_reentrant_checkpointing_turned_on_by_hand_is_refused_at_the_first_loss(tmp_path):
    with pytest.raises(ValueError, match=r"(?s)drop the gradient.*model\.layers\.0"):
        _gradients(tmp_path, TERMS, REENTRANT)


def test_reentrant_checkpointing_without_taps_inside_its_blocks_is_exact(tmp_path):
    """The embeddings' output and the logits leave the checkpointed blocks with their graph: nothing to refuse."""
    terms = ["loss=hidden_mse,layers=0:0,weight=1"]
    torch.testing.assert_close(_gradients(tmp_path, terms, REENTRANT), _gradients(tmp_path, terms), rtol=0, atol=1e-7)


def test_a_first_blocks_input_is_read_before_the_checkpointed_block_runs():
    """T5's hidden state 0 is its first block's input (a pre-hook): outside the checkpointed region, so not refused;
    block outputs inside it are."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_distill.features.checkpointing import check_tapped_checkpointing
    from hf_distill.features.taps import FeatureTaps, TapRequest

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0)).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=REENTRANT)
    for hidden, refused in (({0}, False), ({0, 1}, True)):
        taps = FeatureTaps(model, TapRequest(stacks={"encoder": TapRequest(hidden=hidden)}))
        if refused:
            with pytest.raises(ValueError, match=r"encoder\.block\.0"):
                check_tapped_checkpointing(model, taps.modules())
        else:
            check_tapped_checkpointing(model, taps.modules())


def test_reentrant_checkpointing_turned_on_after_the_first_loss_is_refused(tmp_path):
    """The taps keep the regions around them (the model's structure, found at the first forward) and read whether
    those are checkpointed at every forward: turning it on later is still refused."""
    student = llama(0).train()
    trainer = _trainer(tmp_path, student)
    rows = sft_rows(8)
    batch = labelled_collate([rows[i] for i in range(8)])
    trainer.compute_loss(student, dict(batch))
    student.activation_checkpointing_enable(activation_checkpointing_kwargs=REENTRANT)
    with pytest.raises(ValueError, match=r"(?s)drop the gradient.*model\.layers\.0"):
        trainer.compute_loss(student, dict(batch))
