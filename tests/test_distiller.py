"""The Distiller outside the Trainer: a plain PyTorch loop trains the same weights as DistillationTrainer."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import args, bert, collate, flat_params, labelled_collate, llama, sft_rows, token_dataset
from helpers import teacher as make_teacher

from hf_distill import DistillationTrainer, Distiller


def _loop(student, teacher, run_args, rows, collator, micro_batches: int = 1) -> torch.Tensor:
    """The documented loop (docs/guides/loop.md): AdamW over the student and the distiller's projections, constant
    learning rate, every row in each optimizer step (split into `micro_batches` micro-batches)."""
    distiller = Distiller(student, run_args, teacher_model=teacher)
    params = [*student.parameters(), *distiller.parameters()]
    optimizer = torch.optim.AdamW(params, lr=run_args.learning_rate, weight_decay=0.0)
    rows = list(rows)
    size = len(rows) // micro_batches
    student.train()
    for _ in range(run_args.max_steps):
        batches = [collator(rows[i * size:(i + 1) * size]) for i in range(micro_batches)]
        distiller.start_step(batches)  # token-level means over the whole step, as the Trainer's
        for batch in batches:
            (distiller.compute_loss(student, batch) / micro_batches).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(student)


def _trainer(tmp_path, student, teacher, run_args, rows, collator) -> torch.Tensor:
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=run_args, train_dataset=rows,
                                  data_collator=collator)
    trainer.train()
    return flat_params(trainer.model)


def _args(tmp_path, name, **kw):
    # One optimizer step sees every row (so the Trainer's shuffling changes nothing but summation order), plain
    # AdamW without decay or clipping, constant learning rate: what the loop above does.
    base = dict(max_steps=3, learning_rate=1e-3, optim="adamw_torch", weight_decay=0.0, max_grad_norm=0.0,
                lr_scheduler_type="constant")
    return args(tmp_path / name, **{**base, **kw})


@pytest.mark.slow
def test_plain_loop_trains_the_weights_the_trainer_trains(tmp_path):
    """Logit KD + the task loss + a hidden-state term through a trained projection (student width 16, teacher 32)."""
    student, teacher = bert(layers=2, hidden=16), make_teacher(layers=4)
    terms = dict(distill_terms=["loss=hidden_mse,layers=uniform"], kd_weight=1.0, task_weight=0.5)
    rows = token_dataset(8)
    before = flat_params(student)
    looped = _loop(copy.deepcopy(student), copy.deepcopy(teacher), _args(tmp_path, "loop", **terms), rows, collate)
    trained = _trainer(tmp_path, copy.deepcopy(student), copy.deepcopy(teacher), _args(tmp_path, "trainer", **terms),
                       rows, collate)
    assert (trained - before).abs().max() > 1e-4  # the weights moved
    torch.testing.assert_close(looped, trained, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_plain_loop_with_accumulation_trains_what_the_trainer_trains(tmp_path):
    """A causal LM through the chunked loss head, 2 micro-batches per step: token-level means over the step."""
    student, teacher = llama(seed=0), llama(seed=1)
    rows = sft_rows(8)
    run = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, kd_loss="jsd")
    looped = _loop(copy.deepcopy(student), copy.deepcopy(teacher), _args(tmp_path, "loop", **run), rows,
                   labelled_collate, micro_batches=2)
    trainer = DistillationTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher),
                                  args=_args(tmp_path, "trainer", **run), train_dataset=rows,
                                  data_collator=labelled_collate)
    assert trainer.distiller.paths.chunk is not None  # the loss head path, not whole logits
    trainer.train()
    # The Trainer shuffles rows into micro-batches; per-token means over the whole step do not depend on which
    # micro-batch a row falls in, so only summation order differs.
    torch.testing.assert_close(looped, flat_params(trainer.model), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_distiller_resolves_the_model_it_is_given(tmp_path):
    """The loss runs on the model each call gets, not on the one the Distiller was built with."""
    student, teacher = bert(layers=2), make_teacher(layers=4)
    distiller = Distiller(student, _args(tmp_path, "a"), teacher_model=teacher)
    other = bert(layers=2, seed=5)
    batch = collate(list(token_dataset(4)))
    other.train()
    student.train()
    assert distiller.compute_loss(other, dict(batch)) != distiller.compute_loss(student, dict(batch))
    with pytest.raises(ValueError, match="not the kind of model"):
        distiller.compute_loss(bert(layers=2, labels=3), dict(batch))


def test_distiller_needs_distillation_arguments(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match="DistillationArguments"):
        Distiller(bert(layers=2), TrainingArguments(output_dir=str(tmp_path)), teacher_model=make_teacher())


@pytest.mark.slow
def test_the_mixin_gives_trl_sft_trainer_the_same_distillation(tmp_path):
    """`class DistilSFT(DistillationMixin, SFTTrainer)` with arguments deriving from both configs: SFT's data
    handling (prompt/completion rows, completion-only labels) and DistillationTrainer's loss on its batches."""
    trl = pytest.importorskip("trl")
    from dataclasses import dataclass

    from datasets import Dataset
    from helpers import word_tokenizer

    from hf_distill import DistillationArguments, DistillationMixin

    @dataclass
    class Args(DistillationArguments, trl.SFTConfig):
        pass

    class DistilSFT(DistillationMixin, trl.SFTTrainer):
        pass

    words = [f"w{i}" for i in range(60)]
    tok = word_tokenizer(words)
    tok.eos_token = "<unk>"
    rows = Dataset.from_list([{"prompt": " ".join(words[i:i + 3]), "completion": " " + " ".join(words[i + 3:i + 6])}
                              for i in range(8)])
    common = dict(output_dir=str(tmp_path / "sft"), max_steps=1, per_device_train_batch_size=8, report_to=[],
                  use_cpu=True, save_strategy="no", kd_loss="jsd", disable_tqdm=True, logging_steps=1)
    student, teacher = llama(0, vocab=len(tok)), llama(1, vocab=len(tok))
    sft = DistilSFT(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher), args=Args(**common),
                    train_dataset=rows, processing_class=tok)
    batch = next(iter(sft.get_train_dataloader()))
    prompt_masked = (batch["labels"] == -100) & (batch["attention_mask"] == 1)
    assert prompt_masked.any() and (batch["labels"] != -100).any()  # completion-only labels from SFT's collator
    plain = DistillationTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher),
                                args=args(tmp_path / "plain", kd_loss="jsd"), train_dataset=rows)
    assert sft.settings.kd_token_mask == plain.settings.kd_token_mask == "labels"  # KD on the completion tokens
    sft.model.train()
    plain.model.train()
    keep = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    ours = sft.compute_loss(sft.model, dict(batch))
    torch.testing.assert_close(ours, plain.compute_loss(plain.model, keep), rtol=1e-6, atol=1e-6)
    assert set(sft.tracker.pop_means()) == {"kd", "task"}
    sft.train()
    assert "loss_kd" in sft.state.log_history[0]


