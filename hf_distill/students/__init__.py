"""Building students: copied or shrunk from the teacher (`build`) and pruned in depth (`prune`), the public API
also importable as `hf_distill.students`; the Distilled-BiLSTM student (`bilstm`), FastBERT-style early exit
(`early_exit`) and MobileBERT's progressive transfer (`progressive`)."""

from . import build, prune
from .build import *  # noqa: F403 - `hf_distill.students.from_teacher` etc. are the public API
from .prune import *  # noqa: F403 - `hf_distill.students.prune_depth` etc.

__all__ = [*build.__all__, *prune.__all__]
