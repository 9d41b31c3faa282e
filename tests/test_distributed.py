"""Real 2-process DDP runs (torchrun and accelerate launch, gloo on CPU) against one process with the same batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import distributed_run
import pytest
import torch

pytestmark = pytest.mark.distributed
SCRIPT = Path(distributed_run.__file__)


def _launch(launcher: str, out: Path, *extra: str, timeout: int = 180) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with socket.socket() as sock:  # neither launcher has an "any free port" option
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    if launcher == "torchrun":
        prefix = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    else:  # accelerate's `--cpu` would start one process; these flags start 2 and use_cpu=True keeps gloo
        prefix = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    cmd = [sys.executable, *prefix, str(SCRIPT), str(out), "--per_device_batch", "4", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {} if "--cases" in extra else json.loads((out / "result.json").read_text())


TORCHRUN_CASES = ("logit", "intermediate", "causal")


@pytest.fixture(scope="module")
def torchrun_cases(tmp_path_factory) -> Path:
    """One torchrun launch trains every torchrun case in turn (distributed_run.py --cases): OUT/<case>/result.json."""
    out = tmp_path_factory.mktemp("torchrun")
    _launch("torchrun", out, "--cases", ",".join(TORCHRUN_CASES), timeout=180 * len(TORCHRUN_CASES))
    return out


@pytest.mark.parametrize(
    ("launcher", "mode"),
    [("torchrun", "logit"), ("torchrun", "intermediate"), ("accelerate", "intermediate"), ("torchrun", "causal")],
    ids=["torchrun-logit", "torchrun-logit+intermediate", "accelerate-logit+intermediate", "torchrun-causal-lm"],
)
def test_two_processes_match_one(tmp_path, request, launcher, mode):
    intermediate, causal = mode == "intermediate", mode == "causal"
    if launcher == "torchrun":
        ddp = json.loads((request.getfixturevalue("torchrun_cases") / mode / "result.json").read_text())
    else:
        ddp = _launch(launcher, tmp_path / "ddp", *(("--intermediate",) if intermediate else ()))
    single = distributed_run.run(tmp_path / "single", per_device_batch=8, intermediate=intermediate, causal=causal)
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert ddp["wrapped_type"] == "DistributedDataParallel"
    # a plain replica, never DDP-wrapped
    assert ddp["teacher_type"] == ("LlamaForCausalLM" if causal else "BertForSequenceClassification")
    torch.testing.assert_close(
        torch.tensor(ddp["student"]), torch.tensor(single["student"]), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        torch.tensor(ddp["projections"]), torch.tensor(single["projections"]), atol=1e-6, rtol=0
    )
    for a, b in zip(ddp["logs"], single["logs"], strict=True):
        for key in (k for k in b if k.startswith("loss")):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
