"""Mixed precision end to end: bf16 models with float32 losses, and half-precision inputs that stay finite.

`fp16=True` needs CUDA; on a CPU, accelerate would accept it and silently train in float32, so the trainer
refuses it (checked below). The fp16 guarantees are tested by feeding fp16 tensors to the exact functions the
trainer calls, and on CUDA at the end.
"""

from __future__ import annotations

import pytest
import torch
from helpers import args, bert, bert_config, collate, token_dataset
from helpers import teacher as make_teacher
from torch import nn
from transformers import BertForMaskedLM

from hf_distill import DistillationTrainer, losses
from hf_distill.data.cache import LOGITS_COLUMN, cache_teacher_outputs, hidden_column
from hf_distill.features.taps import Features
from hf_distill.losses.intermediate import IntermediateDistiller
from hf_distill.losses.terms import parse_terms

ALL_TERMS = [
    "loss=hidden_mse,layers=uniform",
    "loss=cosine_loss,layers=last",
    "loss=attention_score_mse,layers=uniform",
    "loss=relation_kl,layers=last,relations=qk;vv",
    "loss=relation_kl,layers=2:4,relations=qq;kk;vv,relation_heads=2,name=rel2",
    "loss=pkd_loss,layers=1:2",
]
TEMPERATURES = (1.0, 2.0, 4.0, 8.0, 20.0)
MAGNITUDE = 60.0


def _record_dtypes(trainer: DistillationTrainer, models: dict[str, nn.Module]) -> dict[str, set]:
    """Dtypes of each model's first query projection output, and of every loss component."""
    seen: dict[str, set] = {name: set() for name in (*models, "components")}
    for name, model in models.items():
        lin = model.bert.encoder.layer[0].attention.self.query
        lin.register_forward_hook(lambda m, i, o, name=name: seen[name].add(o.dtype))
    add = trainer.tracker.add

    def tracked(components):
        seen["components"].update(v.dtype for v in components.values())
        assert all(torch.isfinite(v) for v in components.values()), components
        add(components)

    trainer.tracker.add = tracked
    return seen


def _finite_logs(trainer: DistillationTrainer) -> None:
    for record in trainer.state.log_history:
        for key, value in record.items():
            if key.startswith("loss") or key == "grad_norm":
                assert torch.isfinite(torch.tensor(value)), (key, value)


# ---------------------------------------------------------------- bf16 through the Trainer


def test_bf16_intermediate_terms_run_both_models_in_bf16_and_losses_in_float32(tmp_path):
    student, teacher = bert(2, hidden=16), make_teacher()  # narrower: a float32 projection joins the loss
    a = args(tmp_path, bf16=True, max_steps=2, distill_terms=ALL_TERMS)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=token_dataset(16),
                                  data_collator=collate)
    seen = _record_dtypes(trainer, {"student": student, "teacher": teacher})
    trainer.train()
    assert seen == {"student": {torch.bfloat16}, "teacher": {torch.bfloat16}, "components": {torch.float32}}
    assert all(p.dtype == torch.float32 for p in trainer.intermediate.projections.parameters())
    _finite_logs(trainer)


@pytest.mark.parametrize("cached", ["top-k", "hidden"])
def test_bf16_with_float16_cached_teacher_outputs(tmp_path, cached):
    if cached == "top-k":
        torch.manual_seed(1)
        teacher, student = BertForMaskedLM(bert_config()), BertForMaskedLM(bert_config(layers=2))
        data = cache_teacher_outputs(teacher, token_dataset(16).remove_columns("label"), cache_dir=tmp_path / "c",
                                     top_k=8, dtype=torch.float16, progress=False)
        extra = dict(kd_weight=1.0, task_weight=0.0)
    else:
        teacher, student = make_teacher(), bert(2)
        data = cache_teacher_outputs(teacher, token_dataset(16), cache_dir=tmp_path / "c", hidden_layers=[0, 2, 4],
                                     dtype=torch.float16, progress=False)
        extra = dict(distill_terms=["loss=hidden_mse,layers=uniform", "loss=pkd_loss,layers=1:2"])
    a = args(tmp_path, bf16=True, max_steps=2, **extra)
    trainer = DistillationTrainer(model=student, args=a, train_dataset=data, data_collator=collate)
    seen = _record_dtypes(trainer, {"student": student})
    trainer.train()
    assert seen == {"student": {torch.bfloat16}, "components": {torch.float32}}
    _finite_logs(trainer)


