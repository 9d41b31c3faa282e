"""On-policy (GKD, lmbda) and sequence-level (Kim & Rush, seq_kd) distillation of causal LMs."""

from __future__ import annotations

import types

import datasets
import pytest
import torch
import torch.nn.functional as F
from accelerate.utils import DistributedType
from helpers import VOCAB, args, bert, flat_params, labelled_collate, llama, word_tokenizer

from hf_distill import DistillationArguments, DistillationTrainer, losses, on_policy
from hf_distill.data import prompts as data_prompts
from hf_distill.data.prompts import PromptCompletionCollator
from hf_distill.distiller import Distiller
from hf_distill.losses.normalise import kd_positions
from hf_distill.on_policy import PROMPT_IDS, PROMPT_MASK, completion_rows

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% if m['role'] == 'assistant' %}</s> "
            "{% endif %}{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")


def _tokenizer(chat: bool = True):
    """A WordLevel tokenizer of the tiny Llama's VOCAB ids: <unk> <pad> <s> </s> user assistant w0 w1 ..."""
    tok = word_tokenizer(["<s>", "</s>", "user", "assistant", *[f"w{i}" for i in range(VOCAB - 6)]])
    tok.add_special_tokens({"eos_token": "</s>", "bos_token": "<s>"})
    if chat:
        tok.chat_template = TEMPLATE
    return tok


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 6, (n,), generator=g))


def _rows(n: int = 8, seed: int = 0, prompt_len: int | None = None) -> datasets.Dataset:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p = prompt_len or int(torch.randint(2, 6, (1,), generator=g))
        rows.append({"prompt": _words(g, p), "completion": _words(g, int(torch.randint(2, 6, (1,), generator=g)))})
    return datasets.Dataset.from_list(rows)


def _spy(model, calls: list):
    """Record every generate call on this instance: its output, the model's mode and whether autograd was on."""
    original = model.generate

    def generate(*a, **kw):
        out = original(*a, **kw)
        calls.append({"sequences": out.clone(), "training": model.training, "grad": torch.is_grad_enabled(),
                      "prompt": kw["input_ids"].clone()})
        return out

    model.generate = generate
    return model


def _trainer(tmp_path, student, teacher, train, tok=None, **kw):
    tok = tok or _tokenizer()
    settings = {"kd_weight": 1.0, "task_weight": 0.0, "max_steps": 2, "per_device_train_batch_size": 4, **kw}
    return DistillationTrainer(model=student, teacher_model=teacher, args=args(tmp_path, **settings),
                               train_dataset=train, data_collator=PromptCompletionCollator(tok), processing_class=tok)


def _seen_batches(trainer) -> list[dict]:
    """Record a copy of every training batch the distiller's compute_loss gets."""
    seen, original = [], trainer.distiller.compute_loss

    def compute_loss(model, inputs, **kw):
        seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return original(model, inputs, **kw)

    trainer.distiller.compute_loss = compute_loss
    return seen


def _stop_token(student, batch) -> int:
    """A token greedy decoding emits early in the first row, so that completions end at different lengths."""
    out = student.generate(input_ids=batch[PROMPT_IDS], attention_mask=batch[PROMPT_MASK], max_new_tokens=6,
                           do_sample=False, pad_token_id=1, eos_token_id=None)
    return int(out[0, batch[PROMPT_IDS].shape[1] + 1])


# ---------------------------------------------------------------------- who generates


def test_lmbda_1_trains_on_the_students_own_completions(tmp_path):
    student_calls, teacher_calls = [], []
    student, teacher = _spy(llama(0), student_calls), _spy(llama(1), teacher_calls)
    trainer = _trainer(tmp_path, student, teacher, _rows(8), lmbda=1.0, max_new_tokens=4)
    seen = _seen_batches(trainer)
    trainer.train()
    assert len(student_calls) == 2 and not teacher_calls  # one micro-batch per step, both completed by the student
    assert all(not c["training"] and not c["grad"] for c in student_calls)  # eval mode, no autograd
    assert student.training  # back in train mode
    data = PromptCompletionCollator(_tokenizer())(list(_rows(8)))
    for call, batch in zip(student_calls, seen, strict=True):
        generated = call["sequences"][:, call["prompt"].shape[1]:]
        for i in range(batch["input_ids"].shape[0]):
            completion = batch["input_ids"][i][batch["labels"][i] != -100]
            torch.testing.assert_close(completion, generated[i][: len(completion)])
    dataset_completions = {tuple(r[lab != -100].tolist()) for r, lab in zip(data["input_ids"], data["labels"],
                                                                            strict=True)}
    trained = {tuple(b["input_ids"][i][b["labels"][i] != -100].tolist()) for b in seen for i in range(4)}
    assert not trained & dataset_completions
    logged = [r for r in trainer.state.log_history if "generated_tokens" in r]
    assert len(logged) == 2 and all(r["generated_tokens_per_second"] > 0 for r in logged)
    assert [r["generated_tokens"] for r in logged] == [float((b["labels"] != -100).sum()) for b in seen]


