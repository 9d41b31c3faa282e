"""Training from a served teacher (hf_distill.serving.source): the server's top-k + tail through the offline signal's
path for vLLM, SGLang and the package's server; the refusals made before training; faults (5xx, garbage, short,
slow, killed mid-run) and an exact resume; prefetch of the next step; on-policy and seq_kd; the API key kept out of
everything written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers import VOCAB, args, flat_params, labelled_collate, llama, sft_rows, word_tokenizer
from served_fakes import fake_sglang, fake_vllm
from transformers import TrainerCallback

from hf_distill import DistillationTrainer, losses
from hf_distill.distiller import Distiller
from hf_distill.losses.normalise import kd_positions
from hf_distill.serving.protocol import MalformedAnswer
from hf_distill.serving.server import ServedModel, ServerThread, build_app
from hf_distill.serving.source import TeacherServerDown
from hf_distill.teacher_sources import SIGNAL

K = 8
FAST = dict(teacher_retries=1, teacher_backoff=0.0, teacher_timeout=5.0)


def _tok(prefix: str = "w"):
    return word_tokenizer([f"{prefix}{i}" for i in range(VOCAB - 2)])


def _app(kind: str, teacher=None, tokenizer=None, **kw):
    teacher, tokenizer = teacher or llama(1), tokenizer or _tok()
    if kind == "hf_distill":
        tokens = kw.pop("max_batch_tokens", 8192)
        return build_app(ServedModel(teacher, tokenizer, "tiny-teacher", max_k=kw.pop("max_k", K), **kw),
                         max_batch_tokens=tokens)
    return fake_vllm(teacher, tokenizer, **kw) if kind == "vllm" else fake_sglang(teacher, tokenizer, **kw)


@pytest.fixture
def server():
    running = []

    def start(kind="hf_distill", **kw):
        running.append(ServerThread(_app(kind, **kw)))
        return running[-1]

    yield start
    for s in running:
        s.stop()


def _run(tmp_path, **kw):
    settings = dict(kd_loss="kl", temperature=1.0, kd_weight=1.0, task_weight=0.0, teacher_top_k=K, **FAST)
    settings.update(kw)
    return args(tmp_path, **settings)


@pytest.mark.parametrize("kind", ["hf_distill", "vllm", "sglang"])
def test_served_teacher_trains_as_the_offline_signal(tmp_path, server, kind):
    """The KD loss equals the exact top-k + tail loss of the same teacher, through the sparse loss head."""
    teacher = llama(1)
    url = server(kind, teacher=teacher).url
    student = llama(0).train()
    distiller = Distiller(student, _run(tmp_path, kd_loss="jsd"), url, processing_class=_tok())
    assert distiller.served[0].client.protocol == kind and distiller.teacher is None
    batch = labelled_collate([sft_rows(4)[i] for i in range(4)])
    got = distiller.compute_loss(student, dict(batch))
    assert distiller._student_cache.paths[(SIGNAL, True)].name == "sparse_head"
    with torch.no_grad():
        z = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    exact = tuple(x[:, :-1] for x in losses.topk_with_tail(z, K, 1.0))
    mask = kd_positions(batch["attention_mask"], batch["labels"], "labels", causal=True)
    s = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    want = losses.logit_kd_loss("jsd", s, exact, 1.0, mask=mask, beta=0.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-4)


def test_a_served_teacher_beside_a_local_one(tmp_path, server):
    url = server().url
    student, local = llama(0).train(), llama(2)
    run = _run(tmp_path, multi_teacher="losses", teacher_weights=[0.5, 0.5])
    distiller = Distiller(student, run, [url, local], processing_class=_tok())
    batch = labelled_collate([sft_rows(2)[i] for i in range(2)])
    both = distiller.compute_loss(student, dict(batch))
    plain = args(tmp_path, kd_loss="kl", temperature=1.0, kd_weight=1.0, task_weight=0.0)  # no served fields
    alone = [Distiller(student, run, t, processing_class=_tok()).compute_loss(student, dict(batch))
             for t, run in ((url, _run(tmp_path)), (local, plain))]
    assert both.item() == pytest.approx(0.5 * alone[0].item() + 0.5 * alone[1].item(), rel=1e-4)


@pytest.mark.parametrize("case, kind, words", [
    ("vocabulary", "hf_distill", "vocabulary differs from the student's"),
    ("vocabulary", "vllm", "tokenizes a probe text into other ids"),
    ("k", "hf_distill", "restart the server with --k 16"),
    ("k", "vllm", "--max-logprobs 16"),
    ("temperature", "hf_distill", "applies temperature 2.0 .* DistillationArguments\\(temperature=2.0\\)"),
    ("temperature", "vllm", "raw model's log-probabilities .* set temperature=1.0"),
    ("unreachable", "hf_distill", "is unreachable .*start the server, or fix the URL"),
])
def test_refusals_before_training_name_the_fix(tmp_path, server, case, kind, words):
    kw, run = {}, {}
    if case == "vocabulary":
        kw["tokenizer"] = _tok("v")
    if case == "k":
        run["teacher_top_k"] = 16
        kw.update(max_k=8) if kind == "hf_distill" else kw.update(max_logprobs=8)
    if case == "temperature":
        kw.update(temperature=2.0) if kind == "hf_distill" else run.update(temperature=2.0)
    if case == "unreachable":
        s = server()
        url = s.url
        s.stop()
    else:
        url = server(kind, **kw).url
    with pytest.raises(ValueError, match=words) as err:
        Distiller(llama(0), _run(tmp_path, **run), url, processing_class=_tok())
    assert "\n" not in str(err.value)


def test_what_a_served_teacher_cannot_give_is_refused(tmp_path, server):
    with pytest.raises(ValueError, match="teacher_top_k=16, teacher_protocol='vllm' do nothing without"):
        Distiller(llama(0), args(tmp_path, teacher_top_k=16, teacher_protocol="vllm"), llama(1))
    url = server().url
    with pytest.raises(ValueError, match="kd_loss='mse'"):
        Distiller(llama(0), _run(tmp_path, kd_loss="mse"), url, processing_class=_tok())
    with pytest.raises(ValueError, match="multi_teacher='losses'"):
        Distiller(llama(0), _run(tmp_path), [url, llama(2)], processing_class=_tok())


def _trainer(tmp_path, url, rows=None, callbacks=(), **kw):
    run = _run(tmp_path, per_device_train_batch_size=2, optim="sgd", learning_rate=0.5, **kw)
    return DistillationTrainer(model=llama(0), args=run, teacher_model=url, train_dataset=rows or sft_rows(16),
                               data_collator=labelled_collate, processing_class=_tok(), callbacks=list(callbacks))


def test_5xx_answers_are_retried_and_garbage_or_short_answers_stop_training(tmp_path, server):
    fault = {}
    url = server("vllm", fault=fault).url
    batch = labelled_collate([sft_rows(2)[i] for i in range(2)])
    source = Distiller(llama(0), _run(tmp_path, teacher_retries=2), url, processing_class=_tok()).served[0]
    fault["fail_first"] = 2  # two 503s, then answers: within teacher_retries=2
    source.wait([batch])
    assert fault["fail_first"] == 0
    source = Distiller(llama(0), _run(tmp_path), url, processing_class=_tok()).served[0]
    fault["short"] = True  # (a short answer to the set-up's probe is refused there already)
    with pytest.raises(MalformedAnswer, match="short answer"):
        source.wait([batch])
    fault.clear()
    trainer = _trainer(tmp_path / "garbage", url, max_steps=1)
    fault["garbage"] = True
    with pytest.raises(MalformedAnswer, match="not JSON"):
        trainer.train()
    assert trainer.state.global_step == 0  # never a step without its signal


def test_a_slow_server_past_the_time_out_stops_training_naming_no_checkpoint(tmp_path, server):
    fault = {}
    url = server("vllm", fault=fault).url
    trainer = _trainer(tmp_path, url, max_steps=1, teacher_timeout=0.3)
    fault["slow"] = 1.0
    with pytest.raises(TeacherServerDown, match="before optimizer step 1.*no checkpoint was saved yet"):
        trainer.train()
    assert trainer.state.global_step == 0


class _KillAt(TrainerCallback):
    def __init__(self, step, server):
        self.step, self.server = step, server

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            self.server.stop()


@pytest.mark.slow
def test_server_killed_mid_run_then_resume_gives_the_uninterrupted_weights(tmp_path, server):
    """Bitwise, with a server that runs each request alone (max_batch_tokens=1): one that merges concurrent
    requests into one padded forward changes the last bits of the teacher's log-probabilities with what it merged
    (3.7e-9 in the weights here), as any batching server does."""
    teacher = llama(1)
    first = server(teacher=teacher, max_batch_tokens=1)
    common = dict(max_steps=5, gradient_accumulation_steps=2, save_strategy="steps", save_steps=1)
    whole = _trainer(tmp_path / "whole", first.url, **common)
    whole.train()
    second = server(teacher=teacher, max_batch_tokens=1)
    run = _trainer(tmp_path / "cut", second.url, callbacks=[_KillAt(2, second)], **common)
    with pytest.raises(TeacherServerDown) as err:
        run.train()
    found = re.search(r"resume_from_checkpoint='([^']+)'", str(err.value))
    assert found and "which was not trained" in str(err.value)
    checkpoint = found.group(1)
    step = int(checkpoint.rsplit("-", 1)[1])
    assert step >= 2 and run.state.global_step == step  # the step after the checkpoint was not trained
    # restarted on the same port
    again = ServerThread(_app("hf_distill", teacher=teacher, max_batch_tokens=1), port=second.port)
    try:
        resumed = _trainer(tmp_path / "cut", second.url, **common)
        resumed.train(resume_from_checkpoint=checkpoint)
    finally:
        again.stop()
    torch.testing.assert_close(flat_params(resumed.model), flat_params(whole.model), rtol=0, atol=0)


class _Pending(TrainerCallback):
    def __init__(self, source_of):
        self.source_of, self.sizes = source_of, []

    def on_step_end(self, args, state, control, **kw):
        self.sizes.append(len(self.source_of()._pending))


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_next_steps_rows_are_asked_while_this_step_trains(tmp_path, server, prefetch):
    url = server().url
    watch = _Pending(lambda: trainer.distiller.served[0])
    trainer = _trainer(tmp_path, url, max_steps=2, gradient_accumulation_steps=2, teacher_prefetch=prefetch,
                       callbacks=[watch])
    trainer.train()
    # 4 distinct rows a step (2 micro-batches of 2): with prefetch, the next step's are asked already
    assert watch.sizes[0] == (8 if prefetch else 4)


def test_api_key_never_written_or_logged(tmp_path, server, monkeypatch, capfd, caplog):
    secret = "sk-never-written-8c1f"
    monkeypatch.setenv("MY_TEACHER_KEY", secret)
    app = build_app(ServedModel(llama(1), _tok(), "tiny-teacher", max_k=K), api_key=secret)
    s = ServerThread(app)
    try:
        trainer = _trainer(tmp_path, s.url, max_steps=2, teacher_api_key_env="MY_TEACHER_KEY", save_strategy="steps",
                           save_steps=1, logging_steps=1)
        trainer.train()
        trainer.save_model()
        trainer.create_model_card()
        s.stop()
        with pytest.raises(TeacherServerDown) as err:  # an error message does not hold it either
            trainer.distiller.served[0].wait([labelled_collate([sft_rows(1)[0]])])
    finally:
        s.stop()
    assert secret not in str(err.value)
    out = capfd.readouterr()
    assert secret not in out.out + out.err + caplog.text
    files = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret.encode() in p.read_bytes()]
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "tiny-teacher" in card


def _real(batch) -> list[tuple]:
    return [tuple(r[m != 0].tolist()) for r, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)]


@pytest.mark.slow
def test_on_policy_completions_are_scored_and_seq_kd_asks_the_server(tmp_path, server):
    from test_on_policy import _rows, _tokenizer

    from hf_distill.data.prompts import PromptCompletionCollator

    tok, log = _tokenizer(), []
    url = server("vllm", tokenizer=tok, log=log).url
    with pytest.raises(ValueError, match="seq_kd=True asks the teacher server .* which it cannot"):
        Distiller(llama(0), _run(tmp_path, seq_kd=True, max_new_tokens=3), url, processing_class=tok)
    log.clear()
    student, generated = llama(0), []
    trainer = DistillationTrainer(
        model=student, teacher_model=url, processing_class=tok, train_dataset=_rows(8),
        data_collator=PromptCompletionCollator(tok),
        args=_run(tmp_path / "gkd", lmbda=1.0, max_new_tokens=3, max_steps=2, per_device_train_batch_size=4))
    log.clear()  # the set-up's probe
    original = trainer.distiller.compute_loss
    trainer.distiller.compute_loss = lambda model, inputs, **kw: (generated.extend(_real(inputs)),
                                                                   original(model, inputs, **kw))[1]
    trainer.train()
    asked = {tuple(r) for _, _, body in log for r in body["prompt"]}
    assert generated and asked == set(generated)  # the student's completions were scored, nothing else
    # seq_kd: the completions come from the teacher's server (the student never generates)
    ours = server("hf_distill", tokenizer=tok).url
    student = llama(0)
    student.generate = None  # would fail if called
    trainer = DistillationTrainer(
        model=student, teacher_model=ours, processing_class=tok, train_dataset=_rows(8),
        data_collator=PromptCompletionCollator(tok),
        args=_run(tmp_path / "seq", seq_kd=True, max_new_tokens=3, max_steps=1, per_device_train_batch_size=4))
    trainer.train()
    assert trainer.state.global_step == 1 and [r for r in trainer.state.log_history if "loss_kd" in r]
    assert trainer.state.log_history[0]["generated_tokens"] > 0


def test_a_key_the_server_wants_is_refused(tmp_path, server):
    s = ServerThread(build_app(ServedModel(llama(1), _tok(), "tiny", max_k=K), api_key="the-key"))
    try:
        with pytest.raises(ValueError, match="HTTP 401.*set teacher_api_key_env"):
            Distiller(llama(0), _run(tmp_path), s.url, processing_class=_tok())
    finally:
        s.stop()


def test_packed_rows_are_scored_one_sequence_at_a_time(tmp_path, server):
    """Rows packed several to a row (TRL's packing and padding-free rows, DataCollatorWithFlattening: position_ids
    restarting at 0, no attention mask) train as the same rows padded: each sequence is sent alone, and its
    distributions land at its columns (they were refused as one sequence before)."""
    student = llama(0).train()
    rows = [{**r, "labels": r["input_ids"][:1] + r["labels"][1:]} for r in sft_rows(3)]  # first tokens learnt too:
    # the last position of each sequence then counts by its labels, and by its position_ids it does not
    # KD alone: a packed row's task loss counts those boundaries (transformers' loss reads no position_ids)
    distiller = Distiller(student, _run(tmp_path, kd_loss="jsd"), server().url, processing_class=_tok())
    padded = labelled_collate([rows[i] for i in range(3)])
    packed = {"input_ids": torch.tensor([sum((r["input_ids"] for r in rows), [])]),
              "labels": torch.tensor([sum((r["labels"] for r in rows), [])]),
              "position_ids": torch.cat([torch.arange(len(r["input_ids"])) for r in rows])[None]}
    broadcast = dict(padded, position_ids=torch.arange(padded["input_ids"].shape[1])[None])  # (1, T) for every row
    got = [distiller.compute_loss(student, dict(b)).item() for b in (packed, padded, broadcast)]
    assert got[0] == pytest.approx(got[1], rel=1e-5) and got[2] == pytest.approx(got[1], rel=1e-5)


def test_left_padded_rows_whose_first_token_is_learnt_are_refused_naming_the_padding_side(tmp_path, server):
    """DataCollatorForLanguageModeling with padding_side="left" learns each row's first real token from the padding
    before it, a position a served teacher (scoring real tokens alone) has no distribution for."""
    source = Distiller(llama(0), _run(tmp_path), server().url, processing_class=_tok()).served[0]
    batch = labelled_collate([sft_rows(2)[i] for i in range(2)])
    right = source.logits({k: v.clone() for k, v in batch.items()})
    n = batch["attention_mask"].sum(1)
    short = int(n.argmin())
    shift = int(n.max() - n[short])
    assert shift > 0  # the shorter row moves right by its padding
    for key, fill in (("input_ids", 1), ("attention_mask", 0), ("labels", -100)):
        batch[key][short] = torch.cat([torch.full((shift,), fill), batch[key][short, : int(n[short])]])
    batch["labels"][short, shift] = batch["input_ids"][short, shift]  # its first real token learnt
    with pytest.raises(ValueError, match=rf"Row {short} of this batch is left-padded.*padding_side='right'"):
        source.logits(batch)
    batch["labels"][short, shift] = -100
    left = source.logits(batch)  # left padding alone is fine: the same distributions, moved with the tokens
    end = int(n[short]) - 1
    assert torch.equal(left[0][short, shift + 1 : shift + end], right[0][short, 1:end])
    assert torch.equal(left[1][short, shift + 1 : shift + end], right[1][short, 1:end])
