"""Tests for hf_distill.students: layer-extracted, shrunk and depth-pruned students for the registered encoder and
decoder families."""

from __future__ import annotations

import copy

import pytest
import torch
from decoder_models import DECODERS, decoder, lm_batch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    BertForQuestionAnswering,
    BertModel,
    CamembertConfig,
    Data2VecTextConfig,
    DistilBertConfig,
    ElectraConfig,
    RobertaConfig,
    XLMRobertaConfig,
)

from hf_distill.features import families
from hf_distill.students import DepthPruning, block_importance, from_teacher, prune_depth, register_family, shrink

VOCAB = 100
TEACHER_LAYERS = 6
BENCHMARK_LAYERS = [0, 2, 4]  # the 3-layer student used by the benchmarks
LABELS = {0: "neg", 1: "neu", 2: "pos"}

_BERT_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_hidden_layers=TEACHER_LAYERS,
    intermediate_size=64,
    max_position_embeddings=64,
)
# family -> (config class, size kwargs, encoder-layer path from base_model, config field names for the sizes)
# Written out here rather than read from the registry so the tests check the registry, not echo it.
FAMILIES = {
    "bert": (BertConfig, _BERT_LIKE, "encoder.layer", ("num_hidden_layers", "hidden_size")),
    "roberta": (RobertaConfig, _BERT_LIKE, "encoder.layer", ("num_hidden_layers", "hidden_size")),
    "xlm-roberta": (XLMRobertaConfig, _BERT_LIKE, "encoder.layer", ("num_hidden_layers", "hidden_size")),
    "camembert": (CamembertConfig, _BERT_LIKE, "encoder.layer", ("num_hidden_layers", "hidden_size")),
    # embedding_size != hidden_size exercises ELECTRA's embeddings_project.
    "electra": (
        ElectraConfig,
        {**_BERT_LIKE, "embedding_size": 16},
        "encoder.layer",
        ("num_hidden_layers", "hidden_size"),
    ),
    "distilbert": (
        DistilBertConfig,
        dict(
            vocab_size=VOCAB,
            dim=32,
            n_heads=4,
            n_layers=TEACHER_LAYERS,
            hidden_dim=64,
            max_position_embeddings=64,
        ),
        "transformer.layer",
        ("n_layers", "dim"),
    ),
}
HEADS = {
    "base": AutoModel,
    "seq": AutoModelForSequenceClassification,
    "tok": AutoModelForTokenClassification,
    "mlm": AutoModelForMaskedLM,
    "qa": AutoModelForQuestionAnswering,
}
CASES = [pytest.param(f, h, id=f"{f}-{h}") for f in FAMILIES for h in HEADS]


