"""Teacher placement: the mode chosen from the accelerator state, and real FSDP2 sharding on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from helpers import args, bert, collate, distilbert, teacher, token_dataset

from hf_distill import DistillationTrainer
from hf_distill.placement import (
    FSDP_SHARDED,
    REPLICA,
    ZERO3_SHARDED,
    check_engine,
    check_fsdp2_wrap,
    local_parameter_bytes,
    place_teacher,
    teacher_input_device,
    teacher_mode,
    zero3_inference_config,
)


def _accelerator(kind, stage=None, device="cpu"):
    plugin = SimpleNamespace(deepspeed_config={"zero_optimization": {"stage": stage}}) if stage is not None else None
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(deepspeed_plugin=plugin), device=device)


@pytest.mark.parametrize(
    ("kind", "stage", "mode"),
    [
        (DistributedType.NO, None, REPLICA),
        (DistributedType.MULTI_CPU, None, REPLICA),
        (DistributedType.MULTI_GPU, None, REPLICA),
        (DistributedType.FSDP, None, FSDP_SHARDED),
        (DistributedType.DEEPSPEED, 3, ZERO3_SHARDED),
        (DistributedType.DEEPSPEED, 2, REPLICA),
        (DistributedType.DEEPSPEED, 1, REPLICA),
    ],
)
def test_mode_follows_the_accelerator(kind, stage, mode):
    assert teacher_mode(_accelerator(kind, stage)) == mode


def test_replica_is_frozen_eval_on_device():
    t = teacher().train()
    placed = place_teacher(t, _accelerator(DistributedType.MULTI_CPU))
    assert placed is t and not t.training
    assert not any(p.requires_grad for p in t.parameters())


def test_zero3_inference_config_drops_training_parts():
    train = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "overlap_comm": True},
        "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    }
    config = zero3_inference_config(train)
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}
    assert config["bf16"] == {"enabled": True}
    assert "optimizer" not in config and "scheduler" not in config and "gradient_clipping" not in config
    assert config["train_micro_batch_size_per_gpu"] == 1 and "gradient_accumulation_steps" not in config
    assert train["zero_optimization"]["stage"] == 2  # the student's config is untouched


@pytest.mark.distributed
def test_fsdp2_sharded_teacher_matches_replica_on_two_cpu_processes(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    out = tmp_path / "result.json"
    script = Path(__file__).with_name("fsdp_teacher_run.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
           str(script), str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = json.loads(out.read_text())
    assert [r["world_size"] for r in ranks] == [2, 2]
    for r in ranks:
        assert r["max_abs_diff"] <= 1e-6
        assert r["features"] == 8
        # Each rank holds about half of the teacher (shards of odd-sized tensors round up).
        assert r["sharded_bytes"] <= 0.55 * r["replica_bytes"]
    assert local_parameter_bytes(teacher()) == ranks[0]["replica_bytes"]


# ---------------------------------------------------------------------- teachers placed by their loader


def _dispatched(attr: str, value):
    t = teacher().train()
    setattr(t, attr, value)
    return t


DISPATCHED = [
    ("hf_device_map", {"": "cpu"}),
    ("is_loaded_in_4bit", True),
    ("is_loaded_in_8bit", True),
    ("is_quantized", True),
]


@pytest.mark.parametrize(("attr", "value"), DISPATCHED, ids=[a for a, _ in DISPATCHED])
def test_a_dispatched_or_quantized_teacher_is_not_moved(attr, value, monkeypatch):
    """`.to()` raises on 4/8-bit models and would undo a `device_map` dispatch: such a teacher stays put."""
    t = _dispatched(attr, value)
    monkeypatch.setattr(t, "to", lambda *a, **k: pytest.fail(".to() was called on a placed teacher"))
    placed = place_teacher(t, _accelerator(DistributedType.MULTI_CPU))
    assert placed is t and not t.training
    assert not any(p.requires_grad for p in t.parameters())


@pytest.mark.parametrize("kind", [DistributedType.FSDP, DistributedType.DEEPSPEED])
def test_a_dispatched_teacher_cannot_be_sharded(kind):
    t = _dispatched("hf_device_map", {"bert": 0, "classifier": 1})
    with pytest.raises(ValueError, match="device_map"):
        place_teacher(t, _accelerator(kind, stage=3))


def test_input_device_is_the_first_device_of_the_map():
    assert teacher_input_device(teacher()) is None  # an ordinary teacher follows the student
    t = _dispatched("hf_device_map", {"bert.embeddings": "cpu", "bert.encoder": "disk", "classifier": "cpu"})
    assert teacher_input_device(t) == torch.device("cpu")
    t = _dispatched("hf_device_map", {"bert.embeddings": "disk", "bert.encoder": 0})
    assert teacher_input_device(t) == torch.device("cuda", 0)
    assert teacher_input_device(_dispatched("is_loaded_in_4bit", True)) == torch.device("cpu")  # its weights'


def test_training_with_a_dispatched_teacher(tmp_path, monkeypatch):
    """The trainer never moves such a teacher, feeds it inputs on its device, and trains (logits and features)."""
    t = _dispatched("hf_device_map", {"": "cpu"})
    moved = []
    monkeypatch.setattr(t, "to", lambda *a, **k: moved.append((a, k)))
    a = args(tmp_path, max_steps=3, distill_terms=["loss=hidden_mse,layers=uniform"])
    trainer = DistillationTrainer(model=bert(2), teacher_model=t, args=a, train_dataset=token_dataset(32),
                                  data_collator=collate)
    assert trainer.teacher is t and not t.training
    trainer.train()
    assert moved == []
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == 3 and all(e["loss"] == e["loss"] and e["loss_hidden"] > 0 for e in logged)


# ---------------------------------------------------------------------- engines: configs and refusals

TEMPLATE = Path(__file__).parent / "configs" / "zero3_hf_template.json"


def _autos(config, path=""):
    """Every key path whose value is still "auto"."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _autos(value, f"{path}{key}.")
        elif value == "auto":
            found.append(path + key)
    return found


