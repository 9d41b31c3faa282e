"""Early exit (FastBERT): branches, self-distillation through DistillationTrainer, adaptive inference, saving."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import helpers
import pytest
import torch
from hub_server import FakeHub, tiny_tokenizer
from safetensors.torch import load_file
from test_hub import online
from torch import nn
from transformers import AutoModelForSequenceClassification, BertForMaskedLM

from hf_distill import DistillationTrainer
from hf_distill.features import families
from hf_distill.students.early_exit import (
    BRANCH_CONFIG_FILE,
    BRANCH_FILE,
    PLOT_FILE,
    EarlyExitModel,
    ExitBranch,
    PoolerBranch,
    block_flops,
    flops_per_row,
    row_uncertainties,
    uncertainty,
)


def batch(n: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    b = helpers.collate(helpers.token_dataset(n, seed=seed).to_list())
    b.pop("labels")
    return b


def wrapped(layers: int = 4, seed: int = 1) -> EarlyExitModel:
    model = helpers.teacher(layers=layers, seed=seed)
    model.eval()
    return EarlyExitModel(model)


class ByLength(nn.Module):
    """A fake branch whose prediction is a function of each row's length (rows are identified by length)."""

    def __init__(self, table: dict[int, torch.Tensor], num_labels: int = 2) -> None:
        super().__init__()
        self.table, self.num_labels = table, num_labels

    def forward(self, hidden, attention_mask):
        lengths = attention_mask.sum(-1).tolist()
        return torch.stack([self.table.get(n, torch.zeros(self.num_labels)) for n in lengths])


