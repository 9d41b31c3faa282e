"""Capture of per-layer features through forward hooks (the architecture registry is `features.families`).

With that registry, this is the only code that knows where things live inside a model. Hooks read the
embedding output, each block's output, and the outputs of the query/key/value projections; everything else
(pre-softmax attention scores, relations) is computed from those, so it works under SDPA, flash or eager
attention alike and never relies on `output_attentions` (empty under SDPA, post-softmax and post-dropout under
eager). Hooks exist only inside `FeatureTaps.capture()`: nothing stays attached to a model between steps, so
nothing can leak into a saved student.

Where each family keeps its modules comes from the registry in `hf_distill.features.families`; registering
another family takes one `register_family` call there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..compat import compiled_inner
from .checkpointing import check_tapped_checkpointing, tapped_regions
from .families import REGISTER_HINT, Family, get_family
from .families_audio import check_layerdrop
from .families_vision import stage_width


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside `torch.compile` (`_orig_mod`), DDP/FSDP-style wrappers and PEFT models.

    The Trainer compiles (`torch_compile=True`) and wraps the model it trains after the trainer is built, so
    every model-bound fact (head, LM head, hooked modules, forward arguments) is read from the unwrapped model."""
    while True:
        compiled = compiled_inner(model)  # torch.compile's OptimizedModule
        if isinstance(compiled, nn.Module):
            model = compiled
        elif hasattr(model, "module") and isinstance(model.module, nn.Module):
            model = model.module
        else:
            break
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
    """Shape facts about a model that the losses and validators need.

    `num_kv_heads` is below `num_heads` under grouped-query attention (K and V are `num_kv_heads * head_dim`
    wide, Q `num_heads * head_dim`); `head_dim` may differ from hidden_size / num_heads (Gemma). `causal`: a
    query never attends to a later key (decoders).
    """

    num_layers: int | None
    hidden_size: int | None
    num_heads: int | None
    family: Family | None
    model_type: str | None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = False
    # Per block (0-based), the sliding-window size of its attention, None for full attention; None when no
    # block slides (Mistral/Phi-3 `sliding_window`, Gemma-2/Qwen `layer_types`).
    windows: tuple[int | None, ...] | None = None

    @property
    def q_width(self) -> int | None:
        """Width of the captured Q (and of K/V once repeated to the query heads)."""
        if self.num_heads is None or self.head_dim is None:
            return self.hidden_size
        return self.num_heads * self.head_dim


def stack_family(model: nn.Module, stack: str) -> Family:
    """The registered family of one stack (`encoder`/`decoder`) of an encoder-decoder model, or a ValueError."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if not getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"stack={stack!r} names a stack of an encoder-decoder model, but {type(inner).__name__} "
            f"(model_type={model_type!r}) is not one: leave `stack` out of its terms."
        )
    family = get_family(model_type)
    found = family.stack(stack) if family is not None else None
    if found is None:
        raise ValueError(
            f"The encoder-decoder {type(inner).__name__} (model_type={model_type!r}) has no {stack} stack in the "
            "hf_distill.features.families registry. Register it with "
            "hf_distill.features.families.register_encoder_decoder(model_type, "
            "encoder={...}, decoder={...}, ...) (see that module)."
        )
    return found


def model_info(model: nn.Module, stack: str | None = None) -> ModelInfo:
    """Shape facts of the model, or with `stack` of one stack of an encoder-decoder model (its own config fields)."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    model_type = getattr(config, "model_type", None)
    if stack is not None:
        family = stack_family(model, stack)
        heads = getattr(config, family.num_heads_field)
        hidden = getattr(config, family.hidden_size_field)
        head_dim = getattr(config, family.head_dim_field, None) if family.head_dim_field else None
        blocks = getattr(inner, "base_model", inner).get_submodule(family.layers)
        return ModelInfo(
            num_layers=len(blocks), hidden_size=hidden, num_heads=heads, family=family, model_type=model_type,
            num_kv_heads=heads, head_dim=head_dim or hidden // heads, causal=family.causal,
        )
    family = get_family(model_type)
    num_layers = getattr(config, "num_hidden_layers", None)
    if family is not None:
        blocks = _get(getattr(inner, "base_model", inner), family.layers)
        if blocks is not None:
            num_layers = len(blocks)
    hidden = getattr(config, "hidden_size", None)
    if hidden is None and family is not None and family.channels_first and num_layers is not None:
        hidden = stage_width(config, num_layers)  # a CNN's last stage (families_vision)
    heads = getattr(config, "num_attention_heads", None)
    heads = heads if isinstance(heads, int) else None  # Swin: one count per stage (no attention terms there)
    kv_field = family.num_kv_heads_field if family is not None else None
    kv_heads = (getattr(config, kv_field, None) if kv_field else None) or heads
    dim_field = family.head_dim_field if family is not None else None
    head_dim = getattr(config, dim_field, None) if dim_field else None
    width_field = family.attention_size_field if family is not None else None
    width = getattr(config, width_field, None) if width_field else hidden
    if head_dim is None and width is not None and heads:
        head_dim = width // heads
    window = getattr(config, "sliding_window", None) if family is not None and family.causal else None
    windows = None
    if window is not None and num_layers is not None:
        types = getattr(config, "layer_types", None)
        if isinstance(types, (list, tuple)) and len(types) == num_layers:
            windows = tuple(window if kind == "sliding_attention" else None for kind in types)
        else:  # Mistral, Phi-3: one window for every layer
            windows = (window,) * num_layers
    return ModelInfo(
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        family=family,
        model_type=model_type,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        causal=bool(family is not None and family.causal),
        windows=windows,
    )