def make_config(family: str, head: str = "base", **overrides):
    config_class, sizes, _, _ = FAMILIES[family]
    labels = {}
    if head in ("seq", "tok"):
        labels = dict(id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if head == "seq":
        labels["problem_type"] = "single_label_classification"
    return config_class(**{**sizes, **labels, **overrides})


def make_teacher(family: str, head: str, **overrides):
    """Tiny teacher with every weight perturbed, so zero biases / unit norms cannot match by accident."""
    torch.manual_seed(0)
    teacher = HEADS[head].from_config(make_config(family, head, **overrides))
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    teacher.config._name_or_path = "org/tiny-teacher"
    return teacher.eval()


def layer_list(model, family: str):
    return model.base_model.get_submodule(FAMILIES[family][2])


def layer_prefix(model, family: str) -> str:
    base = "" if model.base_model is model else model.base_model_prefix + "."
    return f"{base}{FAMILIES[family][2]}."


def inputs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, VOCAB, (2, 8), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 6:] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def assert_outputs_equal(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a.keys():
        assert torch.equal(a[key], b[key]), key


def assert_state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def clone_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_tied(model) -> None:
    out, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert out.data_ptr() == emb.data_ptr()


# --------------------------------------------------------------------------------------------- from_teacher


@pytest.mark.parametrize("family, head", CASES)
def test_from_teacher_copies_kept_layers_and_everything_else(family, head):
    teacher = make_teacher(family, head)
    before = clone_state(teacher)
    student = from_teacher(teacher, BENCHMARK_LAYERS)

    assert type(student) is type(teacher)
    layers_field = FAMILIES[family][3][0]
    assert getattr(student.config, layers_field) == 3
    assert student.config.num_hidden_layers == 3  # attribute_map alias for DistilBERT
    assert getattr(teacher.config, layers_field) == TEACHER_LAYERS
    assert student.config.distillation == {
        "init": "from_teacher",
        "teacher_layers": BENCHMARK_LAYERS,
        "teacher_name_or_path": "org/tiny-teacher",
        "teacher_num_layers": TEACHER_LAYERS,
    }

    # Kept layers: student layer i is teacher layer layers[i], bit for bit.
    student_layers, teacher_layers = layer_list(student, family), layer_list(teacher, family)
    assert len(student_layers) == len(BENCHMARK_LAYERS)
    for i, j in enumerate(BENCHMARK_LAYERS):
        assert_state_equal(student_layers[i].state_dict(), teacher_layers[j].state_dict())

    # Everything outside the layer stack (embeddings, pooler, head) is copied under the same name.
    prefix = layer_prefix(teacher, family)
    outside_student = {k: v for k, v in student.state_dict().items() if not k.startswith(prefix)}
    outside_teacher = {k: v for k, v in teacher.state_dict().items() if not k.startswith(prefix)}
    assert_state_equal(outside_student, outside_teacher)
    assert any("embeddings" in k for k in outside_student)
    if head != "base":
        head_keys = [k for k in outside_student if not k.startswith(teacher.base_model_prefix + ".")]
        assert head_keys, "the task head must be part of the comparison"
    if family == "distilbert" and head == "seq":
        assert {"pre_classifier.weight", "classifier.weight"} <= set(head_keys)
    if (
        family in ("bert", "roberta", "xlm-roberta", "camembert") and head == "base"
    ):  # ELECTRA, DistilBERT: no pooler
        assert any(k.startswith("pooler.") for k in outside_student)
    if head == "mlm":
        assert_tied(student)

    # Independent storage: editing the student leaves the teacher untouched.
    teacher_ptrs = {p.untyped_storage().data_ptr() for p in teacher.parameters()}
    assert not teacher_ptrs & {p.untyped_storage().data_ptr() for p in student.parameters()}
    with torch.no_grad():
        for param in student.parameters():
            param.add_(1.0)
    assert_state_equal(clone_state(teacher), before)


@pytest.mark.parametrize("family, head", CASES)
def test_from_teacher_save_and_reload(family, head, tmp_path):
    student = from_teacher(make_teacher(family, head), BENCHMARK_LAYERS)
    student.save_pretrained(tmp_path)
    reloaded = type(student).from_pretrained(tmp_path).eval()

    assert_state_equal(reloaded.state_dict(), student.state_dict())
    with torch.no_grad():
        assert_outputs_equal(reloaded(**inputs()), student(**inputs()))
    assert reloaded.config.distillation == student.config.distillation
    assert reloaded.config.num_hidden_layers == 3
    assert len(layer_list(reloaded, family)) == 3
    if head == "mlm":
        assert_tied(reloaded)


@pytest.mark.parametrize("family", FAMILIES)
def test_from_teacher_with_all_layers_reproduces_teacher(family):
    teacher = make_teacher(family, "seq")
    student = from_teacher(teacher, range(TEACHER_LAYERS))
    with torch.no_grad():
        assert_outputs_equal(student(**inputs()), teacher(**inputs()))


def test_from_teacher_arbitrary_layers_and_renumbering():
    teacher = make_teacher("bert", "seq")
    student = from_teacher(teacher, (1, 4, 5))
    assert student.config.distillation["teacher_layers"] == [1, 4, 5]
    for i, j in enumerate((1, 4, 5)):
        assert_state_equal(
            layer_list(student, "bert")[i].state_dict(), layer_list(teacher, "bert")[j].state_dict()
        )
    # Built fresh, so per-layer bookkeeping is renumbered as from_pretrained would do it.
    assert [layer.attention.self.layer_idx for layer in layer_list(student, "bert")] == [0, 1, 2]


def test_from_teacher_student_is_trainable_and_follows_mode_dtype_attention():
    teacher = make_teacher("bert", "seq", attn_implementation="eager").to(torch.bfloat16)
    teacher.requires_grad_(False)  # a frozen teacher must not give a frozen student
    student = from_teacher(teacher, BENCHMARK_LAYERS)
    assert all(p.requires_grad for p in student.parameters())
    assert not student.training
    assert student.dtype == torch.bfloat16
    assert student.config._attn_implementation == "eager"
    assert_state_equal(
        layer_list(student, "bert")[1].state_dict(), layer_list(teacher, "bert")[2].state_dict()
    )
    assert from_teacher(teacher.train(), BENCHMARK_LAYERS).training


def test_from_teacher_selects_per_layer_config_lists():
    teacher = make_teacher("bert", "base")
    teacher.config.layer_types = ["full_attention", "sliding_attention"] * 3
    student = from_teacher(teacher, [1, 2, 5])
    assert student.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert len(teacher.config.layer_types) == TEACHER_LAYERS
    # shrink cannot know the pattern for a new depth: it leaves the list to the config class's default.
    assert getattr(shrink(teacher, 2, 16, 4, 32).config, "layer_types", None) is None


@pytest.mark.parametrize(
    "layers, match",
    [
        ([], r"layers is empty.*0\.\.5"),
        ([0, 6], r"out-of-range index 6.*6 encoder layers.*valid indices are 0\.\.5"),
        ([-1, 2], r"out-of-range index -1.*valid indices are 0\.\.5"),
        ([0, 2, 2], r"strictly increasing.*did you mean \[0, 2\]"),
        ([4, 2, 0], r"strictly increasing.*did you mean \[0, 2, 4\]"),
    ],
)
def test_from_teacher_rejects_bad_layers(layers, match):
    with pytest.raises(ValueError, match=match):
        from_teacher(make_teacher("bert", "base"), layers)


def test_a_local_teacher_is_recorded_by_its_folder_name_not_its_absolute_path(tmp_path):
    """A teacher loaded from a local folder carries its absolute path as name_or_path; the student's config.json
    (published by push_to_hub) records the folder's name instead (issue #39 case 17)."""
    decoder("llama", layers=3).save_pretrained(tmp_path / "my-teacher")
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "my-teacher")
    assert teacher.config._name_or_path == str(tmp_path / "my-teacher")
    for student in (from_teacher(teacher, [0, 2]), shrink(teacher, 2, 16, 4, 32),
                    prune_depth(teacher, 2, [lm_batch()])[0]):
        assert student.config.distillation["teacher_name_or_path"] == "my-teacher"
        student.save_pretrained(tmp_path / "student")
        assert str(tmp_path) not in (tmp_path / "student" / "config.json").read_text()