def block_batch_sizes(model: EarlyExitModel) -> tuple[dict[int, list[int]], list]:
    seen: dict[int, list[int]] = {i: [] for i in range(model.num_exits)}
    handles = []
    for i, block in enumerate(model._blocks):
        def hook(_m, args, kwargs, _i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[_i].append(hidden.shape[0])
        handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


# ---------------------------------------------------------------------- branches


def test_branch_shape_and_padding_mask():
    torch.manual_seed(0)
    branch = ExitBranch(hidden_size=32, num_labels=3)
    hidden = torch.randn(4, 7, 32)
    mask = torch.ones(4, 7, dtype=torch.long)
    mask[:, 5:] = 0
    out = branch(hidden, mask)
    assert out.shape == (4, 3)
    changed_pad = hidden.clone()
    changed_pad[:, 5:] += 100.0
    torch.testing.assert_close(branch(changed_pad, mask), out)  # padded keys are masked out
    changed_real = hidden.clone()
    changed_real[:, 3] += 1.0
    assert not torch.allclose(branch(changed_real, mask), out)
    assert branch.down.out_features == 128 and branch.attention.num_heads == 2  # FastBERT's sizes


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_branch_attention_equals_multihead_attention(masked, folded):
    """The written-out attention (and its folded inference form) is nn.MultiheadAttention's at the first token."""
    torch.manual_seed(1)
    branch = ExitBranch(hidden_size=32, num_labels=3).eval()
    hidden = torch.randn(3, 6, 32)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]]) if masked else None
    with torch.no_grad():
        x = torch.tanh(branch.down(hidden))
        pooled, _ = branch.attention(x, x, x, key_padding_mask=None if mask is None else mask == 0,
                                     need_weights=False)
        want = branch.out(torch.tanh(branch.pool(pooled[:, 0])))
    with torch.set_grad_enabled(not folded):
        got = branch(hidden, mask)
    assert got.requires_grad != folded  # grad enabled: the reference form; eval + no grad: the folded one
    torch.testing.assert_close(got.detach(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("width,heads", [(128, 2), (64, 4), (16, 1)])
def test_folded_branch_equals_the_reference_and_follows_weight_changes(width, heads):
    torch.manual_seed(width + heads)
    branch = ExitBranch(hidden_size=24, num_labels=4, width=width, heads=heads).eval()
    hidden = torch.randn(5, 9, 24)
    mask = torch.ones(5, 9, dtype=torch.long)
    mask[1, 4:], mask[3, 7:] = 0, 0

    def check() -> None:
        for h, m in ((hidden, mask), (hidden, None), (hidden[3:4, :7], None)):  # the last: batch 1's 2-D path
            with torch.no_grad():
                got = branch(h, m)
            torch.testing.assert_close(got, branch._reference(h, m).detach(), atol=1e-5, rtol=1e-4)

    check()
    cached = branch._fold
    check()
    assert branch._fold is cached  # reused while no weight changes
    optimizer = torch.optim.SGD(branch.parameters(), lr=0.05)  # an optimizer step, in eval mode
    for p in branch.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    check()
    with torch.no_grad():  # an in-place edit by hand: dropped explicitly, as documented
        for p in branch.parameters():
            p.add_(0.05 * torch.randn_like(p))
    branch.drop_fold()
    check()
    branch.load_state_dict(ExitBranch(24, 4, width, heads).state_dict())
    check()
    replaced = nn.Parameter(torch.randn_like(branch.pool.weight))
    with torch.no_grad():
        while replaced._version < branch.pool.weight._version:
            replaced.add_(0.0)  # the same version as the parameter it replaces: only its identity tells them apart
    branch.pool.weight = replaced
    check()
    assert branch._fold is not None
    branch.half().float()  # conversions drop the cache: they may swap `.data` in place (same objects, versions)
    assert branch._fold is None
    check()
    branch.double()
    hidden = hidden.double()
    check()
    branch.train().eval()
    assert branch._fold is None  # train()/eval() drop the folded weights (the documented way after .data edits)


def test_inference_mode_weights_are_folded_on_every_call():
    """Tensors made under inference_mode carry no version counter: nothing is cached, every call folds afresh."""
    with torch.inference_mode():
        branch = ExitBranch(hidden_size=24, num_labels=2, width=16, heads=2).eval()
        hidden = torch.randn(2, 5, 24)
        torch.testing.assert_close(branch(hidden), branch._reference(hidden, None), atol=1e-5, rtol=1e-4)
        assert branch._fold is None
        branch.pool.weight.add_(0.5)  # a folded weight: a stale fold would miss it
        torch.testing.assert_close(branch(hidden), branch._reference(hidden, None), atol=1e-5, rtol=1e-4)


def test_inference_mode_branches_are_folded_only_when_reached(monkeypatch):
    with torch.inference_mode():
        ee = wrapped(layers=4).eval()
        folds = []
        plain = ExitBranch.inference_weights
        monkeypatch.setattr(ExitBranch, "inference_weights", lambda self: folds.append(1) or plain(self))
        res = ee.exit_forward(speed=1.0, **batch(4))  # every row leaves at the first branch
    assert res.exit_layer.tolist() == [1] * 4
    assert len(folds) == 1  # not folded up front for the branches no row reaches: nothing could be cached


def test_predict_keeps_the_folded_weights(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    ee = EarlyExitModel(helpers.teacher(seed=2, vocab_size=len(tok)).eval())
    ee.eval()
    ee.predict(["good movie"], tok, speed=0.5)
    cached = ee.branches[0]._fold
    assert cached is not None
    ee.predict(["not a great film at all"], tok, speed=0.5)
    assert ee.branches[0]._fold is cached  # predict on a model in eval mode does not refold


def test_deebert_off_ramp_reads_the_first_token_only():
    torch.manual_seed(2)
    ee = EarlyExitModel(helpers.teacher(layers=3, seed=2).eval(), branch="deebert")
    assert all(isinstance(b, PoolerBranch) for b in ee.branches) and len(ee.branches) == 2
    branch = ee.branches[0]
    assert (branch.dense.in_features, branch.dense.out_features, branch.out.out_features) == (32, 32, 2)
    hidden = torch.randn(4, 7, 32)
    out = branch(hidden)
    changed = hidden.clone()
    changed[:, 1:] += 5.0
    torch.testing.assert_close(branch(changed), out)  # pooler: first token only
    changed[:, 0] += 0.5
    assert not torch.allclose(branch(changed), out)
    with torch.no_grad():  # the module-free form adaptive inference runs
        torch.testing.assert_close(branch.infer(branch.inference_weights(), hidden), out.detach())


def test_flops_per_row_counts_what_runs():
    """The analytic count equals torch's FLOP counter on a block and on a branch as adaptive inference runs it."""
    from torch.utils.flop_counter import FlopCounterMode

    model = helpers.teacher(layers=2, seed=0, attn_implementation="eager").eval()  # attention as counted matmuls
    cfg = model.config
    tokens = 7
    hidden = torch.randn(1, tokens, cfg.hidden_size)
    branch = ExitBranch(cfg.hidden_size, num_labels=3, width=16, heads=2).eval()
    mask = torch.ones(1, tokens, dtype=torch.long)
    with torch.no_grad():
        branch(hidden, mask)  # folds the weights once (cached): not per-row work
        with FlopCounterMode(display=False) as block_count:
            model.bert.encoder.layer[0](hidden)
        with FlopCounterMode(display=False) as branch_count:
            branch(hidden, mask)
        pooler = PoolerBranch(cfg.hidden_size, num_labels=3).eval()
        with FlopCounterMode(display=False) as pooler_count:
            pooler(hidden, mask)
    assert block_count.get_total_flops() == block_flops(tokens, cfg.hidden_size, cfg.intermediate_size)
    assert branch_count.get_total_flops() == branch.flops(tokens)
    assert pooler_count.get_total_flops() == pooler.flops(tokens)
    args = (tokens, cfg.hidden_size, cfg.intermediate_size)
    assert flops_per_row(3, 2, *args, branch) == 3 * block_flops(*args) + 2 * branch.flops(tokens)


def test_one_branch_per_block_but_the_last_and_frozen_backbone():
    model = wrapped(layers=4)
    assert model.num_exits == 4 and len(model.branches) == 3
    assert not any(p.requires_grad for p in model.model.parameters())
    model.train()
    assert not model.model.training and model.branches[0].training  # the teacher never drops out
    out = model(**batch())
    assert [t.shape for t in out.exit_logits] == [(8, 2)] * 3
    assert sorted(out.distill_losses) == ["exit_1", "exit_2", "exit_3"]
    torch.testing.assert_close(out.loss, sum(out.distill_losses.values()))
    out.loss.backward()
    assert all(p.grad is not None for p in model.branches.parameters())
    assert all(p.grad is None for p in model.model.parameters())


# ---------------------------------------------------------------------- adaptive inference


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
@pytest.mark.parametrize("make", [helpers.teacher, helpers.distilbert])
def test_speed_zero_reproduces_the_model_exactly(make, branch):
    model = make(seed=3)
    model.eval()
    ee = EarlyExitModel(model, branch=branch)
    b = batch(16)
    res = ee.exit_forward(speed=0.0, **b)
    assert torch.equal(res.logits, model(**b).logits)
    assert res.exit_layer.tolist() == [ee.num_exits] * 16
    assert ee.exit_forward(**b).logits.equal(res.logits)  # no rule: same


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_batched_exits_equal_row_by_row_exits(branch):
    """A padded batch (masked branches) leaves as each row run alone without padding (unmasked path)."""
    ee = EarlyExitModel(helpers.teacher(layers=4, seed=5).eval(), branch=branch)
    with torch.no_grad():
        for b in ee.branches:
            b.out.weight.mul_(30.0)  # spread the branches' uncertainties over [0, 1]
    ee.eval()
    b = batch(12, seed=3)
    lengths = b["attention_mask"].sum(-1).tolist()
    assert len(set(lengths)) > 1
    with torch.no_grad():
        values = sorted(uncertainty(x).item() for x in torch.cat(ee(**b).exit_logits).split(1))
    # the threshold sits in the widest gap between branch uncertainties, so no rounding can move a row across it
    inner = [v for v in values if 0.05 < v < 0.95]
    speed = max(((hi - lo, (lo + hi) / 2) for lo, hi in zip(inner, inner[1:])), default=(0, 0.5))[1]
    batched = ee.exit_forward(speed=speed, **b)
    assert len(set(batched.exit_layer.tolist())) > 1  # rows left at different layers
    for i, n in enumerate(lengths):
        alone = ee.exit_forward(speed=speed, **{k: v[i : i + 1, :n] for k, v in b.items()})
        assert alone.exit_layer.item() == batched.exit_layer[i].item()
        torch.testing.assert_close(alone.logits[0], batched.logits[i], atol=1e-4, rtol=1e-4)


def test_exited_rows_are_removed_from_later_blocks():
    ee = wrapped(layers=4)
    b = batch(8)
    lengths = b["attention_mask"].sum(-1)
    short = lengths <= int(lengths.median())
    confident = torch.tensor([10.0, -10.0])
    ee.branches[0] = ByLength({int(n): confident for n in lengths[short].tolist()})
    seen, handles = block_batch_sizes(ee)
    try:
        res = ee.exit_forward(speed=0.5, **b)
    finally:
        for h in handles:
            h.remove()
    n_short = int(short.sum())
    assert 0 < n_short < 8
    assert seen == {0: [8], 1: [8 - n_short], 2: [8 - n_short], 3: [8 - n_short]}
    assert res.branch_calls == 8 + 2 * (8 - n_short)  # branch 1 on every row, branches 2 and 3 on those left
    assert res.exit_layer[short].tolist() == [1] * n_short
    assert res.exit_layer[~short].tolist() == [4] * (8 - n_short)
    torch.testing.assert_close(res.logits[short], confident.expand(n_short, 2))
    # The rows that stayed get the full model's logits: their masks were sliced along with them.
    full = ee.model(**b).logits
    torch.testing.assert_close(res.logits[~short], full[~short], atol=1e-5, rtol=1e-5)


def test_all_rows_leaving_stops_the_forward():
    ee = wrapped(layers=4)
    seen, handles = block_batch_sizes(ee)
    try:
        res = ee.exit_forward(speed=1.0, **batch(8))  # an untrained branch is never certain: uncertainty < 1
    finally:
        for h in handles:
            h.remove()
    assert res.exit_layer.tolist() == [1] * 8
    assert seen == {0: [8], 1: [], 2: [], 3: []}
    with torch.no_grad():
        torch.testing.assert_close(res.logits, ee(**batch(8)).exit_logits[0])  # each row's logits from branch 1


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_branch_hooks_subclasses_and_train_mode_are_honoured(branch, monkeypatch):
    """Adaptive inference calls a branch as a module wherever its module-free path would not do the same."""
    confident = torch.tensor([[10.0, -10.0]])
    ee = EarlyExitModel(helpers.teacher(layers=4, seed=1).eval(), branch=branch).eval()
    b = batch(4)
    calls = []
    handle = ee.branches[1].register_forward_hook(lambda _m, _a, out: calls.append(1) or confident.expand_as(out))
    res = ee.exit_forward(speed=0.5, **b)
    handle.remove()
    assert calls == [1] and res.exit_layer.tolist() == [2] * 4  # the hook ran, and its output decided
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, _a, _o: seen.append(m) if m is ee.branches[0] else None)
    try:
        ee.exit_forward(speed=0.5, **b)
    finally:
        handle.remove()
    assert seen == [ee.branches[0]]  # global module hooks see the branches too

    base = type(ee.branches[0])
    forwards = []
    plain_forward = base.forward
    monkeypatch.setattr(base, "forward", lambda self, *a, **k: forwards.append(self.training) or plain_forward(
        self, *a, **k))
    folds = []
    plain_weights = base.inference_weights
    monkeypatch.setattr(base, "inference_weights", lambda self: folds.append(self) or plain_weights(self))
    ee.exit_forward(speed=0.5, **b)
    # Every branch is called as the module it is (its hooks, the global ones and a subclass's forward run), and in
    # eval mode its forward takes the inference path. (Before issue #30 adaptive inference skipped the module call where
    # it read no hooks in torch's private dicts: `forwards == []` here.)
    assert forwards == [False] * 3 and folds == list(ee.branches)
    ee.branches[0].train()  # train mode: the module's own forward (FastBERT's: the reference form)
    ee.exit_forward(speed=0.5, **b)
    assert forwards[3:] == [True, False, False] and folds[3:] == list(ee.branches)[1:]
    ee.branches[0].eval()

    class Sure(base):
        def forward(self, hidden, attention_mask=None):
            return confident.expand(hidden.shape[0], 2)

    ee.branches[2].__class__ = Sure  # the same branch, as a subclass with its own forward
    assert ee.exit_forward(speed=0.5, **b).exit_layer.tolist() == [3] * 4  # the subclass's forward ran


@pytest.mark.parametrize("block_hook", [False, True])  # with or without a hook of the user's on a block
def test_nothing_stays_attached_when_a_branch_fails_after_rows_left(block_hook):
    ee = wrapped(layers=4)
    b = batch(8)
    user = list(ee._blocks)[3].register_forward_hook(lambda *_: None) if block_hook else None
    lengths = b["attention_mask"].sum(-1)
    short = lengths <= int(lengths.median())
    ee.branches[0] = ByLength({int(n): torch.tensor([10.0, -10.0]) for n in lengths[short].tolist()})

    class Broken(nn.Module):
        def forward(self, hidden, attention_mask):
            raise RuntimeError("broken branch")

    ee.branches[1] = Broken()
    with pytest.raises(RuntimeError, match="broken branch"):
        ee.exit_forward(speed=0.5, **b)  # rows left at block 1, so blocks 2-4 were slicing their inputs
    assert all("forward" not in vars(blk) for blk in ee._blocks)  # no forward was set on a block
    hooks = [(len(blk._forward_hooks), len(blk._forward_pre_hooks)) for blk in ee._blocks]
    assert hooks == [(0, 0)] * 3 + [(int(block_hook), 0)]  # only the user's own hook is left
    if user is not None:
        user.remove()
    torch.testing.assert_close(ee.model(**b).logits, helpers.teacher(layers=4, seed=1).eval()(**b).logits)


def test_instance_forwards_survive_adaptive_inference():
    """A forward set on a block instance (as accelerate's hooks do) runs on the rows that stayed, and is left as it
    was: adaptive inference hooks the blocks for the call and patches no forward."""
    ee = wrapped(layers=4)
    b = batch(8)
    lengths = b["attention_mask"].sum(-1)
    short = lengths <= int(lengths.median())
    ee.branches[0] = ByLength({int(n): torch.tensor([10.0, -10.0]) for n in lengths[short].tolist()})
    blocks = list(ee._blocks)
    calls = []
    own = blocks[2].forward  # the bound method, set on the instance as accelerate's add_hook_to_module does

    def instance_forward(*args, **kwargs):
        calls.append(args[0].shape[0])
        return own(*args, **kwargs)

    blocks[2].forward = instance_forward
    res = ee.exit_forward(speed=0.5, **b)
    n_short = int(short.sum())
    assert calls == [8 - n_short]  # it ran, on the rows that stayed
    assert vars(blocks[2])["forward"] is instance_forward  # put back as it was
    assert all("forward" not in vars(blk) for i, blk in enumerate(blocks) if i != 2)
    full = ee.model(**b).logits
    torch.testing.assert_close(res.logits[~short], full[~short], atol=1e-5, rtol=1e-5)
    assert calls == [8 - n_short, 8]  # the plain forward after it calls the instance forward, unwrapped


@pytest.mark.parametrize("global_hook", [False, True])
def test_block_forward_hooks_run_before_the_branch_sees_the_output(global_hook):
    """A forward hook that changes a block's output (steering, observers) changes what the branch after it reads,
    as in training (where the taps come after it), and it still runs on the block where every row leaves."""
    ee = wrapped(layers=4)
    b = batch(8)
    first = list(ee._blocks)[0]
    ran = []

    def shift(module, _args, output):
        if module is not first:
            return None
        ran.append(1)
        return (output[0] + 3.0,) + tuple(output[1:]) if isinstance(output, tuple) else output + 3.0

    handle = (torch.nn.modules.module.register_module_forward_hook(shift) if global_hook
              else first.register_forward_hook(shift))
    try:
        res = ee.exit_forward(speed=1.0, **b)  # every row leaves at the first branch
        assert ran == [1]
        with torch.no_grad():
            trained_view = ee(**b).exit_logits[0]  # the training forward, through the same hook
    finally:
        handle.remove()
    assert res.exit_layer.tolist() == [1] * 8
    torch.testing.assert_close(res.logits, trained_view)
    with torch.no_grad():
        assert not torch.allclose(ee(**b).exit_logits[0], trained_view, atol=1e-3)  # the shift mattered
    assert all(not blk._forward_hooks and not blk._forward_pre_hooks for blk in ee._blocks)


def test_exit_forward_refuses_to_run_inside_itself():
    ee = wrapped(layers=4)
    b = batch(4)

    class Reentrant(nn.Module):
        def forward(self, hidden, attention_mask):
            return ee.exit_forward(speed=0.5, **b).logits

    plain = ee.branches[1]
    ee.branches[1] = Reentrant()
    with pytest.raises(RuntimeError, match="already running"):
        ee.exit_forward(speed=0.5, **b)
    ee.branches[1] = plain
    assert all("forward" not in vars(blk) for blk in ee._blocks)
    assert ee.exit_forward(speed=0.0, **b).exit_layer.tolist() == [4] * 4  # usable again


def test_shared_blocks_are_refused():
    model = helpers.teacher(layers=4).eval()
    model.bert.encoder.layer[2] = model.bert.encoder.layer[1]
    with pytest.raises(ValueError, match="more than once among the model's blocks"):
        EarlyExitModel(model)


def test_patience_rule_on_a_hand_built_case():
    ee = wrapped(layers=4)
    b = batch(8)
    lengths = b["attention_mask"].sum(-1).tolist()
    assert len(set(lengths[:3])) == 3
    a, c = torch.tensor([5.0, 0.0]), torch.tensor([0.0, 5.0])
    # Per row, the argmax at branches 1, 2, 3: row0 0,0,0; row1 0,1,1; row2 0,1,0.
    plan = {lengths[0]: (a, a, a), lengths[1]: (a, c, c), lengths[2]: (a, c, a)}
    for i in range(3):
        ee.branches[i] = ByLength({n: p[i] for n, p in plan.items()})
    three = {k: v[:3] for k, v in b.items()}
    assert ee.exit_forward(patience=1, **three).exit_layer.tolist() == [2, 3, 4]
    assert ee.exit_forward(patience=2, **three).exit_layer.tolist() == [3, 4, 4]
    assert ee.exit_forward(patience=3, **three).exit_layer.tolist() == [4, 4, 4]


def test_uncertainty_is_normalised_entropy():
    u = uncertainty(torch.tensor([[0.0, 0.0, 0.0], [100.0, 0.0, 0.0]]))
    torch.testing.assert_close(u, torch.tensor([1.0, 0.0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(1, 2), (3, 5), (8, 3)])
def test_row_uncertainties_equal_uncertainty(shape):
    torch.manual_seed(shape[0])
    logits = torch.randn(*shape) * 4
    logits[0, 0] = 200.0  # one row near certainty: exp underflows to 0 for the other classes
    if shape[0] > 1:
        logits[-1, :] = torch.tensor([0.0, 0.0, -744.5, 0.0, 0.0][: shape[1]])  # a probability that rounds to 0
    want = uncertainty(logits).tolist()
    got = row_uncertainties(logits)
    assert len(got) == shape[0] and all(isinstance(u, float) for u in got)
    assert got == pytest.approx(want, abs=1e-6)
    assert got[0] < 1e-6
    assert row_uncertainties(logits.half()) == pytest.approx(uncertainty(logits.half()).tolist(), abs=1e-3)


def test_row_uncertainties_of_non_finite_logits_are_those_of_uncertainty():
    """NaN logits give NaN (the row never leaves), as the on-device rule does, not a confident 0."""
    logits = torch.tensor([[float("nan"), 1.0], [float("-inf"), float("-inf")], [float("inf"), 0.0], [2.0, 0.0]])
    got, want = row_uncertainties(logits), uncertainty(logits).tolist()
    assert all(g == w or (g != g and w != w) for g, w in zip(got, want))  # equal, NaN where NaN
    assert got[0] != got[0] and not got[0] < 0.9  # a NaN row does not pass any speed


def test_predict_is_pipeline_shaped(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tok")
    model = helpers.teacher(seed=2)
    model.config.vocab_size = len(tok)
    ee = EarlyExitModel(model)
    out = ee.predict(["good movie", "not a great film at all"], tok, speed=0.0)
    assert [sorted(o) for o in out] == [["exit_layer", "label", "score"]] * 2
    assert all(o["exit_layer"] == 4 and o["label"] in ("LABEL_0", "LABEL_1") for o in out)
    assert all(0.5 <= o["score"] <= 1.0 for o in out)


# ---------------------------------------------------------------------- training through DistillationTrainer


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_self_distillation_through_the_trainer_on_unlabeled_rows(tmp_path, branch):
    ee = EarlyExitModel(helpers.teacher(layers=3, seed=1).eval(), branch=branch)
    frozen = helpers.flat_params(ee.model).clone()
    branches = helpers.flat_params(ee.branches).clone()
    rows = helpers.token_dataset(32).remove_columns("label")  # unlabeled
    trainer = DistillationTrainer(
        model=ee, args=helpers.args(tmp_path, kd_weight=0.0, max_steps=4, learning_rate=1e-2),
        train_dataset=rows, data_collator=helpers.collate,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all("loss_exit_1" in h and "loss_exit_2" in h for h in logs)
    for h in logs:
        assert h["loss"] == pytest.approx(h["loss_exit_1"] + h["loss_exit_2"], rel=1e-4)
    assert torch.equal(helpers.flat_params(ee.model), frozen)
    assert not torch.equal(helpers.flat_params(ee.branches), branches)


def _exits_by_hand(ee: EarlyExitModel, b: dict, speed: float) -> tuple[list[int], list[int]]:
    """Predicted class and exit layer of each row under `speed`, read from exit_forward one row at a time."""
    preds, layers = [], []
    for i in range(b["input_ids"].shape[0]):
        n = int(b["attention_mask"][i].sum())
        res = ee.exit_forward(speed=speed, input_ids=b["input_ids"][i : i + 1, :n])
        preds.append(int(res.logits.argmax(-1)))
        layers.append(int(res.exit_layer))
    return preds, layers


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_branch_metrics_on_an_eval_set(tmp_path, branch):
    """With an eval_dataset (labelled rows) and compute_metrics=branch_metrics(speed), evaluate() reports every
    branch's accuracy and agreement, and adaptive inference's accuracy and mean exit layer at that speed, equal
    to what exit_forward does row by row (before: no metrics at all, not even eval_loss)."""
    from hf_distill.students.early_exit import branch_metrics

    ee = EarlyExitModel(helpers.teacher(layers=4, seed=1).eval(), branch=branch)
    train = helpers.token_dataset(32).remove_columns("label")
    evalset = helpers.token_dataset(24, seed=7)
    trainer = DistillationTrainer(model=ee, args=helpers.args(tmp_path, kd_weight=0.0, max_steps=4,
                                                              learning_rate=1e-2, per_device_eval_batch_size=8),
                                  train_dataset=train, eval_dataset=evalset, data_collator=helpers.collate)
    trainer.train()
    ee.eval()
    b = helpers.collate(evalset.to_list())
    labels = b.pop("labels")
    with torch.no_grad():
        out = ee(**b)
    # a speed between two rows' uncertainties at the first branch: some rows leave there, others go on
    first = sorted(uncertainty(out.exit_logits[0]).tolist())
    speed = (first[len(first) // 2] + first[len(first) // 2 + 1]) / 2
    trainer.compute_metrics = branch_metrics(speed=speed)
    metrics = trainer.evaluate()
    for i, logits in enumerate(out.exit_logits, start=1):
        pred = logits.argmax(-1)
        assert metrics[f"eval_exit_{i}_accuracy"] == pytest.approx((pred == labels).float().mean().item())
        agreement = (pred == out.logits.argmax(-1)).float().mean().item()
        assert metrics[f"eval_exit_{i}_agreement"] == pytest.approx(agreement)
    assert metrics["eval_final_accuracy"] == pytest.approx((out.logits.argmax(-1) == labels).float().mean().item())
    preds, layers = _exits_by_hand(ee, b, speed)
    assert 1 < sum(layers) / len(layers) < 4 and 1 in layers  # the rule let some rows go, not all
    assert metrics["eval_mean_exit_layer"] == pytest.approx(sum(layers) / len(layers))
    assert metrics["eval_accuracy"] == pytest.approx(sum(p == y for p, y in zip(preds, labels.tolist())) / len(preds))
    # eval_loss: the branches' self-distillation loss on the eval rows
    assert metrics["eval_loss"] == pytest.approx(out.loss.item(), rel=1e-4)


def test_branch_metrics_patience_and_bad_predictions():
    """PABEE's rule on hand-made logits; predictions that are not an EarlyExitModel's are refused."""
    import numpy as np
    from transformers import EvalPrediction

    from hf_distill.students.early_exit import branch_metrics

    a, b = [2.0, 0.0], [0.0, 2.0]  # class 0, class 1
    exits = (np.array([a, a, b]), np.array([a, b, b]), np.array([a, b, a]))  # 3 branches, 3 rows
    final = np.array([b, b, b])
    labels = np.array([0, 1, 1])
    m = branch_metrics(patience=1)(EvalPrediction((final, exits), labels))
    # row 0: same argmax at branches 1 and 2 -> leaves at 2 (class 0); row 1: changes at 2, same at 3 -> leaves
    # at 3 (class 1); row 2: b, b -> leaves at 2 (class 1)
    assert m["mean_exit_layer"] == pytest.approx((2 + 3 + 2) / 3) and m["accuracy"] == 1.0
    assert m["exit_1_accuracy"] == pytest.approx(2 / 3) and m["exit_3_agreement"] == pytest.approx(1 / 3)
    assert "accuracy" not in branch_metrics()(EvalPrediction((final, exits), labels))
    with pytest.raises(ValueError, match="reads an EarlyExitModel's predictions"):
        branch_metrics()(EvalPrediction(final, labels))
    with pytest.raises(ValueError, match="speed must be in"):
        branch_metrics(speed="0.5")


def test_labelled_training_rows_are_refused_with_the_fix(tmp_path):
    """Labels now reach the model (so that an eval set keeps them for branch_metrics); in training the Trainer
    would use them for a task term that adds the same loss again, so they are refused, saying how to drop them."""
    ee = EarlyExitModel(helpers.teacher(layers=3).eval())
    rows = helpers.token_dataset(16)  # labelled
    trainer = DistillationTrainer(model=ee, args=helpers.args(tmp_path, kd_weight=0.0, max_steps=1),
                                  train_dataset=rows, data_collator=helpers.collate)
    with pytest.raises(ValueError, match=r"labels are not used.*remove_columns\('label'\)"):
        trainer.train()
    trainer = DistillationTrainer(model=ee, args=helpers.args(tmp_path, kd_weight=0.0, max_steps=2),
                                  train_dataset=rows.remove_columns("label"), eval_dataset=rows,
                                  data_collator=helpers.collate)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(h["loss"] == pytest.approx(h["loss_exit_1"] + h["loss_exit_2"], rel=1e-4) for h in logs)
    assert "eval_loss" in trainer.evaluate()


def test_trainer_save_model_writes_what_from_pretrained_loads_and_resumes_from_it(tmp_path):
    """`trainer.save_model(out)` then `EarlyExitModel.from_pretrained(out)`, as after any Trainer run: before, the
    Trainer wrote the wrapper's state dict alone (no config.json, no branch files), which from_pretrained refused
    and trainer.push_to_hub could not publish. Its checkpoints (save_strategy="steps") have the same layout and still
    resume exactly: before, the blocks were registered under the wrapper too, so every block weight had two names
    and the first checkpoint raised safetensors' shared tensors error."""
    rows = helpers.token_dataset(16).remove_columns("label")

    def run(out, **kw):
        ee = EarlyExitModel(helpers.teacher(layers=2, seed=1).eval())
        trainer = DistillationTrainer(model=ee, train_dataset=rows, data_collator=helpers.collate,
                                      args=helpers.args(tmp_path / out, kd_weight=0.0, max_steps=2, learning_rate=1e-2,
                                                        save_strategy="steps", save_steps=1))
        trainer.train(**kw)
        return trainer, ee

    trainer, ee = run("full")
    trainer.save_model(str(tmp_path / "final"))
    back = EarlyExitModel.from_pretrained(tmp_path / "final").eval()
    b = batch(8)
    for x, y in zip(back.eval()(**b).exit_logits, ee.eval()(**b).exit_logits):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    assert not any(k.startswith("branches") for k in load_file(str(tmp_path / "final" / "model.safetensors")))
    checkpoint = tmp_path / "full" / "out" / "checkpoint-1"
    assert (checkpoint / BRANCH_CONFIG_FILE).is_file()  # a checkpoint loads with from_pretrained too
    _, resumed = run("full", resume_from_checkpoint=str(checkpoint))
    torch.testing.assert_close(helpers.flat_params(resumed), helpers.flat_params(ee), rtol=0, atol=1e-6)
    # a checkpoint an earlier version wrote (the wrapper's state dict in model.safetensors) still resumes
    from safetensors.torch import save_file

    old = {f"model.{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    old.update({f"branches.{k}": v for k, v in load_file(str(checkpoint / BRANCH_FILE)).items()})
    for name in (BRANCH_FILE, BRANCH_CONFIG_FILE, "config.json"):
        (checkpoint / name).unlink()
    save_file(old, str(checkpoint / "model.safetensors"), metadata={"format": "pt"})
    _, resumed = run("full", resume_from_checkpoint=str(checkpoint))
    torch.testing.assert_close(helpers.flat_params(resumed), helpers.flat_params(ee), rtol=0, atol=1e-6)
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        trainer.push_to_hub()
    files = hub.files(next(iter(hub.repos)))
    assert {"config.json", "model.safetensors", BRANCH_FILE, BRANCH_CONFIG_FILE, "README.md"} <= set(files)
    card = files["README.md"].decode()  # the card says how to load it with its branches, and names the method
    usage = card.split("## How to use", 1)[1]
    assert "EarlyExitModel.from_pretrained(" in usage and "AutoModel.from_pretrained(" not in usage
    assert "## Early exit" in card and "liu2020fastbert" in card and "pipeline_tag: text-classification" in card
    exit_row = ("| exit_1 | KL divergence of branch 1 from the final head (self-distillation) | 1 | "
                "block 1 -> final head |")
    assert exit_row in card  # the loss the run minimised: one term per branch
    assert "| task |" not in card  # labelled training rows are refused: no task term ran


def test_load_best_model_at_end_restores_the_best_checkpoints_branches(tmp_path):
    """The best checkpoint (step 1 here, by a metric that says so) is read back in EarlyExitModel's layout: the
    Trainer's own load would put its backbone-named weights into the wrapper non-strictly, loading nothing."""
    rows = helpers.token_dataset(8)
    scores = iter([1.0, 0.0])
    ee = EarlyExitModel(helpers.teacher(layers=2, seed=1).eval())
    trainer = DistillationTrainer(
        model=ee, train_dataset=rows.remove_columns("label"), eval_dataset=rows, data_collator=helpers.collate,
        compute_metrics=lambda _: {"score": next(scores)},
        args=helpers.args(tmp_path, kd_weight=0.0, max_steps=2, learning_rate=1e-2, save_strategy="steps",
                          save_steps=1, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                          metric_for_best_model="score", greater_is_better=True))
    trainer.train()
    best = tmp_path / "out" / "checkpoint-1"
    assert trainer.state.best_model_checkpoint == str(best)
    saved, last = (load_file(str(tmp_path / "out" / f"checkpoint-{i}" / BRANCH_FILE)) for i in (1, 2))
    assert any(not torch.equal(saved[k], last[k]) for k in saved)  # the last step's branches are not the best's
    for name, value in ee.branches.state_dict().items():
        torch.testing.assert_close(value, saved[name], rtol=0, atol=0)


# ---------------------------------------------------------------------- saving and publishing


@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_save_and_load_round_trip(tmp_path, branch):
    ee = EarlyExitModel(helpers.teacher(layers=4, seed=1).eval(), branch=branch)
    with torch.no_grad():
        for p in ee.branches.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ee.save_pretrained(tmp_path / "m")
    names = {p.name for p in (tmp_path / "m").iterdir()}
    assert {"config.json", "model.safetensors", BRANCH_FILE, BRANCH_CONFIG_FILE} <= names
    assert not any(k.startswith("branches") for k in load_file(str(tmp_path / "m" / "model.safetensors")))
    alone = AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    assert torch.equal(helpers.flat_params(alone), helpers.flat_params(ee.model))
    back = EarlyExitModel.from_pretrained(tmp_path / "m")
    assert back.branch == branch and type(back.branches[0]) is type(ee.branches[0])
    assert torch.equal(helpers.flat_params(back), helpers.flat_params(ee))
    b = batch(8)
    for x, y in zip(back(**b).exit_logits, ee(**b).exit_logits):
        torch.testing.assert_close(x, y)


def test_push_to_hub_uploads_branches_and_card(tmp_path):
    ee = wrapped(layers=4)
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"\x89PNG fake")
    sweep = [{"speed": 0.0, "accuracy": 0.9, "mean_exit_layer": 4.0, "speedup_b1": 1.0, "flops_ratio": 1.0},
             {"speed": 0.5, "accuracy": 0.88, "mean_exit_layer": 1.7, "speedup_b1": 2.3, "flops_ratio": 0.45}]
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        ee.push_to_hub("fake-user/fastbert", tmp_path / "out", sweep=sweep, plot=plot)
    files = hub.files("fake-user/fastbert")
    assert {"config.json", "model.safetensors", BRANCH_FILE, BRANCH_CONFIG_FILE, "README.md", PLOT_FILE} == set(files)
    card = files["README.md"].decode()
    assert "## Early exit" in card and "| 0.5 | 88.0% | 1.70 | 2.30x | 0.45 |" in card
    assert f"]({PLOT_FILE})" in card and "liu2020fastbert" in card
    down = tmp_path / "down"
    down.mkdir()
    for name, data in files.items():
        (down / name).write_bytes(data)
    assert json.loads((down / BRANCH_CONFIG_FILE).read_text())["num_exits"] == 4
    back = EarlyExitModel.from_pretrained(down)
    assert torch.equal(helpers.flat_params(back), helpers.flat_params(ee))


def test_deebert_card_names_its_off_ramps_and_both_papers(tmp_path):
    ee = EarlyExitModel(helpers.teacher(layers=3, seed=1).eval(), branch="deebert")
    with FakeHub() as hub, pytest.MonkeyPatch.context() as mp:
        online(mp, hub.endpoint)
        ee.push_to_hub("fake-user/deebert", tmp_path / "out")
    files = hub.files("fake-user/deebert")
    card = files["README.md"].decode()
    assert "(DeeBERT off-ramps)" in card and "xin2020deebert" in card and "liu2020fastbert" in card
    assert json.loads(files[BRANCH_CONFIG_FILE])["branch"] == "deebert"


def test_files_without_a_branch_entry_load_as_fastbert(tmp_path):
    ee = wrapped(layers=3)
    ee.save_pretrained(tmp_path / "m")
    spec = json.loads((tmp_path / "m" / BRANCH_CONFIG_FILE).read_text())
    del spec["branch"]  # as written before the deebert branch existed
    (tmp_path / "m" / BRANCH_CONFIG_FILE).write_text(json.dumps(spec))
    back = EarlyExitModel.from_pretrained(tmp_path / "m")
    assert back.branch == "fastbert" and torch.equal(helpers.flat_params(back), helpers.flat_params(ee))


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"speed": -0.1}, "speed must be in"), ({"speed": 1.5}, "speed must be in"),
     ({"patience": 0}, "patience must be an integer >= 1"), ({"patience": 1.5}, "patience must be"),
     ({"speed": 0.5, "patience": 2}, "either speed")],
)
def test_bad_rule_is_refused(kwargs, match):
    ee = wrapped()
    with pytest.raises(ValueError, match=match):
        ee.exit_forward(**kwargs, **batch(2))


@pytest.mark.parametrize(("speed", "match"), [
    (True, "a real number, got the bool True: pass a float"),
    ("0.5", r"got the string '0.5': convert it first, speed=float\('0.5'\)"),
    (float("nan"), "speed must be in .*got nan"),
    (torch.tensor(0.5), "got Tensor .*pass speed.item()"),
    ({"input_ids": None}, r"got a dict \(the batch\?\): pass the inputs as keywords"),
])
def test_speed_must_be_a_real_number(speed, match):
    """A bool is an int to Python (True meant speed 1.0: every row left at the first branch); a string was
    refused without saying why ("got 0.5")."""
    ee = wrapped(layers=3)
    with pytest.raises(ValueError, match=match):
        ee.exit_forward(speed=speed, **batch(2))
    with pytest.raises(ValueError, match=match):
        ee.predict(["a"], tokenizer=None, speed=speed)


def test_real_numbers_of_any_type_are_speeds():
    import numpy as np

    ee = wrapped(layers=3)
    b = batch(4)
    want = ee.exit_forward(speed=0.5, **b)
    for speed in (np.float64(0.5), np.float32(0.5), 0.5):
        got = ee.exit_forward(speed=speed, **b)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.exit_layer, want.exit_layer)
    assert ee.exit_forward(speed=1, **b).exit_layer.tolist() == ee.exit_forward(speed=1.0, **b).exit_layer.tolist()
    assert ee.exit_forward(speed=0, **b).exit_layer.tolist() == [3] * 4


def test_missing_inputs_are_named():
    ee = wrapped(layers=3)
    b = batch(2)
    mask = b["attention_mask"]
    for call in (lambda: ee.exit_forward(speed=0.5, attention_mask=mask), lambda: ee(attention_mask=mask),
                 lambda: ee.exit_forward(speed=0.0, attention_mask=mask)):
        with pytest.raises(ValueError, match="needs input_ids \\(or inputs_embeds\\); the inputs given were: "
                                             "attention_mask. Pass the tokenizer's output"):
            call()
    with pytest.raises(ValueError, match="input_ids must be a tensor, got list"):
        ee.exit_forward(speed=0.5, input_ids=b["input_ids"].tolist())


def test_from_pretrained_of_a_bad_path_is_one_clear_error(tmp_path):
    """A missing folder, a file, a Hub id that cannot be read: each one error naming the path (the missing
    folder was a huggingface_hub HFValidationError about repo id characters)."""
    with pytest.raises(FileNotFoundError, match="no such folder \\(and not a Hub repo id"):
        EarlyExitModel.from_pretrained(tmp_path / "missing" / "model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="weights.bin is a file: give the folder"):
        EarlyExitModel.from_pretrained(tmp_path / "weights.bin")
    with pytest.raises(FileNotFoundError, match="nobody/no-such-model is not a local folder, and as a Hub repo id "
                                                "its early_exit_config.json could not be read: "):
        EarlyExitModel.from_pretrained("nobody/no-such-model")  # offline in the tests (conftest)


def test_unknown_branch_and_unused_branch_shape_are_refused():
    with pytest.raises(ValueError, match="branch must be one of 'fastbert'.*'deebert'.*Got 'pabee'"):
        EarlyExitModel(helpers.teacher(), branch="pabee")
    with pytest.raises(ValueError, match="DeeBERT's off-ramp is as wide as the model"):
        EarlyExitModel(helpers.teacher(), branch="deebert", branch_width=64)


def test_from_pretrained_refuses_branch_arguments_and_unknown_formats(tmp_path):
    ee = EarlyExitModel(helpers.teacher(layers=3).eval(), branch="deebert")
    ee.save_pretrained(tmp_path / "m")
    spec = json.loads((tmp_path / "m" / BRANCH_CONFIG_FILE).read_text())
    assert spec["format"].endswith("deebert-v1") and spec["branch_width"] is None
    with pytest.raises(ValueError, match="reads branch, branch_width from early_exit_config.json"):
        EarlyExitModel.from_pretrained(tmp_path / "m", branch="fastbert", branch_width=64)
    spec["format"] = "hf_distill.early_exit/fastbert-v1"  # says FastBERT, holds DeeBERT's off-ramps
    (tmp_path / "m" / BRANCH_CONFIG_FILE).write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="has format 'hf_distill.early_exit/fastbert-v1' and branch 'deebert'"):
        EarlyExitModel.from_pretrained(tmp_path / "m")


def test_left_padding_is_refused():
    ee = wrapped(layers=3)
    b = batch(4)
    left = {k: v.flip(-1) for k, v in b.items()}  # the padding moves to the front of the short rows
    assert not left["attention_mask"][:, 0].all()
    with pytest.raises(ValueError, match="masks the first token.*padding_side = 'right'"):
        ee.exit_forward(speed=0.5, **left)
    with pytest.raises(ValueError, match="masks the first token"):
        ee(**left)


def test_a_one_block_model_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        EarlyExitModel(helpers.teacher(layers=1))


def test_unregistered_family_is_refused(monkeypatch):
    monkeypatch.delitem(families.FAMILIES, "bert")
    with pytest.raises(ValueError, match="'bert' is not a registered family.*register_family"):
        EarlyExitModel(helpers.teacher())


def test_non_classification_heads_are_refused():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="single-label sequence classifier"):
        EarlyExitModel(BertForMaskedLM(helpers.bert_config()))
    with pytest.raises(ValueError, match="single-label sequence classifier"):
        EarlyExitModel(helpers.bert(labels=1, problem_type="regression"))


def test_from_pretrained_of_a_plain_model_folder_is_refused(tmp_path):
    helpers.teacher().save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="not an early-exit model"):
        EarlyExitModel.from_pretrained(Path(tmp_path / "plain"))