def test_seq_kd_completes_with_the_teacher(tmp_path):
    student_calls, teacher_calls = [], []
    student, teacher = _spy(llama(0), student_calls), _spy(llama(1), teacher_calls)
    trainer = _trainer(tmp_path, student, teacher, _rows(8), seq_kd=True, max_new_tokens=3, task_weight=0.5,
                       kd_weight=0.5)
    seen = _seen_batches(trainer)
    trainer.train()
    assert len(teacher_calls) == 2 and not student_calls
    for call, batch in zip(teacher_calls, seen, strict=True):
        generated = call["sequences"][:, call["prompt"].shape[1]:]
        for i in range(4):
            torch.testing.assert_close(batch["labels"][i][batch["labels"][i] != -100], generated[i][:3])


@pytest.mark.slow
def test_lmbda_coin_is_seeded_and_mixes_with_seq_kd(tmp_path):
    student_calls, teacher_calls = [], []
    student, teacher = _spy(llama(0), student_calls), _spy(llama(1), teacher_calls)
    trainer = _trainer(tmp_path, student, teacher, _rows(8), lmbda=0.5, seq_kd=True, max_new_tokens=2, max_steps=6,
                       per_device_train_batch_size=2, generation_temperature=0.7, top_p=0.9)
    trainer.train()
    want = sum(on_policy.coin(0, step, 0) < 0.5 for step in range(6))  # one micro-batch per step
    assert len(student_calls) == want and len(teacher_calls) == 6 - want and 0 < want < 6


def test_sampled_completions_are_a_function_of_seed_step_and_micro_batch(tmp_path):
    """A micro-batch's samples do not depend on the global RNG (which a resumed Trainer restores only after the first
    resumed step has generated) and do not move it (dropout, data order); another step samples otherwise."""
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(4, prompt_len=3)))
    distiller = Distiller(llama(0), args(tmp_path, lmbda=1.0, max_new_tokens=6), llama(1), processing_class=tok)
    student, runs = llama(0), []
    for step, global_seed in ((3, 0), (3, 1), (4, 0)):
        torch.manual_seed(global_seed)
        batches = [dict(batch), dict(batch)]
        distiller.on_policy.prepare(batches, student, step, teachers=[], shared_base=False, accelerator=None,
                                    label_name="labels")
        runs.append([b["input_ids"].tolist() for b in batches])
        after = torch.rand(1)
        torch.manual_seed(global_seed)
        assert torch.equal(after, torch.rand(1))  # generation left the global RNG where it was
    assert runs[0] == runs[1]  # the same step under two global RNG states: the same samples
    assert runs[0][0] != runs[0][1] and runs[0] != runs[2]  # another micro-batch, another step: other samples


def test_lmbda_coin_is_a_function_of_seed_step_and_micro_batch():
    draws = [on_policy.coin(0, step, micro) for step in range(50) for micro in range(4)]
    assert len(set(draws)) == len(draws) and all(0 <= d < 1 for d in draws)
    assert 0.35 < sum(d < 0.5 for d in draws) / len(draws) < 0.65  # 200 draws: a fair coin lands here (p > 0.9999)
    assert draws[:4] == [on_policy.coin(0, 0, m) for m in range(4)]
    assert [on_policy.coin(1, 0, m) for m in range(4)] != draws[:4]


@pytest.mark.slow
def test_resumed_run_draws_the_uninterrupted_runs_coins(tmp_path):
    """0 < lmbda < 1 with gradient accumulation: a run resumed from checkpoint-3 of 6 generates with the same models
    at the same micro-batches as the uninterrupted run (the coin is drawn from the step number, which the checkpoint
    restores), samples the same completions (the Trainer restores its RNG only after the first resumed step's
    batches, so generation was resumed with another RNG state), and ends with the same weights."""
    def tagged(model, who, log):
        original = model.generate

        def generate(*a, **kw):
            out = original(*a, **kw)
            log.append((who, kw["input_ids"].tolist(), out.tolist()))
            return out

        model.generate = generate
        return model

    def run(resume=None):
        log = []
        trainer = _trainer(tmp_path, tagged(llama(0), "student", log), tagged(llama(1), "teacher", log), _rows(24),
                           lmbda=0.5, seq_kd=True, max_new_tokens=2, max_steps=6, per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, generation_temperature=1.0, save_strategy="steps",
                           save_steps=3, learning_rate=1e-2)
        trainer.train(resume_from_checkpoint=resume)
        return log, flat_params(trainer.model)

    full_log, full = run()
    resumed_log, resumed = run(resume=str(tmp_path / "out" / "checkpoint-3"))
    assert len(full_log) == 12 and 0 < sum(who == "student" for who, *_ in full_log) < 12
    assert resumed_log == full_log[6:]  # steps 4-6: the same prompts, completed by the same model, the same samples
    torch.testing.assert_close(resumed, full, atol=1e-6, rtol=0)


@pytest.mark.slow
def test_lmbda_0_is_todays_run(tmp_path):
    """lmbda=0 with the prompt collator: the weights and losses of today's run on the same tokenised rows."""
    rows, tok = _rows(8), _tokenizer()
    collator = PromptCompletionCollator(tok)
    tokenised = datasets.Dataset.from_list(
        [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c in (collator.tokenize(r) for r in rows)])
    calls = []
    on = _trainer(tmp_path / "on", _spy(llama(0), calls), llama(1), rows, lmbda=0.0, task_weight=0.5,
                  kd_weight=0.5)
    on.train()
    today = DistillationTrainer(model=llama(0), teacher_model=llama(1), train_dataset=tokenised,
                                data_collator=labelled_collate, processing_class=tok,
                                args=args(tmp_path / "today", kd_weight=0.5, task_weight=0.5, max_steps=2,
                                          per_device_train_batch_size=4))
    today.train()
    assert not calls and on.distiller.on_policy is None
    assert torch.equal(flat_params(on.model), flat_params(today.model))
    losses = [[r["loss"] for r in t.state.log_history if "loss" in r] for t in (on, today)]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