@pytest.mark.parametrize("use_cpu", [True, False])
def test_fp16_on_cpu_is_refused_by_the_trainer(tmp_path, use_cpu):
    """accelerate runs fp16 only on GPUs and other accelerators: on a CPU it would silently train in float32, so
    the trainer refuses it and points to bf16. The arguments still build, so a GPU config parses on a CPU."""
    a = args(tmp_path, fp16=True, max_steps=1, use_cpu=use_cpu)
    if a.device.type != "cpu":
        pytest.skip(f"on {a.device.type} fp16 is real")
    assert a.fp16
    with pytest.raises(ValueError, match=r"fp16=True .*CPU.*bf16=True"):
        DistillationTrainer(model=bert(2), teacher_model=make_teacher(), args=a, train_dataset=token_dataset(8),
                            data_collator=collate)


# ---------------------------------------------------------------- half-precision inputs of magnitude 60


def _half(shape, dtype, seed, sign=1.0) -> torch.Tensor:
    """Values spread over [-60, 60] with both extremes present, as a leaf in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(shape, generator=g) * 2 - 1) * MAGNITUDE * sign
    x.view(-1)[0], x.view(-1)[-1] = MAGNITUDE, -MAGNITUDE
    return x.to(dtype).requires_grad_()


def _assert_finite(loss: torch.Tensor, *leaves: torch.Tensor) -> None:
    assert loss.dtype == torch.float32 and torch.isfinite(loss), loss
    grads = [g for g in torch.autograd.grad(loss, leaves, allow_unused=True) if g is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["kl", "soft_ce", "mse"])
def test_logit_kd_loss_is_finite_for_half_logits_of_magnitude_60(dtype, kind):
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]])
    for temperature in TEMPERATURES:
        for shape, m in (((4, 2), None), ((4, 7), None), ((3, 6, 50), mask)):
            s, t = _half(shape, dtype, 0), _half(shape, dtype, 1, sign=-1.0)  # opposite: the largest divergence
            _assert_finite(losses.logit_kd_loss(kind, s, t, temperature, mask=m), s)
            if kind != "mse" and len(shape) == 3:
                values, indices = t.detach().topk(5, dim=-1)
                _assert_finite(losses.logit_kd_loss(kind, s, (values, indices), temperature, mask=m), s)


def test_trainer_loss_is_finite_for_fp16_models_with_logits_of_magnitude_60(tmp_path):
    """The whole compute_loss (task + kd) with fp16 logits, as an fp16 CUDA run would produce them."""

    class HalfLogits(nn.Module):
        """Two saturated logits (+-60), returned in fp16 like an fp16 model's head."""

        def __init__(self, logits: list[float]) -> None:
            super().__init__()
            self.logits = nn.Parameter(torch.tensor(logits))

        def forward(self, input_ids, attention_mask):
            return self.logits.expand(input_ids.shape[0], -1).half()

    batch = collate([token_dataset(4)[i] for i in range(4)])
    for temperature in TEMPERATURES:
        for kind in ("kl", "soft_ce", "mse"):
            student, teacher = HalfLogits([MAGNITUDE, -MAGNITUDE]), HalfLogits([-MAGNITUDE, MAGNITUDE])
            a = args(tmp_path, kd_loss=kind, temperature=temperature)
            trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
            loss = trainer.compute_loss(student.train(), dict(batch))
            _assert_finite(loss, student.logits)