def test_from_teacher_names_a_decoder_only_teachers_layers_as_decoder_layers():
    with pytest.raises(ValueError, match=r"out-of-range index 3: the teacher has 3 decoder layers, .*0\.\.2"):
        from_teacher(decoder("llama", layers=3), [0, 3])


@pytest.mark.parametrize("layers", [[0, 1.5], ["0"], "012", [True]])
def test_from_teacher_rejects_non_int_layers(layers):
    with pytest.raises(TypeError, match="layers must"):
        from_teacher(make_teacher("bert", "base"), layers)


@pytest.fixture
def scratch_registry(monkeypatch):
    """Registrations made by a test disappear afterwards."""
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))


def test_register_family_adds_a_family(scratch_registry):
    config = Data2VecTextConfig(**_BERT_LIKE)
    teacher = AutoModelForMaskedLM.from_config(config).eval()
    with pytest.raises(ValueError, match=r"model_type 'data2vec-text'.*register_family\('data2vec-text'"):
        from_teacher(teacher, [0, 1])
    with pytest.raises(ValueError, match="register_family"):
        shrink(config, 2, 16, 4, 32)

    register_family("data2vec-text", "encoder.layer")
    register_family("data2vec-text", "encoder.layer")  # identical re-registration is a no-op
    student = from_teacher(teacher, [0, 3])
    assert student.config.num_hidden_layers == 2
    assert torch.equal(
        student.data2vec_text.encoder.layer[1].output.dense.weight,
        teacher.data2vec_text.encoder.layer[3].output.dense.weight,
    )
    assert_tied(student)
    assert len(shrink(config, 2, 16, 4, 32).encoder.layer) == 2

    with pytest.raises(ValueError, match="overwrite=True"):
        register_family("data2vec-text", "encoder.layers")
    register_family("data2vec-text", "encoder.layers", overwrite=True)
    with pytest.raises(ValueError, match="'encoder.layers'.*does not exist"):
        from_teacher(teacher, [0])


