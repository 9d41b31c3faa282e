"""Decoder-only families: feature taps, causal/GQA attention and relation terms (hf_distill.features.taps, .losses,
.intermediate). Tiny random models of every registered decoder family, each test a few seconds at most."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from decoder_models import DECODERS, ROTARY, decoder, lm_batch
from helpers import args, bert, collate, flat_params, labelled_collate, sft_rows

from hf_distill import DistillationTrainer, losses
from hf_distill.features.taps import FeatureTaps, ModelInfo, TapRequest, attention_scores, expand_kv, model_info
from hf_distill.losses.intermediate import IntermediateDistiller
from hf_distill.losses.terms import parse_terms


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


@pytest.mark.parametrize("family", DECODERS)
def test_hidden_taps_equal_output_hidden_states(family):
    model = decoder(family)
    layers = set(range(model.config.num_hidden_layers + 1))
    tap = FeatureTaps(model, TapRequest(hidden=layers))
    batch = _inputs(lm_batch())
    with torch.no_grad(), tap.capture() as feats:
        reference = model(**batch, output_hidden_states=True).hidden_states
    assert len(reference) == len(layers)
    for i in layers:  # [0] the (scaled, for Gemma) embeddings, [-1] after the final norm, as transformers returns
        assert torch.equal(feats.hidden[i], reference[i]), i


@pytest.mark.parametrize("family", DECODERS)
def test_attention_probabilities_from_taps_equal_eager_attentions(family):
    """Rotated (rotary families), GQA-repeated scores with future and padded keys masked give exactly the
    model's own attention probabilities (eager), for every real query."""
    model = decoder(family)
    info = model_info(model)
    layers = set(range(1, 4))
    tap = FeatureTaps(model, TapRequest(q=layers, k=layers, v=layers))
    batch = _inputs(lm_batch())
    with torch.no_grad(), tap.capture() as feats:
        model(**batch)
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        attentions = eager(**batch, output_attentions=True).attentions
    assert (feats.rope is not None) == (family in ROTARY)
    heads, kv, dh = info.num_heads, info.num_kv_heads, info.head_dim
    assert (heads, kv) == ((4, 4) if family == "gpt2" else (4, 2))
    real = batch["attention_mask"].bool()
    t = real.shape[1]
    allowed = real[:, None, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
    for i in layers:
        assert feats.q[i].shape[-1] == heads * dh and feats.k[i].shape[-1] == feats.v[i].shape[-1] == kv * dh
        scores = attention_scores(feats.q[i], feats.k[i], heads, kv, feats.rope)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        rows = real[:, None, :, None].expand_as(probs)
        torch.testing.assert_close(probs[rows], attentions[i - 1][rows], atol=1e-6, rtol=0)


def test_fused_qkv_slices_equal_the_models_own_split():
    """GPT-2's c_attn and Phi-3's qkv_proj: the captured q/k/v are the slices the attention module uses."""
    for family in ("gpt2", "phi3"):
        model = decoder(family)
        tap = FeatureTaps(model, TapRequest(q={2}, k={2}, v={2}))
        batch = _inputs(lm_batch())
        block = model.base_model.get_submodule(model_info(model).family.layers)[1]
        fused = block.attn.c_attn if family == "gpt2" else block.self_attn.qkv_proj
        seen = {}
        handle = fused.register_forward_hook(lambda _m, _i, out, seen=seen: seen.__setitem__("out", out))
        with torch.no_grad(), tap.capture() as feats:
            model(**batch)
        handle.remove()
        q_w, kv_w = (32, 32) if family == "gpt2" else (32, 16)
        q, k, v = seen["out"].split((q_w, kv_w, kv_w), dim=-1)
        assert torch.equal(feats.q[2], q) and torch.equal(feats.k[2], k) and torch.equal(feats.v[2], v)


def test_expand_kv_matches_repeat_kv():
    x = torch.randn(2, 5, 2 * 3)
    out = expand_kv(x, num_heads=4, num_kv_heads=2)
    heads = out.view(2, 5, 4, 3)
    src = x.view(2, 5, 2, 3)
    for j in range(4):
        assert torch.equal(heads[:, :, j], src[:, :, j // 2])
    with pytest.raises(ValueError, match="does not divide"):
        expand_kv(torch.randn(1, 2, 9), num_heads=4, num_kv_heads=3)


def _tril_pairs(mask):
    real = mask.bool()
    t = real.shape[1]
    return real[:, :, None] & real[:, None, :] & torch.ones(t, t, dtype=torch.bool).tril()


def test_causal_attention_score_mse_ignores_future_keys_and_equals_hand_mean():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 3, 5, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    pairs = _tril_pairs(mask)[:, None].expand_as(s)
    want = (s - t)[pairs].square().mean()
    got = losses.attention_score_mse(s, t, mask, causal=True)
    torch.testing.assert_close(got, want)
    future = ~torch.ones(5, 5, dtype=torch.bool).tril()
    noisy = s + future * 1e3  # anything above the diagonal is not part of the causal loss
    torch.testing.assert_close(losses.attention_score_mse(noisy, t, mask, causal=True), want)
    assert losses.attention_score_mse(noisy, t, mask) > 10 * want  # the bidirectional loss does see it
    no_mask = (s - t)[_tril_pairs(torch.ones(2, 5))[:, None].expand_as(s)].square().mean()
    torch.testing.assert_close(losses.attention_score_mse(s, t, causal=True), no_mask)


def _hand_causal_relation_kl(sa, sb, ta, tb, heads, mask):
    """Per example: mean over heads and real queries of KL over real keys not after the query."""
    total, n = 0.0, 0
    for b in range(sa.shape[0]):
        idx = mask[b].nonzero().flatten().tolist()
        if not idx:
            continue
        kl_sum = 0.0
        for h in range(heads):
            def rel(a, c, b=b, h=h):
                d = a.shape[-1] // heads
                a_h, c_h = a[b, :, h * d : (h + 1) * d], c[b, :, h * d : (h + 1) * d]
                return a_h @ c_h.T / math.sqrt(d)
            rs, rt = rel(sa, sb), rel(ta, tb)
            for qi in idx:
                keys = [k for k in idx if k <= qi]
                p = rt[qi, keys].softmax(-1)
                kl_sum += (p * (p.log() - rs[qi, keys].log_softmax(-1))).sum().item()
        total += kl_sum / (heads * len(idx))
        n += 1
    return total / n


def test_causal_relation_kl_masks_future_keys():
    g = torch.Generator().manual_seed(1)
    sa, sb = torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    ta, tb = torch.randn(2, 5, 12, generator=g), torch.randn(2, 5, 12, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    got = losses.relation_kl(sa, sb, ta, tb, 2, mask, causal=True)
    assert got.item() == pytest.approx(_hand_causal_relation_kl(sa, sb, ta, tb, 2, mask), rel=1e-5)
    assert got.item() != pytest.approx(losses.relation_kl(sa, sb, ta, tb, 2, mask).item(), rel=1e-3)
    # a later token's keys cannot reach an earlier query: changing the last key changes only the last row
    sb2 = sb.clone()
    sb2[:, -1] += 5.0
    only_first_rows = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    torch.testing.assert_close(
        losses.relation_kl(sa, sb2, ta, tb, 2, only_first_rows, causal=True),
        losses.relation_kl(sa, sb, ta, tb, 2, only_first_rows, causal=True),
    )
    # gradients stay finite with padding (a padded query's row is never all -inf)
    sa.requires_grad_(True)
    losses.relation_kl(sa, sb, ta, tb, 2, mask, causal=True).backward()
    assert torch.isfinite(sa.grad).all()


TERMS = [
    "loss=hidden_mse,layers=0:0;2:3,weight=1,name=hidden",
    "loss=attention_score_mse,layers=1:2;2:3,weight=1,name=attention",
    "loss=relation_kl,layers=last,relations=qk;vv,weight=1,name=relation",
    "loss=relation_kl,layers=last,relations=qq;kk;vv,relation_heads=2,weight=1,name=rel2",
]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "gpt2"])
def test_decoder_terms_equal_hand_computation(family):
    """Every term of a decoder pair, from the distiller, equals the causal losses of hand-prepared features:
    rotated, GQA-repeated scores for attention; pre-rotary Q and repeated K/V for relations."""
    student, teacher = decoder(family, layers=2, seed=3), decoder(family, layers=3, seed=4)
    dist = IntermediateDistiller(parse_terms(TERMS), student, teacher, "none")
    batch = _inputs(lm_batch())
    mask = batch["attention_mask"]
    with torch.no_grad():
        _, s = dist.student_taps.run(student, batch)
        _, t = dist.teacher_taps.run(teacher, batch)
        got = dist.losses(s, t, mask)
        s_hs = student(**batch, output_hidden_states=True).hidden_states
        t_hs = teacher(**batch, output_hidden_states=True).hidden_states
    si, ti = model_info(student), model_info(teacher)
    assert si.causal and ti.causal
    H, kv = si.num_heads, si.num_kv_heads

    def rel(f, kind, i, info):
        x = getattr(f, kind)[i]
        return x if kind == "q" else expand_kv(x, info.num_heads, info.num_kv_heads)

    want = {
        "hidden": losses.hidden_mse(s_hs[0], t_hs[0], mask) + losses.hidden_mse(s_hs[2], t_hs[3], mask),
        "attention": sum(
            losses.attention_score_mse(
                attention_scores(s.q[a], s.k[a], H, kv, s.rope), attention_scores(t.q[b], t.k[b], H, kv, t.rope),
                mask, causal=True,
            )
            for a, b in ((1, 2), (2, 3))
        ),
        "relation_qk": losses.relation_kl(
            s.q[2], rel(s, "k", 2, si), t.q[3], rel(t, "k", 3, ti), H, mask, causal=True
        ),
        "relation_vv": losses.relation_kl(
            rel(s, "v", 2, si), rel(s, "v", 2, si), rel(t, "v", 3, ti), rel(t, "v", 3, ti), H, mask, causal=True
        ),
    }
    for kind in "qkv":
        pair = (rel(s, kind, 2, si), rel(t, kind, 3, ti))
        want[f"rel2_{kind * 2}"] = losses.relation_kl(*pair[:1], *pair[:1], *pair[1:], *pair[1:], 2, mask, causal=True)
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)
        assert torch.isfinite(value) and value > 0, name
    assert dist.count_kinds()["attention"] == "causal_pairs"


def test_decoder_and_encoder_cannot_share_attention_terms():
    student, teacher = decoder("llama", layers=2), bert(layers=2)
    for term in ("loss=attention_score_mse,layers=last", "loss=relation_kl,layers=last,relations=qk"):
        with pytest.raises(ValueError, match="causal decoder .*llama.* the teacher is not"):
            IntermediateDistiller(parse_terms([term]), student, teacher, "none")


def test_relation_heads_must_divide_the_qkv_width_not_the_hidden_size():
    # head_dim 16 with 4 heads: Q/K/V are 64 wide while hidden is 32 (as Gemma's head_dim is set apart)
    student = decoder("gemma", layers=2, head_dim=16)
    teacher = decoder("gemma", layers=2, head_dim=16, seed=1)
    assert model_info(student).q_width == 64
    IntermediateDistiller(parse_terms(["loss=relation_kl,layers=last,relations=qq,relation_heads=64"]),
                          student, teacher, "none")
    with pytest.raises(ValueError, match="relation_heads=3 does not divide the student's Q/K/V width 64"):
        IntermediateDistiller(parse_terms(["loss=relation_kl,layers=last,relations=qq,relation_heads=3"]),
                              student, teacher, "none")


def test_fused_projection_that_the_config_does_not_describe_is_refused():
    model = decoder("phi3")
    model.config.num_key_value_heads = 4  # now Q + 2 K/V would be 96 wide; qkv_proj is 64
    with pytest.raises(ValueError, match=r"fused projection 'self_attn.qkv_proj' is 64 wide.*32 \+ 2 \* 32"):
        FeatureTaps(model, TapRequest(q={1}))


def test_cached_teacher_with_decoder_student_gets_the_cache_error():
    student = decoder("llama", layers=2)
    cached = ModelInfo(num_layers=3, hidden_size=32, num_heads=4, family=None, model_type="llama")
    with pytest.raises(ValueError, match="hf_distill.data.cache does not store"):
        IntermediateDistiller(parse_terms(["loss=attention_score_mse,layers=last"]), student, cached, "none")


def _lm_rows(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(3, 12, (1,), generator=g))
        rows.append({"input_ids": torch.randint(3, 128, (length,), generator=g).tolist()})
    return Dataset.from_list(rows)


def _lm_collate(features):
    batch = collate(features)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


@pytest.mark.slow
def test_decoder_terms_under_gradient_accumulation_match_one_big_batch(tmp_path):
    """Causal attention scores are normalised by the step's (query, key <= query) pairs: two micro-batches of
    different lengths give the big batch's update and logged values."""
    terms = ["loss=hidden_mse,layers=uniform,name=hidden", "loss=attention_score_mse,layers=uniform,name=attention",
             "loss=relation_kl,layers=last,relations=qk;vv,name=relation"]
    common = dict(max_steps=2, optim="sgd", learning_rate=0.5, distill_terms=terms, kd_weight=0.5, task_weight=0.5)
    runs = []
    for name, extra in (("big", dict(per_device_train_batch_size=8)),
                        ("acc", dict(per_device_train_batch_size=4, gradient_accumulation_steps=2))):
        trainer = DistillationTrainer(model=decoder("llama", layers=2, seed=0).train(),
                                      teacher_model=decoder("llama", layers=4, seed=1),
                                      args=args(tmp_path / name, **common, **extra), train_dataset=_lm_rows(),
                                      data_collator=_lm_collate)
        trainer.train()
        runs.append(trainer)
    big, acc = runs
    torch.testing.assert_close(flat_params(acc.model), flat_params(big.model), atol=1e-6, rtol=0)
    logs = [[r for r in t.state.log_history if "loss" in r] for t in (big, acc)]
    assert logs[0] and all("loss_attention" in r and r["loss_attention"] > 0 for r in logs[0])
    for a, b in zip(*logs, strict=True):
        for key in ("loss", "loss_hidden", "loss_attention", "loss_relation_qk", "loss_relation_vv"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), key


@pytest.mark.slow
def test_sliding_window_blocks_refuse_batches_longer_than_the_window():
    # Gemma-2 layer_types: sliding, full, sliding; window 4 < the batch's 7 tokens
    student, teacher = decoder("gemma2", layers=3, sliding_window=4), decoder("gemma2", layers=3, seed=1)
    assert model_info(student).windows == (4, None, 4)
    batch = _inputs(lm_batch())
    cases = (("loss=attention_score_mse,layers=1:1,name=att", True),
             ("loss=attention_score_mse,layers=2:2,name=att", False),
             ("loss=relation_kl,layers=3:3,relations=vv,name=rel", True))
    for term, bad in cases:
        dist = IntermediateDistiller(parse_terms([term]), student, teacher, "none")
        with torch.no_grad():
            _, s = dist.student_taps.run(student, batch)
            _, t = dist.teacher_taps.run(teacher, batch)
        if bad:
            with pytest.raises(ValueError, match="block [13] of the student uses sliding-window attention .window 4."):
                dist.losses(s, t, batch["attention_mask"])
        else:
            assert torch.isfinite(dist.losses(s, t, batch["attention_mask"])["att"])
    short = {k: v[:, :4] for k, v in batch.items()}  # no longer than the window: sliding = full causal
    dist = IntermediateDistiller(parse_terms([cases[0][0]]), student, teacher, "none")
    with torch.no_grad():
        _, s = dist.student_taps.run(student, short)
        _, t = dist.teacher_taps.run(teacher, short)
    assert torch.isfinite(dist.losses(s, t, short["attention_mask"])["att"])
    assert model_info(decoder("mistral", layers=2, sliding_window=16)).windows == (16, 16)


@pytest.mark.slow
def test_causal_defaults_distil_the_completion_at_temperature_1(tmp_path):
    """A TRL/SFT user's rows mask the prompt with -100 in `labels`. Given nothing, a causal-LM student's KD term
    is GKD's: T = 1 KL on the completion tokens only (the ones its own loss counts), not T = 2 over the prompt too."""
    student, teacher = decoder("llama", layers=2, seed=0), decoder("llama", layers=3, seed=1)
    trainer = DistillationTrainer(model=student, teacher_model=teacher,
                                  args=args(tmp_path, kd_weight=1.0, task_weight=0.0), train_dataset=sft_rows(8),
                                  data_collator=labelled_collate)
    batch = labelled_collate([sft_rows(8)[i] for i in range(8)])
    real = batch["attention_mask"].bool()
    assert (batch["labels"] == -100)[real].any()  # the prompts are masked
    loss = trainer.compute_loss(student.train(), dict(batch))
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    with torch.no_grad():
        s, t = student(**inputs).logits, teacher(**inputs).logits
    completion = batch["labels"][:, 1:] != -100
    assert loss.item() == pytest.approx(losses.kl_div(s[:, :-1], t[:, :-1], 1.0, mask=completion).item(), rel=1e-5)
    every_token = losses.kl_div(s[:, :-1], t[:, :-1], 2.0, mask=real[:, :-1] & real[:, 1:])  # the encoder defaults
    assert abs(loss.item() - every_token.item()) > 1e-3 * every_token.item()
