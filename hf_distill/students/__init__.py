"""Building students: copied or shrunk from the teacher and pruned in depth (`build`, the public API also
importable as `hf_distill.students`), the Distilled-BiLSTM student (`bilstm`), FastBERT-style early exit
(`early_exit`) and MobileBERT's progressive transfer (`progressive`)."""

from .build import *  # noqa: F403 - `hf_distill.students.from_teacher` etc. are the public API
from .build import __all__  # noqa: F401