# --------------------------------------------------------------------------------------------- shrink


def loss_of(model, head: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    ids = batch["input_ids"]
    if head == "base":
        return model(**batch).last_hidden_state.pow(2).mean()
    labels = {
        "seq": {"labels": torch.tensor([0, 2])},
        "tok": {"labels": torch.randint(0, len(LABELS), ids.shape)},
        "mlm": {"labels": ids},
        "qa": {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])},
    }[head]
    return model(**batch, **labels).loss


@pytest.mark.parametrize("family, head", CASES)
def test_shrink_sizes_labels_training_and_reload(family, head, tmp_path):
    teacher = make_teacher(family, head)
    student = shrink(teacher, 2, 24, 4, 48, seed=0)

    assert type(student) is type(teacher)
    layers_field, hidden_field = FAMILIES[family][3]
    assert getattr(student.config, layers_field) == 2
    assert getattr(student.config, hidden_field) == 24
    assert (student.config.num_hidden_layers, student.config.hidden_size) == (2, 24)
    assert student.config.num_attention_heads == 4
    assert len(layer_list(student, family)) == 2
    embedding_dim = 16 if family == "electra" else 24  # ELECTRA's factorised embedding size is kept
    assert student.get_input_embeddings().weight.shape == (VOCAB, embedding_dim)
    for field in (
        "vocab_size",
        "max_position_embeddings",
        "type_vocab_size",
        "num_labels",
        "id2label",
        "label2id",
        "problem_type",
    ):
        assert getattr(student.config, field, None) == getattr(teacher.config, field, None), field
    assert student.config.distillation == {"init": "shrink", "teacher_name_or_path": "org/tiny-teacher"}
    assert getattr(teacher.config, layers_field) == TEACHER_LAYERS
    if head == "mlm":
        assert_tied(student)

    student.train()
    loss = loss_of(student, head, inputs())
    loss.backward()
    assert torch.isfinite(loss)
    assert student.get_input_embeddings().weight.grad is not None

    student.eval().save_pretrained(tmp_path)
    reloaded = type(student).from_pretrained(tmp_path).eval()
    assert_state_equal(reloaded.state_dict(), student.state_dict())
    with torch.no_grad():
        assert_outputs_equal(reloaded(**inputs()), student(**inputs()))
    assert reloaded.config.distillation == student.config.distillation


def test_shrink_tinybert_general_student_shape():
    teacher = make_teacher("bert", "seq")
    student = shrink(teacher, 4, 312, 12, 1200)
    layer = student.bert.encoder.layer[0]
    assert len(student.bert.encoder.layer) == 4
    assert layer.attention.self.query.weight.shape == (312, 312)
    assert layer.intermediate.dense.weight.shape == (1200, 312)
    assert student.classifier.weight.shape == (3, 312)


def test_shrink_electra_embedding_follows_hidden_when_teacher_is_unfactorised():
    teacher = make_teacher("electra", "mlm", embedding_size=32)
    student = shrink(teacher, 2, 24, 4, 48)
    assert student.config.embedding_size == 24
    assert_tied(student)