# ---------------------------------------------------------------------- what the loss covers


def test_loss_covers_exactly_the_generated_completion_tokens(tmp_path):
    tok = _tokenizer()
    student, teacher = llama(0).train(), llama(1)
    batch = PromptCompletionCollator(tok)(list(_rows(3, seed=2)))
    stop = _stop_token(student, batch)
    run = args(tmp_path, lmbda=1.0, generation_temperature=0.0, max_new_tokens=6, stop_token_ids=[stop],
               kd_weight=1.0, task_weight=0.0)
    distiller = Distiller(student, run, teacher, processing_class=tok)
    calls = []
    _spy(student, calls)
    prompts = [batch[PROMPT_IDS][i][batch[PROMPT_MASK][i] != 0].tolist() for i in range(3)]
    distiller.start_step([batch], model=student)
    generated = calls[0]["sequences"][:, calls[0]["prompt"].shape[1]:].tolist()
    kept = []
    for i, row in enumerate(generated):  # by hand: up to and including the first stop token
        c = row[: row.index(stop) + 1] if stop in row else row
        kept.append(c)
        n = len(prompts[i]) + len(c)
        assert batch["input_ids"][i, :n].tolist() == prompts[i] + c
        assert batch["labels"][i].tolist() == [-100] * len(prompts[i]) + c + [-100] * (batch["labels"].shape[1] - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (batch["attention_mask"].shape[1] - n)
    assert len({len(c) for c in kept}) > 1  # the stop token cut the rows at different lengths
    got = distiller.compute_loss(student, batch)
    # KL(teacher || student) at the positions predicting each generated token, and nowhere else
    ids, mask = batch["input_ids"], batch["attention_mask"]
    s = F.log_softmax(student(input_ids=ids, attention_mask=mask).logits[:, :-1].double(), -1)
    with torch.no_grad():
        t = F.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits[:, :-1].double(), -1)
    rows = [(i, len(prompts[i]) - 1 + j) for i in range(3) for j in range(len(kept[i]))]
    want = sum((t[i, p].exp() * (t[i, p] - s[i, p])).sum() for i, p in rows) / len(rows)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_completions_stop_where_the_students_own_generate_stops(tmp_path):
    """An instruct model's generation_config lists several eos ids (end of turn and end of text); the tokenizer names
    one. The model's generation_config is set aside while it generates, so its other ids used to be dropped: the
    completion ran past one of them to max_new_tokens and was trained on. Every id stops it now, the first kept."""
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(2, seed=4, prompt_len=3)))
    student = llama(0)
    stop = _stop_token(student, batch)
    assert stop != tok.eos_token_id
    student.generation_config.eos_token_id = [tok.eos_token_id, stop]
    distiller = Distiller(student, args(tmp_path, lmbda=1.0, max_new_tokens=6, generation_temperature=0.0), llama(1),
                          processing_class=tok)
    assert distiller.on_policy.stop_ids == [tok.eos_token_id, stop]
    batches = [dict(batch)]
    distiller.on_policy.prepare(batches, student, 0, teachers=[], shared_base=False, accelerator=None,
                                label_name="labels")
    completion = batches[0]["labels"][0][batches[0]["labels"][0] != -100].tolist()
    assert completion[-1] == stop and stop not in completion[:-1] and len(completion) < 6