def _features(request, dims: int, dtype, seed: int, batch: int = 3, length: int = 6) -> Features:
    feats, n = Features(), seed
    for kind in ("hidden", "q", "k", "v"):
        for layer in sorted(getattr(request, kind)):
            n += 1
            getattr(feats, kind)[layer] = _half((batch, length, dims), dtype, n)
    return feats


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_intermediate_losses_are_finite_for_half_features_of_magnitude_60(tmp_path, dtype):
    distiller = IntermediateDistiller(parse_terms(ALL_TERMS), bert(2, hidden=16), make_teacher(), "shared")
    s = _features(distiller.student_taps.request, 16, dtype, seed=0)
    t = _features(distiller.teacher_request, 32, dtype, seed=100)
    for feats in t.hidden, t.q, t.k, t.v:
        for key in feats:
            feats[key] = feats[key].detach()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]])
    out = distiller.losses(s, t, mask)
    assert set(out) == set(distiller.component_names())
    leaves = [x for d in (s.hidden, s.q, s.k, s.v) for x in d.values()] + list(distiller.projections.parameters())
    for name, value in out.items():
        _assert_finite(value, *[x for x in leaves if x.requires_grad])
        assert value >= 0, name  # saturated relations (v.v peaks on the diagonal) may give exactly 0


# ---------------------------------------------------------------- on CUDA (skipped elsewhere; run on a GPU machine)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CUDA_PRECISIONS = ["bf16", "fp16"]


@cuda
@pytest.mark.parametrize("precision", CUDA_PRECISIONS)
def test_cuda_half_precision_runs_both_models_in_half_and_losses_in_float32(tmp_path, precision):
    student, teacher = bert(2, hidden=16), make_teacher()
    a = args(tmp_path, use_cpu=False, max_steps=3, distill_terms=ALL_TERMS, **{precision: True})
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, train_dataset=token_dataset(24),
                                  data_collator=collate)
    seen = _record_dtypes(trainer, {"student": student, "teacher": teacher})
    trainer.train()
    half = torch.bfloat16 if precision == "bf16" else torch.float16
    assert next(trainer.teacher.parameters()).device.type == "cuda"
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert seen == {"student": {half}, "teacher": {half}, "components": {torch.float32}}
    _finite_logs(trainer)


@cuda
@pytest.mark.parametrize("kind", ["kl", "soft_ce", "mse"])
def test_cuda_fp16_logit_kd_loss_is_finite_at_magnitude_60(kind):
    """The same guarantee as the CPU test above, on CUDA's own fp16 kernels."""
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], device="cuda")
    for temperature in TEMPERATURES:
        for shape, m in (((4, 2), None), ((3, 6, 50), mask)):
            s = _half(shape, torch.float16, 0).detach().cuda().requires_grad_()
            t = _half(shape, torch.float16, 1, sign=-1.0).detach().cuda()
            _assert_finite(losses.logit_kd_loss(kind, s, t, temperature, mask=m), s)


@cuda
def test_cuda_sdpa_student_gives_the_eager_loss_for_every_term(tmp_path):
    """Taps capture Q/K/V by hooks, so an SDPA model (the CUDA default) must give the loss eager attention gives."""
    batch = collate([token_dataset(8)[i] for i in range(8)])
    results = {}
    for impl in ("sdpa", "eager"):
        student, teacher = bert(2, hidden=16).cuda(), make_teacher().cuda()
        student.set_attn_implementation(impl)
        teacher.set_attn_implementation(impl)
        a = args(tmp_path / impl, use_cpu=False, distill_terms=ALL_TERMS)
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=a, data_collator=collate)
        loss = trainer.compute_loss(trainer.model.train(), {k: v.cuda() for k, v in batch.items()})
        results[impl] = loss.detach()
    torch.testing.assert_close(results["sdpa"], results["eager"], atol=1e-4, rtol=1e-4)


@cuda
def test_cuda_cached_teacher_outputs_equal_the_online_forward(tmp_path):
    teacher, data = make_teacher().cuda(), token_dataset(24)
    cached = cache_teacher_outputs(teacher, data, cache_dir=tmp_path / "c", hidden_layers=[0, 2, 4], progress=False)
    teacher.eval()
    for i in range(len(data)):
        ids = torch.tensor([data[i]["input_ids"]], device="cuda")
        with torch.no_grad():
            ref = teacher(input_ids=ids, output_hidden_states=True)
        row = cached[i]
        torch.testing.assert_close(torch.tensor(row[LOGITS_COLUMN]), ref.logits[0].cpu(), atol=1e-5, rtol=1e-5)
        for layer in (0, 2, 4):
            torch.testing.assert_close(torch.tensor(row[hidden_column(layer)]), ref.hidden_states[layer][0].cpu(),
                                       atol=1e-5, rtol=1e-5)
