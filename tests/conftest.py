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


def _xdist_workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


if _xdist_workers() > 1:
    # Several pytest-xdist workers share the machine's cores: each takes its share of intra-op threads, so that
    # torch's threads do not outnumber the cores (they spin while they wait for each other).
    import torch  # noqa: E402

    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, _cores // _xdist_workers()))

MULTIPROCESS_GROUP = "multiprocess"


def pytest_collection_modifyitems(config, items):
    """Tests that start several processes (marked `distributed`) are slow (`make test-fast` leaves them out) and
    run one at a time, on one pytest-xdist worker (`--dist loadgroup`, as `make test` runs): two at once would put
    4 processes and a test worker on 2 cores and run into their launch timeouts."""
    import pytest

    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.xdist_group(MULTIPROCESS_GROUP))