def test_completion_rows_cut_at_the_first_stop_token():
    prompt = torch.tensor([[0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    sequences = torch.cat([prompt, torch.tensor([[10, 3, 11], [12, 13, 14]])], 1)
    rows, n = completion_rows(prompt, mask, sequences, stop_ids=[3], pad_id=0)
    assert n == 5
    assert rows["input_ids"].tolist() == [[5, 6, 10, 3, 0, 0], [7, 8, 9, 12, 13, 14]]
    assert rows["labels"].tolist() == [[-100, -100, 10, 3, -100, -100], [-100, -100, -100, 12, 13, 14]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]
    # a tokenizer whose pad token is its eos: generate pads a stopped row with eos; the first is kept, once
    prompt = torch.tensor([[3, 5, 6], [7, 8, 9]])
    sequences = torch.cat([prompt, torch.tensor([[10, 3, 3, 3], [12, 13, 3, 3]])], 1)
    rows, n = completion_rows(prompt, mask, sequences, stop_ids=[3], pad_id=3)
    assert n == 5 and rows["labels"].tolist() == [[-100, -100, 10, 3, -100, -100], [-100, -100, -100, 12, 13, 3]]
    assert rows["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]


@pytest.mark.slow
def test_accumulated_generated_steps_equal_the_big_batch(tmp_path):
    """Greedy completions of unequal length: GA 2 x 2 rows gives the weights of one batch of 4 (SGD), because the
    step's counts are the generated rows'."""
    rows, tok = _rows(8, seed=4, prompt_len=3), _tokenizer()
    stop = _stop_token(llama(0), PromptCompletionCollator(tok)(list(rows)[:4]))
    runs, calls = [], []
    for name, shape in (("big", dict(per_device_train_batch_size=4)),
                        ("acc", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2))):
        calls.append([])
        trainer = _trainer(tmp_path / name, _spy(llama(0), calls[-1]), llama(1), rows, tok, lmbda=1.0,
                           generation_temperature=0.0, max_new_tokens=5, stop_token_ids=[stop], optim="sgd",
                           learning_rate=0.5, kd_loss="jsd", kd_weight=0.6, task_weight=0.4, **shape)
        seen = _seen_batches(trainer)
        trainer.train()
        runs.append((trainer, seen))
    big = [r.tolist() for c in calls[0] for r in c["sequences"][:, 3:]]
    acc = [r.tolist() for c in calls[1] for r in c["sequences"][:, 3:]]
    assert [r[: r.index(stop) + 1] if stop in r else r for r in big] == \
           [r[: r.index(stop) + 1] if stop in r else r for r in acc]  # the same completions in both runs
    counts = [int((b["labels"] != -100).sum()) for b in runs[1][1]]
    assert counts[0] != counts[1] or counts[2] != counts[3]  # micro-batches of unequal generated counts
    torch.testing.assert_close(flat_params(runs[0][0].model), flat_params(runs[1][0].model), atol=1e-6, rtol=0)
    assert flat_params(runs[0][0].model).ne(flat_params(llama(0))).any()
    # the first step's logged KD is the mean over its generated tokens (not over the dataset's completions)
    first = runs[0][1][0]
    ids, mask = first["input_ids"], first["attention_mask"]
    with torch.no_grad():
        s, t = (m(input_ids=ids, attention_mask=mask).logits[:, :-1] for m in (llama(0), llama(1)))
    want = losses.logit_kd_loss("jsd", s, t, 1.0, mask=kd_positions(mask, first["labels"], "labels", True), beta=0.5)
    logged = [[r["loss_kd"] for r in trainer.state.log_history if "loss_kd" in r] for trainer, _ in runs]
    assert logged[0][0] == pytest.approx(want.item(), rel=1e-5) and logged[0] == pytest.approx(logged[1], rel=1e-5)


# ---------------------------------------------------------------------- PEFT and conversational data


@pytest.mark.slow
def test_peft_student_generates_with_its_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    student = peft.get_peft_model(llama(0), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False))
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(4, seed=6)))
    greedy = dict(input_ids=batch[PROMPT_IDS], attention_mask=batch[PROMPT_MASK], max_new_tokens=5, do_sample=False,
                  pad_token_id=1, eos_token_id=None)
    with_adapters = student.generate(**greedy)
    with student.disable_adapter():
        without = student.generate(**greedy)
    assert not torch.equal(with_adapters, without)  # the adapters change what is generated
    calls = []
    _spy(student, calls)
    trainer = _trainer(tmp_path, student, llama(1), datasets.Dataset.from_list(list(_rows(4, seed=6))), tok,
                       lmbda=1.0, generation_temperature=0.0, max_new_tokens=5, max_steps=1, stop_token_ids=[0])
    trainer.train()
    assert len(calls) == 1
    order = [batch[PROMPT_IDS].tolist().index(r) for r in calls[0]["prompt"].tolist()]  # the sampler shuffles
    assert torch.equal(calls[0]["sequences"], with_adapters[order])
    # self-distillation on the shared base: seq_kd's teacher is the base, so it generates with the adapters off
    calls.clear()
    trainer = _trainer(tmp_path / "self", student, student, datasets.Dataset.from_list(list(_rows(4, seed=6))), tok,
                       seq_kd=True, generation_temperature=0.0, max_new_tokens=5, max_steps=1, stop_token_ids=[0],
                       learning_rate=0.0)
    trainer.train()
    order = [batch[PROMPT_IDS].tolist().index(r) for r in calls[0]["prompt"].tolist()]
    assert len(calls) == 1 and torch.equal(calls[0]["sequences"], without[order])
    assert student.training and any(m.training for m in student.modules())


@pytest.mark.slow
def test_conversational_messages_with_a_chat_template(tmp_path):
    tok = _tokenizer()
    rows = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]},
        {"messages": [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"},
                      {"role": "user", "content": "w7 w8 w9"}, {"role": "assistant", "content": "w10"}]},
    ])
    collator = PromptCompletionCollator(tok)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert collator.tokenize(rows[0]) == (ids("user w1 w2 assistant"), ids("w3 w4 </s>"))
    assert collator.tokenize(rows[1]) == (ids("user w5 assistant w6 </s> user w7 w8 w9 assistant"), ids("w10 </s>"))
    listed = {"prompt": [{"role": "user", "content": "w1 w2"}], "completion": [{"role": "assistant", "content": "w3"}]}
    assert collator.tokenize(listed) == (ids("user w1 w2 assistant"), ids("w3 </s>"))
    calls = []
    trainer = _trainer(tmp_path, _spy(llama(0), calls), llama(1), rows, tok, lmbda=1.0, max_new_tokens=3,
                       max_steps=1, per_device_train_batch_size=2)
    seen = _seen_batches(trainer)
    trainer.train()
    prompts = {tuple(collator.tokenize(r)[0]) for r in rows}
    for i in range(2):  # each trained row: a templated prompt, then the generated completion
        prompt = (seen[0]["attention_mask"][i] == 1) & (seen[0]["labels"][i] == -100)
        assert tuple(seen[0]["input_ids"][i][prompt].tolist()) in prompts
    assert len(calls) == 1 and int((seen[0]["labels"] != -100).sum()) > 0