def test_zero3_template_autos_are_filled_from_the_teachers_width():
    """HF's ZeRO-3 template leaves the hidden-size-based buckets "auto" until train(); the teacher's engine is
    built before, so they are sized here from the teacher (HF's formulas) and no "auto" reaches DeepSpeed."""
    template = json.loads(TEMPLATE.read_text())
    config = zero3_inference_config(template, hidden_size=48, mixed_precision="bf16")
    zero = config["zero_optimization"]
    assert zero["reduce_bucket_size"] == 48 * 48
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 48 * 48)
    assert zero["stage3_param_persistence_threshold"] == 10 * 48
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True} and "offload_optimizer" not in zero
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert _autos(config) == []
    assert config["train_micro_batch_size_per_gpu"] == 1 and "train_batch_size" not in config
    assert _autos(template)  # the template itself is untouched


def test_zero3_teacher_engine_gets_the_teachers_config(monkeypatch):
    """The path place_teacher takes under ZeRO-3, with the template as the accelerator's config."""
    seen = {}

    def initialize(model, config):
        seen.update(config=config, model=model)
        return SimpleNamespace(eval=lambda: None), None, None, None

    monkeypatch.setitem(sys.modules, "deepspeed", SimpleNamespace(initialize=initialize))
    acc = _accelerator(DistributedType.DEEPSPEED, stage=3)
    acc.state.deepspeed_plugin.deepspeed_config = json.loads(TEMPLATE.read_text())
    acc.mixed_precision = "no"
    t = teacher(hidden=48, heads=4)
    place_teacher(t, acc)
    assert seen["model"] is t and _autos(seen["config"]) == []
    assert seen["config"]["zero_optimization"]["reduce_bucket_size"] == 48 * 48
    assert seen["config"]["fp16"]["enabled"] is False and seen["config"]["bf16"]["enabled"] is False


def test_zero3_auto_bucket_without_a_hidden_size_is_refused():
    with pytest.raises(ValueError, match="reduce_bucket_size.*hidden_size"):
        zero3_inference_config(json.loads(TEMPLATE.read_text()), hidden_size=None)