def test_shrink_from_config_picks_base_or_requested_class():
    config = make_config("bert", "seq")
    assert type(shrink(config, 2, 16, 4, 32)) is BertModel
    tok = shrink(config, 2, 16, 4, 32, model_class=AutoModelForTokenClassification)
    assert tok.config.id2label == LABELS
    assert tok.classifier.out_features == 3
    qa = shrink(make_config("bert"), 2, 16, 4, 32, model_class=BertForQuestionAnswering)
    assert type(qa) is BertForQuestionAnswering
    # A model teacher with model_class: the requested head on the teacher's family.
    mlm = shrink(make_teacher("roberta", "seq"), 2, 16, 4, 32, model_class=AutoModelForMaskedLM)
    assert type(mlm).__name__ == "RobertaForMaskedLM"


def test_shrink_seed_is_reproducible_and_leaves_global_rng_alone():
    config = make_config("distilbert")
    rng = torch.random.get_rng_state()
    a = shrink(config, 2, 16, 4, 32, seed=3)
    b = shrink(config, 2, 16, 4, 32, seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert_state_equal(a.state_dict(), b.state_dict())
    c = shrink(config, 2, 16, 4, 32, seed=4)
    assert not torch.equal(a.embeddings.word_embeddings.weight, c.embeddings.word_embeddings.weight)


def test_shrink_config_overrides():
    distil = shrink(make_teacher("distilbert", "seq"), 2, 16, 4, 32, activation="relu", dropout=0.0)
    assert (distil.config.activation, distil.config.dropout) == ("relu", 0.0)
    relabelled = shrink(make_teacher("bert", "seq"), 2, 16, 4, 32, num_labels=5, problem_type=None)
    assert relabelled.config.num_labels == 5
    assert relabelled.classifier.out_features == 5


@pytest.mark.parametrize(
    "family, kwargs, match",
    [
        ("bert", {"hidden_size": 30}, r"hidden_size \(30\) must be divisible by num_attention_heads \(4\)"),
        ("distilbert", {"hidden_size": 30}, r"hidden_size \(30\).*num_attention_heads \(4\)"),
        ("bert", {"num_layers": 0}, "num_layers must be a positive int"),
        ("bert", {"hiden_act": "relu"}, "'hiden_act' is not a field of BertConfig"),
        ("bert", {"num_hidden_layers": 3}, "duplicates shrink's num_layers"),
        ("distilbert", {"n_heads": 2}, "duplicates shrink's num_attention_heads"),
        ("distilbert", {"hidden_dim": 20}, "duplicates shrink's intermediate_size"),
    ],
)
def test_shrink_rejects_bad_arguments(family, kwargs, match):
    sizes = dict(num_layers=2, hidden_size=16, num_attention_heads=4, intermediate_size=32)
    overrides = {k: v for k, v in kwargs.items() if k not in sizes}
    sizes.update({k: v for k, v in kwargs.items() if k in sizes})
    with pytest.raises(ValueError, match=match):
        shrink(make_config(family), **sizes, **overrides)


def test_shrink_rejects_non_models():
    with pytest.raises(TypeError, match="PreTrainedModel or PreTrainedConfig"):
        shrink({"model_type": "bert"}, 2, 16, 4, 32)


# --------------------------------------------------------------------------------------------- decoders


def _blocks(model):
    return model.base_model.get_submodule(families.get_family(model.config.model_type).layers)


def _prefix(model) -> str:
    return next(name for name, m in model.named_modules() if m is _blocks(model)) + "."


def _expected_student_state(teacher, kept: list[int]) -> dict[str, torch.Tensor]:
    prefix, new = _prefix(teacher), {old: i for i, old in enumerate(kept)}
    out = {}
    for key, value in teacher.state_dict().items():
        if key.startswith(prefix):
            old, _, rest = key[len(prefix) :].partition(".")
            if int(old) not in new:
                continue
            key = f"{prefix}{new[int(old)]}.{rest}"
        out[key] = value
    return out


@pytest.mark.parametrize("family", DECODERS)
def test_from_teacher_decoder_copies_layers_norms_head_and_config(family, tmp_path):
    teacher = decoder(family, layers=3)
    student = from_teacher(teacher, [0, 2])
    assert type(student) is type(teacher) and len(_blocks(student)) == 2
    assert student.config.num_hidden_layers == 2
    assert_state_equal(clone_state(student), _expected_student_state(teacher, [0, 2]))
    teacher_types = getattr(teacher.config, "layer_types", None)
    if teacher_types is not None:  # Gemma-2 / Qwen: sliding vs full attention per layer follows the layer
        assert student.config.layer_types == [teacher_types[0], teacher_types[2]]
    tied = teacher.config.tie_word_embeddings
    out, emb = student.get_output_embeddings().weight, student.get_input_embeddings().weight
    assert (out.data_ptr() == emb.data_ptr()) == tied
    # the student runs: forward with a loss, backward; and it saves and reloads to the same outputs
    batch = lm_batch()
    student.train()
    student(**batch).loss.backward()
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)
    student.eval().save_pretrained(tmp_path)
    reloaded = type(teacher).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(**batch).logits, student(**batch).logits)
    # all layers: the very same model
    full = from_teacher(teacher, [0, 1, 2])
    with torch.no_grad():
        assert torch.equal(full(**batch).logits, teacher(**batch).logits)


