"""Train a tiny student through DistillationTrainer.train() under one engine (DDP, FSDP1, FSDP2, ZeRO-3).

Run under torchrun / `accelerate launch` (2 processes) or directly (1 process). Logit KD plus a hidden and an
attention term; by default the student has the teacher's width, `--student_width 16` makes it narrower, so a
projection is trained too (DDP and DeepSpeed; refused under FSDP). Rank 0 writes `result.json`: the student's
full parameters (gathered from shards) and the projections', losses, how the models were wrapped, per-rank
teacher and student parameter bytes, peak memory per rank and wall time, so that tests/test_engines.py and
benchmarks/distributed.py can compare the run with a single-process one. `--resume_check` saves a checkpoint at
step `steps - 1` and, after the run, resumes a fresh trainer from it: its final student and projections are
recorded too.
`--push_to REPO` pushes the student and its card to the Hub at HF_ENDPOINT (tests/hub_server.py) afterwards.
`--causal_lm` distils a tiny Llama instead (tests/on_policy_run.py's prompt + completion rows, JSD + CE on the
completion tokens, no intermediate terms) through the causal-LM loss head, and records whether the head was used.
`--fsdp_on_cpu` lets FSDP run on CPU processes (gloo): accelerate enables FSDP only on accelerators
(:func:`fsdp_on_cpu`); the wrapping, sharding and training are torch's and accelerate's own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from helpers import args, bert, collate, leave_distributed_run, llama, teacher, token_dataset  # noqa: E402
from on_policy_run import rows, tokenizer  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402
from hf_distill.data.prompts import PromptCompletionCollator  # noqa: E402
from hf_distill.placement import local_parameter_bytes  # noqa: E402

TERMS = ["loss=hidden_mse,layers=uniform", "loss=attention_score_mse,layers=uniform"]


def engine_kwargs(engine: str, deepspeed_config: str | None, block: str = "BertLayer", use_cpu: bool = False) -> dict:
    """The TrainingArguments fields that select `engine` (`block`: the class FSDP2 wraps). On a CPU the processes
    build the same seeded models, so nothing is broadcast (accelerate's `sync_module_states` wants an accelerator)."""
    cpu = {"sync_module_states": False} if use_cpu else {}
    if engine == "fsdp1":
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": {"version": 1, "use_orig_params": True, **cpu}}
    if engine == "fsdp2":  # BertEmbeddings left out of the wrap: see placement.check_fsdp2_wrap
        return {"fsdp": "full_shard auto_wrap",
                "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": [block], **cpu}}
    if engine == "zero3":
        return {"deepspeed": deepspeed_config}
    return {}


def fsdp_on_cpu() -> None:
    """Make accelerate honour an FSDP plugin on CPU processes, as it does on GPUs: its `AcceleratorState` turns
    FSDP on only for accelerator process groups (a CPU run silently becomes DDP, which
    hf_distill.placement.check_engine refuses), although torch's FSDP1 and FSDP2 both run on gloo. Test-only."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *a, fsdp_plugin=None, **kw):
        init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            self.device = torch.device("cpu")  # not "cpu:<rank>": FSDP1 refuses a device_id its compute device is not
            # later AcceleratorState() calls copy the process state over these: it must say FSDP too
            PartialState._shared_state.update(distributed_type=DistributedType.FSDP, device=self.device)

    AcceleratorState.__init__ = patched


class _Warnings(logging.Handler):
    """The package's warnings during a run ("Causal-LM logits are computed whole" means the loss head was not used)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak: the accelerator's allocated peak, or the resident set size on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def flat_state(state: dict) -> list[float]:
    return torch.cat([v.detach().reshape(-1).float().cpu() for _, v in sorted(state.items())]).tolist()


def full_state(acc, model: torch.nn.Module) -> dict:
    """The student's full parameters on every rank: accelerate's gather, except for FSDP on CPU processes, where
    FSDP1's full state dict crashes (a segfault in its CPU offload): gathered by hand there."""
    if acc.distributed_type.value != "FSDP" or acc.device.type != "cpu":
        return acc.get_state_dict(model)
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            return {k.replace("_fsdp_wrapped_module.", ""): v.clone() for k, v in model.module.state_dict().items()}
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}  # FSDP2