@dataclass
class TapRequest:
    """Which features to capture: hidden-state indices (0 = embeddings) and, per projection, blocks."""

    hidden: set[int] = field(default_factory=set)
    q: set[int] = field(default_factory=set)
    k: set[int] = field(default_factory=set)
    v: set[int] = field(default_factory=set)
    # Encoder-decoder models: the request of each stack (`encoder`/`decoder`), captured in the same forward pass.
    stacks: dict[str, TapRequest] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.hidden or self.q or self.k or self.v or any(self.stacks.values()))


@dataclass
class Features:
    """What one forward pass left behind: `hidden[i]` is hidden_states[i], `q[i]` block i's query, ...

    Q/K/V are the projections as `(B, T, heads * head_dim)` (K/V with the model's K/V heads), *before* any
    rotary position embedding; `rope` is the model's rotary `(cos, sin)` when it has one and Q or K was
    captured, so `attention_scores` can rotate them as the model does.
    """

    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    stacks: dict[str, Features] = field(default_factory=dict)  # encoder-decoder models: each stack's features


class FeatureTaps:
    """Forward hooks on exactly the modules a set of losses needs, attached only while capturing."""

    def __init__(self, model: nn.Module, request: TapRequest, role: str = "model", stack: str | None = None) -> None:
        self.request = request
        self._role = role
        self.info = model_info(model, stack)
        self._targets: list[tuple[nn.Module, str | tuple[str, ...], int]] = []
        self._split: tuple[int, int, int] | None = None
        self._channels_first = False  # (B, C, H, W) feature maps, stored as (B, H*W, C)
        # Without a registered family, hidden states still come from `output_hidden_states`.
        self.use_hidden_states_output = False
        self._regions: tuple[nn.Module, list] | None = None  # (model, its tapped_regions): found once, not per step
        self._stacks = {name: FeatureTaps(model, sub, role, name) for name, sub in request.stacks.items() if sub}
        if not (request.hidden or request.q or request.k or request.v):
            return
        family = self.info.family
        if family is None:
            if request.q or request.k or request.v:
                raise ValueError(
                    f"The {role} ({type(unwrap(model)).__name__}, model_type={self.info.model_type!r}) is not "
                    "in the hf_distill.features.families registry, so its attention scores and Q/K/V cannot be "
                    "captured. "
                    + REGISTER_HINT
                )
            self.use_hidden_states_output = True
            return
        if family.refuse_attention and (request.q or request.k or request.v):
            raise ValueError(f"The {role} ({self.info.model_type}) has no attention or Q/K/V terms: "
                             f"{family.refuse_attention} Use hidden-state terms (hidden_mse, hidden_cos).")
        self._channels_first = family.channels_first
        base = getattr(unwrap(model), "base_model", unwrap(model))
        blocks = base.get_submodule(family.layers)
        for i in sorted(request.hidden):
            if i == 0 and family.embeddings_from_block_input:
                self._targets.append((blocks[0], "block_input", 0))
            elif i == 0:
                emb = next((m for p in family.embeddings if (m := _get(base, p)) is not None), None)
                if emb is None:
                    raise ValueError(f"The {role} has none of the modules {family.embeddings}. " + REGISTER_HINT)
                self._targets.append((emb, "hidden", 0))
            elif i == len(blocks) and family.final_norm is not None:
                # output_hidden_states ends with the final norm's output on decoders (transformers 5).
                self._targets.append((self._module(base, family.final_norm, role), "hidden", i))
            else:
                self._targets.append((blocks[i - 1], "hidden", i))
        if family.qkv is not None:
            info = self.info
            q_width, kv_width = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
            self._split = (q_width, kv_width, kv_width)
            for i in sorted(request.q | request.k | request.v):
                kinds = tuple(kind for kind in ("q", "k", "v") if i in getattr(request, kind))
                fused = self._module(blocks[i - 1], family.qkv, role)
                # nn.Linear says out_features, transformers' Conv1D (GPT-2) nf
                width = getattr(fused, "out_features", getattr(fused, "nf", None))
                if width is not None and width != sum(self._split):
                    raise ValueError(
                        f"The {role}'s fused projection {family.qkv!r} is {width} wide, but num_heads * head_dim "
                        f"+ 2 * num_kv_heads * head_dim = {q_width} + 2 * {kv_width}: its config "
                        f"({family.num_kv_heads_field}, {family.head_dim_field}) does not describe it. "
                        + REGISTER_HINT
                    )
                self._targets.append((fused, kinds, i))
        else:
            for kind, path in (("q", family.query), ("k", family.key), ("v", family.value)):
                for i in sorted(getattr(request, kind)):
                    self._targets.append((self._module(blocks[i - 1], path, role), kind, i))
        if family.rotary is not None and (request.q or request.k):
            self._targets.append((self._module(base, family.rotary, role), "rope", 0))

    def modules(self) -> list[nn.Module]:
        """Every module whose forward a hook reads (each stack's too); a first block's input is read before it runs."""
        own = [m for m, kind, _ in self._targets if kind != "block_input"]
        return own + [m for taps in self._stacks.values() for m in taps.modules()]

    @staticmethod
    def _module(root: nn.Module, path: str, role: str) -> nn.Module:
        module = _get(root, path)
        if module is None:
            raise ValueError(f"The {role} has no module {path!r} under {type(root).__name__}. " + REGISTER_HINT)
        return module

    @contextlib.contextmanager
    def capture(self) -> Iterator[Features]:
        """Attach the hooks for one forward pass; they are removed on exit, even on error."""
        feats = Features()
        handles = []
        with contextlib.ExitStack() as stacks:
            for name, taps in self._stacks.items():
                feats.stacks[name] = stacks.enter_context(taps.capture())
            try:
                for module, kind, i in self._targets:
                    if kind == "block_input":
                        hook = _store_input(feats.hidden, i)
                        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
                    else:
                        handles.append(module.register_forward_hook(self._hook(feats, kind, i)))
                yield feats
            finally:
                for h in handles:
                    h.remove()

    def _hook(self, feats: Features, kind: str | tuple[str, ...], i: int):
        if kind == "rope":
            def store_rope(_m, _inp, out):
                feats.rope = (out[0], out[1])

            return store_rope
        if isinstance(kind, tuple):  # a fused Q|K|V projection: keep the requested slices
            def store_slices(_m, _inp, out):
                for name, part in zip(("q", "k", "v"), out.split(self._split, dim=-1), strict=True):
                    if name in kind:
                        getattr(feats, name)[i] = part

            return store_slices
        store = getattr(feats, kind)

        channels_first = self._channels_first and kind == "hidden"

        def hook(_m, _inp, out):
            out = out[0] if isinstance(out, tuple) else out
            if channels_first and out.dim() == 4:  # a CNN stage's feature map: one position per pixel
                store[i] = out.flatten(2).transpose(1, 2)
                return
            # per-head modules (Qwen3's q_norm/k_norm) return (B, T, heads, head_dim)
            store[i] = out.flatten(2) if kind != "hidden" and out.dim() == 4 else out

        return hook

    def run(self, model: nn.Module, kwargs: dict) -> tuple[object, Features]:
        """One forward pass with the hooks attached: the model's outputs and the captured features."""
        if self._targets:
            check_layerdrop(unwrap(model), self._role)
        inner = unwrap(model)
        if self._regions is None or self._regions[0] is not inner:
            self._regions = (inner, tapped_regions(inner, self.modules()))
        check_tapped_checkpointing(inner, (), self._role, self._regions[1])
        with self.capture() as feats:
            out = model(**{**kwargs, **self.forward_kwargs()})  # the loss head may ask for hidden states too
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