def test_from_teacher_decoder_generates_with_the_teachers_generation_config():
    """A decoder student used to get a generation config made from its config: a teacher whose config says
    use_cache=False (as saved after training) gave a student that generated without a KV cache, and the teacher's
    stop ids were lost."""
    teacher = decoder("llama", layers=3, use_cache=False)
    teacher.generation_config.use_cache = True
    teacher.generation_config.eos_token_id = [2, 5]
    teacher.generation_config.max_new_tokens = 7
    student = from_teacher(teacher, [0, 2])
    assert student.generation_config.to_dict() == teacher.generation_config.to_dict()
    assert student.generation_config is not teacher.generation_config
    assert student.generation_config.use_cache and not student.config.use_cache
    assert student.generation_config.eos_token_id == [2, 5]


def test_from_teacher_decoder_keeps_an_untied_head_untied():
    teacher = decoder("llama", layers=3, tie_word_embeddings=False)
    student = from_teacher(teacher, [1])
    assert student.lm_head.weight.data_ptr() != student.model.embed_tokens.weight.data_ptr()
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "gpt2"])
def test_shrink_decoder_runs_with_smaller_heads_and_kv_heads(family):
    teacher = decoder(family, layers=3)
    student = shrink(teacher, 2, 16, 4, 32, seed=0)
    cfg = student.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 16, 4)
    if family != "gpt2":
        # GQA teacher (4 heads, 2 kv heads): the student keeps 2 kv heads; head_dim follows hidden / heads
        assert (cfg.num_key_value_heads, cfg.head_dim) == (2, 4)
        attn = student.model.layers[0].self_attn
        k_width = attn.qkv_proj.weight.shape[0] - 16 - 8 if family == "phi3" else attn.k_proj.weight.shape[0]
        assert k_width == 2 * 4
        if getattr(cfg, "layer_types", None) is not None:
            assert len(cfg.layer_types) == 2
    student(**lm_batch()).loss.backward()
    if family != "gpt2":
        gqa = shrink(teacher, 2, 16, 4, 32, num_key_value_heads=1)
        assert gqa.config.num_key_value_heads == 1


def test_shrink_decoder_refuses_kv_heads_that_do_not_divide_heads():
    teacher = decoder("llama", layers=2)  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\).*num_attention_heads \(3\).*num_key_value_heads="):
        shrink(teacher, 2, 24, 3, 32)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) must divide num_attention_heads \(4\)"):
        shrink(teacher, 2, 16, 4, 32, num_key_value_heads=3)
    with pytest.raises(ValueError, match="gpt2 has no grouped-query attention"):
        shrink(decoder("gpt2", layers=2), 2, 16, 4, 32, num_key_value_heads=2)


