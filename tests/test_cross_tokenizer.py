"""Cross-tokenizer KD (`cross_tokenizer="uld"` / `"aligned"`): a WordPiece teacher and a BPE student trained here
on WikiText-2 lines, the alignment on hand-made tokenizers, both losses against float64 references written out with
loops, training steps, and gradient accumulation."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from decoder_models import decoder
from helpers import args as make_args
from helpers import bert
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hf_distill import CrossTokenizerCollator, DistillationArguments, DistillationTrainer, Distiller
from hf_distill.data.cross_tokenizer import align_positions
from hf_distill.losses import cross_tokenizer as xt

WIKI = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext2" / "wiki.valid.raw"
if not WIKI.exists():  # a worktree beside the main checkout
    WIKI = Path("/work/shared/data/wikitext2/wiki.valid.raw")


def _lines(n: int, skip: int = 0) -> list[str]:
    rows = [line.strip() for line in WIKI.read_text(encoding="utf-8").splitlines()]
    rows = [r for r in rows if r and not r.startswith("=")]
    return rows[skip: skip + n]


def _fast(tok: Tokenizer, pad: str, unk: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=pad, unk_token=unk)


@pytest.fixture(scope="module")
def tokenizers_pair():
    """(student: BPE of 200 tokens, teacher: WordPiece of 500 tokens), trained on 400 WikiText-2 lines."""
    lines = _lines(400)
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.train_from_iterator(lines, trainers.WordPieceTrainer(vocab_size=500, special_tokens=["[PAD]", "[UNK]"],
                                                                   show_progress=False))
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=200, special_tokens=["<pad>", "<unk>"],
                                                       show_progress=False))
    return _fast(bpe, "<pad>", "<unk>"), _fast(wordpiece, "[PAD]", "[UNK]")


def _models(s_tok, t_tok):
    student = decoder("llama", layers=2, seed=0, vocab_size=len(s_tok), max_position_embeddings=128)
    teacher = decoder("llama", layers=2, seed=1, vocab_size=len(t_tok), max_position_embeddings=128)
    with torch.no_grad():  # a peaked teacher, so its distributions are far from the student's
        teacher.lm_head.weight.mul_(30.0)
    return student, teacher


def _rows(n: int = 4, skip: int = 400) -> list[dict]:
    """Short held-out text rows, one an SFT prompt + completion."""
    texts = [" ".join(line.split()[:12]) for line in _lines(n, skip)]
    rows = [{"text": t, "prompt": None, "completion": None} for t in texts]
    words = texts[0].split()
    rows[0] = {"text": None, "prompt": " ".join(words[:5]) + " ", "completion": " ".join(words[5:])}
    return rows


# ---------------------------------------------------------------------- the alignment


def test_alignment_pairs_prefixes_that_end_at_the_same_character():
    # "unhappy cats": student [un][happy][cats], teacher [unh][appy][cat][s]
    student = [(0, 2), (2, 7), (8, 12)]
    teacher = [(0, 3), (3, 7), (8, 11), (11, 12)]
    assert align_positions(student, teacher) == [-1, 1, 3]
    assert align_positions(teacher, student) == [-1, 1, -1, 2]
    # special tokens (empty spans) end nothing; of two pieces of one character (8, 9) only the last is a boundary
    student = [(0, 0), (0, 2), (2, 7), (8, 9), (8, 9), (9, 12), (0, 0)]
    assert align_positions(student, teacher + [(0, 0)]) == [-1, -1, 1, -1, -1, 3, -1]


def _hand_tokenizer(vocab: list[str], pad: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return _fast(tok, pad, "[UNK]")


def test_the_collator_tokenizes_one_text_twice_and_aligns_it():
    """Hand-made vocabularies (greedy longest match) give tokenizations known in advance."""
    student = _hand_tokenizer(["<pad>", "[UNK]", "un", "##happy", "cats", "sat"], "<pad>")
    teacher = _hand_tokenizer(["[PAD]", "[UNK]", "unh", "##appy", "cat", "##s", "s", "##at"], "[PAD]")
    collate = CrossTokenizerCollator(student, teacher)
    batch = collate([{"text": "unhappy cats"}, {"prompt": "cats ", "completion": "sat"}])
    # row 0: student un|happy|cats, teacher unh|appy|cat|s; row 1: student cats|sat, teacher cat|s|s|at
    assert batch["input_ids"].tolist() == [[2, 3, 4], [4, 5, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[2, 3, 4], [-100, 5, -100]]  # the prompt "cats " is not learnt
    assert batch["teacher_input_ids"].tolist() == [[2, 3, 4, 5], [4, 5, 6, 7]]
    assert batch["teacher_labels"].tolist() == [[2, 3, 4, 5], [-100, -100, 6, 7]]
    assert batch["teacher_positions"].tolist() == [[-1, 1, 3], [1, 3, -1]]
    # what "aligned" distils: student position 1 ("unhappy" read) with teacher 1; in row 1 only the prompt's end
    # (student 0, teacher 1) predicts a completion token on both sides
    rows, s_pos, t_pos = xt.pairs("aligned", batch)
    assert list(zip(rows.tolist(), s_pos.tolist(), t_pos.tolist(), strict=True)) == [(0, 1, 1), (1, 0, 1)]
    # what "uld" distils: the k-th counted position of each side, cut to the shorter (row 0: 2 vs 3, row 1: 1 vs 2)
    rows, s_pos, t_pos = xt.pairs("uld", batch)
    assert list(zip(rows.tolist(), s_pos.tolist(), t_pos.tolist(), strict=True)) == [(0, 0, 0), (0, 1, 1), (1, 0, 1)]
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        collate([{"input_ids": [1, 2]}])


# ---------------------------------------------------------------------- chat rows (issue 39, case 5)

STUDENT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}USER {{ m['content'] }} END "
                    "{% else %}ASSISTANT {{ m['content'] }} END {% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}ASSISTANT {% endif %}")
TEACHER_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}HUMAN {{ m['content'] }}\n"
                    "{% else %}BOT {{ m['content'] }} STOP\n{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}BOT {% endif %}")


def _chat_tokenizers(student_template=STUDENT_TEMPLATE, teacher_template=TEACHER_TEMPLATE):
    student = _hand_tokenizer(["<pad>", "[UNK]", "USER", "ASSISTANT", "END", "un", "##happy", "cats", "sat"], "<pad>")
    teacher = _hand_tokenizer(["[PAD]", "[UNK]", "HUMAN", "BOT", "STOP", "unh", "##appy", "cat", "##s", "s", "##at"],
                              "[PAD]")
    student.chat_template, teacher.chat_template = student_template, teacher_template
    return student, teacher


CHAT = [{"role": "user", "content": "unhappy cats"}, {"role": "assistant", "content": "cats sat"}]


def test_chat_rows_are_rendered_by_each_sides_template_and_aligned_on_the_conversation():
    """`messages` and conversational prompt/completion rows: each side renders its own template
    ("USER unhappy cats END ASSISTANT cats sat END " / "HUMAN unhappy cats\nBOT cats sat STOP\n"), tokenizes it
    without adding special tokens, and labels what SFT counts (every token; the completion). Positions pair where
    both have read the same conversation: inside the contents, and at each turn's header (ASSISTANT / BOT, which
    predict the reply's first token); never the template's other words."""
    student, teacher = _chat_tokenizers()
    collate = CrossTokenizerCollator(student, teacher)
    batch = collate([{"messages": CHAT}, {"prompt": CHAT[:1], "completion": CHAT[1:]}])
    # student: USER un ##happy cats END ASSISTANT cats sat END
    # teacher: HUMAN unh ##appy cat ##s BOT cat ##s s ##at STOP
    s_ids, t_ids = [2, 5, 6, 7, 4, 3, 7, 8, 4], [2, 5, 6, 7, 8, 3, 7, 8, 9, 10, 4]
    assert batch["input_ids"].tolist() == [s_ids, s_ids] and batch["teacher_input_ids"].tolist() == [t_ids, t_ids]
    assert batch["labels"].tolist() == [s_ids, [-100] * 6 + s_ids[6:]]  # the completion after "... ASSISTANT"
    assert batch["teacher_labels"].tolist() == [t_ids, [-100] * 6 + t_ids[6:]]  # after "... BOT"
    assert batch["teacher_positions"].tolist() == [[0, -1, 2, 4, -1, 5, 7, 9, -1]] * 2
    # the completion row distils the reply's three student predictions: its first token (after the headers), "sat"
    # (after "cats" / "cat"+"s") and the turn's end (after "sat" / "s"+"at")
    rows, s_pos, t_pos = xt.pairs("aligned", batch)
    assert [(s, t) for r, s, t in zip(rows.tolist(), s_pos.tolist(), t_pos.tolist(), strict=True) if r == 1] == [
        (5, 5), (6, 7), (7, 9)]


def test_a_chat_template_that_trims_is_followed_and_one_that_rewrites_is_refused():
    trimming = STUDENT_TEMPLATE.replace("m['content'] }}", "m['content'] | trim }}")
    student, teacher = _chat_tokenizers(student_template=trimming)
    padded = [{"role": "user", "content": "  unhappy cats "}, {"role": "assistant", "content": "cats sat"}]
    assert CrossTokenizerCollator(student, teacher)([{"messages": padded}])["teacher_positions"].tolist() == [
        [0, -1, 2, 4, -1, 5, 7, 9, -1]]
    student, teacher = _chat_tokenizers(teacher_template=TEACHER_TEMPLATE.replace("m['content'] }}",
                                                                                  "m['content'] | upper }}"))
    with pytest.raises(ValueError, match="teacher's tokenizer's chat template changes the messages' contents"):
        CrossTokenizerCollator(student, teacher)([{"messages": CHAT}])


def test_assistant_only_loss_learns_each_sides_generation_blocks():
    """SFT's `assistant_only_loss`: each side learns the tokens its own template's {% generation %} blocks cover (the
    reply and its turn end: "cats sat END" / "cat s s at STOP"); text rows and templates without the markers are
    refused in one line naming the fix."""
    marked = [STUDENT_TEMPLATE.replace("ASSISTANT {{ m['content'] }} END ",
                                       "ASSISTANT {% generation %}{{ m['content'] }} END{% endgeneration %} "),
              TEACHER_TEMPLATE.replace("BOT {{ m['content'] }} STOP",
                                       "BOT {% generation %}{{ m['content'] }} STOP{% endgeneration %}")]
    assert marked != [STUDENT_TEMPLATE, TEACHER_TEMPLATE]
    student, teacher = _chat_tokenizers(*marked)
    collate = CrossTokenizerCollator(student, teacher, assistant_only_loss=True)
    batch = collate([{"messages": CHAT}, {"prompt": CHAT[:1], "completion": CHAT[1:]}])
    s_ids, t_ids = [2, 5, 6, 7, 4, 3, 7, 8, 4], [2, 5, 6, 7, 8, 3, 7, 8, 9, 10, 4]
    assert batch["labels"].tolist() == [[-100] * 6 + s_ids[6:]] * 2
    assert batch["teacher_labels"].tolist() == [[-100] * 6 + t_ids[6:]] * 2
    with pytest.raises(ValueError, match="a row is a text row"):
        collate([{"text": "unhappy cats"}])
    student, teacher = _chat_tokenizers(marked[0], TEACHER_TEMPLATE)
    with pytest.raises(ValueError, match=r"the teacher's tokenizer's chat template marks no assistant token"):
        CrossTokenizerCollator(student, teacher, assistant_only_loss=True)([{"messages": CHAT}])


@pytest.mark.parametrize("side", ["student", "teacher"])
def test_chat_rows_with_a_tokenizer_without_a_chat_template_are_refused_when_the_trainer_is_built(tmp_path, side):
    """Refused at construction (the first rows are read), in one line naming the side and the fix; not the late
    "No columns ... match" of the Trainer's column removal, nor a failure inside the first training step."""
    from datasets import Dataset

    student_tok, teacher_tok = _chat_tokenizers()
    (student_tok if side == "student" else teacher_tok).chat_template = None
    student = decoder("llama", layers=1, seed=0, vocab_size=len(student_tok), max_position_embeddings=32)
    teacher = decoder("llama", layers=1, seed=1, vocab_size=len(teacher_tok), max_position_embeddings=32)
    with pytest.raises(ValueError, match=f"the {side}'s tokenizer has none. Set its chat_template") as caught:
        DistillationTrainer(model=student, teacher_model=teacher, args=_run_args(tmp_path, "uld"),
                            train_dataset=Dataset.from_list([{"messages": CHAT}] * 2), processing_class=student_tok,
                            data_collator=CrossTokenizerCollator(student_tok, teacher_tok))
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------- the losses against float64 references


