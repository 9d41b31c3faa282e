"""Intermediate-layer distillation bound to a concrete student and teacher.

`IntermediateDistiller` turns the declarative terms of `DistillationArguments` into: validated layer
pairs, the exact set of features each model must expose (so nothing else is captured), the projections
needed when widths differ, and, per step, one loss value per logged component. Every shape problem is
raised here, when the trainer is built, not at the first step.

Term weights are read again at every step (`set_weights`, called by the trainer with `args.distill_terms`),
so callbacks can schedule them or switch stages; a term of weight 0 costs nothing: its features are not
captured on either model and its loss is not computed. The terms themselves (losses, layers) are fixed
when the trainer is built, because the projections and the optimizer depend on them.

Decoders (causal families in hf_distill.features.families): attention and relation terms never let a query see a
later key (future keys are masked in relation softmaxes and left out of attention_score_mse). Under
grouped-query attention K/V are repeated to the query head count, as the model does, before scores or
relations are formed. attention_score_mse compares the model's real pre-softmax scores: Q and K are
rotated with the captured rotary cos/sin first. Relation terms (MiniLM/MiniLMv2) use the projections
before the rotary embedding, as MiniLM-style relations on decoders commonly do: relations of Q/K/V
content, not of positions. Sliding-window blocks (Mistral, Gemma-2, Qwen with layer_types) are accepted for
these terms only while the batch is no longer than the window (then they attend like full-causal blocks);
a longer batch is refused with an error rather than compared against attention the model never computes.

Encoder-decoder models: each term names its stack (`stack=encoder|decoder`, hf_distill.losses.terms); its layer map,
features, projection keys and masks are that stack's. The encoder's real tokens are the attention mask's; the
decoder's are its label positions (`decoder_mask`, hf_distill.losses.normalise.decoder_positions), and its attention and
relation terms are causal. Only self-attention is tapped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base.batch_keys import TEACHER_PREFIX
from ..features import layer_map
from ..features.families_vision import STAGE_MODELS, check_stage_pairs
from ..features.projections import Projections
from ..features.taps import (
    Features,
    FeatureTaps,
    ModelInfo,
    TapRequest,
    attention_scores,
    expand_kv,
    model_info,
    unwrap,
)
from . import feature_losses as losses
from .terms import DistillTerm, check_incremental_pairs, parse_terms


class IntermediateDistiller:
    """Validated terms with their layer pairs, the taps of both models and the projections."""

    def __init__(
        self,
        terms: list[DistillTerm],
        student: nn.Module,
        teacher: nn.Module | ModelInfo,
        projection: str,
        seed: int | None = None,
    ) -> None:
        # A ModelInfo instead of a teacher: its features come from a cache (hf_distill.data.cache), never a forward.
        s, t = model_info(student), teacher if isinstance(teacher, ModelInfo) else model_info(teacher)
        self.student_info, self.teacher_info = s, t
        self.bound: list[tuple[DistillTerm, list[tuple[int, int]], int | None]] = []
        self._requests: dict[str, tuple[TapRequest, TapRequest]] = {}
        self._infos: dict[str, tuple[ModelInfo, ModelInfo]] = {}  # per term: its stack's (or the models') infos
        projected_layers: list[int | str] = []
        for term in terms:
            s_req, t_req = TapRequest(), TapRequest()  # this term's features
            what = f"distill_terms[{term.name}] ({term.loss})"
            s, t = _stack_infos(term, student, teacher, self.student_info, self.teacher_info, what)
            self._infos[term.name] = (s, t)
            for info, role in ((s, "student"), (t, "teacher")):
                if info.num_layers is None or info.hidden_size is None:
                    raise ValueError(
                        f"{what}: the {role} has no transformers config with num_hidden_layers/hidden_size, "
                        "so intermediate layers cannot be matched. Use logit distillation only (kd_weight)."
                    )
            feature = term.feature
            pairs = layer_map.resolve(term.layers, s.num_layers, t.num_layers, feature == "hidden", what)
            heads = None
            if term.loss == "incremental_mse":
                check_incremental_pairs(pairs, what)
                pairs = sorted(pairs, key=lambda p: p[1])  # by teacher layer: each target needs the next one up
            for info, role in ((s, "student"), (t, "teacher")):  # issue #43: Swin's windows, CNNs
                if feature not in ("hidden", "cls") and info.family is not None and info.family.refuse_attention:
                    raise ValueError(f"{what}: the {role} ({info.model_type}) has no attention or Q/K/V terms: "
                                     f"{info.family.refuse_attention} Use hidden-state terms (hidden_mse, hidden_cos).")
            stages = s.model_type in STAGE_MODELS or t.model_type in STAGE_MODELS  # issue #43: vision stage models
            if feature in ("hidden", "cls") and stages:
                if feature == "cls":
                    raise ValueError(f"{what}: a stage model ({s.model_type} / {t.model_type}) has no [CLS] position; "
                                     "use hidden_mse or hidden_cos on its stage features.")
                t_config = None if isinstance(teacher, ModelInfo) else getattr(unwrap(teacher), "config", None)
                check_stage_pairs(getattr(unwrap(student), "config", None), t_config, pairs, what)
                for ls, lt in pairs:
                    s_req.hidden.add(ls)
                    t_req.hidden.add(lt)
            elif feature in ("hidden", "cls"):
                if s.hidden_size != t.hidden_size:
                    if projection == "none":
                        raise ValueError(
                            f"{what}: hidden sizes differ (student {s.hidden_size}, teacher {t.hidden_size}) "
                            "and projection='none'. Set projection='shared' or 'per_layer' to learn a map "
                            "from the student's width to the teacher's."
                        )
                    projected_layers += [_projection_key(term, p[0]) for p in pairs]
                for ls, lt in pairs:
                    s_req.hidden.add(ls)
                    t_req.hidden.add(lt)
            elif feature == "attention":
                _need_heads(s, t, what)
                _same_causality(s, t, what)
                for info, role in ((s, "student"), (t, "teacher")):
                    if info.family is not None and info.family.score_bias:
                        raise ValueError(
                            f"{what}: the {role} ({info.model_type}) adds a relative position bias to its attention "
                            "scores and does not scale them by 1/sqrt(head_dim), so its pre-softmax scores cannot be "
                            "rebuilt from Q and K. Use relation_kl (MiniLM relations of Q/K/V) or hidden-state terms."
                        )
                if s.num_heads != t.num_heads:
                    raise ValueError(
                        f"{what}: attention_score_mse compares scores head by head, but the student has "
                        f"{s.num_heads} heads and the teacher {t.num_heads}. Give the student "
                        f"{t.num_heads} heads, or use relation_kl with relation_heads (MiniLMv2), which "
                        "works across head counts."
                    )
                for ls, lt in pairs:
                    s_req.q.add(ls), s_req.k.add(ls)
                    t_req.q.add(lt), t_req.k.add(lt)
            else:  # qkv relations
                heads = _relation_heads(term, s, t, what)
                for ls, lt in pairs:
                    for rel in term.relations:
                        for kind in set(rel):
                            getattr(s_req, kind).add(ls)
                            getattr(t_req, kind).add(lt)
            self.bound.append((term, pairs, heads))
            if term.stack is not None:  # captured inside that stack (hf_distill.features.taps)
                s_req, t_req = TapRequest(stacks={term.stack: s_req}), TapRequest(stacks={term.stack: t_req})
            self._requests[term.name] = (s_req, t_req)
        self._student, self._teacher = student, (None if isinstance(teacher, ModelInfo) else teacher)
        self._taps: dict[tuple[str, ...], tuple[FeatureTaps, FeatureTaps | None, TapRequest]] = {}
        self._weights = {term.name: term.weight for term, _, _ in self.bound}
        # Every term's teacher features, whatever the current weights (what a cache must provide).
        t_req = _union(r[1] for r in self._requests.values())
        self.teacher_request = t_req
        self._select(tuple(self._weights))  # build (and validate) the taps of all terms now
        if isinstance(teacher, ModelInfo) and (t_req.q or t_req.k or t_req.v):
            raise ValueError(
                "Attention and relation terms need the teacher's Q/K/V, which hf_distill.data.cache does not store: "
                "pass teacher_model, or keep only hidden_mse/cosine_loss/pkd_loss terms."
            )
        self.projections: Projections | None = None
        self._projection_spec = (s.hidden_size, t.hidden_size, projection, projected_layers)
        self._seed = seed
        if projected_layers:
            self.projections = self._new_projections()

    def _new_projections(self) -> Projections:
        """Projections drawn from `seed` (when given) without touching the global RNG, so every run and every
        `model_init` trial starts them alike."""
        with torch.random.fork_rng(devices=[]):
            if self._seed is not None:
                torch.manual_seed(self._seed)
            return Projections(*self._projection_spec)

    def reset_projections(self) -> None:
        """Start the projections afresh, in place (the optimizer and callbacks keep the same modules): a new
        student from `model_init` (each hyperparameter-search trial) is a new run, not a continuation."""
        if self.projections is not None:
            self.projections.load_state_dict(self._new_projections().state_dict())

    def bind_student(self, student: nn.Module) -> None:
        """Hook the student features on `student` from now on. The Trainer may replace the model it trains after
        the trainer is built (`model_init`, hyperparameter search), so taps follow the model the loss is given;
        the terms were validated against the first one, so a student of another shape is refused."""
        if unwrap(student) is unwrap(self._student):
            return
        info = model_info(student)
        if info != self.student_info:
            raise ValueError(
                f"The model to train ({type(unwrap(student)).__name__}: {info.num_layers} layers, hidden size "
                f"{info.hidden_size}, {info.num_heads} heads) does not have the shape the distill_terms were "
                f"validated against when the trainer was built ({self.student_info.num_layers} layers, hidden size "
                f"{self.student_info.hidden_size}, {self.student_info.num_heads} heads). model_init must return "
                "students of one architecture; vary training hyperparameters only, or build one trainer per shape."
            )
        self._student = student
        self._taps.clear()  # rebuilt for the active terms on first use

    # ------------------------------------------------------------------ run-time weights

    def set_weights(self, specs: list | None) -> None:
        """Take the current term weights from `specs` (`args.distill_terms`). Only weights may change
        during training: adding, removing or redefining a term raises."""
        current = {t.name: t for t in parse_terms(specs or [])}
        bound = {term.name: term for term, _, _ in self.bound}
        changed = sorted(n for n in bound.keys() | current.keys()
                         if n not in current or n not in bound or _definition(current[n]) != _definition(bound[n]))
        if changed:
            raise ValueError(
                f"distill_terms changed during training ({', '.join(changed)}): only weights can change once the "
                "trainer is built. Declare every term the run will use up front (weight 0 until it is needed)."
            )
        self._weights = {n: current[n].weight for n in bound}

    @property
    def active(self) -> tuple[str, ...]:
        """Names of the terms whose current weight is > 0."""
        return tuple(n for n, w in self._weights.items() if w > 0)

    def _select(self, names: tuple[str, ...]) -> tuple[FeatureTaps, FeatureTaps | None, TapRequest]:
        if names not in self._taps:
            s_req = _union(self._requests[n][0] for n in names)
            t_req = _union(self._requests[n][1] for n in names)
            teacher = FeatureTaps(self._teacher, t_req, "teacher") if self._teacher is not None else None
            self._taps[names] = (FeatureTaps(self._student, s_req, "student"), teacher, t_req)
        return self._taps[names]

    @property
    def student_taps(self) -> FeatureTaps:
        """Hooks for the student features of the active terms only."""
        return self._select(self.active)[0]

    @property
    def teacher_taps(self) -> FeatureTaps | None:
        """Hooks for the teacher features of the active terms only (None when features come from a cache)."""
        return self._select(self.active)[1]

    def cached_features(self, cached: dict[str, torch.Tensor]) -> Features | None:
        """The teacher features from cached `teacher_hidden_<i>` batch columns, or None when any needed
        feature is missing (Q/K/V are never cached), in which case the teacher must run."""
        req = self._select(self.active)[2]
        if req.q or req.k or req.v or req.stacks:  # encoder-decoder stacks are never cached
            return None
        names = {i: f"{TEACHER_PREFIX}hidden_{i}" for i in req.hidden}
        if not all(n in cached for n in names.values()):
            return None
        return Features(hidden={i: cached[n] for i, n in names.items()})

    def component_names(self) -> list[str]:
        return [n for term, _, _ in self.bound for n in term.component_names()]

    def count_kinds(self) -> dict[str, str | None]:
        """Per component, the positions its value is a mean over (hf_distill.losses.normalise): real tokens for
        hidden_mse/cosine_loss/incremental_mse (a sum of hidden_mse means), real (query, key) pairs for
        attention_score_mse (key <= query on decoders), None for the per-row terms (relation_kl averages per
        example, pkd_loss per row). A decoder stack's terms count the decoder's positions (`decoder_*` kinds)."""
        out: dict[str, str | None] = {}
        for t, _, _ in self.bound:
            s_info, t_info = self._infos[t.name]
            if t.stack == "decoder":
                kinds = {"hidden_mse": "decoder_tokens", "cosine_loss": "decoder_tokens",
                         "incremental_mse": "decoder_tokens", "attention_score_mse": "decoder_causal_pairs"}
            else:
                pairs = "causal_pairs" if s_info.causal and t_info.causal else "pairs"
                kinds = {"hidden_mse": "tokens", "cosine_loss": "tokens", "incremental_mse": "tokens",
                         "attention_score_mse": pairs}
            out.update({n: kinds.get(t.loss) for n in t.component_names()})
        return out

    def weights(self) -> dict[str, float]:
        """Current weight of each component of the active terms."""
        active = self.active
        return {n: self._weights[t.name] for t, _, _ in self.bound if t.name in active for n in t.component_names()}

    def _project(self, x: torch.Tensor, layer: int | str) -> torch.Tensor:
        if self.projections is None:
            return x
        # Features may be bf16 (autocast); projections and losses run in float32.
        return self.projections(x.float(), layer)

    def losses(
        self,
        s_all: Features,
        t_all: Features,
        input_mask: torch.Tensor | None,
        decoder_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """One value per component of the active terms, each summed over the term's layer pairs (as
        TinyBERT sums layers). `input_mask` marks the real tokens of the input (an encoder-decoder's encoder),
        `decoder_mask` those of an encoder-decoder's decoder."""
        out: dict[str, torch.Tensor] = {}
        active = self.active
        for term, pairs, heads in self.bound:
            if term.name not in active:
                continue
            si, ti = self._infos[term.name]
            sh, th = si.num_heads, ti.num_heads
            causal = si.causal and ti.causal
            s, t = (s_all, t_all) if term.stack is None else (s_all.stacks[term.stack], t_all.stacks[term.stack])
            mask = decoder_mask if term.stack == "decoder" else input_mask
            if term.loss in ("hidden_mse", "cosine_loss"):
                fn = losses.FEATURE_LOSSES[term.loss]
                out[term.name] = sum(
                    fn(self._project(s.hidden[a], _projection_key(term, a)), t.hidden[b], mask) for a, b in pairs
                )
            elif term.loss == "incremental_mse":
                targets = incremental_targets(t.hidden, [b for _, b in pairs])
                out[term.name] = sum(
                    losses.hidden_mse(self._project(s.hidden[a], _projection_key(term, a)), target, mask)
                    for (a, _), target in zip(pairs, targets, strict=True)
                )
            elif term.loss == "pkd_loss":
                out[term.name] = sum(
                    losses.pkd_loss(self._project(s.hidden[a][:, 0], _projection_key(term, a)), t.hidden[b][:, 0])
                    for a, b in pairs
                )
            elif term.loss == "attention_score_mse":
                _check_windows(term, pairs, si, ti, s.q, mask)
                out[term.name] = sum(
                    losses.attention_score_mse(
                        attention_scores(s.q[a], s.k[a], sh, _kv(si), s.rope),
                        attention_scores(t.q[b], t.k[b], th, _kv(ti), t.rope),
                        mask,
                        causal=causal,
                    )
                    for a, b in pairs
                )
            else:
                _check_windows(term, pairs, si, ti, s.q if s.q else s.v, mask)
                for rel in term.relations:
                    x, y = rel[0], rel[1]
                    out[f"{term.name}_{rel}"] = sum(
                        losses.relation_kl(
                            _qkv(s, x, a, si), _qkv(s, y, a, si), _qkv(t, x, b, ti), _qkv(t, y, b, ti), heads, mask,
                            causal=causal,
                        )
                        for a, b in pairs
                    )
        return out


def _projection_key(term: DistillTerm, layer: int) -> int | str:
    """The student layer a per-layer projection is keyed by (`encoder_1`, `decoder_1` inside stacks)."""
    return layer if term.stack is None else f"{term.stack}_{layer}"


def _stack_infos(term: DistillTerm, student: nn.Module, teacher, s: ModelInfo, t: ModelInfo, what: str):
    """The student's and teacher's infos for this term: of its stack on encoder-decoder models, else the models'."""
    encoder_decoder = [
        role for role, m in (("student", student), ("teacher", teacher))
        if not isinstance(m, ModelInfo) and getattr(getattr(unwrap(m), "config", None), "is_encoder_decoder", False)
    ]
    if term.stack is None:
        if encoder_decoder:
            raise ValueError(
                f"{what}: the {' and the '.join(encoder_decoder)} {'is an' if len(encoder_decoder) == 1 else 'are'} "
                "encoder-decoder model(s), whose encoder and decoder each have their own layers: say which stack the "
                "term compares with stack=encoder or stack=decoder (one term per stack)."
            )
        return s, t
    if isinstance(teacher, ModelInfo):
        raise ValueError(f"{what}: cached teacher features have no stacks; pass teacher_model (stack={term.stack}).")
    if len(encoder_decoder) < 2:
        other = "student" if "student" not in encoder_decoder else "teacher"
        raise ValueError(
            f"{what}: stack={term.stack!r} compares a stack of two encoder-decoder models, but the {other} "
            f"({type(unwrap(student if other == 'student' else teacher)).__name__}) is not one. Leave `stack` out "
            "for encoder-only or decoder-only models."
        )
    return model_info(student, term.stack), model_info(teacher, term.stack)


def incremental_targets(hidden: dict[int, torch.Tensor], layers: list[int]) -> list[torch.Tensor]:
    """incremental_mse's targets for teacher `layers` in increasing order: `F_T(l_i) - F_T(l_{i+1})` for every
    layer but the top one, and `F_T(l_top)` itself (differences in float32, as teacher features may be bf16)."""
    diffs = [hidden[lo].float() - hidden[hi].float() for lo, hi in zip(layers, layers[1:])]
    return [*diffs, hidden[layers[-1]]]


def _check_windows(term: DistillTerm, pairs, s: ModelInfo, t: ModelInfo, feats: dict, mask) -> None:
    """Attention/relation terms assume full causal attention; a sliding-window block sees only its last
    `window` keys, so a longer batch would compare something the model never computes: refuse it."""
    length = mask.shape[1] if mask is not None else next(iter(feats.values())).shape[1]
    for info, role, layers in ((s, "student", [a for a, _ in pairs]), (t, "teacher", [b for _, b in pairs])):
        for layer in layers:
            window = info.windows[layer - 1] if info.windows is not None else None
            if window is not None and length > window:
                raise ValueError(
                    f"distill_terms[{term.name}] ({term.loss}): block {layer} of the {role} uses sliding-window "
                    f"attention (window {window}) and the batch has {length} tokens, but attention and relation "
                    f"terms assume full causal attention. Use sequences of at most {window} tokens, or map the "
                    "term to full-attention layers (config.layer_types)."
                )


def _qkv(feats: Features, kind: str, layer: int, info: ModelInfo) -> torch.Tensor:
    """Q, or K/V repeated to the query head count under grouped-query attention (pre-rotary)."""
    x = getattr(feats, kind)[layer]
    if kind == "q" or _kv(info) == info.num_heads:
        return x
    return expand_kv(x, info.num_heads, _kv(info))


def _union(requests) -> TapRequest:
    out = TapRequest()
    stacks: dict[str, list[TapRequest]] = {}
    for r in requests:
        for kind in ("hidden", "q", "k", "v"):
            getattr(out, kind).update(getattr(r, kind))
        for name, sub in r.stacks.items():
            stacks.setdefault(name, []).append(sub)
    out.stacks = {name: _union(subs) for name, subs in stacks.items()}
    return out


def _definition(term: DistillTerm) -> dict:
    d = term.to_dict()
    d.pop("weight")
    return d


def _need_heads(s: ModelInfo, t: ModelInfo, what: str) -> None:
    if s.num_heads is None or t.num_heads is None:
        raise ValueError(f"{what}: both configs must define num_attention_heads.")


def _same_causality(s: ModelInfo, t: ModelInfo, what: str) -> None:
    # Without a registered family (or for a cached teacher) Q/K/V cannot be captured; that error comes later.
    if s.family is not None and t.family is not None and s.causal != t.causal:
        causal, other = ("student", "teacher") if s.causal else ("teacher", "student")
        raise ValueError(
            f"{what}: the {causal} is a causal decoder ({s.model_type if s.causal else t.model_type}) and the "
            f"{other} is not; attention and relation terms compare a query's keys, which a decoder restricts "
            "to earlier tokens. Distil these terms between two decoders (or two encoders), or use hidden-state "
            "terms only."
        )


def _kv(info: ModelInfo) -> int | None:
    return info.num_kv_heads or info.num_heads


def _relation_heads(term: DistillTerm, s: ModelInfo, t: ModelInfo, what: str) -> int:
    _need_heads(s, t, what)
    _same_causality(s, t, what)
    heads = term.relation_heads
    if heads is None:
        if s.num_heads != t.num_heads:
            raise ValueError(
                f"{what}: the student has {s.num_heads} attention heads and the teacher {t.num_heads}; "
                "relations over each model's own heads need equal counts. Set relation_heads (MiniLMv2) "
                "to a number that divides both hidden sizes."
            )
        heads = s.num_heads
    for info, role in ((s, "student"), (t, "teacher")):
        # Q/K/V are num_heads * head_dim wide (K/V once repeated to the query heads); that is the hidden size
        # except where head_dim is set apart from it (Gemma).
        width = info.q_width
        if width % heads:
            raise ValueError(
                f"{what}: relation_heads={heads} does not divide the {role}'s Q/K/V width {width} "
                f"(num_attention_heads * head_dim). Choose a number of relation heads that divides both widths."
            )
    return heads
