"""DistillationTrainer.train() end to end under DeepSpeed ZeRO-3 on 2 CPU processes (gloo), then push_to_hub.

`accelerate launch --config_file` starts tests/engine_run.py with a student narrower than the teacher, so a
projection trains inside the engine with it. The student and the projection must equal a single-process run,
each rank must hold about half of the teacher and of the student, a fresh trainer resumed from the step-2
checkpoint must end where the run ended, the student's files must hold no projection, and the push from every
rank must complete (the ZeRO-3 save gathers the shards: a rank skipping it would deadlock the others). FSDP needs a GPU
(accelerate runs it as DDP on a CPU, which hf_distill.placement.check_engine refuses): see
benchmarks/distributed_gpu.sh. A second launch (tests/on_policy_run.py) trains a tiny Llama on completions it
generates (lmbda) or its teacher generates (seq_kd) under ZeRO-3: they must be the single process's, token for token.
Off-policy causal-LM KD runs under DDP, FSDP1 and FSDP2 (torchrun; FSDP on CPU through engine_run.fsdp_on_cpu, a
test-only shim) and must equal one process: through the loss head under DDP, with whole logits under FSDP.
DeepSpeed is a dev dependency; its first run on a machine JIT-builds a small
shared-memory op (seconds with a C++ compiler; cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import engine_run
import on_policy_run
import pytest
import torch
from hub_server import FakeHub
from safetensors import safe_open

pytestmark = pytest.mark.distributed
CONFIGS = Path(__file__).parent / "configs"


def _free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_zero3_on_two_cpu_processes_matches_one_and_pushes(tmp_path):
    port = _free_port()
    root = str(Path(__file__).parents[1])  # this checkout's hf_distill, not an installed one
    with FakeHub() as hub:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint,
               "HF_TOKEN": "hf_test", "HF_HUB_DISABLE_XET": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(CONFIGS / "accelerate_zero3_cpu.yaml"), "--main_process_port", port, engine_run.__file__,
               str(tmp_path / "zero3"), "--engine", "zero3", "--per_device_batch", "4",
               "--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json"), "--push_to", "user/zero3-student",
               "--student_width", "16", "--resume_check"]
        # A deadlock (e.g. a card evaluating a sharded teacher on rank 0) never ends; a slow, loaded machine does.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        repo = hub.repos["user/zero3-student"]
    zero3 = json.loads((tmp_path / "zero3" / "result.json").read_text())
    single = engine_run.run(tmp_path / "single", "ddp", per_device_batch=8, steps=3, student_width=16)
    assert (zero3["distributed_type"], zero3["world_size"], zero3["steps"]) == ("DEEPSPEED", 2, 3)
    assert zero3["teacher_type"] == zero3["wrapped_type"] == "DeepSpeedEngine"
    torch.testing.assert_close(torch.tensor(zero3["student"]), torch.tensor(single["student"]), atol=1e-5, rtol=0)
    assert len(single["projections"]) == 16 * 32 + 32  # one shared Linear, 16 -> 32
    torch.testing.assert_close(
        torch.tensor(zero3["projections"]), torch.tensor(single["projections"]), atol=1e-5, rtol=0
    )
    for a, b in zip(zero3["logs"], single["logs"], strict=True):
        for key in ("loss_kd", "loss_hidden", "loss_attention", "grad_norm"):  # grad_norm counts the projection
            assert a[key] == pytest.approx(b[key], rel=1e-4), key
    # resumed from checkpoint-2 by a fresh trainer: the engine's checkpoint restored the projection too
    resumed = zero3["resumed"]
    assert "global_step2" in resumed["checkpoint_files"] and "distill_projections.pt" not in resumed["checkpoint_files"]
    torch.testing.assert_close(torch.tensor(resumed["student"]), torch.tensor(zero3["student"]), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        torch.tensor(resumed["projections"]), torch.tensor(zero3["projections"]), atol=1e-6, rtol=0
    )
    # the student's files hold the student only, during training (checkpoint) and after it
    assert not any("projection" in k for k in zero3["student_keys"])
    with safe_open(str(tmp_path / "zero3" / "out" / "checkpoint-2" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == zero3["student_keys"]
    full_teacher, full_student = single["ranks"][0]["teacher_bytes"], single["ranks"][0]["student_bytes"]
    for rank in zero3["ranks"]:  # a partition each (odd-sized tensors round up)
        assert rank["teacher_bytes"] <= 0.55 * full_teacher and rank["student_bytes"] <= 0.55 * full_student
    files = repo["revisions"]["main"]
    assert "model.safetensors" in files and "README.md" in files
    assert b"teacher" in files["README.md"].lower()


def test_zero3_generation_on_two_cpu_processes_matches_one(tmp_path):
    """lmbda=1 (the student generates) then seq_kd (the teacher generates) under ZeRO-3 on 2 processes, greedy: the
    completions, losses, logged generated tokens and final student equal one process on the same global batch.
    Each process's completions stop at their own lengths (synced_gpus keeps the finished one stepping), the
    parameters are gathered with the engines' hooks set aside (from step 2 on, their prefetch left parameters in
    flight when GatheredParameters repartitioned them), and the evaluations of the lmbda phase complete."""
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(CONFIGS / "accelerate_zero3_cpu.yaml"), "--main_process_port", _free_port(), on_policy_run.__file__,
           str(tmp_path / "zero3"), "--per_device_batch", "4",
           "--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)  # a hang never ends
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    zero3 = json.loads((tmp_path / "zero3" / "result.json").read_text())
    single = on_policy_run.run(tmp_path / "single", per_device_batch=8, steps=3)
    initial = torch.cat([v.reshape(-1) for _, v in sorted(on_policy_run.llama(0).state_dict().items())])
    for phase in ("lmbda", "seq_kd"):
        z, s = zero3[phase], single[phase]
        assert (z["distributed_type"], z["world_size"], z["steps"]) == ("DEEPSPEED", 2, 3), phase
        assert len(z["generated"]) == 3 and all(len(rows) == 8 for rows in z["generated"]), phase
        assert z["generated"] == s["generated"], phase  # token-identical completions of the same prompts
        assert any(len(set(longest)) > 1 for longest in z["longest"]), phase  # one process stopped first
        for a, b, rows in zip(z["logs"], s["logs"], z["generated"], strict=True):
            assert a["generated_tokens"] == b["generated_tokens"] == sum(len(c) for _, c in rows), phase
            for key in ("loss", "loss_kd", "loss_task", "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), (phase, key)
        torch.testing.assert_close(torch.tensor(z["student"]), torch.tensor(s["student"]), atol=1e-5, rtol=0)
        assert (torch.tensor(s["student"]) - initial).abs().max() > 1e-3  # the student did learn
    evals = [[(r["step"], r["eval_loss"]) for r in run["lmbda"]["eval_logs"]] for run in (zero3, single)]
    assert [step for step, _ in evals[0]] == [2, 3]
    assert [loss for _, loss in evals[0]] == pytest.approx([loss for _, loss in evals[1]], rel=1e-5)


@pytest.mark.parametrize("engine", ["ddp", "fsdp1", "fsdp2"])
def test_causal_lm_on_two_cpu_processes_matches_one(tmp_path, engine):
    """Off-policy causal-LM KD (a tiny Llama: JSD + CE on completion tokens, SGD) on 2 processes equals one process
    on the same global batch. DDP and FSDP2 go through the loss head (hf_distill.losses.chunked; FSDP2 with the LM
    heads' weights whole once per step, hf_distill.kd_paths.engine_heads); FSDP1 computes whole logits with a warning
    that names the reason and FSDP2 (its LM head is a piece of a flat-parameter shard outside the forward). FSDP runs
    on CPU processes by engine_run.fsdp_on_cpu (accelerate turns FSDP on only on accelerators). The FSDP2 launch then
    runs tests/engine_heads_run.py's scenarios in the same process group (issue #41 item 1)."""
    root = str(Path(__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           engine_run.__file__, str(tmp_path / engine), "--engine", engine, "--per_device_batch", "4", "--causal_lm",
           *(["--fsdp_on_cpu"] if engine != "ddp" else []), *(["--head_scenarios"] if engine == "fsdp2" else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)  # a hang fails the test
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run = json.loads((tmp_path / engine / "result.json").read_text())
    single = engine_run.run(tmp_path / "single", "ddp", per_device_batch=8, steps=3, causal_lm=True)
    fsdp = engine != "ddp"
    assert (run["distributed_type"], run["world_size"], run["steps"]) == ("FSDP" if fsdp else "MULTI_CPU", 2, 3)
    assert run["wrapped_type"] == {"ddp": "DistributedDataParallel", "fsdp1": "FullyShardedDataParallel",
                                   "fsdp2": "FSDPLlamaForCausalLM"}[engine]
    whole = [w for w in run["warnings"] if "computed whole" in w]
    assert single["loss_head"] is True and not any("computed whole" in w for w in single["warnings"])
    if engine == "fsdp1":
        assert run["loss_head"] is None and len(whole) == 1 and "FSDP1" in whole[0] and "FSDP2" in whole[0]
    else:
        assert run["loss_head"] is True and not whole
    assert run["student_keys"] == single["student_keys"]
    torch.testing.assert_close(torch.tensor(run["student"]), torch.tensor(single["student"]), atol=1e-5, rtol=0)
    initial = torch.cat([v.reshape(-1) for _, v in sorted(on_policy_run.llama(0).state_dict().items())])
    assert (torch.tensor(single["student"]) - initial).abs().max() > 1e-3  # the student did learn
    for a, b in zip(run["logs"], single["logs"], strict=True):
        for key in ("loss", "loss_kd", "loss_task", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), key
    if engine == "fsdp2":
        _check_head_scenarios(tmp_path / engine / "scenarios", tmp_path, "fsdp2")


_SINGLE: dict[str, dict] = {}  # the scenarios' one-process references, shared by the FSDP2 and ZeRO-3 tests


def _check_head_scenarios(folder: Path, tmp_path: Path, engine: str) -> None:
    """tests/engine_heads_run.py's scenarios (tied and untied heads, gradient accumulation, processes with different
    lengths and numbers of token chunks; FSDP2: a head resharded after the forward) through the loss head on 2
    processes: losses and weights equal one process on the same global batch within 1e-6, and each head gathered
    once per micro-batch on every process."""
    import engine_heads_run

    distributed_type = {"fsdp2": "FSDP", "zero3": "DEEPSPEED"}[engine]
    for name in engine_heads_run.scenarios(engine):
        _, accumulation, chunk = engine_heads_run.SCENARIOS[name]
        run = json.loads((folder / name / f"{name}.json").read_text())
        if name not in _SINGLE:
            _SINGLE[name] = engine_heads_run.run_scenario(tmp_path / "single" / name, "ddp", 8, name)
        single = _SINGLE[name]
        assert (run["distributed_type"], run["world_size"], run["steps"]) == (distributed_type, 2, 2), name
        assert run["loss_head"] is True and single["loss_head"] is True, name
        assert not any("computed whole" in w for w in run["warnings"]), (name, run["warnings"])
        torch.testing.assert_close(torch.tensor(run["student"]), torch.tensor(single["student"]), atol=1e-6, rtol=0)
        assert len(run["logs"]) == 2, name
        for a, b in zip(run["logs"], single["logs"], strict=True):
            for key in ("loss", "loss_kd", "loss_task"):
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), (name, key)
        first, second = run["calls"]  # per process, per micro-batch
        assert len(first) == len(second) == 2 * accumulation, name
        for calls in (first, second):  # one gather of each head per micro-batch, whatever the chunk count
            assert all(c["student_calls"] == 1 and c["teacher_gathers"] == 1 for c in calls), (name, calls)
        assert {c["length"] for c in first}.isdisjoint({c["length"] for c in second}), name  # unequal lengths
        resharded = name in engine_heads_run.FSDP2_ONLY  # the student's head a DTensor shard: full_tensor() once
        assert all(c["dtensor_gathers"] == int(resharded) for c in first + second), (name, first, second)
        if chunk is not None:
            assert all(a["chunks"] != b["chunks"] for a, b in zip(first, second, strict=True)), name


def test_zero3_loss_head_with_unequal_chunk_counts_on_two_cpu_processes(tmp_path):
    """Multi-process ZeRO-3 through the loss head (issue #41 item 3): the processes hold rows of different lengths,
    so different numbers of token chunks (kd_chunk_size=2), with and without tied embeddings and gradient
    accumulation. The student's LM head is gathered by ZeRO-3 once per micro-batch around the whole head (its module
    called once, hf_distill.kd_paths.engine_heads), the teacher's once: no collective depends on the chunk count, so
    the run cannot hang by construction (before, each chunk called the head as a module, a gather each, and processes
    with different chunk counts waited for each other forever; the head was refused there). A hang fails the time
    limit. Losses and weights equal one process within 1e-6."""
    import engine_heads_run

    root = str(Path(__file__).parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(CONFIGS / "accelerate_zero3_cpu.yaml"), "--main_process_port", _free_port(), engine_heads_run.__file__,
           str(tmp_path / "zero3"), "--engine", "zero3", "--per_device_batch", "4",
           "--deepspeed_config", str(CONFIGS / "zero3_auto_no_optimizer.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)  # a hang fails the test
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    _check_head_scenarios(tmp_path / "zero3", tmp_path, "zero3")
