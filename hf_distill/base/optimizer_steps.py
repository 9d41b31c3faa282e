"""Whether any optimizer has stepped since a cached value was made, without a hook registered at import.

A cache of something computed from weights (a teacher's fingerprint, an exit branch's folded weights) is stale
once an optimizer steps: the step writes in place (same memory), and fused optimizers do not bump the tensors'
version counters. Torch only offers a process-wide post-step hook for "any optimizer". Each cached value holds a
`StepWatch`: while at least one lives, one such hook (an integer increment per step) is registered; the last
watch to go (its cache dropped or garbage-collected) removes it, so importing hf_distill changes nothing in torch.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook

__all__ = ["StepWatch"]


class _Hook:
    """The process-wide count and the one hook that advances it, registered while any watch lives."""

    steps = 0
    watches = 0
    handle: Any = None

    @classmethod
    def acquire(cls) -> None:
        if cls.watches == 0:
            cls.handle = register_optimizer_step_post_hook(cls.step)
        cls.watches += 1

    @classmethod
    def release(cls) -> None:
        cls.watches -= 1
        if cls.watches == 0:
            cls.handle.remove()
            cls.handle = None

    @classmethod
    def step(cls, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        cls.steps += 1


class StepWatch:
    """Made with a cached value: `stepped()` tells whether any optimizer in this process has stepped since. A copy
    (`copy.deepcopy` of the model holding it) watches from the same moment; an unpickled one reports a step, since
    another process's steps cannot be seen."""

    __slots__ = ("__weakref__", "start")

    def __init__(self, start: int | None = None) -> None:
        _Hook.acquire()
        weakref.finalize(self, _Hook.release)
        self.start = _Hook.steps if start is None else start

    def stepped(self) -> bool:
        return _Hook.steps != self.start

    def __copy__(self) -> StepWatch:
        return StepWatch(self.start)

    def __deepcopy__(self, memo: dict) -> StepWatch:
        return StepWatch(self.start)

    def __reduce__(self) -> tuple:
        return StepWatch, (-1,)