def _random_batch(seed: int = 0):
    """Two rows, right-padded, the first with a masked prompt; independent teacher positions and lengths."""
    g = torch.Generator().manual_seed(seed)
    s_logits = torch.randn(2, 7, 11, generator=g, dtype=torch.float64) * 2
    t_logits = torch.randn(2, 9, 17, generator=g, dtype=torch.float64) * 3
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, -100, -100]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    t_labels = torch.tensor([[-100, -100, -100, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, -100, -100]])
    t_mask = torch.tensor([[1] * 9, [1] * 7 + [0] * 2])
    positions = torch.tensor([[0, 2, 3, 5, -1, 7, 8], [1, -1, 2, 4, 6, -1, -1]])
    batch = {"input_ids": labels.clamp_min(0), "attention_mask": mask, "labels": labels,
             "teacher_input_ids": t_labels.clamp_min(0), "teacher_attention_mask": t_mask, "teacher_labels": t_labels,
             "teacher_positions": positions}
    return s_logits, t_logits, batch


def _uld_reference(s_logits, t_logits, batch, temperature):
    """Per row: the student's positions predicting a counted label, the teacher's likewise, the k-th with the k-th up to
    the shorter; per pair the sum over ranks of |sorted student prob - sorted teacher prob|; mean over all pairs."""
    total, pairs = 0.0, 0
    for b in range(s_logits.shape[0]):
        s_idx = [i for i in range(s_logits.shape[1] - 1) if batch["labels"][b, i + 1] != -100]
        t_idx = [j for j in range(t_logits.shape[1] - 1) if batch["teacher_labels"][b, j + 1] != -100]
        for i, j in zip(s_idx, t_idx, strict=False):
            q = sorted(torch.softmax(s_logits[b, i] / temperature, -1).tolist(), reverse=True)
            p = sorted(torch.softmax(t_logits[b, j] / temperature, -1).tolist(), reverse=True)
            width = max(len(p), len(q))
            q, p = q + [0.0] * (width - len(q)), p + [0.0] * (width - len(p))
            total += sum(abs(a - c) for a, c in zip(q, p, strict=True))
            pairs += 1
    return total / pairs


