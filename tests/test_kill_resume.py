"""SIGKILL in the middle of training, resume from the last checkpoint, finish with the same weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).with_name("kill_run.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _run(out: Path, *extra: str) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out), *extra], env=ENV, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(tmp_path):
    _run(tmp_path / "full")

    killed = tmp_path / "killed"
    killed.mkdir()
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(killed), "--pause_after_save", "8"], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "paused").exists():
        assert proc.poll() is None, "the run ended before reaching its checkpoint"
        assert time.monotonic() < deadline, "the run never reached its checkpoint"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "final.pt").exists()
    checkpoints = sorted(p.name for p in (killed / "out").glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-4", "checkpoint-8"]

    _run(killed, "--resume")  # resume_from_checkpoint=True picks checkpoint-8
    full = torch.load(tmp_path / "full" / "final.pt", weights_only=False)
    resumed = torch.load(killed / "final.pt", weights_only=False)
    for part in ("student", "projections"):
        for name, tensor in full[part].items():
            torch.testing.assert_close(resumed[part][name], tensor, atol=1e-6, rtol=0, msg=f"{part}.{name}")
    # The history of steps 1..8 comes back from the checkpoint; steps 9..12 were trained after the kill.
    logged = {r["step"]: r for r in resumed["log_history"] if "loss" in r}
    assert sorted(logged) == list(range(1, 13))
    for r in (r for r in full["log_history"] if "loss" in r):
        for key in (k for k in r if k.startswith("loss")):
            assert abs(logged[r["step"]][key] - r[key]) <= 1e-5 * max(1.0, abs(r[key])), (r["step"], key)
