"""Building students: copied or shrunk from the teacher (`build`), pruned in depth (`prune`) and in width (`width`),
the public API also importable as `hf_distill.students`; the Distilled-BiLSTM student (`bilstm`), FastBERT-style early
exit (`early_exit`) and MobileBERT's progressive transfer (`progressive`); distil-whisper's student (`speech`)."""

from . import build, prune, speech, width
from .build import *  # noqa: F403 - `hf_distill.students.from_teacher` etc. are the public API
from .prune import *  # noqa: F403 - `hf_distill.students.prune_depth` etc.
from .speech import *  # noqa: F403 - `hf_distill.students.whisper_student` etc.
from .width import *  # noqa: F403 - `hf_distill.students.prune_width` etc.

__all__ = [*build.__all__, *prune.__all__, *speech.__all__, *width.__all__]