# ---------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("settings", "match"), [
    (dict(lmbda=1.5), "lmbda must be in"),
    (dict(lmbda=-0.1), "lmbda must be in"),
    (dict(max_new_tokens=8), "max_new_tokens set, but nothing is generated"),
    (dict(generation_temperature=0.7, top_p=0.9), "generation_temperature, top_p set"),
    (dict(stop_token_ids=[2]), "stop_token_ids set"),
    (dict(lmbda=1.0, max_new_tokens=0), "max_new_tokens must be > 0"),
    (dict(lmbda=1.0, generation_temperature=-1.0), "generation_temperature must be >= 0"),
    (dict(lmbda=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(lmbda=1.0, generation_temperature=0.0, top_p=0.9), "greedy"),
    (dict(seq_kd=True, stop_token_ids=[]), "non-empty list"),
    (dict(lmbda=1.0, kd_weight=0.0, task_weight=1.0), "kd_weight=0"),
    (dict(lmbda=1.0, cross_tokenizer="uld"), "cross_tokenizer"),
])
def test_arguments_refuse_meaningless_generation_settings(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        DistillationArguments(output_dir=str(tmp_path), **settings)


def test_distiller_refuses_what_cannot_generate(tmp_path):
    tok = _tokenizer()
    with pytest.raises(ValueError, match="needs a causal-LM student"):
        Distiller(bert(2), args(tmp_path, lmbda=1.0), bert(2, seed=1))
    with pytest.raises(ValueError, match="give teacher_model"):
        Distiller(llama(0), args(tmp_path, seq_kd=True), None, processing_class=tok)
    with pytest.raises(ValueError, match="would distil the prompt tokens too"):
        Distiller(llama(0), args(tmp_path, lmbda=1.0, kd_token_mask="attention"), llama(1), processing_class=tok)
    cached = datasets.Dataset.from_list([{"prompt": "w1", "completion": "w2", "teacher_logits": [[0.0] * VOCAB]}])
    with pytest.raises(ValueError, match="carries cached teacher outputs"):
        Distiller(llama(0), args(tmp_path, lmbda=1.0), llama(1), processing_class=tok, train_dataset=cached)
    fsdp = types.SimpleNamespace(distributed_type=DistributedType.FSDP, device=torch.device("cpu"), num_processes=2)
    with pytest.raises(ValueError, match="under FSDP is not supported"):
        Distiller(llama(0), args(tmp_path, lmbda=0.5), llama(1), processing_class=tok, accelerator=fsdp)
    with pytest.raises(ValueError, match="needs a padding id"):
        Distiller(llama(0), args(tmp_path, lmbda=1.0), llama(1))  # no tokenizer, no pad id in the Llama config
    distiller = Distiller(llama(0), args(tmp_path, lmbda=1.0, max_new_tokens=8), llama(1), processing_class=tok)
    plain = labelled_collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}])
    with pytest.raises(ValueError, match="PromptCompletionCollator"):
        distiller.start_step([plain], model=llama(0))


def test_collator_refuses_rows_it_cannot_read():
    with pytest.raises(ValueError, match="no chat template"):
        PromptCompletionCollator(_tokenizer(chat=False))([{"messages": [{"role": "user", "content": "w1"},
                                                                          {"role": "assistant", "content": "w2"}]}])
    with pytest.raises(ValueError, match="reads `prompt` \\+ `completion`"):
        PromptCompletionCollator(_tokenizer())([{"text": "w1 w2"}])
    with pytest.raises(ValueError, match="both be strings or both be lists"):
        mixed = {"prompt": "w1", "completion": [{"role": "assistant", "content": "w2"}]}
        PromptCompletionCollator(_tokenizer())([mixed])
    with pytest.raises(ValueError, match="leaves no room"):
        PromptCompletionCollator(_tokenizer(), max_length=2)([{"prompt": "w1 w2", "completion": "w3"}])
    tok = _tokenizer()
    tok.pad_token = None
    with pytest.raises(ValueError, match="no pad token"):
        PromptCompletionCollator(tok)


@pytest.mark.slow
def test_trl_sft_trainer_generates_through_the_mixin(tmp_path):
    """`class DistilSFT(DistillationMixin, SFTTrainer)` with this collator (TRL's dataset preparation skipped)."""
    trl = pytest.importorskip("trl")
    import dataclasses

    from hf_distill import DistillationMixin

    @dataclasses.dataclass
    class Args(DistillationArguments, trl.SFTConfig):
        pass

    class DistilSFT(DistillationMixin, trl.SFTTrainer):
        pass

    tok, calls = _tokenizer(), []
    run = Args(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
               save_strategy="no", lmbda=1.0, max_new_tokens=3, kd_weight=1.0, task_weight=0.0, logging_steps=1,
               dataset_kwargs={"skip_prepare_dataset": True})
    trainer = DistilSFT(model=_spy(llama(0), calls), teacher_model=llama(1), args=run, train_dataset=_rows(8),
                        processing_class=tok, data_collator=PromptCompletionCollator(tok))
    trainer.train()
    logged = [r["generated_tokens"] for r in trainer.state.log_history if "generated_tokens" in r]
    assert len(calls) == 2 and len(logged) == 2 and all(n > 0 for n in logged)