def projection_values(trainer: DistillationTrainer) -> list[float]:
    """The projections' parameters, gathered from their ZeRO-3 partitions (every rank must call it)."""
    state = trainer._projection_file_state()  # what a checkpoint's distill_projections.pt holds
    return torch.cat([v.reshape(-1).float() for v in state.values()]).tolist() if state else []


def causal_lm_trainer(out: Path, engine: str, per_device_batch: int, steps: int, use_cpu: bool,
                      deepspeed_config: str | None, learning_rate: float,
                      kd_chunk_size: int | None = None) -> DistillationTrainer:
    """A tiny Llama distilled from another (off-policy: the dataset's completions): JSD + CE on completion tokens."""
    a = args(out, per_device_train_batch_size=per_device_batch, max_steps=steps, optim="sgd",
             learning_rate=learning_rate, use_cpu=use_cpu, kd_loss="jsd", kd_weight=0.7, task_weight=0.3,
             kd_token_mask="labels", kd_chunk_size=kd_chunk_size,
             **engine_kwargs(engine, deepspeed_config, "LlamaDecoderLayer", use_cpu))
    tok = tokenizer()
    return DistillationTrainer(model=llama(0), teacher_model=llama(1), args=a, train_dataset=rows(8 * steps),
                               data_collator=PromptCompletionCollator(tok), processing_class=tok)


def make_trainer(out: Path, engine: str, per_device_batch: int, steps: int, use_cpu: bool,
                 deepspeed_config: str | None, width: int, student_width: int | None, save_steps: int | None,
                 learning_rate: float = 0.5, causal_lm: bool = False, kd_chunk_size: int | None = None):
    if causal_lm:
        return causal_lm_trainer(out, engine, per_device_batch, steps, use_cpu, deepspeed_config, learning_rate,
                                 kd_chunk_size)
    a = args(
        out,
        per_device_train_batch_size=per_device_batch,
        max_steps=steps,
        optim="sgd",
        learning_rate=learning_rate,
        use_cpu=use_cpu,
        distill_terms=TERMS,
        kd_weight=0.5,
        task_weight=0.5,
        **({"save_strategy": "steps", "save_steps": save_steps} if save_steps else {}),
        **engine_kwargs(engine, deepspeed_config),
    )
    t = teacher(hidden=width, heads=4)
    return DistillationTrainer(
        model=bert(2, hidden=student_width or width), teacher_model=t, args=a, train_dataset=token_dataset(8 * steps),
        data_collator=collate,
    )


