import os

# Nothing in the tests may touch the network; a Hub lookup would otherwise retry for ~23 s.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

# Property tests draw the same examples on every run (a CI run must not pass or fail by the draw); set
# HYPOTHESIS_PROFILE=explore locally to search with fresh random examples instead.
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

try:
    import fcntl
except ImportError:  # POSIX only: elsewhere multi-process tests are not serialised across xdist workers
    fcntl = None

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests that start several processes (marked `distributed`) are slow too: `make test-fast` leaves them out."""
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _one_multiprocess_test_at_a_time(request, tmp_path_factory):
    """Under pytest-xdist, a test that starts several processes (marked `distributed`) waits until no other worker
    runs one: two at once would put 4 processes beside the test workers on 2 cores and run into their launch
    timeouts. An exclusive lock on a file in the folder the workers share (the session's base temporary folder's
    parent) does it; the system drops the lock of a worker that dies. (xdist's `--dist loadgroup` cannot do it with
    pytest 9: the group suffix it writes into `item._nodeid` no longer reaches the node id.) A test that launches
    processes from a fixture of a wider scope would start them before this lock: launch from the test (see
    tests/test_distributed.py)."""
    if _xdist_workers() <= 1 or request.node.get_closest_marker("distributed") is None or fcntl is None:
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "multiprocess-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_collection_finish(session):
    """Freeze what the imports and collection made: the Trainer's `accelerator.free_memory()` runs `gc.collect()`
    at every `train()` (about 0.3-0.7 s each over the whole torch / transformers object graph in this process), and
    the suite trains a few hundred times. Objects made later are still collected."""
    import gc

    gc.collect()
    gc.freeze()