@pytest.mark.slow
@pytest.mark.parametrize("given_collator", [False, True], ids=["built", "given"])
def test_distillation_sft_trainer_on_policy_generates_with_the_student(tmp_path, given_collator):
    """DistillationSFTTrainer with lmbda=1 on prompt/completion rows: SFT's dataset preparation is skipped for the
    user (the raw rows reach PromptCompletionCollator, built when none is given), the student completes every
    micro-batch's prompts, it trains on exactly those completions, and the generated tokens are logged."""
    pytest.importorskip("trl")
    from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

    tok, student_calls, teacher_calls = _tokenizer(), [], []
    student, teacher = _spy(llama(0), student_calls), _spy(llama(1), teacher_calls)
    before = flat_params(student).clone()
    run = DistillationSFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                                use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=False,
                                lmbda=1.0, max_new_tokens=3, kd_loss="jsd", kd_weight=1.0, task_weight=0.0,
                                logging_steps=1, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0)
    extra = {"data_collator": PromptCompletionCollator(tok)} if given_collator else {}
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=run, train_dataset=_rows(8),
                                     processing_class=tok, **extra)
    assert run.dataset_kwargs == {"skip_prepare_dataset": True}
    assert sorted(trainer.train_dataset.column_names) == ["completion", "prompt"]  # SFT did not tokenise them
    assert isinstance(trainer.data_collator.base, PromptCompletionCollator)
    seen = _seen_batches(trainer)
    trainer.train()
    assert len(student_calls) == 2 and not teacher_calls
    prompts = {tuple(t for t in call["prompt"][i].tolist() if t != tok.pad_token_id)
               for call in student_calls for i in range(4)}
    assert prompts == {tuple(tok(r["prompt"])["input_ids"]) for r in _rows(8)}  # the rows' own prompts, all of them
    for call, batch in zip(student_calls, seen, strict=True):
        generated = call["sequences"][:, call["prompt"].shape[1]:]
        for i in range(4):
            completion = batch["input_ids"][i][batch["labels"][i] != -100]
            assert 0 < len(completion) <= 3
            torch.testing.assert_close(completion, generated[i][: len(completion)])
    assert (flat_params(trainer.model) - before).abs().max() > 1e-5
    logged = [r["generated_tokens"] for r in trainer.state.log_history if "generated_tokens" in r]
    assert logged == [float((b["labels"] != -100).sum()) for b in seen]


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (dict(packing=True, max_length=32), "no dataset sequences to pack"),
        (dict(padding_free=True, max_length=None), "no dataset sequences to pack"),
        (dict(completion_only_loss=False), "completion_only_loss=False"),
        (dict(assistant_only_loss=True), "assistant_only_loss=True"),
        (dict(dataset_kwargs={"skip_prepare_dataset": False}), "Remove skip_prepare_dataset"),
        ("formatting_func", "formatting_func"),
    ],
)
def test_distillation_sft_trainer_refuses_what_generation_cannot_honour(tmp_path, settings, match):
    pytest.importorskip("trl")
    from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

    tok = _tokenizer()
    kw = {"formatting_func": lambda row: row["prompt"]} if settings == "formatting_func" else {}
    run = DistillationSFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, lmbda=1.0,
                                kd_weight=1.0, task_weight=0.0, **({} if kw else settings))
    with pytest.raises(ValueError, match=match):
        DistillationSFTTrainer(model=llama(0), teacher_model=llama(1), args=run, train_dataset=_rows(8),
                               processing_class=tok, **kw)


def test_generation_ignores_the_models_generation_config(tmp_path):
    """A checkpoint's generation_config.json (repetition_penalty, no_repeat_ngram_size, suppress_tokens, num_beams,
    ...) would change what `generate` produces: the completions are the model's own greedy ones all the same, and
    the model's generation_config is left as it was."""
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(4, seed=2)))
    greedy = dict(input_ids=batch[PROMPT_IDS], attention_mask=batch[PROMPT_MASK], max_new_tokens=5, do_sample=False,
                  pad_token_id=1, eos_token_id=None)
    width = batch[PROMPT_IDS].shape[1]
    plain = llama(0).generate(**greedy)[:, width:]
    student = llama(0)
    config = student.generation_config
    config.suppress_tokens = plain[:, 0].tolist()  # each row's first greedy token
    config.no_repeat_ngram_size, config.repetition_penalty, config.num_beams = 1, 3.0, 2
    assert not torch.equal(student.generate(**greedy)[:, width:], plain)  # the settings do change generate
    run = args(tmp_path, lmbda=1.0, generation_temperature=0.0, max_new_tokens=5, stop_token_ids=[0], kd_weight=1.0,
               task_weight=0.0)
    distiller = Distiller(student, run, llama(1), processing_class=tok)
    distiller.start_step([batch], model=student)
    for i in range(4):
        completion = batch["input_ids"][i][batch["labels"][i] != -100]
        stop = plain[i].tolist().index(0) + 1 if 0 in plain[i].tolist() else 5
        assert completion.tolist() == plain[i, :stop].tolist()
    assert student.generation_config is config and config.suppress_tokens == plain[:, 0].tolist()
    assert config.num_beams == 2 and config.repetition_penalty == 3.0


