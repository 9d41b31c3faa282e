import os

# Nothing in the tests may touch the network; a Hub lookup would otherwise retry for ~23 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

# Property tests draw the same examples on every run (a CI run must not pass or fail by the draw); set
# HYPOTHESIS_PROFILE=explore locally to search with fresh random examples instead.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