def test_uld_matches_a_float64_reference():
    s_logits, t_logits, batch = _random_batch()
    for temperature in (1.0, 2.0):
        got = xt.cross_tokenizer_kd("uld", s_logits.float(), t_logits.float(), batch, temperature=temperature)
        assert got.dtype == torch.float32
        assert math.isclose(float(got), _uld_reference(s_logits, t_logits, batch, temperature), rel_tol=1e-5)
    # the gradient too (the reference's own autograd, float64, with the sort written as indexing)
    s = s_logits.clone().requires_grad_(True)
    xt.cross_tokenizer_kd("uld", s.float(), t_logits.float(), batch).backward()
    ref = s_logits.clone().requires_grad_(True)
    loss, n = 0.0, 0
    for b, i, j in [(0, 1, 2), (0, 2, 3), (0, 3, 4), (0, 4, 5), (0, 5, 6), (1, 0, 0), (1, 1, 1), (1, 2, 2), (1, 3, 3)]:
        q, p = torch.softmax(ref[b, i], -1), torch.softmax(t_logits[b, j], -1)
        q = q[torch.argsort(q.detach(), descending=True)]
        p = p[torch.argsort(p, descending=True)]
        loss = loss + (torch.cat([q, q.new_zeros(len(p) - len(q))]) - p).abs().sum()
        n += 1
    (loss / n).backward()
    torch.testing.assert_close(s.grad, ref.grad, rtol=1e-5, atol=1e-7)


