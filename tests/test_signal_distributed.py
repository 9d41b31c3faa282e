"""Training from a teacher signal under real 2-process DDP (torchrun, gloo on CPU): each rank trains on its own rows
of the signal (the sampler's share of each global batch; streamed, its own signal files), and the weights are those
of one process trained on the same global batches."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest
import signal_distributed_run as run
import torch

from hf_distill.data.signal_format import signal_metadata
from hf_distill.data.teacher_signal import create_teacher_signal, load_teacher_signal

pytestmark = pytest.mark.distributed


def _rows_of(step: list[list[int]]) -> Counter:
    return Counter(tuple(r) for r in step)


def test_two_processes_train_from_their_own_rows_of_a_signal(tmp_path):
    signal_dir = tmp_path / "signal"
    create_teacher_signal(run.llama(1), run.rows(), signal_dir, tokenizer=run.tokenizer(), k=run.K,
                          temperature=run.T, rows_per_shard=run.ROWS_PER_SHARD, batch_size=12, progress=False)
    compact_dir = tmp_path / "compact"  # the compact layout (format 3), streamed: each rank its own files too
    create_teacher_signal(run.llama(1), run.rows(), compact_dir, tokenizer=run.tokenizer(), k=run.K,
                          temperature=run.T, rows_per_shard=run.ROWS_PER_SHARD, batch_size=12, progress=False,
                          layout="compact")
    adaptive_dir = tmp_path / "adaptive"  # adaptive k (format 4): at 1 - 0.97 of this flat teacher's mass, padded
    create_teacher_signal(run.llama(1), run.rows(), adaptive_dir, tokenizer=run.tokenizer(), k=run.K,
                          temperature=run.T, rows_per_shard=run.ROWS_PER_SHARD, batch_size=12, progress=False,
                          layout="compact", epsilon=0.97)
    sizes = [signal_metadata(load_teacher_signal(d))["payload_bytes_per_token"] for d in (adaptive_dir, compact_dir)]
    assert sizes[0] < sizes[1]  # some positions keep fewer than k ids
    with socket.socket() as sock:  # torchrun has no "any free port" option
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    out = tmp_path / "ddp"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           run.__file__, str(out), str(signal_dir), str(compact_dir), str(adaptive_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]

    # Streamed, accelerate gives each rank whole signal files (4 files: rank 0 rows 0-23, rank 1 rows 24-47), so
    # global batch s is rows 4s..4s+3 and 24+4s..24+4s+3: one process sees the same batches in that order.
    interleaved = [i for s in range(3) for i in (*range(4 * s, 4 * s + 4), *range(24 + 4 * s, 28 + 4 * s))]
    singles = {"map": run.train(tmp_path / "single", signal_dir, "map", per_device_batch=8),
               "stream": run.train(tmp_path / "single", signal_dir, "stream", per_device_batch=8, order=interleaved),
               "compact": run.train(tmp_path / "single", compact_dir, "compact", per_device_batch=8,
                                    order=interleaved),
               "adaptive": run.train(tmp_path / "single", adaptive_dir, "adaptive", per_device_batch=8,
                                     order=interleaved)}
    data = run.rows()
    for mode, single in singles.items():
        ddp = [r[mode] for r in ranks]
        assert [d["world_size"] for d in ddp] == [2, 2] and single["world_size"] == 1, mode
        assert ddp[0]["wrapped_type"] == "DistributedDataParallel"
        for step in range(3):  # each rank trained on its own rows; together, the one process's global batch
            mine, theirs = _rows_of(ddp[0]["seen"][step]), _rows_of(ddp[1]["seen"][step])
            assert sum(mine.values()) == sum(theirs.values()) == 4 and not mine & theirs, (mode, step)
            assert mine + theirs == _rows_of(single["seen"][step]), (mode, step)
        if mode != "map":
            assert _rows_of(ddp[0]["seen"][0]) == _rows_of([data[i]["input_ids"] for i in range(4)])
            assert _rows_of(ddp[1]["seen"][0]) == _rows_of([data[i]["input_ids"] for i in range(24, 28)])
        # Same global batches, losses normalised over the whole step's tokens on every rank (hf_distill.losses
        # .normalise): only the order of float32 sums differs (the all-reduce), as in tests/test_distributed.py.
        torch.testing.assert_close(torch.tensor(ddp[0]["student"]), torch.tensor(single["student"]), atol=1e-6, rtol=0)
        assert ddp[0]["student"] == ddp[1]["student"]  # DDP keeps the replicas identical
        for a, b in zip(ddp[0]["logs"], single["logs"], strict=True):
            for key in (k for k in b if k.startswith("loss")):
                assert a[key] == pytest.approx(b[key], rel=1e-4), (mode, key)