def test_start_step_refuses_to_skip_generation_silently(tmp_path):
    """Two ways a step would quietly train on the dataset's completions: a plain loop that calls start_step without
    the student (nothing to generate with), and a callback that raises lmbda from 0 after the distiller was built
    (generation was never set up)."""
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(2)))
    distiller = Distiller(llama(0), args(tmp_path, lmbda=1.0, max_new_tokens=8), llama(1), processing_class=tok)
    with pytest.raises(ValueError, match="start_step\\(batches, model=student\\)"):
        distiller.start_step([dict(batch)])
    run = args(tmp_path, lmbda=0.0)
    distiller = Distiller(llama(0), run, llama(1), processing_class=tok)
    distiller.start_step([dict(batch)], model=llama(0))  # off-policy: nothing to generate
    run.lmbda = 0.5  # as a callback would
    with pytest.raises(ValueError, match="lmbda=0.5 was set after"):
        distiller.start_step([dict(batch)], model=llama(0))
    run.lmbda, run.seq_kd = 0.0, True
    with pytest.raises(ValueError, match="seq_kd=True was set after"):
        distiller.start_step([dict(batch)], model=llama(0))


def test_a_training_loss_without_start_step_refuses_to_keep_the_completions(tmp_path):
    """A plain loop that never calls start_step: with lmbda / seq_kd, compute_loss in training would train on the
    dataset's completions (nothing generated them) and quietly ignore lmbda. Refused; evaluation (no generation
    asked) and a step that start_step prepared still compute."""
    tok = _tokenizer()
    batch = PromptCompletionCollator(tok)(list(_rows(2)))
    student = llama(0).train()
    distiller = Distiller(student, args(tmp_path, lmbda=1.0, max_new_tokens=3), llama(1), processing_class=tok)
    with pytest.raises(ValueError, match="start_step\\(batches, model=student\\)"):
        distiller.compute_loss(student, dict(batch))
    prepared = dict(batch)
    distiller.start_step([prepared], model=student)
    assert torch.isfinite(distiller.compute_loss(student, prepared))
    assert torch.isfinite(distiller.compute_loss(student.eval(), dict(batch)))


# ---------------------------------------------------------------------- issue #39: refused before the models run


def _gpt2(positions: int, seed: int = 0):
    """A tiny GPT-2 (learned position embeddings: a row past `positions` is an IndexError inside generate)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=positions, n_embd=32, n_layer=1, n_head=2))


@pytest.fixture
def no_distiller(monkeypatch):
    """The trainer's Distiller (which loads and places the teachers) must not be reached: the refusal comes first."""
    def built(*a, **kw):
        raise AssertionError("the Distiller was built (the teacher loaded) before the refusal")

    monkeypatch.setattr("hf_distill.trainer.Distiller", built)


def test_prompt_plus_max_new_tokens_past_the_models_positions_is_refused_at_set_up(tmp_path, no_distiller):
    """Issue #39, case 4: prompts of 5 tokens + max_new_tokens=12 > 16 positions. It used to build, then fail with
    an IndexError inside generate; now the trainer refuses when built, from the first rows and the configs, naming
    the longest max_new_tokens that fits. A teacher given as a folder is read through its config."""
    rows = _rows(8, prompt_len=5)
    with pytest.raises(ValueError, match=r"prompt of 5 tokens plus max_new_tokens=12 .* student has 16 positions"
                                         r".*set max_new_tokens <= 11"):
        _trainer(tmp_path, _gpt2(16), _gpt2(16, seed=1), rows, lmbda=1.0, max_new_tokens=12)
    folder = tmp_path / "teacher"
    _gpt2(14, seed=1).save_pretrained(folder)
    with pytest.raises(ValueError, match=r"the teacher has 14 positions.*set max_new_tokens <= 9"):
        _trainer(tmp_path, _gpt2(64), str(folder), rows, seq_kd=True, max_new_tokens=12)


def test_a_later_prompt_past_the_positions_is_refused_before_generate(tmp_path):
    """Issue #39, case 4, rows past the first: each generated micro-batch is checked before generate runs (a clear
    refusal instead of an IndexError part-way through generation); the Distiller refuses a max_new_tokens that no
    prompt leaves room for as it is built."""
    tok = _tokenizer()
    with pytest.raises(ValueError, match="max_new_tokens=16 .* student has 16 positions"):
        Distiller(_gpt2(16), args(tmp_path, lmbda=1.0, max_new_tokens=16), _gpt2(16, seed=1), processing_class=tok)
    calls = []
    student = _spy(_gpt2(16), calls)
    distiller = Distiller(student, args(tmp_path, lmbda=1.0, max_new_tokens=8), _gpt2(12, seed=1),
                          processing_class=tok)
    short = PromptCompletionCollator(tok)(list(_rows(2, prompt_len=3)))
    distiller.start_step([short], model=student)  # 4 + 8 <= 12 positions: generated
    long = PromptCompletionCollator(tok)(list(_rows(2, prompt_len=6)))
    with pytest.raises(ValueError, match=r"Step 1, micro-batch 0: a prompt of 6 tokens .* teacher has 12 positions"):
        distiller.start_step([long], model=student)
    assert len(calls) == 1  # the long batch never reached generate