def _aligned_reference(s_logits, t_logits, batch, s_ids, t_ids, kind, temperature):
    """Per student position i predicting a counted label whose teacher position j also does: both distributions
    restricted to the shared ids and renormalised there, then T^2 * KL (or reverse KL); mean over the pairs."""
    total, pairs = 0.0, 0
    for b in range(s_logits.shape[0]):
        for i in range(s_logits.shape[1] - 1):
            j = int(batch["teacher_positions"][b, i])
            if batch["labels"][b, i + 1] == -100 or j < 0 or j >= t_logits.shape[1] - 1:
                continue
            if batch["teacher_labels"][b, j + 1] == -100:
                continue
            q = [math.exp(float(s_logits[b, i, k]) / temperature) for k in s_ids]
            p = [math.exp(float(t_logits[b, j, k]) / temperature) for k in t_ids]
            q, p = [x / sum(q) for x in q], [x / sum(p) for x in p]
            a, c = (p, q) if kind == "kl" else (q, p)
            total += temperature**2 * sum(x * math.log(x / y) for x, y in zip(a, c, strict=True))
            pairs += 1
    return total / pairs


@pytest.mark.parametrize("kind", ["kl", "reverse_kl"])
def test_aligned_matches_a_float64_reference(kind):
    s_logits, t_logits, batch = _random_batch(1)
    s_ids, t_ids = torch.tensor([0, 2, 3, 7, 10]), torch.tensor([5, 1, 16, 8, 0])
    for temperature in (1.0, 2.0):
        got = xt.cross_tokenizer_kd("aligned", s_logits.float(), t_logits.float(), batch, kind=kind,
                                    temperature=temperature, shared=(s_ids, t_ids))
        want = _aligned_reference(s_logits, t_logits, batch, s_ids.tolist(), t_ids.tolist(), kind, temperature)
        assert math.isclose(float(got), want, rel_tol=1e-5)


def test_with_one_tokenizer_aligned_is_plain_kd_and_uld_of_equal_logits_is_zero(tokenizers_pair):
    s_tok, _ = tokenizers_pair
    batch = CrossTokenizerCollator(s_tok, s_tok)(_rows())
    assert (batch["teacher_positions"][batch["attention_mask"] == 1] == torch.arange(batch["input_ids"].shape[1])
            .expand_as(batch["input_ids"])[batch["attention_mask"] == 1]).all()
    g = torch.Generator().manual_seed(0)
    s_logits = torch.randn(*batch["input_ids"].shape, len(s_tok), generator=g)
    t_logits = torch.randn(*batch["input_ids"].shape, len(s_tok), generator=g)
    from hf_distill.losses import kl_div
    from hf_distill.losses.normalise import kd_positions

    plain = kl_div(s_logits[:, :-1], t_logits[:, :-1], 1.0, kd_positions(None, batch["labels"], "labels", True))
    aligned = xt.cross_tokenizer_kd("aligned", s_logits, t_logits, batch, shared=xt.shared_vocabulary(s_tok, s_tok))
    torch.testing.assert_close(aligned, plain)
    assert float(xt.cross_tokenizer_kd("uld", s_logits, s_logits, batch)) == 0.0


# ---------------------------------------------------------------------- training


