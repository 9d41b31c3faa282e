"""Capture of per-layer features through forward hooks, and the architecture registry.

This is the only module that knows where things live inside a model. Hooks read the embedding output,
each block's output, and the outputs of the query/key/value projections; everything else (pre-softmax
attention scores, relations) is computed from those, so it works under SDPA, flash or eager attention
alike and never relies on `output_attentions` (empty under SDPA, post-softmax and post-dropout under
eager). Hooks exist only inside `FeatureTaps.capture()`: nothing stays attached to a model between
steps, so nothing can leak into a saved student.

Where each family keeps its modules comes from the registry in `hf_distill.families`; registering
another family takes one `register_family` call there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .families import REGISTER_HINT, Family, get_family


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP/FSDP-style wrappers and PEFT models."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model


def _get(root: nn.Module, path: str) -> nn.Module | None:
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


@dataclass
class ModelInfo:
    """Shape facts about a model that the losses and validators need."""

    num_layers: int | None
    hidden_size: int | None
    num_heads: int | None
    family: Family | None
    model_type: str | None


def model_info(model: nn.Module) -> ModelInfo:
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    family = get_family(model_type)
    num_layers = getattr(config, "num_hidden_layers", None)
    if family is not None:
        blocks = _get(getattr(inner, "base_model", inner), family.layers)
        if blocks is not None:
            num_layers = len(blocks)
    return ModelInfo(
        num_layers=num_layers,
        hidden_size=getattr(config, "hidden_size", None),
        num_heads=getattr(config, "num_attention_heads", None),
        family=family,
        model_type=model_type,
    )


@dataclass
class TapRequest:
    """Which features to capture: hidden-state indices (0 = embeddings) and, per projection, blocks."""

    hidden: set[int] = field(default_factory=set)
    q: set[int] = field(default_factory=set)
    k: set[int] = field(default_factory=set)
    v: set[int] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.hidden or self.q or self.k or self.v)


@dataclass
class Features:
    """What one forward pass left behind: `hidden[i]` is hidden_states[i], `q[i]` block i's query, ..."""

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class FeatureTaps:
    """Forward hooks on exactly the modules a set of losses needs, attached only while capturing."""

    def __init__(self, model: nn.Module, request: TapRequest, role: str = "model") -> None:
        self.request = request
        self.info = model_info(model)
        self._targets: list[tuple[nn.Module, str, int]] = []
        # Without a registered family, hidden states still come from `output_hidden_states`.
        self.use_hidden_states_output = False
        if not request:
            return
        family = self.info.family
        if family is None:
            if request.q or request.k or request.v:
                raise ValueError(
                    f"The {role} ({type(unwrap(model)).__name__}, model_type={self.info.model_type!r}) is not "
                    "in the hf_distill.families registry, so its attention scores and Q/K/V cannot be captured. "
                    + REGISTER_HINT
                )
            self.use_hidden_states_output = True
            return
        base = getattr(unwrap(model), "base_model", unwrap(model))
        blocks = base.get_submodule(family.layers)
        for i in sorted(request.hidden):
            if i == 0:
                emb = next((m for p in family.embeddings if (m := _get(base, p)) is not None), None)
                if emb is None:
                    raise ValueError(f"The {role} has none of the modules {family.embeddings}. " + REGISTER_HINT)
                self._targets.append((emb, "hidden", 0))
            else:
                self._targets.append((blocks[i - 1], "hidden", i))
        for kind, path in (("q", family.query), ("k", family.key), ("v", family.value)):
            for i in sorted(getattr(request, kind)):
                self._targets.append((blocks[i - 1].get_submodule(path), kind, i))

    @contextlib.contextmanager
    def capture(self) -> Iterator[Features]:
        """Attach the hooks for one forward pass; they are removed on exit, even on error."""
        feats = Features()
        handles = []
        try:
            for module, kind, i in self._targets:
                store = getattr(feats, kind)

                def hook(_m, _inp, out, store=store, i=i):
                    store[i] = out[0] if isinstance(out, tuple) else out

                handles.append(module.register_forward_hook(hook))
            yield feats
        finally:
            for h in handles:
                h.remove()

    def run(self, model: nn.Module, kwargs: dict) -> tuple[object, Features]:
        """One forward pass with the hooks attached: the model's outputs and the captured features."""
        with self.capture() as feats:
            out = model(**kwargs, **self.forward_kwargs())
        self.collect(feats, out)
        return out, feats

    def forward_kwargs(self) -> dict:
        """Extra forward arguments the capture needs (only for the `output_hidden_states` fallback)."""
        return {"output_hidden_states": True} if self.use_hidden_states_output else {}

    def collect(self, feats: Features, outputs) -> None:
        """Fill hidden states from the model outputs when hooks could not be used."""
        if not self.use_hidden_states_output:
            return
        hidden_states = outputs["hidden_states"] if isinstance(outputs, dict) else outputs.hidden_states
        for i in self.request.hidden:
            feats.hidden[i] = hidden_states[i]


def forward(model: nn.Module, kwargs: dict, taps: FeatureTaps | None = None) -> tuple[object, Features | None]:
    """A forward pass that also captures features when `taps` is given (else the features are None)."""
    return (model(**kwargs), None) if taps is None else taps.run(model, kwargs)


def attention_scores(q: torch.Tensor, k: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) = Q_h K_hᵀ / sqrt(d_h), from (B, T, D) projections, in float32.

    This is what TinyBERT distils (its modified BERT returns the scores before the softmax). Padding is
    not added here: the losses mask padded queries and keys instead.
    """
    b, t, d = q.shape
    dh = d // num_heads
    qh = q.float().view(b, t, num_heads, dh).transpose(1, 2)
    kh = k.float().view(b, k.shape[1], num_heads, dh).transpose(1, 2)
    return qh @ kh.transpose(-1, -2) * dh**-0.5