CHAT_OK = {"messages": [{"role": "user", "content": "w3"}, {"role": "assistant", "content": "w4"}]}


@pytest.mark.parametrize(("rows", "collator", "match"), [
    ([{"text": "w1 w2"}] * 4, {}, r"Row 0 has columns \['text'\].*reads `prompt` \+ `completion`"),
    ([CHAT_OK] * 3 + [{"messages": [{"role": "user", "content": "w1"}, {"role": "user", "content": "w2"}]}], {},
     "Row 3: `messages` needs an assistant message"),
    ([{"prompt": "w1", "completion": "w2"}] * 3 + [{"prompt": "w1 w2 w3 w4", "completion": "w5"}],
     {"max_length": 4}, "Row 3: its prompt has 4 tokens, which leaves no room .* Raise max_length"),
], ids=["no_prompt_column", "no_assistant_turn", "max_length_below_a_prompt"])
def test_on_policy_rows_the_collator_cannot_read_are_refused_at_set_up(tmp_path, no_distiller, rows, collator,
                                                                        match):
    """Issue #39, case 10: found from the train set's first rows when the trainer is built, before the teacher
    loads (they used to surface at the first step). Map-style and streamed datasets alike; a streamed one is read
    without being consumed."""
    tok = _tokenizer()
    for data in (datasets.Dataset.from_list(rows), datasets.IterableDataset.from_generator(lambda: iter(rows))):
        with pytest.raises(ValueError, match=f"train_dataset \\(its first 4 rows, read before any model runs\\): "
                                             f"{match}"):
            DistillationTrainer(model=llama(0), teacher_model=llama(1), train_dataset=data, processing_class=tok,
                                args=args(tmp_path, lmbda=1.0, max_new_tokens=4, max_steps=1),
                                data_collator=PromptCompletionCollator(tok, **collator))
    streamed = datasets.IterableDataset.from_generator(lambda: iter([CHAT_OK] * 3))
    assert data_prompts.peek_rows(streamed) == [CHAT_OK] * 3 and list(streamed) == [CHAT_OK] * 3  # not consumed


def test_distillation_sft_trainer_refuses_unreadable_rows_at_set_up(tmp_path, no_distiller):
    """Issue #39, case 10, through DistillationSFTTrainer's own PromptCompletionCollator (built after SFTTrainer's
    set-up): refused when the trainer is built."""
    pytest.importorskip("trl")
    from hf_distill import DistillationSFTConfig, DistillationSFTTrainer

    run = DistillationSFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False, lmbda=1.0,
                                max_new_tokens=4, max_length=None)
    with pytest.raises(ValueError, match=r"train_dataset \(its first 1 rows.*reads `prompt` \+ `completion`"):
        DistillationSFTTrainer(model=llama(0), teacher_model=llama(1), args=run, processing_class=_tokenizer(),
                               train_dataset=datasets.Dataset.from_list([{"text": "w1 w2"}]))


def test_generated_tokens_logs_0_in_windows_without_generation(tmp_path):
    """Issue #39, case 11: with lmbda=0.5 (no seq_kd) the coin keeps the dataset's completions at some steps; those
    logging windows log generated_tokens=0 (it used to be absent), the others the count."""
    trainer = _trainer(tmp_path, llama(0), llama(1), _rows(12), lmbda=0.5, max_new_tokens=2, max_steps=6,
                       per_device_train_batch_size=2)
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    generated = [on_policy.coin(0, step, 0) < 0.5 for step in range(6)]
    assert len(logs) == 6 and 0 < sum(generated) < 6
    for record, did in zip(logs, generated, strict=True):
        assert (record["generated_tokens"] > 0) == did
        assert ("generated_tokens_per_second" in record) == did


def test_readme_on_policy_snippet_trains_on_gkds_loss(tmp_path):
    """Issue #39, case 9: README's snippet (lmbda=0.5, kd_loss="jsd", task_weight=0.0, kd_weight not given) gives
    GKD's loss, the JSD alone at weight 1 (it was 0.5 x JSD); max_new_tokens=4 for the tiny model's 64 positions."""
    tok, student, teacher = _tokenizer(), llama(0).train(), llama(1)
    run = args(tmp_path, lmbda=0.5, kd_loss="jsd", task_weight=0.0, max_new_tokens=4)
    distiller = Distiller(student, run, teacher, processing_class=tok)
    batch = PromptCompletionCollator(tok)(list(_rows(3)))
    distiller.start_step([batch], model=student)
    got = distiller.compute_loss(student, batch)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        s, t = (m(input_ids=ids, attention_mask=mask).logits[:, :-1] for m in (student, teacher))
    want = losses.logit_kd_loss("jsd", s, t, 1.0, mask=kd_positions(mask, batch["labels"], "labels", True), beta=0.5)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