def _run_args(tmp_path, method: str, **kw):
    # remove_unused_columns keeps its default (True): the trainer keeps the collator's text columns itself
    base = dict(cross_tokenizer=method, kd_weight=1.0, task_weight=0.0, max_steps=1, per_device_train_batch_size=4,
                optim="adamw_torch", weight_decay=0.0, max_grad_norm=0.0)
    return make_args(tmp_path / method, **{**base, **kw})


@pytest.mark.parametrize("method", ["uld", "aligned"])
def test_one_training_step_distils_a_wordpiece_teacher_into_a_bpe_student(tmp_path, tokenizers_pair, method):
    from datasets import Dataset

    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    before = [p.detach().clone() for p in student.parameters()]
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=_run_args(tmp_path, method),
                                  train_dataset=Dataset.from_list(_rows()),  # text rows and one prompt + completion
                                  processing_class=s_tok, teacher_processing_class=t_tok,
                                  data_collator=CrossTokenizerCollator(s_tok, t_tok))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert math.isfinite(logged["loss"]) and logged["loss_kd"] > 0 and "loss_task" not in logged
    # task_weight=0: only the KD term's gradient can have moved the student
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, student.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["uld", "aligned"])
def test_two_accumulated_micro_batches_equal_one_batch_of_both(tmp_path, tokenizers_pair, method):
    """KD (a mean over the step's paired positions) and the task loss (over its counted tokens): exact under GA."""
    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    student.train()
    distiller = Distiller(student, _run_args(tmp_path, method, task_weight=0.5), teacher_model=teacher,
                          processing_class=s_tok, teacher_processing_class=t_tok)
    collate = CrossTokenizerCollator(s_tok, t_tok)
    rows = _rows(4)

    def grads(batches):
        student.zero_grad()
        distiller.start_step(batches)
        for batch in batches:
            (distiller.compute_loss(student, dict(batch)) / len(batches)).backward()
        return torch.cat([p.grad.flatten() for p in student.parameters()])

    whole = grads([collate(rows)])
    halves = grads([collate(rows[:2]), collate(rows[2:])])
    assert whole.abs().max() > 0
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=1e-7)
    # the two halves pair different numbers of positions, so a plain mean of two means would differ
    counts = [xt.count(method, collate(rows[:2])), xt.count(method, collate(rows[2:]))]
    assert counts[0] != counts[1]


@pytest.mark.parametrize("method", ["uld", "aligned"])
def test_the_paired_share_is_logged_per_window_over_every_accumulated_micro_batch(tmp_path, tokenizers_pair, method):
    """`xtok_paired_share` (issue 39, case 12): the window's paired positions over its distilled student positions,
    summed over the four accumulated one-row micro-batches before dividing (not a mean of the rows' shares)."""
    from datasets import Dataset

    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    rows = _rows(4)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=Dataset.from_list(rows),
                                  args=_run_args(tmp_path, method, per_device_train_batch_size=1,
                                                 gradient_accumulation_steps=4, logging_steps=1),
                                  processing_class=s_tok, teacher_processing_class=t_tok,
                                  data_collator=CrossTokenizerCollator(s_tok, t_tok))
    trainer.train()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    collate = CrossTokenizerCollator(s_tok, t_tok)
    paired = [xt.count(method, collate([row])) for row in rows]
    distilled = [int(xt.distilled_positions(collate([row]), "labels", "labels", method)[0].sum()) for row in rows]
    share = sum(paired) / sum(distilled)
    assert 0 < share < 1 and logged["xtok_paired_share"] == pytest.approx(share, rel=1e-9)
    mean_of_shares = sum(p / d for p, d in zip(paired, distilled, strict=True)) / len(rows)
    assert abs(mean_of_shares - share) > 1e-3  # so a per-batch mean would have been caught


def test_the_shared_vocabulary_size_is_logged_once_at_construction(tmp_path, tokenizers_pair, caplog):
    import logging

    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    with caplog.at_level(logging.INFO, logger="hf_distill"):
        Distiller(student, _run_args(tmp_path, "aligned"), teacher_model=teacher, processing_class=s_tok,
                  teacher_processing_class=t_tok)
    n = len(xt.shared_vocabulary(s_tok, t_tok)[0])
    lines = [r.getMessage() for r in caplog.records if "share" in r.getMessage() and "token strings" in r.getMessage()]
    assert len(lines) == 1 and f"share {n} token strings" in lines[0] and f"student's {len(s_tok)}" in lines[0]


