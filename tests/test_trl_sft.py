"""DistillationSFTTrainer (hf_distill.trl): TRL's SFTTrainer data paths with a teacher.

Conversational rows through a chat template, completion- and assistant-only labels (the KD term counts exactly the
tokens SFT's loss counts, against masks built by hand), packing (a packed batch's KD equals the same sequences run
unpacked: neither attention nor KD crosses a sequence boundary, on the chunked loss head and on whole logits), the
refusals, and the ImportError without TRL. Skipped where `trl` is not installed, except that last one.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from helpers import flat_params, llama, loss_components, word_tokenizer

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")

WORDS = [f"w{i}" for i in range(40)]
# A chat template with generation markers (what assistant_only_loss reads): "USER w1 w2 END ASSISTANT w3 END ..."
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}ASSISTANT {% generation %}{{ m['content'] }} END{% endgeneration %} "
    "{% else %}USER {{ m['content'] }} END {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT {% endif %}"
)
# Conversations of two exchanges, 13 to 20 tokens: the first assistant turn is in the prompt of a prompt/completion row.
CONVERSATIONS = [
    [("user", "w1 w2"), ("assistant", "w3 w4 w5"), ("user", "w6"), ("assistant", "w7 w8")],
    [("user", "w9"), ("assistant", "w10"), ("user", "w11 w12 w13"), ("assistant", "w14 w15 w16 w17")],
    [("user", "w18 w19 w20 w21"), ("assistant", "w22"), ("user", "w23 w24"), ("assistant", "w25 w26 w27 w28 w29")],
    [("user", "w30"), ("assistant", "w31 w32"), ("user", "w33"), ("assistant", "w34")],
    [("user", "w35 w36"), ("assistant", "w37 w38 w39"), ("user", "w1 w3 w5 w7"), ("assistant", "w2 w4 w6")],
    [("user", "w8 w9 w10"), ("assistant", "w11"), ("user", "w12"), ("assistant", "w13 w14")],
]


def _tokenizer():
    tok = word_tokenizer(["USER", "ASSISTANT", "END", "dummy", *WORDS])  # "dummy": TRL probes the template with it
    tok.eos_token = "END"
    tok.chat_template = TEMPLATE
    return tok


def _messages(conv):
    return [{"role": r, "content": c} for r, c in conv]


def _rows(kind: str) -> Dataset:
    if kind == "messages":
        return Dataset.from_list([{"messages": _messages(c)} for c in CONVERSATIONS])
    return Dataset.from_list([{"prompt": _messages(c[:-1]), "completion": _messages(c[-1:])} for c in CONVERSATIONS])


def _hand_labels(tok, conv, counted: str) -> tuple[list[int], list[int]]:
    """The ids of a conversation and its labels, built turn by turn from the template's words (not through the
    template): `counted` is "all" (every token), "assistant" (each assistant turn's words and END) or "last" (the
    last turn's, a prompt/completion row's completion)."""
    ids, labels = [], []
    for i, (role, content) in enumerate(conv):
        if role == "assistant":
            head, body = ["ASSISTANT"], [*content.split(), "END"]
        else:
            head, body = ["USER", *content.split(), "END"], []
        counted_body = counted == "all" or (counted == "assistant") or (counted == "last" and i == len(conv) - 1)
        for words, counts in ((head, counted == "all"), (body, counted_body)):
            token_ids = tok.convert_tokens_to_ids(words)
            ids += token_ids
            labels += token_ids if counts else [-100] * len(token_ids)
    return ids, labels


def _config(tmp_path, name: str, **kw):
    from hf_distill import DistillationSFTConfig

    base = dict(output_dir=str(tmp_path / name), max_steps=1, per_device_train_batch_size=8, report_to=[],
                use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False, disable_tqdm=True,
                logging_steps=1, dataloader_num_workers=0, seed=0, kd_loss="kl", kd_weight=1.0, task_weight=1.0,
                learning_rate=1e-3)
    base.update(kw)
    return DistillationSFTConfig(**base)


def _pair(vocab: int):
    return llama(0, vocab=vocab), llama(1, layers=3, vocab=vocab)


def _trainer(tmp_path, name, rows, student, teacher, tok, **kw):
    from hf_distill import DistillationSFTTrainer

    return DistillationSFTTrainer(model=copy.deepcopy(student), teacher_model=copy.deepcopy(teacher),
                                  args=_config(tmp_path, name, **kw), train_dataset=rows, processing_class=tok)


def _reference(student, teacher, batch: dict, counted: torch.Tensor) -> tuple[float, float]:
    """Forward KL (T = 1) and cross-entropy over `counted` (B, T - 1) positions, from both models' whole logits in
    float64; each sequence of a batch is run on its own (one row each, padded rows cut to their length)."""
    kl, ce = [], []
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        ids = batch["input_ids"][i, :n][None]
        with torch.no_grad():
            s = student(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
            t = teacher(input_ids=ids).logits[0, :-1].double().log_softmax(-1)
        keep = counted[i, : n - 1]
        kl.append((t.exp() * (t - s)).sum(-1)[keep])
        labels = batch["labels"][i, 1:n]
        ce.append(F.nll_loss(s, labels.clamp_min(0), reduction="none")[labels != -100])
    return torch.cat(kl).mean().item(), torch.cat(ce).mean().item()


@pytest.mark.slow
@needs_trl
@pytest.mark.parametrize(
    ("kind", "sft", "counted"),
    [
        ("messages", dict(assistant_only_loss=True), "assistant"),
        ("messages", {}, "all"),
        ("prompt_completion", {}, "last"),  # completion_only_loss defaults to True for prompt/completion rows
        ("prompt_completion", dict(completion_only_loss=False), "all"),
    ],
)
def test_kd_counts_the_tokens_sft_loss_counts(tmp_path, kind, sft, counted):
    """Conversational rows through the chat template: SFT's labels equal the hand-built ones, and the KD term and
    the task term are means over exactly those positions (float64 references from whole logits)."""
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    trainer = _trainer(tmp_path, kind, _rows(kind), student, teacher, tok, **sft)
    batch = next(iter(trainer.get_train_dataloader()))
    hand = {}
    for conv in CONVERSATIONS:
        ids, labels = _hand_labels(tok, conv, counted)
        hand[tuple(ids)] = labels
    expected = torch.full_like(batch["labels"], -100)
    for i in range(batch["input_ids"].shape[0]):
        n = int(batch["attention_mask"][i].sum())
        expected[i, :n] = torch.tensor(hand[tuple(batch["input_ids"][i, :n].tolist())])  # KeyError: other tokens
    assert torch.equal(batch["labels"], expected)
    mask = expected[:, 1:] != -100
    real = (batch["attention_mask"][:, :-1] != 0) & (batch["attention_mask"][:, 1:] != 0)
    assert mask.any() and (counted == "all") == torch.equal(mask, real)  # the masks differ where they should
    assert trainer.settings.kd_token_mask == "labels"
    kd, ce = _reference(student, teacher, batch, mask)
    for train in (True, False):  # the chunked loss head (training) and whole logits (evaluation with the teacher)
        trainer.args.eval_with_teacher = not train
        got = loss_components(trainer, batch, train)
        assert got["kd"] == pytest.approx(kd, rel=1e-5, abs=1e-7)
        assert got["task"] == pytest.approx(ce, rel=1e-5, abs=1e-7)
    assert trainer.distiller._student_state(trainer.model).rebuilds  # the training pass did take the loss head


def _one_sequence_per_row(batch: dict) -> dict:
    """A padding-free row (position_ids restarting at 0) as a right-padded batch of its sequences."""
    pos = batch["position_ids"][0]
    starts = [*(pos == 0).nonzero().flatten().tolist(), pos.numel()]
    pieces = [(s, e) for s, e in zip(starts[:-1], starts[1:], strict=True)]
    width = max(e - s for s, e in pieces)
    out = {"input_ids": torch.zeros(len(pieces), width, dtype=torch.long),
           "attention_mask": torch.zeros(len(pieces), width, dtype=torch.long),
           "labels": torch.full((len(pieces), width), -100)}
    for i, (s, e) in enumerate(pieces):
        out["input_ids"][i, : e - s] = batch["input_ids"][0, s:e]
        out["attention_mask"][i, : e - s] = 1
        out["labels"][i, : e - s] = batch["labels"][0, s:e]
    return out


@pytest.mark.slow
@needs_trl
@pytest.mark.parametrize("kd_token_mask", ["labels", "attention"])
@pytest.mark.parametrize("flat", [dict(packing=True, packing_strategy="bfd", max_length=36),
                                  dict(padding_free=True, max_length=None)], ids=["bfd", "padding_free"])
def test_packed_kd_equals_the_sequences_run_unpacked(tmp_path, kd_token_mask, flat):
    """One padding-free row holding every sequence: KD and task terms equal those of the same sequences as a padded
    batch (same counted tokens), on the chunked loss head and on whole logits, so neither the models' attention nor
    the KD term crosses a boundary; the teacher reads the same position_ids."""
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    common = dict(assistant_only_loss=True, kd_token_mask=kd_token_mask, eval_with_teacher=True)
    packed = _trainer(tmp_path, "packed", _rows("messages"), student, teacher, tok, **common, **flat)
    batch = next(iter(packed.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    assert int((batch["position_ids"] == 0).sum()) == len(CONVERSATIONS)  # one row, every conversation in it
    if flat.get("packing"):
        assert 1 < len(packed.train_dataset) < len(CONVERSATIONS)  # bfd packed them into rows of <= 36 tokens
    unpacked = _trainer(tmp_path, "unpacked", _rows("messages"), student, teacher, tok, **common)
    rows = next(iter(unpacked.get_train_dataloader()))
    assert rows["input_ids"].shape[0] == len(CONVERSATIONS)
    for train in (True, False):  # chunked loss head, then whole logits (evaluation with the teacher)
        ours, ref = loss_components(packed, batch, train), loss_components(unpacked, rows, train)
        assert ours["kd"] == pytest.approx(ref["kd"], rel=1e-5, abs=1e-7)
        assert ours["task"] == pytest.approx(ref["task"], rel=1e-5, abs=1e-7)
    # The same sequences cut out of the packed row, run one per row: the reference does not depend on SFT's own
    # unpacked path.
    counted = _one_sequence_per_row(batch)
    mask = counted["labels"][:, 1:] != -100 if kd_token_mask == "labels" else (
        (counted["attention_mask"][:, :-1] != 0) & (counted["attention_mask"][:, 1:] != 0))
    kd, ce = _reference(student, teacher, counted, mask)
    assert ours["kd"] == pytest.approx(kd, rel=1e-5, abs=1e-7)
    assert ours["task"] == pytest.approx(ce, rel=1e-5, abs=1e-7)
    # What makes it true: with a KV cache transformers ignores the packed boundaries (attention crosses), and
    # without position_ids the row is one sequence.
    for broken in ({**batch, "use_cache": True}, {k: v for k, v in batch.items() if k != "position_ids"}):
        assert loss_components(packed, broken, True)["kd"] != pytest.approx(kd, rel=1e-3)


@needs_trl
def test_packed_training_runs_and_logs(tmp_path):
    """A packed run trains (weights move, loss_kd and SFT's num_tokens are logged) and evaluates with
    compute_metrics (Trainer's prediction step on the Distiller's outputs)."""
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    from hf_distill import DistillationSFTTrainer

    args = _config(tmp_path, "run", packing=True, max_length=36, assistant_only_loss=True, max_steps=2,
                   per_device_train_batch_size=2, per_device_eval_batch_size=2, kd_loss="jsd")
    trainer = DistillationSFTTrainer(model=copy.deepcopy(student), teacher_model=teacher, args=args,
                                     train_dataset=_rows("messages"), eval_dataset=_rows("messages"),
                                     processing_class=tok, compute_metrics=lambda p: {"rows": float(len(p.label_ids))})
    trainer.train()
    assert (flat_params(trainer.model) - flat_params(student)).abs().max() > 1e-5
    logged = trainer.state.log_history[0]
    assert {"loss_kd", "loss_task", "num_tokens", "entropy", "mean_token_accuracy"} <= set(logged)
    assert logged["num_tokens"] > 0
    metrics = trainer.evaluate()
    # padding-free: each evaluation batch of 2 packed rows is one flattened row
    assert metrics["eval_rows"] == math.ceil(len(trainer.eval_dataset) / 2) and metrics["eval_loss"] > 0


def _fitted(student, tok, steps: int = 8):
    """The student after a few Adam steps on the conversations: its top token is right on some labels and wrong on
    others, so that `mean_token_accuracy` is neither 0 nor 1 (a random tiny model's is ~0)."""
    student = copy.deepcopy(student).train()
    ids = [torch.tensor(tok.apply_chat_template(_messages(c), tokenize=True, return_dict=True)["input_ids"])
           for c in CONVERSATIONS]
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    for _ in range(steps):
        for row in ids:
            student(input_ids=row[None], labels=row[None]).loss.backward()
        opt.step()
        opt.zero_grad()
    return student.eval()


SFT_METRICS = ("entropy", "mean_token_accuracy", "num_tokens")


def _sft_logs(tmp_path, student, teacher, tok, kind: str, trainer_kw: dict, sft_kw: dict):
    """Two logged steps (learning_rate=0: both trainers see the same weights throughout) and an evaluation of
    DistillationSFTTrainer and of plain trl.SFTTrainer on the same student, rows, batches and seed; with which loss
    path computed each of ours (the Distiller's `student_hook` flag: hidden states through the loss head, or
    logits)."""
    from trl import SFTConfig, SFTTrainer

    from hf_distill import DistillationSFTTrainer

    common = dict(max_steps=2, per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=0.0,
                  **sft_kw)
    ours = DistillationSFTTrainer(model=copy.deepcopy(student), teacher_model=teacher, train_dataset=_rows(kind),
                                  args=_config(tmp_path, "ours", **common, **trainer_kw), eval_dataset=_rows(kind),
                                  processing_class=tok)
    paths, hook = [], ours.distiller.student_hook

    def record(model, outputs, inputs, from_hidden):
        paths.append((model.training, from_hidden))
        if hook is not None:
            hook(model, outputs, inputs, from_hidden)

    ours.distiller.student_hook = record
    theirs = SFTTrainer(model=copy.deepcopy(student), train_dataset=_rows(kind), eval_dataset=_rows(kind),
                        args=SFTConfig(**{f.name: getattr(ours.args, f.name) for f in dataclasses.fields(SFTConfig)
                                          if f.init and f.name not in ("output_dir", "logging_dir")},
                                       output_dir=str(tmp_path / "theirs")),
                        processing_class=tok)
    logs = []
    for trainer in (ours, theirs):
        trainer.train()
        logs.append([*(h for h in trainer.state.log_history if "loss" in h), trainer.evaluate()])
    return logs, paths


@pytest.mark.slow
@needs_trl
@pytest.mark.parametrize(
    ("kind", "trainer_kw", "sft_kw", "head"),
    [
        # the causal-LM loss head, 3 tokens per chunk (the metrics' chunks too), assistant turns only
        ("messages", dict(kd_chunk_size=3), dict(assistant_only_loss=True), True),
        # packed (padding-free) rows: -100 on each sequence's first label, so no metric crosses a boundary
        ("messages", dict(eval_with_teacher=True), dict(assistant_only_loss=True, packing=True, max_length=36), True),
        ("prompt_completion", {}, {}, True),  # the completion only
        ("messages", dict(kd_loss="mse"), dict(assistant_only_loss=True), False),  # mse: whole logits in training
    ],
    ids=["head-assistant", "head-packed", "head-completion", "logits-assistant"],
)
def test_sft_metrics_equal_sft_trainers(tmp_path, kind, trainer_kw, sft_kw, head):
    """SFTTrainer's own metrics, as it logs them in training and evaluation (entropy, mean_token_accuracy,
    num_tokens), equal plain trl.SFTTrainer's on the same student and data: from the hidden states through the
    loss head (chunked) in training where it runs, from the logits otherwise and in evaluation."""
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    (ours, theirs), paths = _sft_logs(tmp_path, _fitted(student, tok), teacher, tok, kind, trainer_kw, sft_kw)
    assert len(ours) == len(theirs) == 3
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        prefix = "eval_" if step == 2 else ""
        for name in SFT_METRICS:
            assert got[prefix + name] == pytest.approx(want[prefix + name], rel=1e-5, abs=1e-6), (step, name)
    accuracies = [log[("eval_" if i == 2 else "") + "mean_token_accuracy"] for i, log in enumerate(ours)]
    assert all(0 < a < 1 for a in accuracies), accuracies  # a metric that can tell right from wrong
    assert ours[1]["num_tokens"] > ours[0]["num_tokens"] > 0 and ours[2]["eval_num_tokens"] == ours[1]["num_tokens"]
    assert {hidden for training, hidden in paths if training} == {head}
    assert {hidden for training, hidden in paths if not training} == {False}


@pytest.mark.slow
@needs_trl
def test_sft_metrics_under_mixed_precision(tmp_path):
    """bf16 autocast (CPU): the loss head's metrics (float32 logits from the bf16 LM head, under the forward's
    autocast) are SFTTrainer's, whose fused head rounds each logit to bf16, within that rounding."""
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    (ours, theirs), paths = _sft_logs(tmp_path, _fitted(student, tok), teacher, tok, "messages", dict(bf16=True),
                                      dict(assistant_only_loss=True))
    assert {hidden for training, hidden in paths if training} == {True}
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        prefix = "eval_" if step == 2 else ""
        assert got[prefix + "entropy"] == pytest.approx(want[prefix + "entropy"], rel=1e-3)
        accuracy = want[prefix + "mean_token_accuracy"]
        assert got[prefix + "mean_token_accuracy"] == pytest.approx(accuracy, abs=0.05)  # one argmax flipped at most
        assert got[prefix + "num_tokens"] == want[prefix + "num_tokens"]


@pytest.mark.slow
@needs_trl
@pytest.mark.parametrize("kd_loss", ["kl", "mse"], ids=["head", "logits"])
def test_moe_student_logs_sft_aux_loss(tmp_path, kd_loss):
    """A Mixture-of-Experts student with a router loss coefficient: SFTTrainer also logs its load-balancing loss
    (`aux_loss`, `eval_aux_loss`); ours equal it, on the loss head and on whole logits."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tok = _tokenizer()
    _, teacher = _pair(len(tok))
    torch.manual_seed(0)
    student = MixtralForCausalLM(MixtralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        max_position_embeddings=64))
    (ours, theirs), paths = _sft_logs(tmp_path, student, teacher, tok, "messages", dict(kd_loss=kd_loss),
                                      dict(assistant_only_loss=True))
    assert {hidden for training, hidden in paths if training} == {kd_loss == "kl"}
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        prefix = "eval_" if step == 2 else ""
        assert want[prefix + "aux_loss"] > 0
        for name in (*SFT_METRICS, "aux_loss"):
            assert got[prefix + name] == pytest.approx(want[prefix + name], rel=1e-5, abs=1e-6), (step, name)


@needs_trl
@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(packing=True, packing_strategy="wrapped", max_length=24), "wrapped"),
        (dict(loss_type="dft"), "loss_type='dft'"),
        (dict(packing=True, max_length=24, distill_terms=["loss=attention_score_mse,layers=last"]),
         "attention_score_mse"),
        (dict(eval_packing=True, eval_with_teacher=True), "eval_packing"),
    ],
)
def test_sft_settings_that_would_lie_are_refused(tmp_path, kw, match):
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    with pytest.raises(ValueError, match=match):
        _trainer(tmp_path, "refused", _rows("messages"), student, teacher, tok, **kw)


@needs_trl
def test_packing_without_a_teacher_is_refused(tmp_path):
    from hf_distill import DistillationSFTTrainer

    tok = _tokenizer()
    with pytest.raises(ValueError, match="packing=True needs teacher_model"):
        DistillationSFTTrainer(model=llama(0, vocab=len(tok)), args=_config(tmp_path, "x", packing=True, max_length=24),
                               train_dataset=_rows("messages"), processing_class=tok)


@needs_trl
def test_arguments_keep_sft_defaults_and_upgrade(tmp_path):
    """DistillationSFTConfig's defaults are SFTConfig's (not TrainingArguments'); an SFTConfig given to the trainer
    is upgraded with every field kept."""
    from trl import SFTConfig

    from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

    ours = DistillationSFTConfig(output_dir=str(tmp_path / "a"), use_cpu=True, report_to=[])
    theirs = SFTConfig(output_dir=str(tmp_path / "a"), use_cpu=True, report_to=[])
    for f in dataclasses.fields(SFTConfig):
        if f.init and f.name not in ("logging_dir",):
            assert getattr(ours, f.name) == getattr(theirs, f.name), f.name
    tok = _tokenizer()
    student, teacher = _pair(len(tok))
    sft = SFTConfig(output_dir=str(tmp_path / "b"), use_cpu=True, report_to=[], bf16=False, max_length=24,
                    packing=True, assistant_only_loss=True, max_steps=1)
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=sft, train_dataset=_rows("messages"),
                                     processing_class=tok)
    assert isinstance(trainer.args, DistillationSFTConfig)
    assert trainer.args.packing and trainer.args.assistant_only_loss and trainer.args.max_length == 24


def test_without_trl_the_import_error_names_the_extra(monkeypatch):
    """hf_distill.trl without TRL installed: an ImportError that says which extra to install."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` now fails as if it were not installed
    monkeypatch.delitem(sys.modules, "hf_distill.trl", raising=False)
    with pytest.raises(ImportError, match=r"hf-distill\[trl\]"):
        importlib.import_module("hf_distill.trl")


def test_distillation_trainer_on_flattened_batches_equals_padded(tmp_path):
    """Without TRL: transformers' DataCollatorWithFlattening (padding-free rows, position_ids, -100 at each
    sequence's first label) gives the padded batch's KD and task terms, in training (loss head) and evaluation."""
    from helpers import args, labelled_collate, sft_rows
    from transformers import DataCollatorWithFlattening

    from hf_distill import Distiller

    student, teacher = llama(0), llama(1, layers=3)
    rows = list(sft_rows(6))
    flat = DataCollatorWithFlattening()(rows)
    assert flat["input_ids"].shape[0] == 1 and int((flat["position_ids"] == 0).sum()) == len(rows)
    padded = labelled_collate(rows)
    for mode in ("labels", "attention"):
        distiller = Distiller(student, args(tmp_path, kd_token_mask=mode, kd_weight=1.0, task_weight=1.0,
                                            eval_with_teacher=True), teacher_model=teacher)
        for train in (True, False):
            student.train(train)
            values = []
            for batch in (flat, padded):
                distiller.tracker.reset()
                with torch.no_grad():
                    total = distiller.compute_loss(student, dict(batch))
                values.append(distiller.tracker.pop_means() if train else {"total": float(total)})
            for key, value in values[0].items():
                assert value == pytest.approx(values[1][key], rel=1e-5, abs=1e-7), (mode, train, key)


@needs_trl
def test_rows_without_labels_are_evaluated_as_distillation_trainer_does(tmp_path):
    """A data_collator that gives no labels: under eval_with_teacher the batch gets its distillation loss (KD over
    the real tokens, as DistillationTrainer's), and a batch the student predicts alone never hands it the cached
    teacher_* columns; the predictions stay the student's logits (SFT's prediction_step went to the Trainer's, which
    reported no loss and passed the columns on)."""
    from hf_distill import DistillationSFTTrainer

    tok = _tokenizer()
    student, teacher = _pair(len(tok))

    def unlabeled(features):
        ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(f["input_ids"]) for f in features], batch_first=True,
                                              padding_value=tok.pad_token_id)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(f["input_ids"]), dtype=torch.long) for f in features],
                                               batch_first=True)
        return {"input_ids": ids, "attention_mask": mask}

    rows = _rows("messages")
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, data_collator=unlabeled, train_dataset=rows,
                                     args=_config(tmp_path, "unlabeled", eval_with_teacher=True, task_weight=0.0,
                                                  per_device_eval_batch_size=len(rows)), processing_class=tok)
    prepared = trainer.train_dataset
    batch = unlabeled(list(prepared))
    out = trainer.predict(prepared)
    real = batch["attention_mask"].bool()
    kl, _ = _reference(student, teacher, dict(batch, labels=batch["input_ids"]), real[:, :-1] & real[:, 1:])
    assert out.metrics["test_loss"] == pytest.approx(kl, rel=1e-4) and kl > 0
    with torch.no_grad():
        logits = student(**batch).logits
    assert torch.allclose(torch.as_tensor(out.predictions), logits, atol=1e-5)
    seen = set()
    student.register_forward_pre_hook(lambda module, a, kw: seen.update(kw), with_kwargs=True)
    trainer.args.eval_with_teacher = False
    cached = prepared.add_column("teacher_logits", [[[0.0] * len(tok)] * len(r) for r in prepared["input_ids"]])
    out = trainer.predict(cached)
    assert seen == {"input_ids", "attention_mask"} and "test_loss" not in out.metrics
    assert torch.allclose(torch.as_tensor(out.predictions), logits, atol=1e-5)