class _LoraLikeHead(torch.nn.Module):
    """An LM head that is not a plain nn.Linear (an adapter's wrapper): the loss head cannot read its weight."""

    def __init__(self, inner: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = inner
        self.weight = inner.weight  # what logits_fn's callers would read: still not a plain linear

    def forward(self, x):
        return self.base_layer(x)


def test_fsdp1_computes_causal_lm_logits_whole_fsdp2_takes_the_loss_head(tmp_path, caplog):
    """FSDP1 keeps the LM head as a piece of a flat-parameter shard outside the model's forward: the causal-LM loss
    head is not used there (whole logits, one warning naming the reason and FSDP2), and a kd_chunk_size asking for it
    is refused. FSDP2 takes the loss head (the heads' weights whole once per step, kd_paths.engine_heads; run on 2
    processes in tests/test_engines.py), unless an LM head is not a plain nn.Linear (refused, with the reason)."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    student = llama(seed=0)
    distiller = Distiller(student, args(tmp_path, kd_loss="jsd"), teacher_model=llama(seed=1))
    assert distiller.paths.chunk_size(student) is not None  # one process: the loss head
    distiller.paths.context.accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False)
    with caplog.at_level("WARNING"):
        assert distiller.paths.chunk_size(student) is None
    assert "computed whole" in caplog.text and "FSDP1" in caplog.text and "fsdp_config={'version': 2}" in caplog.text
    distiller.args.kd_chunk_size = 64
    with pytest.raises(ValueError, match=r"kd_chunk_size=64 cannot be honoured: under FSDP1 the LM head is a piece"):
        distiller.paths.chunk_size(student)
    distiller.paths.context.accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)
    assert distiller.paths.chunk_size(student) == 64  # FSDP2: the loss head
    student.lm_head = _LoraLikeHead(student.lm_head)
    with pytest.raises(ValueError, match=r"under FSDP2 the loss head reads the LM head's weight.*_LoraLikeHead"):
        distiller.paths.chunk_size(student)
    distiller.paths.context.accelerator = SimpleNamespace(distributed_type=DistributedType.DEEPSPEED)
    assert distiller.paths.chunk_size(student) == 64  # ZeRO-3 gathers the head in its own call: the loss head


def test_zero3_with_several_processes_takes_the_loss_head(tmp_path, caplog):
    """Under ZeRO-3 with several processes the loss head runs with each LM head gathered once per step (the student's
    module called once around the whole head: no collective per token chunk, so processes with different chunk
    counts cannot wait for each other; tests/test_engines.py runs it on 2 processes). An LM head that is not a plain
    nn.Linear would be called once per chunk: refused there with the reason; one process keeps the module route."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    def deepspeed(stage, processes):
        config = {"zero_optimization": {"stage": stage}}
        return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, num_processes=processes,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))

    student = llama(seed=0)
    distiller = Distiller(student, args(tmp_path, kd_loss="jsd"), teacher_model=llama(seed=1))
    for stage, processes in ((3, 1), (2, 2), (3, 2)):
        distiller.paths.context.accelerator = deepspeed(stage, processes)
        assert distiller.paths.chunk_size(student) is not None
    distiller.args.kd_chunk_size = 64
    assert distiller.paths.chunk_size(student) == 64
    student.lm_head = _LoraLikeHead(student.lm_head)
    with pytest.raises(ValueError, match=r"under DeepSpeed ZeRO-3 with several processes the loss head reads"):
        distiller.paths.chunk_size(student)
    distiller.paths.context.accelerator = deepspeed(3, 1)
    assert distiller.paths.chunk_size(student) == 64  # one process: the module route, no one to wait for
