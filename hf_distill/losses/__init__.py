"""What the student is trained on: logit divergences (`divergences`, one registry entry per kind: `registry`, the
built-in kinds in `kinds`) and feature losses (`feature_losses`), both also importable as `hf_distill.losses`, the
causal-LM loss head (`chunked`, `kd_head`, `sparse_head`, `triton_head`), intermediate-layer terms (`terms`,
`intermediate`) and the step-level normalisation of token-level means (`normalise`)."""

# `kinds` registers the built-in divergences, so importing any losses module finds them registered
from . import divergences, feature_losses, kinds, registry, teacher_forms  # noqa: F401
from .divergences import *  # noqa: F403 - `hf_distill.losses.kl_div` etc. are the public API
from .feature_losses import *  # noqa: F403 - `hf_distill.losses.hidden_mse` etc.
from .registry import *  # noqa: F403 - `hf_distill.losses.register` etc.: the divergence registry
from .teacher_forms import *  # noqa: F403 - `hf_distill.losses.TopKTail` etc.: the teacher's forms

__all__ = sorted([*divergences.__all__, *feature_losses.__all__, *registry.__all__, *teacher_forms.__all__])