def _store_input(store: dict[int, torch.Tensor], i: int):
    """A forward pre-hook keeping a block's input hidden states (positional or keyword) as `store[i]`."""

    def hook(_m, args, kwargs):
        store[i] = args[0] if args else kwargs["hidden_states"]

    return hook


def forward(model: nn.Module, kwargs: dict, taps: FeatureTaps | None = None) -> tuple[object, Features | None]:
    """A forward pass that also captures features when `taps` is given (else the features are None)."""
    return (model(**kwargs), None) if taps is None else taps.run(model, kwargs)


def _rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The rotary embedding as transformers applies it (rotate_half; a partial rotary dim rotates the first
    `cos.shape[-1]` features of each head and passes the rest, as Phi-3)."""
    cos, sin = (r.float().unsqueeze(1) for r in rope)  # (B|1, 1, T, rot)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = x_rot.shape[-1] // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def expand_kv(x: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """K or V `(B, T, num_kv_heads * d)` repeated to `(B, T, num_heads * d)`: query head j reads K/V head
    `j // (num_heads / num_kv_heads)`, as transformers' `repeat_kv` under grouped-query attention."""
    if num_kv_heads == num_heads:
        return x
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
    b, t, width = x.shape
    rep = num_heads // num_kv_heads
    return x.view(b, t, num_kv_heads, 1, width // num_kv_heads).expand(-1, -1, -1, rep, -1).reshape(b, t, width * rep)


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    num_heads: int,
    num_kv_heads: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pre-softmax scores (B, H, T, T) = Q_h K_hᵀ / sqrt(d_h), from (B, T, D) projections, in float32.

    This is what TinyBERT distils (its modified BERT returns the scores before the softmax). Under
    grouped-query attention K has `num_kv_heads` heads and is repeated to the `num_heads` query heads, as the
    model does. With `rope` (the model's rotary cos/sin, `Features.rope`) Q and K are rotated first, so the
    scores are the model's own (Llama-style decoders); without it they are scores of the raw projections.
    Gemma-2's `query_pre_attn_scalar` scaling and logit soft-capping are not applied: the scale is always
    1/sqrt(head_dim). Neither padding nor the causal mask is added here: the losses exclude padded and
    (with `causal=True`) future keys instead.
    """
    b, t, d = q.shape
    dh = d // num_heads
    kv = num_kv_heads or num_heads
    if k.shape[-1] != kv * dh:
        raise ValueError(
            f"attention_scores: k has width {k.shape[-1]}, expected num_kv_heads * head_dim = {kv} * {dh}"
        )
    qh = q.float().view(b, t, num_heads, dh).transpose(1, 2)
    kh = k.float().view(b, k.shape[1], kv, dh).transpose(1, 2)
    if rope is not None:
        qh, kh = _rotate(qh, rope), _rotate(kh, rope)
    if kv != num_heads:
        kh = kh.repeat_interleave(num_heads // kv, dim=1)
    return qh @ kh.transpose(-1, -2) * dh**-0.5