def run(out: Path, engine: str, per_device_batch: int, steps: int, use_cpu: bool = True,
        deepspeed_config: str | None = None, push_to: str | None = None, width: int = 32,
        student_width: int | None = None, resume_check: bool = False, learning_rate: float = 0.5,
        causal_lm: bool = False, kd_chunk_size: int | None = None) -> dict:
    setup = (engine, per_device_batch, steps, use_cpu, deepspeed_config, width, student_width)
    kw = {"learning_rate": learning_rate, "causal_lm": causal_lm, "kd_chunk_size": kd_chunk_size}
    last_save = steps - 1  # the resumed trainer runs the last step again
    warnings = _Warnings()
    logging.getLogger("hf_distill").addHandler(warnings)
    try:
        trainer = make_trainer(out, *setup, save_steps=last_save if resume_check else None,
                               **kw)
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    finally:
        logging.getLogger("hf_distill").removeHandler(warnings)
    acc = trainer.accelerator
    state = full_state(acc, trainer.model_wrapped)  # gathers FSDP / ZeRO-3 shards (on rank 0)
    projections = projection_values(trainer)
    resumed = {}
    if resume_check:  # a fresh trainer (new engine) continues from checkpoint-<steps - 1> to the same last step
        again = make_trainer(out, *setup, save_steps=None, **kw)
        again.train(resume_from_checkpoint=str(out / "out" / f"checkpoint-{last_save}"))
        again_state = acc.get_state_dict(again.model_wrapped)
        resumed = {
            "student": flat_state(again_state) if acc.is_main_process else [],
            "projections": projection_values(again),
            "checkpoint_files": sorted(os.listdir(out / "out" / f"checkpoint-{last_save}"))
            if acc.is_main_process else [],
        }
    rank = {
        "teacher_bytes": local_parameter_bytes(trainer.teacher),
        "student_bytes": local_parameter_bytes(trainer.model_wrapped),
        "peak_memory_bytes": peak_memory_bytes(acc.device),
    }
    ranks = acc.gather_for_metrics([rank], use_gather_object=True)
    if push_to:  # every rank calls it, as a user's script does: the save is a collective under ZeRO-3 / FSDP
        trainer.args.hub_model_id = push_to
        trainer.evaluate_teacher(token_dataset(6, seed=1))  # every rank: the card's teacher column
        trainer.push_to_hub(commit_message="engine run", teacher="local-teacher")
    result = {
        "engine": engine,
        "distributed_type": acc.distributed_type.value,
        "world_size": acc.num_processes,
        "device": str(acc.device),
        "steps": trainer.state.global_step,
        "terms": ["kd", "task"] if causal_lm else ["kd", *TERMS],
        # the causal-LM loss head: its logits rebuilt from hidden states (None: never checked), the LM heads' route
        "loss_head": trainer.distiller._student_state(trainer.model_wrapped).rebuilds if causal_lm else None,
        "route": trainer.distiller.route,
        "warnings": warnings.messages,
        "student": flat_state(state) if acc.is_main_process else [],
        "student_keys": sorted(state) if acc.is_main_process else [],
        "projections": projections,
        "resumed": resumed,
        "logs": [r for r in trainer.state.log_history if "loss" in r],
        "teacher_type": type(trainer.teacher).__name__,
        "wrapped_type": type(trainer.model_wrapped).__name__,
        "ranks": ranks,
        "wall_s": wall,
        "pushed": bool(push_to),
    }
    if acc.is_main_process:
        (out / "result.json").write_text(json.dumps(result))
    acc.wait_for_everyone()
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--engine", choices=["ddp", "fsdp1", "fsdp2", "zero3"], default="ddp")
    p.add_argument("--per_device_batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--gpu", action="store_true", help="train on the accelerator (default: use_cpu=True)")
    p.add_argument("--deepspeed_config", default=None)
    p.add_argument("--push_to", default=None, help="a repo id to push the student to (Hub at HF_ENDPOINT)")
    p.add_argument("--student_width", type=int, default=None, help="narrower than the teacher's 32: projections")
    p.add_argument("--resume_check", action="store_true", help="checkpoint at step 2, then resume a fresh trainer")
    p.add_argument("--learning_rate", type=float, default=0.5, help="0.5 suits the SGD of the comparisons")
    p.add_argument("--causal_lm", action="store_true", help="a tiny Llama through the causal-LM loss head")
    p.add_argument("--kd_chunk_size", type=int, default=None, help="--causal_lm: the loss head's tokens per chunk")
    p.add_argument("--fsdp_on_cpu", action="store_true", help="FSDP on CPU processes (gloo): see fsdp_on_cpu()")
    p.add_argument("--head_scenarios", action="store_true",
                   help="--causal_lm: then tests/engine_heads_run.py's scenarios, in this process group")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    if a.fsdp_on_cpu:
        fsdp_on_cpu()
    run(a.out, a.engine, a.per_device_batch, a.steps, not a.gpu, a.deepspeed_config, a.push_to,
        student_width=a.student_width, resume_check=a.resume_check, learning_rate=a.learning_rate,
        causal_lm=a.causal_lm, kd_chunk_size=a.kd_chunk_size)
    if a.head_scenarios:
        import engine_heads_run

        engine_heads_run.run_all(a.out / "scenarios", a.engine, a.per_device_batch, not a.gpu, a.deepspeed_config)
    leave_distributed_run()
