"""Width pruning (students.width): Minitron's activation importance, exact copies of the kept units, every family."""

from __future__ import annotations

import audio_models
import pytest
import torch
from decoder_models import DECODERS, decoder
from helpers import VOCAB, args, collate, mobilebert, token_dataset
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification
from transformers.pytorch_utils import Conv1D

from hf_distill import DistillationTrainer
from hf_distill.features.families import FAMILIES, get_family
from hf_distill.students import (
    WidthImportance,
    encoder_layers,
    prune_depth,
    prune_width,
    width_importance,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tensors here are a few hundred numbers: a second intra-op thread only adds hand-off cost (several times the
    work on a busy 2-core runner), so these tests run on one and restore the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ENCODERS = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "distilbert")
SEQ2SEQ = ("t5", "mt5", "bart", "marian", "mbart", "pegasus", "whisper")  # refused by prune_width (two stacks)


def encoder(model_type: str, layers: int = 3, seed: int = 0, **kw):
    """A tiny encoder classifier (hidden 32, 4 heads of 8, FFN 64) whose every weight matters."""
    torch.manual_seed(seed)
    if model_type == "distilbert":
        sizes = dict(dim=32, n_layers=layers, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0,
                     seq_classif_dropout=0.0)
    else:
        sizes = dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        if model_type == "electra":
            sizes["embedding_size"] = 16
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=64, num_labels=2,
                                  **{**sizes, **kw})
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def model_of(name: str, seed: int = 0):
    if name == "electra-tied":  # embedding_size == hidden_size: the embeddings follow the hidden channels
        return encoder("electra", seed=seed, embedding_size=32)
    if name in DECODERS:
        return decoder(name, layers=3, seed=seed)
    return encoder(name, seed=seed)


