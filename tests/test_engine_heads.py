"""hf_distill.kd_paths.engine_heads in one process: which engines gather the LM heads, the whole-weight head it hands
the loss head (the direct route, gradients to the tensor it was built from), and the zero term that gives a process
counting no token a gradient for the head's weight (so every process reduces the same gradients). The engines
themselves run on 2 processes in tests/test_engines.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from accelerate.utils import DistributedType
from helpers import llama

from hf_distill.kd_paths import engine_heads
from hf_distill.losses import chunked


def _deepspeed(stage: int):
    config = {"zero_optimization": {"stage": stage}}
    return SimpleNamespace(distributed_type=DistributedType.DEEPSPEED,
                           state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))


def test_engine_names_the_sharding_engines_only():
    assert engine_heads.engine(None) is None
    assert engine_heads.engine(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)) is None
    assert engine_heads.engine(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False)) is None
    assert engine_heads.engine(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True)) == "fsdp2"
    assert engine_heads.engine(_deepspeed(3)) == "zero3"
    assert engine_heads.engine(_deepspeed(2)) is None  # ZeRO-0/1/2: replicated heads, the module route


def test_a_gathered_weight_takes_the_direct_route_and_its_gradient_reaches_the_source():
    """A head built on a non-leaf weight (as a gathered shard is) is a plain nn.Linear to the loss head: the direct
    route runs on it and the gradient flows back through the weight to the tensor it came from, equal to the head's
    own (the FSDP2 route of a DTensor head, without the collective)."""
    model = llama(0)
    head = chunked.logits_fn(model)
    source = head.module.weight.detach().clone().requires_grad_(True)
    gathered = engine_heads._as_linear(source * 1.0, None)  # non-leaf, like full_tensor()'s output
    proxy = chunked.LogitsHead(gathered, head.scale, head.cap)
    assert proxy.direct and gathered.weight.grad_fn is not None
    hidden = torch.randn(2, 6, 32)
    labels = torch.randint(0, 120, (2, 5))
    _, ce = chunked.chunked_kd_and_ce(hidden, proxy, None, None, None, labels, None, 4, route="direct")
    ce.backward()
    _, want = chunked.chunked_kd_and_ce(hidden, head, None, None, None, labels, None, 4, route="direct")
    want.backward()
    torch.testing.assert_close(source.grad, head.module.weight.grad, atol=1e-6, rtol=0)


def test_a_process_without_counted_tokens_still_gives_the_weight_a_gradient():
    """Under an engine a process whose batch counts no token gets a zero gradient for the head's weight (its terms
    do not read it), so its gradient reduction matches the other processes'; without an engine nothing is added."""
    model = llama(0)
    head = chunked.logits_fn(model)
    hidden = torch.randn(1, 3, 32, requires_grad=True)

    def nothing(h, s):  # the loss head's terms of a batch with no counted token: no read of the weight
        return s.sum() * 0

    engine_heads.run_student("fsdp2", head, hidden, True, nothing).backward()
    assert head.module.weight.grad is not None and not head.module.weight.grad.any()
    model.zero_grad(set_to_none=True)
    engine_heads.run_student(None, head, hidden, True, nothing).backward()
    assert head.module.weight.grad is None


def test_the_forward_logits_anchor_the_result_under_fsdp2():
    """Under FSDP2 the result reads the forward's own (empty) logits, times 0: FSDP2's pre-backward gather of the
    head's unit hangs on them (tests/test_engines.py: a unit resharded after the forward segfaulted without it)."""
    model = llama(0)
    out = model(input_ids=torch.tensor([[1, 2, 3]]), **chunked.hidden_only_kwargs({}))
    assert out.logits.shape[1] == 0 and out.logits.requires_grad
    head = chunked.logits_fn(model)
    result = engine_heads.run_student("fsdp2", head, chunked.last_hidden(out), False,
                                      lambda h, s: h(s).float().sum(), anchor=out.logits)
    seen, stack = set(), [result.grad_fn]
    while stack:  # the forward's logits are in the result's graph
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack += [n for n, _ in node.next_functions]
    assert out.logits.grad_fn in seen


def test_the_check_head_multiplies_in_the_hidden_states_dtype():
    """FSDP2's mixed precision gathers a module's parameters in `param_dtype`, the dtype of the hidden states: the
    head handed to the one-time logits check multiplies in that dtype too (a float32 weight against bf16 states
    would not rebuild the model's own bf16 logits, and the check would refuse the loss head)."""
    head = chunked.logits_fn(llama(0))
    hidden = torch.randn(3, 32).bfloat16()
    checked = engine_heads.check_head("fsdp2", head)(hidden)
    assert checked.dtype == torch.bfloat16
    torch.testing.assert_close(checked, torch.nn.functional.linear(hidden, head.module.weight.bfloat16()), atol=0,
                               rtol=0)
    assert engine_heads.check_head(None, head) is head  # no engine: the model's own head
