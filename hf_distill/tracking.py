"""Per-component loss bookkeeping, so `loss_kd`, `loss_task`, ... are logged next to `loss`.

Values are summed per micro-batch and averaged at logging time over every micro-batch since the last
log and over all processes. That is the same averaging the Trainer applies to `loss`, so the logged
`loss` equals the weighted sum of the logged components.
"""

from __future__ import annotations

import torch


class ComponentTracker:
    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self._sums)

    def reset(self) -> None:
        self._sums, self._counts = {}, {}

    def add(self, components: dict[str, torch.Tensor]) -> None:
        for name, value in components.items():
            v = value.detach().float()
            self._sums[name] = self._sums[name] + v if name in self._sums else v
            self._counts[name] = self._counts.get(name, 0) + 1

    def fold(self, parts: list[tuple[ComponentTracker, float]]) -> None:
        """Add the components of one micro-batch computed in parts (routing per row: one sub-batch per teacher,
        hf_distill.routing), each part's sums times its weight, as one micro-batch: the logged means stay means
        over micro-batches, so `loss` is still the weighted sum of the logged components."""
        folded: dict[str, torch.Tensor] = {}
        for tracker, weight in parts:
            for name, value in tracker._sums.items():
                folded[name] = folded[name] + value * weight if name in folded else value * weight
        if folded:
            self.add(folded)

    def pop_means(self, accelerator=None) -> dict[str, float]:
        """Means since the last call, averaged over processes; resets the sums."""
        names = sorted(self._sums)
        sums = torch.stack([self._sums[n] for n in names])
        counts = torch.tensor([float(self._counts[n]) for n in names], device=sums.device)
        if accelerator is not None and accelerator.num_processes > 1:
            sums, counts = accelerator.reduce(sums, "sum"), accelerator.reduce(counts, "sum")
        self._sums, self._counts = {}, {}
        return {n: (s / c).item() for n, s, c in zip(names, sums, counts)}