def batches(n: int = 2, b: int = 3, t: int = 9, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches of random ids (row i of a batch has t - 2i real tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(5, VOCAB, (b, t), generator=g)
        mask = torch.ones(b, t, dtype=torch.long)
        for i in range(b):
            mask[i, t - 2 * i :] = 0
        out.append({"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask})
    return out


def outputs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def sizes(model) -> dict[str, int]:
    family, config = get_family(model.config.model_type), model.config
    names = {"hidden": family.hidden_size_field, "heads": family.num_heads_field,
             "intermediate": family.intermediate_size_field, "layers": family.num_layers_field}
    if family.num_kv_heads_field:
        names["kv"] = family.num_kv_heads_field
    if family.head_dim_field and hasattr(config, family.head_dim_field):
        names["head_dim"] = family.head_dim_field
    return {key: getattr(config, field) for key, field in names.items()}


# ---------------------------------------------------------------------------------------------- every family

PRUNED = (*ENCODERS, "electra-tied", *DECODERS)


def test_the_cases_cover_every_registered_family():
    audio = set(audio_models.BUILDERS)  # pruned (or refused) in tests/test_families_audio.py
    from test_families_vision import FAMILIES as VISION  # pruned or refused there (issue #43)

    assert set(FAMILIES) == ({n for n in PRUNED if n != "electra-tied"} | set(SEQ2SEQ) | {"mobilebert"} | audio
                             | set(VISION))


@pytest.mark.parametrize("name", PRUNED)
def test_pruning_nothing_computes_what_the_teacher_does(name):
    teacher = model_of(name)
    student, report = prune_width(teacher, batches())
    assert student is not teacher and sizes(student) == sizes(teacher)
    assert report.layers == [0, 1, 2] and len(report.hidden) == sizes(teacher)["hidden"]
    for batch in batches(seed=1):
        torch.testing.assert_close(outputs(student, batch), outputs(teacher, batch), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", PRUNED)
def test_pruned_student_states_its_shape_and_reloads_identically(name, tmp_path):
    teacher = model_of(name)
    grouped = sizes(teacher).get("kv", 4) < 4
    # decoders with an explicit head_dim: heads and hidden apart; elsewhere hidden = heads * 8 follows the heads
    explicit = "head_dim" in sizes(teacher)
    target = dict(num_attention_heads=2, hidden_size=24) if explicit else dict(num_attention_heads=3)
    student, report = prune_width(teacher, batches(), intermediate_size=40, num_layers=2, **target)
    got = sizes(student)
    heads = target["num_attention_heads"]
    assert (got["heads"], got["hidden"], got["intermediate"], got["layers"]) == (heads, 24, 40, 2)
    assert got.get("kv", got["heads"]) == (1 if grouped else got["heads"])
    assert got.get("head_dim", 8) == 8
    assert student.config.distillation["init"] == "prune_width"
    assert student.config.distillation["teacher_shape"]["hidden_size"] == 32
    assert len(report.layers) == 2 and all(len(n) == 40 for n in report.neurons) and len(report.hidden) == 24
    family = get_family(name.split("-tied")[0])
    out = encoder_layers(student)[0].get_submodule(family.attention_output)
    assert (out.weight.shape[0] if isinstance(out, Conv1D) else out.weight.shape[1]) == heads * 8
    student.save_pretrained(tmp_path)
    reloaded = type(student).from_pretrained(tmp_path).eval()
    assert sizes(reloaded) == got
    for batch in batches(seed=2):
        assert torch.equal(outputs(reloaded, batch), outputs(student.eval(), batch))
    if getattr(teacher.config, "tie_word_embeddings", False) and hasattr(teacher, "lm_head"):
        assert reloaded.lm_head.weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()


def test_refused_families_say_what_to_use_instead():
    with pytest.raises(ValueError, match="bottleneck width .true_hidden_size.*prune_depth or shrink"):
        prune_width(mobilebert(), batches())
    for model_type in ("t5", "bart"):
        config = AutoConfig.for_model(model_type, vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                                      d_kv=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)
        with pytest.raises(ValueError, match="encoder-decoder model.*from_teacher.*decoder_layers"):
            prune_width(AutoModel.from_config(config), batches())


def test_unregistered_family_names_register_family():
    config = AutoConfig.for_model("albert", vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, embedding_size=16, num_hidden_layers=1)
    with pytest.raises(ValueError, match="No model family is registered for model_type 'albert'.*register_family"):
        prune_width(AutoModel.from_config(config), batches())


# ------------------------------------------------------------------------- the right units are the ones kept

def _rows(module, index):
    """Set the output channels `index` of a Linear/Conv1D (weight rows, bias entries) to zero."""
    with torch.no_grad():
        if isinstance(module, Conv1D):
            module.weight[:, index] = 0.0
        else:
            module.weight[index] = 0.0
        if module.bias is not None:
            module.bias[index] = 0.0


@pytest.mark.parametrize("name", ("bert", "distilbert", "gpt2", "llama", "qwen2", "qwen3", "phi3"))
def test_units_silenced_by_construction_are_pruned_and_the_outputs_do_not_change(name):
    """Zeroed MLP input rows give a zero activation (GELU(0) = SiLU(0) = 0) and zeroed V rows a zero head output:
    those units score 0 and are the ones removed, so the student computes exactly what the teacher does."""
    teacher = model_of(name)
    family = get_family(teacher.config.model_type)
    explicit = "head_dim" in sizes(teacher)  # heads can be pruned without touching the hidden size
    inter, chunks = 64, family.mlp_input_chunks
    dead_neurons, dead_groups = [], []
    for i, block in enumerate(encoder_layers(teacher)):
        dead = [(7 * i + 3 * k) % inter for k in range(24)]
        dead_neurons.append(sorted(set(dead)))
        for path in family.mlp_input:
            _rows(block.get_submodule(path), [c * inter + n for c in range(chunks) for n in dead])
        if explicit:
            group = i % 2  # K/V head `group` serves query heads 2*group, 2*group + 1
            dead_groups.append(group)
            channels = list(range(group * 8, group * 8 + 8))
            if family.qkv:  # fused Q|K|V: V starts after 4 query heads and 2 K/V heads of 8
                _rows(block.get_submodule(family.qkv), [32 + 16 + c for c in channels])
            else:
                _rows(block.get_submodule((family.projections or (None, None, family.value))[2]), channels)
    target = dict(num_attention_heads=2) if explicit else {}
    student, report = prune_width(teacher, batches(), intermediate_size=inter - 24, **target)
    for i, kept in enumerate(report.neurons):
        assert kept == [n for n in range(inter) if n not in dead_neurons[i]]
        assert report.importance.neurons[i, dead_neurons[i]].abs().max() == 0
    if explicit:
        assert report.kv_heads == [[1 - g] for g in dead_groups]
        assert report.heads == [[2 * (1 - g), 2 * (1 - g) + 1] for g in dead_groups]
    for batch in batches(seed=3):
        torch.testing.assert_close(outputs(student, batch), outputs(teacher, batch), atol=1e-6, rtol=0)


def test_scores_are_minitrons_mean_over_real_tokens_then_l2_over_rows():
    teacher = encoder("bert", layers=2)
    data = batches(n=2)
    seen = {"mlp": [], "att": [], "norm": []}
    block = encoder_layers(teacher)[1]
    hooks = [block.output.dense.register_forward_pre_hook(lambda m, a: seen["mlp"].append(a[0])),
             block.attention.output.dense.register_forward_pre_hook(lambda m, a: seen["att"].append(a[0]))]
    hooks += [n.register_forward_hook(lambda m, a, o: seen["norm"].append(o))
              for b in encoder_layers(teacher) for n in (b.attention.output.LayerNorm, b.output.LayerNorm)]
    with torch.no_grad():
        for batch in data:
            teacher(**batch)
    for h in hooks:
        h.remove()

    def score(captured, masks):
        rows = []
        for x, m in zip(captured, masks, strict=True):
            for row, mask in zip(x.abs(), m, strict=True):
                rows.append(row[mask.bool()].double().mean(0))
        return torch.stack(rows).norm(dim=0)

    masks = [b["attention_mask"] for b in data]
    imp = width_importance(teacher, data)
    torch.testing.assert_close(imp.neurons[1], score(seen["mlp"], masks))
    torch.testing.assert_close(imp.heads[1], score(seen["att"], masks).view(4, 8).norm(dim=-1))
    per_norm = [score(seen["norm"][k::4], masks) for k in range(4)]  # 4 norms a batch, in forward order
    torch.testing.assert_close(imp.hidden, sum(per_norm))
    assert imp.num_tokens == sum(int(m.sum()) for m in masks)
    # padding adds nothing: the same rows padded further score the same
    longer = [{"input_ids": torch.nn.functional.pad(b["input_ids"], (0, 4), value=1),
               "attention_mask": torch.nn.functional.pad(b["attention_mask"], (0, 4))} for b in data]
    padded = width_importance(teacher, longer)
    for name in ("heads", "neurons", "hidden"):
        torch.testing.assert_close(getattr(padded, name), getattr(imp, name), atol=1e-5, rtol=1e-5)


def test_importance_measured_once_serves_many_shapes_and_depth_combines():
    teacher = decoder("llama", layers=3)
    imp = width_importance(teacher, batches())
    assert isinstance(imp, WidthImportance) and imp.heads.shape == (3, 4) and imp.hidden.shape == (32,)
    a, ra = prune_width(teacher, batches(), hidden_size=24, intermediate_size=48, num_layers=2)
    b, rb = prune_width(teacher, importance=imp, hidden_size=24, intermediate_size=48, num_layers=2)
    assert (ra.layers, ra.neurons, ra.hidden) == (rb.layers, rb.neurons, rb.hidden)
    batch = batches(seed=4)[0]
    assert torch.equal(outputs(a, batch), outputs(b, batch))
    _, depth = prune_depth(teacher, 2, batches())
    assert ra.layers == depth.kept  # the same Block Influence ranking as prune_depth
    assert a.config.distillation["teacher_layers"] == depth.kept
    # the other order: a width-pruned student is a plain model that prune_depth takes as is
    narrow, _ = prune_width(teacher, importance=imp, hidden_size=24)
    shallow, _ = prune_depth(narrow, 1, batches())
    assert sizes(shallow)["hidden"] == 24 and sizes(shallow)["layers"] == 1


# ----------------------------------------------------------------------------------------------- bad input

@pytest.mark.parametrize(
    ("name", "kw", "error", "match"),
    [
        ("bert", dict(num_attention_heads=5), ValueError, "num_attention_heads=5: pruning only removes whole heads.*"
         "between 1 and 4"),
        ("llama", dict(num_attention_heads=3), ValueError, "num_attention_heads=3 is not a whole number of "
         "grouped-query groups.*2 key/value heads serves 2 query heads.*num_attention_heads=2"),
        ("bert", dict(num_attention_heads=2, hidden_size=24), ValueError, "hidden_size=24 does not fit "
         "num_attention_heads=2: bert computes its head size as hidden_size / num_attention_heads.*hidden_size=16"),
        ("gpt2", dict(hidden_size=20), ValueError, "hidden_size=20 is not divisible by the head size 8.*hidden_size="
         " a multiple of 8"),
        ("llama", dict(intermediate_size=0), ValueError, "intermediate_size=0: pruning only removes MLP channels"),
        ("llama", dict(hidden_size=33), ValueError, "hidden_size=33: .*between 1 and 32"),
        ("llama", dict(num_layers=4), ValueError, "num_layers=4: pruning only removes blocks"),
        ("llama", dict(hidden_size=2.0), TypeError, "hidden_size must be an int"),
    ],
)
def test_bad_targets_name_the_argument_and_the_fix(name, kw, error, match):
    with pytest.raises(error, match=match):
        prune_width(model_of(name), batches(), **kw)


def test_bad_calibration_and_importance_are_refused():
    teacher = decoder("llama", layers=3)
    with pytest.raises(TypeError, match="needs calibration_batches.*or importance="):
        prune_width(teacher, hidden_size=24)
    imp = width_importance(teacher, batches())
    with pytest.raises(ValueError, match="calibration_batches or importance, not both"):
        prune_width(teacher, batches(), importance=imp)
    with pytest.raises(ValueError, match=r"importance.heads has shape \(3, 4\).*measured on another model"):
        prune_width(decoder("llama", layers=2), importance=imp)
    with pytest.raises(ValueError, match="calibration_batches is empty"):
        prune_width(teacher, [], hidden_size=24)
    with pytest.raises(TypeError, match="teacher must be a transformers PreTrainedModel"):
        prune_width(torch.nn.Linear(2, 2), batches())


# ------------------------------------------------------------------------------- a pruned student distils

def _lm_collate(features):
    batch = collate(features)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "target", "terms"),
    [
        # BERT: hidden 24 with 3 heads; MiniLM's attention relation across head counts
        ("bert", dict(num_attention_heads=3), ["loss=hidden_mse,layers=uniform,name=hidden",
                                               "loss=relation_kl,layers=last,relations=qk;vv,relation_heads=4"]),
        # Llama: hidden 24 with the teacher's 4 heads, so attention scores compare head by head
        ("llama", dict(hidden_size=24), ["loss=hidden_mse,layers=uniform,name=hidden",
                                         "loss=attention_score_mse,layers=uniform,name=attention"]),
        # Llama: 2 of 4 heads (one K/V group), hidden 24
        ("llama", dict(num_attention_heads=2, hidden_size=24),
         ["loss=hidden_mse,layers=uniform,name=hidden",
          "loss=relation_kl,layers=last,relations=qk;vv,relation_heads=4"]),
    ],
)
def test_trainer_step_with_intermediate_terms_and_a_projection(name, target, terms, tmp_path):
    teacher = decoder(name, layers=4, seed=1) if name in DECODERS else encoder(name, layers=4, seed=1)
    student, _ = prune_width(teacher, batches(), intermediate_size=40, num_layers=2, **target)
    causal = name in DECODERS
    trainer = DistillationTrainer(
        model=student.train(), teacher_model=teacher,
        args=args(tmp_path, max_steps=2, per_device_train_batch_size=4, distill_terms=terms),
        train_dataset=token_dataset(8), data_collator=_lm_collate if causal else collate,
    )
    batch = (_lm_collate if causal else collate)([token_dataset(4)[i] for i in range(4)])
    trainer.compute_loss(student, dict(batch)).backward()
    proj = trainer.intermediate.projections
    assert proj is not None  # student 24 wide, teacher 32
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.parameters())
    family = get_family(name)
    for path in (family.attention_output, family.mlp_output):
        assert encoder_layers(student)[0].get_submodule(path).weight.grad.abs().sum() > 0
    student.zero_grad()
    trainer.train()
    logged = [r for r in trainer.state.log_history if "loss" in r]
    names = {"loss_hidden"} | ({"loss_attention"} if "attention" in str(terms) else {"loss_relation_qk"})
    assert len(logged) == 2
    for record in logged:
        for key in names:
            assert torch.isfinite(torch.tensor(record[key])) and record[key] > 0, key


def test_hidden_channels_are_the_highest_scored_and_copied_exactly():
    teacher = decoder("llama", layers=2)
    student, report = prune_width(teacher, batches(), hidden_size=20)
    kept = torch.tensor(report.hidden)
    removed = [c for c in range(32) if c not in report.hidden]
    assert report.importance.hidden[kept].min() >= report.importance.hidden[removed].max()
    t, s = teacher.model, student.model
    assert torch.equal(s.embed_tokens.weight, t.embed_tokens.weight[:, kept])
    assert torch.equal(student.lm_head.weight, teacher.lm_head.weight[:, kept])
    assert torch.equal(s.norm.weight, t.norm.weight[kept])
    for sb, tb in zip(s.layers, t.layers, strict=True):
        assert torch.equal(sb.self_attn.q_proj.weight, tb.self_attn.q_proj.weight[:, kept])  # all heads kept
        assert torch.equal(sb.self_attn.o_proj.weight, tb.self_attn.o_proj.weight[kept])
        assert torch.equal(sb.mlp.down_proj.weight, tb.mlp.down_proj.weight[kept])
        assert torch.equal(sb.input_layernorm.weight, tb.input_layernorm.weight[kept])


def test_a_family_layout_that_misses_a_module_names_the_field(monkeypatch):
    from dataclasses import replace

    monkeypatch.setitem(FAMILIES, "bert", replace(FAMILIES["bert"], mlp_output="output.nope"))
    with pytest.raises(ValueError, match="no module 'output.nope' .the family's mlp_output.*register_family.'bert'"):
        prune_width(encoder("bert"), batches())