def test_shrink_keeps_an_explicit_head_dim():
    # head_dim set apart from hidden / heads (Gemma: 256 with 3072 / 16 = 192) stays as the teacher set it
    teacher = decoder("gemma", layers=2, head_dim=16)
    student = shrink(teacher, 1, 24, 3, 32, num_key_value_heads=1)
    assert student.config.head_dim == 16
    student(**lm_batch()).loss.backward()


# --------------------------------------------------------------------------------------------- prune_depth


def _calibration(n=2):
    return [lm_batch(b=3, t=7, seed=s) for s in range(n)]


def _hand_importance(model, batches) -> list[float]:
    """1 - mean cosine(hidden_states[i], hidden_states[i + 1]) over real tokens, from output_hidden_states of a
    copy whose final norm is the identity (transformers returns the last hidden state after it)."""
    plain = copy.deepcopy(model).eval()
    final_norm = families.get_family(plain.config.model_type).final_norm
    if final_norm is not None:
        parent, _, name = final_norm.rpartition(".")
        setattr(plain.base_model.get_submodule(parent) if parent else plain.base_model, name, torch.nn.Identity())
    sums, count = None, 0
    with torch.no_grad():
        for batch in batches:
            hs = plain(**batch, output_hidden_states=True).hidden_states
            real = batch["attention_mask"].bool()
            cos = torch.stack([torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1)[real]
                               for i in range(len(hs) - 1)])
            sums = cos.double().sum(-1) if sums is None else sums + cos.double().sum(-1)
            count += int(real.sum())
    return (1 - sums / count).tolist()


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_prune_depth_keeps_the_most_important_blocks_bit_exactly(family):
    teacher = decoder(family, layers=4)
    batches = _calibration()
    student, report = prune_depth(teacher, 2, batches)
    assert isinstance(report, DepthPruning)
    assert report.scores == pytest.approx(_hand_importance(teacher, batches), rel=1e-5, abs=1e-7)
    ranked = sorted(range(4), key=lambda i: -report.scores[i])
    assert report.kept == sorted(ranked[:2]) and report.removed == sorted(ranked[2:])
    assert report.num_tokens == sum(int(b["attention_mask"].sum()) for b in batches)
    assert student.config.num_hidden_layers == 2
    assert_state_equal(clone_state(student), _expected_student_state(teacher, report.kept))
    assert student.config.distillation["init"] == "prune_depth"
    assert student.config.distillation["block_importance"] == report.scores
    student.train()
    student(**batches[0]).loss.backward()
    # deterministic: the same calibration data gives the same scores, bit for bit
    assert block_importance(teacher, batches) == report.scores
    assert teacher.training is False  # the teacher's mode is restored


def test_prune_depth_works_for_encoders():
    teacher = make_teacher("bert", "seq")
    batch = inputs()
    student, report = prune_depth(teacher, 1, [batch])
    n = teacher.config.num_hidden_layers
    hs = teacher.eval()(**batch, output_hidden_states=True).hidden_states
    real = batch["attention_mask"].bool()
    want = [1 - torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1)[real].double().mean().item()
            for i in range(n)]
    assert report.scores == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert report.kept == [max(range(n), key=lambda i: want[i])]
    assert_state_equal(clone_state(student), _expected_student_state(teacher, report.kept))


@pytest.mark.parametrize(
    ("num_layers", "batches", "error", "match"),
    [
        (0, "ok", ValueError, r"num_layers must be between 1 and 3"),
        (4, "ok", ValueError, r"num_layers must be between 1 and 3"),
        (True, "ok", TypeError, "num_layers must be an int"),
        (2, [], ValueError, "calibration_batches is empty"),
        (2, "pad", ValueError, "no real tokens"),
        (2, ["not a dict"], TypeError, "calibration batch 0 must be a dict"),
    ],
)
def test_prune_depth_refuses_bad_input(num_layers, batches, error, match):
    teacher = decoder("llama", layers=3)
    if batches == "ok":
        batches = _calibration(1)
    elif batches == "pad":
        batch = lm_batch()
        batches = [{**batch, "attention_mask": torch.zeros_like(batch["attention_mask"])}]
    with pytest.raises(error, match=match):
        prune_depth(teacher, num_layers, batches)