def test_evaluate_teacher_reads_the_teachers_own_tokenization(tmp_path, tokenizers_pair):
    """The teacher's metrics (model card) come from its own tokens: its loss on `teacher_input_ids` and
    `teacher_labels`, not on the student's ids, which mean other tokens to it."""
    from datasets import Dataset

    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    collate = CrossTokenizerCollator(s_tok, t_tok)
    data = Dataset.from_list(_rows())
    trainer = DistillationTrainer(model=student, teacher_model=teacher, train_dataset=data, eval_dataset=data,
                                  args=_run_args(tmp_path, "uld", per_device_eval_batch_size=4),
                                  processing_class=s_tok, teacher_processing_class=t_tok, data_collator=collate)
    got = trainer.evaluate_teacher()["teacher_loss"]
    batch = collate(list(data))
    with torch.no_grad():
        own = teacher(input_ids=batch["teacher_input_ids"], attention_mask=batch["teacher_attention_mask"],
                      labels=batch["teacher_labels"]).loss
        on_student_ids = teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                 labels=batch["labels"]).loss
    # The two readings differ beyond the check's tolerance, so the check below can fail. (By how much depends on
    # the tokenizers' training, whose ties the `tokenizers` trainers break differently from run to run: seen
    # from 0.001 to 0.15 here, so a fixed 0.05 margin failed some runs.)
    assert float(on_student_ids) != pytest.approx(float(own), rel=2e-5)
    assert got == pytest.approx(float(own), rel=1e-5)


def _sft_setup(tokenizers_pair):
    """Copies of the pair with an EOS token each (TRL's SFT appends it), the models sized to them, and prompt +
    completion rows."""
    from datasets import Dataset

    s_tok, t_tok = (copy.deepcopy(t) for t in tokenizers_pair)
    s_tok.add_special_tokens({"eos_token": "</s>"})
    t_tok.add_special_tokens({"eos_token": "[SEP]"})
    texts = [r["text"] or r["prompt"] + r["completion"] for r in _rows()]
    rows = Dataset.from_list([{"prompt": t[:20], "completion": t[20:]} for t in texts])
    return s_tok, t_tok, *_models(s_tok, t_tok), rows


def _sft_config(tmp_path, **kw):
    from hf_distill import DistillationSFTConfig

    base = dict(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                save_strategy="no", bf16=False, gradient_checkpointing=False, cross_tokenizer="uld", kd_weight=1.0,
                task_weight=0.5, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0, max_length=64)
    return DistillationSFTConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("given", [True, False], ids=["given", "built"])
def test_distillation_sft_trainer_gives_the_raw_text_to_both_tokenizers(tmp_path, tokenizers_pair, given):
    """SFT's dataset preparation (the student's EOS appended to the text, the student's tokenization, its labels and
    truncation) is not what the collator reads: the trainer skips it, and every training batch is exactly
    CrossTokenizerCollator's on the dataset's own rows (the collator built from the two tokenizers when not given)."""
    pytest.importorskip("trl")
    from hf_distill import DistillationSFTTrainer

    s_tok, t_tok, student, teacher, rows = _sft_setup(tokenizers_pair)
    collate = CrossTokenizerCollator(s_tok, t_tok, max_length=64)
    extra = {"data_collator": collate} if given else {}
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=_sft_config(tmp_path),
                                     train_dataset=rows, processing_class=s_tok, teacher_processing_class=t_tok,
                                     **extra)
    seen, original = [], trainer.distiller.compute_loss

    def compute_loss(model, inputs, **kw):
        seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return original(model, inputs, **kw)

    trainer.distiller.compute_loss = compute_loss
    trainer.train()
    want = collate(list(rows))
    key = lambda batch, i: tuple(batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist())  # noqa: E731
    order = {key(want, i): i for i in range(4)}
    got = seen[0]
    assert sorted(order) == sorted(key(got, i) for i in range(4))
    for i in range(4):
        j = order[key(got, i)]
        for name in ("labels", "teacher_input_ids", "teacher_labels", "teacher_positions"):
            assert got[name][i].tolist() == want[name][j].tolist(), name
    assert any(h.get("loss_kd", 0) > 0 for h in trainer.state.log_history)


