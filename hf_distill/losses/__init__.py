"""What the student is trained on: divergences and feature losses (`divergences`, also importable as
`hf_distill.losses`), the causal-LM loss head (`chunked`, `triton_head`), intermediate-layer terms (`terms`,
`intermediate`) and the step-level normalisation of token-level means (`normalise`)."""

from .divergences import *  # noqa: F403 - `hf_distill.losses.kl_div` etc. are the public API
from .divergences import __all__  # noqa: F401
