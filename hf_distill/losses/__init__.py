"""What the student is trained on: logit divergences (`divergences`) and feature losses (`feature_losses`), both
also importable as `hf_distill.losses`, the causal-LM loss head (`chunked`, `kd_head`, `triton_head`),
intermediate-layer terms (`terms`, `intermediate`) and the step-level normalisation of token-level means
(`normalise`)."""

from . import divergences, feature_losses
from .divergences import *  # noqa: F403 - `hf_distill.losses.kl_div` etc. are the public API
from .divergences import DIVERGENCE_KINDS  # noqa: F401 - the loss head's divergences (chunked, triton_head)
from .feature_losses import *  # noqa: F403 - `hf_distill.losses.hidden_mse` etc.

__all__ = sorted([*divergences.__all__, *feature_losses.__all__])