# ---------------------------------------------------------------------- the recipe


@pytest.mark.slow
@pytest.mark.parametrize("branch", ["fastbert", "deebert"])
def test_fastbert_recipe_end_to_end(tmp_path, branch):
    """recipes/fastbert.py on a tiny teacher: branches trained, speed sweep written, speed 0 == teacher."""
    from hub_server import VOCAB_WORDS

    tok = tiny_tokenizer(tmp_path / "teacher")
    model = helpers.teacher(seed=4, vocab_size=len(tok))
    model.save_pretrained(tmp_path / "teacher")
    tok.save_pretrained(tmp_path / "teacher")
    for name, n in (("train.tsv", 48), ("validation.tsv", 24)):
        lines = ["sentence\tlabel"] + [f"{VOCAB_WORDS[i % len(VOCAB_WORDS)]} {VOCAB_WORDS[(3 * i) % 7]}\t{i % 2}"
                                       for i in range(n)]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    cmd = [str(root / "recipes" / "fastbert.py"), "--config",
           str(root / "recipes" / "configs" / "fastbert_sst2.yaml"), "--teacher", str(tmp_path / "teacher"),
           "--train_file", str(tmp_path / "train.tsv"), "--validation_file", str(tmp_path / "validation.tsv"),
           "--max_train_rows", "48", "--max_steps", "3", "--logging_steps", "1", "--bf16", "false",
           "--per_device_train_batch_size", "16", "--speeds", "0.0", "0.5", "1.0", "--output_dir", str(out),
           "--branch", branch]
    proc = helpers.run_script(*cmd)  # as `python recipes/fastbert.py ...`, in this process
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert [r["speed"] for r in res["sweep"]] == [0.0, 0.5, 1.0]
    assert res["sweep"][0]["matches_teacher"] and res["sweep"][0]["flops_ratio"] == 1.0
    assert res["sweep"][0]["exit_histogram"] == [0, 0, 0, 24]
    assert res["sweep"][2]["mean_exit_layer"] < 4  # speed 1: every row whose branch is not exactly uniform leaves
    assert all("loss_exit_3" in h for h in res["distill_logs"])
    assert res["branch"] == branch and res["sweep"][2]["flops_ratio"] < 1
    assert res["distill_args"]["max_steps"] == 3 and res["distill_args"]["num_train_epochs"] == 5  # config's epochs
    back = EarlyExitModel.from_pretrained(out)
    assert (out / BRANCH_FILE).is_file() and back.num_exits == 4 and back.branch == branch
    # the validation set is the Trainer's eval set: each branch's accuracy there, and the state for the report
    metrics = res["branch_metrics"]
    assert metrics["eval_final_accuracy"] == pytest.approx(res["teacher_accuracy"])
    assert all(0 <= metrics[f"eval_exit_{i}_accuracy"] <= 1 for i in (1, 2, 3))
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and any("eval_exit_1_accuracy" in h for h in state["log_history"])


