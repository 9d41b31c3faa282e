"""Real 2-process DDP runs (torchrun and accelerate launch, gloo on CPU) against one process with the same batch; in
the same torchrun launch, a teacher served on 127.0.0.1 (issue #42), alone and routed per row beside a local teacher
and an offline signal."""

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
from helpers import llama, sft_rows

from hf_distill.data.teacher_signal import create_teacher_signal
from hf_distill.serving.server import ServedModel, ServerThread, build_app

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


TORCHRUN_CASES = ("logit", "intermediate", "causal", *distributed_run.SERVED_CASES)


@pytest.fixture(scope="module")
def teacher_server(tmp_path_factory):
    """The package's own teacher server on 127.0.0.1 (a thread of this process, stopped after the module's tests),
    serving the causal case's teacher at k = the vocabulary, and an offline signal of another teacher for the
    routed case: (url, signal folder)."""
    tok = distributed_run.served_tokenizer()
    served = ServedModel(llama(1, layers=3), tok, "tiny/teacher", max_k=distributed_run.SERVED_K,
                         temperature=distributed_run.SERVED_T)
    server = ServerThread(build_app(served))
    folder = tmp_path_factory.mktemp("routed") / "signal"
    create_teacher_signal(llama(3), sft_rows(48), folder, tokenizer=tok, k=8, temperature=distributed_run.SERVED_T,
                          progress=False)
    yield server.url, folder
    server.stop()


@pytest.fixture(scope="module")
def torchrun_cases(tmp_path_factory, teacher_server) -> Path:
    """One torchrun launch trains every torchrun case in turn (distributed_run.py --cases): OUT/<case>/result.json
    (the served cases: OUT/<case>/rank<r>.json). The launch's time-out fails a hang."""
    out = tmp_path_factory.mktemp("torchrun")
    url, signal = teacher_server
    _launch("torchrun", out, "--cases", ",".join(TORCHRUN_CASES), "--teacher_url", url, "--signal_dir", str(signal),
            timeout=180 * len(TORCHRUN_CASES))
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


@pytest.mark.parametrize("case", distributed_run.SERVED_CASES)
def test_two_processes_with_a_served_teacher_match_one_with_it_local(tmp_path, request, teacher_server, case):
    """`served`: 2 processes training from the package's server equal 1 process with the same teacher local (k =
    the vocabulary: the served top-k + tail is the whole distribution). `routed`: rows routed per `teacher_id` to a
    local teacher, the server and an offline signal: 2 processes equal 1 with the same teachers, per-teacher KD
    included. In both, each process asks the server only for rows of its own share of each global batch (and for
    every row it trains on that is routed there)."""
    url, signal = teacher_server
    ranks = [json.loads((request.getfixturevalue("torchrun_cases") / case / f"rank{r}.json").read_text())
             for r in (0, 1)]
    routed = case == "routed"
    single = distributed_run.run_served(tmp_path, 8, url if routed else None, signal if routed else None)
    assert [r["world_size"] for r in ranks] == [2, 2] and single["world_size"] == 1
    assert ranks[0]["wrapped_type"] == "DistributedDataParallel"
    torch.testing.assert_close(torch.tensor(ranks[0]["student"]), torch.tensor(single["student"]), atol=1e-6, rtol=0)
    assert ranks[0]["student"] == ranks[1]["student"]
    for a, b in zip(ranks[0]["logs"], single["logs"], strict=True):
        assert {k for k in a if k.startswith("loss")} == {k for k in b if k.startswith("loss")}
        for key in (k for k in b if k.startswith("loss")):
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    data = sft_rows(48)
    teacher_of = {tuple(r["input_ids"]): (distributed_run.routed_ids(48)[i] if routed else "big")
                  for i, r in enumerate(data)}
    assert len(teacher_of) == 48  # distinct rows: a row names its rank
    seen = [{tuple(r) for r in rank["seen"]} for rank in ranks]
    asked = [{tuple(r) for r in rank["asked"]} for rank in ranks]
    assert sum(len(r["seen"]) for r in ranks) == 24 and not seen[0] & seen[1]
    for mine, other in ((0, 1), (1, 0)):
        assert {row for row in seen[mine] if teacher_of[row] == "big"} <= asked[mine]  # every row it trained on
        assert asked[mine] and not asked[mine] & seen[other]  # never the other process's rows
        assert {teacher_of[row] for row in asked[mine]} == {"big"}  # only the rows routed to the server
    assert not asked[0] & asked[1]
    if routed:  # each process's rows went to all three teachers, and each was logged
        assert {"loss_kd/local", "loss_kd/big", "loss_kd/sig"} <= {k for log in ranks[0]["logs"] for k in log}
        assert ranks[0]["routing"]["sig"]["teacher"].endswith("(offline signal, k=8)")