@pytest.mark.parametrize("kind", ["messages", "prompt/completion"])
def test_distillation_sft_trainer_distils_chat_rows_across_tokenizers(tmp_path, tokenizers_pair, kind):
    """`messages` (and conversational prompt/completion) rows through DistillationSFTTrainer with the collator it
    builds: every batch is CrossTokenizerCollator's on the rows (each side's own chat template), the KD term trains,
    and the paired share is logged. Before, such rows failed in the first step (or the Trainer's column removal)."""
    pytest.importorskip("trl")
    from datasets import Dataset

    from hf_distill import DistillationSFTTrainer

    s_tok, t_tok, student, teacher, _ = _sft_setup(tokenizers_pair)
    s_tok.chat_template, t_tok.chat_template = STUDENT_TEMPLATE, TEACHER_TEMPLATE
    texts = [r["text"] or r["prompt"] + r["completion"] for r in _rows()]
    chats = [[{"role": "user", "content": t[:20]}, {"role": "assistant", "content": t[20:]}] for t in texts]
    rows = Dataset.from_list([{"messages": c} for c in chats] if kind == "messages" else
                             [{"prompt": c[:1], "completion": c[1:]} for c in chats])
    trainer = DistillationSFTTrainer(model=student, teacher_model=teacher, args=_sft_config(tmp_path),
                                     train_dataset=rows, processing_class=s_tok, teacher_processing_class=t_tok)
    seen, original = [], trainer.distiller.compute_loss

    def compute_loss(model, inputs, **kw):
        seen.append({k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return original(model, inputs, **kw)

    trainer.distiller.compute_loss = compute_loss
    trainer.train()
    want = CrossTokenizerCollator(s_tok, t_tok, max_length=64)(list(rows))
    key = lambda batch, i: tuple(batch["input_ids"][i][batch["attention_mask"][i] == 1].tolist())  # noqa: E731
    order = {key(want, i): i for i in range(4)}
    got = seen[0]
    assert sorted(order) == sorted(key(got, i) for i in range(4))
    for i in range(4):
        j = order[key(got, i)]
        for name in ("labels", "teacher_input_ids", "teacher_labels", "teacher_positions"):
            assert got[name][i].tolist() == want[name][j].tolist(), name
    assert (want["teacher_positions"] >= 0).any()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert logged["loss_kd"] > 0 and 0 < logged["xtok_paired_share"] <= 1


def test_distillation_sft_trainer_honours_assistant_only_loss_on_chat_rows_across_tokenizers(tmp_path,
                                                                                             tokenizers_pair):
    """assistant_only_loss=True (refused with cross_tokenizer before): the collator the trainer builds learns each
    side's assistant turns; a given collator set otherwise is refused."""
    pytest.importorskip("trl")
    from datasets import Dataset

    from hf_distill import DistillationSFTTrainer

    s_tok, t_tok, student, teacher, _ = _sft_setup(tokenizers_pair)
    s_tok.chat_template = STUDENT_TEMPLATE.replace(
        "ASSISTANT {{ m['content'] }} END ", "ASSISTANT {% generation %}{{ m['content'] }} END{% endgeneration %} ")
    t_tok.chat_template = TEACHER_TEMPLATE.replace(
        "BOT {{ m['content'] }} STOP", "BOT {% generation %}{{ m['content'] }} STOP{% endgeneration %}")
    texts = [r["text"] or r["prompt"] + r["completion"] for r in _rows()]
    rows = Dataset.from_list([{"messages": [{"role": "user", "content": t[:20]}, {"role": "assistant",
                                                                               "content": t[20:]}]} for t in texts])
    config = _sft_config(tmp_path, assistant_only_loss=True)
    trainer = DistillationSFTTrainer(model=copy.deepcopy(student), teacher_model=teacher, args=config,
                                     train_dataset=rows, processing_class=s_tok, teacher_processing_class=t_tok)
    base = trainer.data_collator.base
    assert isinstance(base, CrossTokenizerCollator) and base.assistant_only_loss
    batch = base(list(rows))
    assert ((batch["labels"] != -100).sum(1) < batch["attention_mask"].sum(1)).all()  # the user turns not learnt
    trainer.train()
    assert next(h for h in trainer.state.log_history if "loss" in h)["loss_kd"] > 0
    with pytest.raises(ValueError, match="CrossTokenizerCollator's assistant_only_loss is False"):
        DistillationSFTTrainer(model=copy.deepcopy(student), teacher_model=teacher, args=config, train_dataset=rows,
                               processing_class=s_tok, teacher_processing_class=t_tok,
                               data_collator=CrossTokenizerCollator(s_tok, t_tok, max_length=64))


def test_distillation_sft_trainer_refuses_chat_rows_without_the_teachers_chat_template(tmp_path, tokenizers_pair):
    pytest.importorskip("trl")
    from datasets import Dataset

    from hf_distill import DistillationSFTTrainer

    s_tok, t_tok, student, teacher, _ = _sft_setup(tokenizers_pair)
    s_tok.chat_template = STUDENT_TEMPLATE  # the teacher's tokenizer has none
    rows = Dataset.from_list([{"messages": CHAT}] * 4)
    with pytest.raises(ValueError, match="the teacher's tokenizer has none"):
        DistillationSFTTrainer(model=student, teacher_model=teacher, args=_sft_config(tmp_path), train_dataset=rows,
                               processing_class=s_tok, teacher_processing_class=t_tok)


@pytest.mark.parametrize(("settings", "match"), [
    (dict(completion_only_loss=False), "completion_only_loss=False"),
    (dict(assistant_only_loss=True), "assistant_only_loss=True"),
    (dict(dataset_kwargs={"skip_prepare_dataset": False}), "Remove skip_prepare_dataset"),
    (dict(eval_packing=True), "eval_packing"),
    ("formatting_func", "formatting_func"),
    (dict(max_length=32), "max_length=32"),
    (dict(dataset_text_field="body"), "dataset_text_field='body'"),
    ("no teacher tokenizer", "teacher_processing_class"),
])
def test_distillation_sft_trainer_refuses_sft_settings_cross_tokenizer_ignores(tmp_path, tokenizers_pair, settings,
                                                                               match):
    pytest.importorskip("trl")
    from hf_distill import DistillationSFTTrainer

    s_tok, t_tok, student, teacher, rows = _sft_setup(tokenizers_pair)
    kw = {"data_collator": CrossTokenizerCollator(s_tok, t_tok, max_length=64), "teacher_processing_class": t_tok}
    if settings == "formatting_func":
        kw["formatting_func"] = lambda row: row["prompt"]
    if settings == "no teacher tokenizer":
        kw = {}
    config = _sft_config(tmp_path, **(settings if isinstance(settings, dict) else {}))
    with pytest.raises(ValueError, match=match):
        DistillationSFTTrainer(model=student, teacher_model=teacher, args=config, train_dataset=rows,
                               processing_class=s_tok, **kw)


# ---------------------------------------------------------------------- refusals


def test_arguments_refuse_what_cross_tokenizer_cannot_honour(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="cross_tokenizer='other' is unknown"):
        DistillationArguments(**base, cross_tokenizer="other")
    for extra, match in [
        (dict(kd_weight=0.0), "kd_weight=0"),
        (dict(distill_terms=["loss=hidden_mse,layers=uniform"]), "distill_terms"),
        (dict(kd_chunk_size=64), "kd_chunk_size"),
        (dict(kd_loss="jsd"), "ULD is its own distance"),
    ]:
        with pytest.raises(ValueError, match=match):
            DistillationArguments(**base, cross_tokenizer="uld", **extra)
    with pytest.raises(ValueError, match="kd_loss='mse'"):
        DistillationArguments(**base, cross_tokenizer="aligned", kd_loss="mse")
    args = DistillationArguments(**base, cross_tokenizer="aligned", kd_loss="jsd")
    assert args.distillation_summary()["cross_tokenizer"] == "aligned"


def test_different_tokenizers_are_refused_without_the_flag(tmp_path, tokenizers_pair):
    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    with pytest.raises(ValueError, match="not the student's.*cross_tokenizer"):
        Distiller(student, make_args(tmp_path), teacher_model=teacher, processing_class=s_tok,
                  teacher_processing_class=t_tok)


def test_the_distiller_refuses_cross_tokenizer_where_it_cannot_work(tmp_path, tokenizers_pair):
    s_tok, t_tok = tokenizers_pair
    student, teacher = _models(s_tok, t_tok)
    with pytest.raises(ValueError, match="is not a causal LM"):
        Distiller(bert(layers=2), _run_args(tmp_path, "uld"), teacher_model=bert(layers=2, seed=1))
    with pytest.raises(ValueError, match="exactly one teacher"):
        Distiller(student, _run_args(tmp_path, "uld"), teacher_model=[teacher, copy.deepcopy(teacher)])
    with pytest.raises(ValueError, match="needs both tokenizers"):  # "aligned" reads both vocabularies
        Distiller(student, _run_args(tmp_path, "aligned"), teacher_model=teacher, processing_class=s_tok)
    distiller = Distiller(student, _run_args(tmp_path, "uld"), teacher_model=teacher)  # ULD needs no tokenizer
    student.train()
    ids = torch.randint(2, len(s_tok), (2, 6))
    with pytest.raises(ValueError, match="CrossTokenizerCollator"):
        distiller.compute_loss(student, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})


def test_the_collator_pickles_for_spawned_dataloader_workers(tokenizers_pair):
    """`dataloader_num_workers > 0` with spawned workers (macOS, Windows) pickles it, with both tokenizers."""
    import pickle

    collator = CrossTokenizerCollator(*tokenizers_pair)
    want, got = collator(_rows()), pickle.loads(pickle.dumps(collator))(_rows())
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) if isinstance(want[k], torch.Tensor) else want[k] == got[k] for k in want)


def test_length_grouping_of_text_rows_reads_their_length_column(tmp_path, tokenizers_pair):
    """Rows of text have no tokens to measure: `train_sampling_strategy='group_by_length'` is refused when the trainer
    is built, naming the fix (a `length` column), and with that column the rows are grouped by it."""
    from datasets import Dataset

    s_tok, t_tok = tokenizers_pair
    collator = CrossTokenizerCollator(s_tok, t_tok)
    rows = Dataset.from_list(_rows(8))
    student, teacher = _models(s_tok, t_tok)
    common = dict(model=student, teacher_model=teacher, processing_class=s_tok, teacher_processing_class=t_tok,
                  data_collator=collator, args=_run_args(tmp_path, "uld", train_sampling_strategy="group_by_length"))
    with pytest.raises(ValueError, match=r"train_sampling_strategy='group_by_length'.*Add a 'length' column"):
        DistillationTrainer(train_dataset=rows, **common)
    rows = rows.map(lambda r: {"length": collator([r])["input_ids"].shape[1]})
    first = next(iter(DistillationTrainer(train_dataset=rows, **common).get_train_dataloader()))
    assert first["input_ids"].shape[1] == max(rows["length"])  # the longest rows come first (LengthGroupedSampler)