@pytest.mark.parametrize(("flag", "message"), [
    (["--model_seed", "3"], "not used by the FastBERT recipe"),
    (["--student_layers", "0", "1"], "not used by the FastBERT recipe"),
    (["--branch", "pabee"], "branch must be one of"),
    (["--branch", "deebert", "--branch_heads", "4"], "the deebert off-ramp is as wide as the model"),
])
def test_fastbert_recipe_refuses_student_fields_it_does_not_use(tmp_path, flag, message):
    root = Path(__file__).resolve().parent.parent
    proc = helpers.run_script(root / "recipes" / "fastbert.py", "--config",  # in this process, as `python ...` runs it
                              root / "recipes" / "configs" / "fastbert_sst2.yaml", "--output_dir", tmp_path / "out",
                              *flag)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- public torch APIs only (issue #30)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def torch_private_uses(source: str) -> list[str]:
    """Where `source` leans on torch internals: an attribute read or written that torch names privately (`_x` on a
    module, parameter, tensor, hook handle or `torch.nn.modules.module`) or that the source does not define itself,
    an override of a private `nn.Module` method, an import of a private torch name, or a `.forward` assignment
    (patching an instance's method)."""
    objects = (nn.Module, nn.Module(), nn.Linear(2, 2), nn.MultiheadAttention(4, 2), nn.ModuleList(), torch.Tensor,
               torch.zeros(1), nn.Parameter(torch.zeros(1)), torch.nn.modules.module, torch.utils.hooks.RemovableHandle)
    torch_private = {name for obj in objects for name in dir(obj) if _private(name)}
    tree = ast.parse(source)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # this package's own names
            own.update(a.asname or a.name for a in node.names)
    own -= torch_private
    found = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            found.append(f"{where}: .{node.attr}")
        elif isinstance(node, ast.FunctionDef) and node.name in torch_private:
            found.append(f"{where}: overrides {node.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append(f"{where}: imports {node.module}: {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "torch" and any(_private(p) for p in a.name.split("."))]
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [f"{where}: assigns .forward" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr == "forward"]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "forward"):
            found.append(f"{where}: setattr(..., 'forward', ...)")
    return found


def test_early_exit_uses_public_torch_apis_only():
    """Early exit reads no private torch attribute and patches no instance method (issue #30): a torch upgrade
    that renames a private dict or changes `Module.__call__` cannot break it silently."""
    import hf_distill.students.early_exit as early_exit
    import hf_distill.students.exit_branches as exit_branches
    import hf_distill.students.exit_rules as exit_rules

    for module in (early_exit, exit_branches, exit_rules):
        path = Path(module.__file__)
        assert torch_private_uses(path.read_text(encoding="utf-8")) == [], path.name


def test_the_private_api_scan_finds_what_early_exit_used_to_read():
    """The scan above is not vacuous: lines of the module before issue #30 are each found."""
    old = {
        "from torch.nn.modules import module as _global_hooks\nx = bool(_global_hooks._global_forward_hooks)": 1,
        "hooked = any(b._forward_hooks or b._forward_pre_hooks for b in blocks)": 2,
        "inner, out_proj = attn._parameters, attn._modules['out_proj']._parameters": 3,
        "key = [p._version for p in params]": 1,
        "block.forward = wrap(i, block.forward)": 1,
        "setattr(block, 'forward', run)": 1,
        "class B(nn.Module):\n    def _apply(self, fn, *args):\n        return super()._apply(fn, *args)": 2,
        "from torch.nn.modules.module import _global_forward_hooks": 1,
        "self._fold = None\nfold = self._fold\nw = self.weight.detach()": 0,  # its own private names: fine
    }
    for source, count in old.items():
        assert len(torch_private_uses(source)) == count, source