def test_fsdp1_teacher_leaves_the_students_wrap_policy_alone(monkeypatch):
    """The teacher (BERT blocks) is wrapped from a copy of the plugin: the student (DistilBERT) is then wrapped
    with its own layer classes, and the teacher honours offload, prefetch and all-gather limits."""
    import torch.distributed.fsdp as fsdp
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.bert.modeling_bert import BertEmbeddings, BertLayer

    wrapped = {}
    monkeypatch.setattr(fsdp, "FullyShardedDataParallel", lambda module, **kw: wrapped.update(kw) or module)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=1, auto_wrap_policy="transformer_based_wrap", cpu_offload=True, forward_prefetch=True,
        limit_all_gathers=False,
    )
    acc = SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False, device=torch.device("cpu"),
                          state=SimpleNamespace(fsdp_plugin=plugin))
    place_teacher(teacher(), acc)
    assert wrapped["auto_wrap_policy"].keywords["transformer_layer_cls"] == {BertLayer, BertEmbeddings}
    assert wrapped["cpu_offload"].offload_params is True
    assert wrapped["forward_prefetch"] is True and wrapped["limit_all_gathers"] is False
    assert plugin.auto_wrap_policy is transformer_auto_wrap_policy and plugin.transformer_cls_names_to_wrap is None
    plugin.set_auto_wrap_policy(distilbert())  # what accelerate does when it prepares the student
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == set()  # DistilBERT names no block class


@pytest.mark.parametrize(
    ("requested", "kind", "match"),
    [
        ({"fsdp": "full_shard auto_wrap"}, DistributedType.MULTI_CPU, "fsdp=.*silently train as DDP"),
        ({"fsdp": [], "deepspeed": "ds.json"}, DistributedType.MULTI_CPU, "deepspeed=.*ignored"),
    ],
)
def test_an_engine_accelerate_did_not_enable_is_refused(requested, kind, match):
    """accelerate enables FSDP only on GPUs: with use_cpu on 2 processes the Trainer would train as DDP
    (benchmarks/results/distributed.md); one process is already refused by transformers."""
    acc = SimpleNamespace(distributed_type=kind, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=match):
        check_engine(SimpleNamespace(**{"fsdp": None, "deepspeed": None, **requested}), acc)
    check_engine(SimpleNamespace(fsdp=None, deepspeed=None), acc)  # plain DDP is fine
    check_engine(SimpleNamespace(fsdp=requested.get("fsdp"), deepspeed=None),
                 SimpleNamespace(distributed_type=DistributedType.FSDP, device=acc.device))


def test_an_fsdp2_wrap_that_shards_the_embeddings_twice_is_refused():
    """BERT's `_no_split_modules` names BertEmbeddings: accelerate 1.15 shards it, then the word embeddings inside
    it again, and torch's fully_shard fails (benchmarks/results/distributed_gpu.json). Refused before training,
    naming the class list that works; the run with that list is benchmarks/distributed_gpu.sh's fsdp2 row."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    def acc(**plugin_kwargs):
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, **plugin_kwargs)
        return SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True, state=SimpleNamespace(
            fsdp_plugin=plugin))

    with pytest.raises(ValueError, match=r"bert.embeddings.word_embeddings \(inside BertEmbeddings\).*"
                                         r"'transformer_layer_cls_to_wrap': \['BertLayer'\]"):
        check_fsdp2_wrap(bert(2), acc(auto_wrap_policy="transformer_based_wrap"))
    check_fsdp2_wrap(bert(2), acc(auto_wrap_policy="transformer_based_wrap",
                                  transformer_cls_names_to_wrap=["BertLayer"]))
    check_fsdp2_wrap(bert(2), acc(auto_wrap_policy="NO_WRAP"))  # nothing wrapped before the embeddings
    check_fsdp2_wrap(distilbert(), acc(auto_wrap_policy="transformer_based_wrap"))  # names no block class
    # the word embeddings wrapped themselves (bottom-up, before their parent): accelerate skips them
    check_fsdp2_wrap(bert(2), acc(auto_wrap_policy="transformer_based_wrap",
                                  transformer_cls_names_to_wrap=["BertLayer", "BertEmbeddings", "Embedding"]))
