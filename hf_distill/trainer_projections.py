"""How a Trainer trains the projections (student width -> teacher width) that intermediate terms learn with it.

They belong to the run, not to the student: they join the optimizer in their own groups (`projection_lr`), are
clipped and, under DDP, averaged with the student's gradients, and are checkpointed next to it
(`distill_projections.pt`), never in its folder. Under DeepSpeed they ride inside the engine as a submodule of the
student while `train()` runs, so the engine partitions, reduces, clips and checkpoints them with it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .compat import checkpoint_parent, children_dict, load_renamed_checkpoint
from .trainer_runs import load_early_exit, save_early_exit

PROJECTIONS_FILE = "distill_projections.pt"
# Under DeepSpeed the projections ride inside the engine as this submodule of the student while train() runs.
PROJECTIONS_ATTR = "hf_distill_projections"


class ProjectionTraining:
    """Trainer overrides for the projections of `self.distiller` (see docs/design.md for why each is needed)."""

    def _projections(self) -> nn.Module | None:
        distiller = getattr(self, "distiller", None)
        return distiller.projections if distiller is not None else None

    def _projections_in_engine(self) -> bool:
        """DeepSpeed owns the gradients, clipping and optimizer state of what it prepares (partitioned under
        ZeRO), so the projections are prepared with the student as one of its submodules. DDP keeps them
        beside the model and averages their gradients itself: a DDP module must give every parameter a
        gradient in each backward (or find unused ones from its forward outputs), which projections used only
        by the loss, or idle in a stage without hidden terms, would break."""
        from accelerate.utils import DistributedType

        return self._projections() is not None and self.accelerator.distributed_type == DistributedType.DEEPSPEED

    @contextlib.contextmanager
    def _projections_attached(self):
        """While train() runs under DeepSpeed, the projections are a submodule of the student, so the engine
        prepares, partitions, reduces, clips and checkpoints them with it; afterwards the student is bare again
        (`trainer.model.save_pretrained` writes the student only)."""
        if not self._projections_in_engine() or PROJECTIONS_ATTR in children_dict(self.model):
            yield
            return
        proj, engine = self._projections(), getattr(self, "deepspeed", None)
        if engine is not None and not all(p in getattr(engine, "param_names", {}) for p in proj.parameters()):
            raise RuntimeError(
                "A DeepSpeed engine was built for this trainer before train() (by evaluate() or predict()), without "
                "the projections, and the Trainer would train with that engine: the projections would be neither "
                "partitioned nor optimised. Call train() before evaluating, or evaluate with a separate trainer."
            )
        student = self.model  # detach from this one even if the Trainer swaps self.model meanwhile
        student.add_module(PROJECTIONS_ATTR, proj)
        try:
            yield
        finally:
            children_dict(student).pop(PROJECTIONS_ATTR, None)
            children_dict(self.model).pop(PROJECTIONS_ATTR, None)  # the student model_init built (call_model_init)

    def _attached(self) -> bool:
        return PROJECTIONS_ATTR in children_dict(self.model)

    def _check_projection_optimizer(self) -> None:
        """Projections are created with the trainer, so an optimizer and scheduler built by the user before it
        cannot know them: the optimizer gets them as a new group, but a scheduler built earlier would leave that
        group's learning rate unscheduled, so that case is refused. Engines that own the gradients of the model
        they prepared: DeepSpeed gets them inside the student (`_projections_attached`); FSDP is refused, since
        sharded projections used outside the student's forward have not been run under it anywhere."""
        proj = self._projections()
        if proj is None:
            return
        from accelerate.utils import DistributedType

        widths = (
            f"Projections (student width {self.distiller.intermediate.student_info.hidden_size} -> teacher width "
            f"{self.distiller.intermediate.teacher_info.hidden_size})"
        )
        optim = getattr(self.args.optim, "value", self.args.optim)
        if str(optim).endswith("layerwise") or optim in ("lomo", "adalomo"):
            instead = "adamw_torch" if optim in ("lomo", "adalomo") else str(optim).removesuffix("_layerwise")
            raise ValueError(
                f"optim={optim!r} updates the student's parameters only, inside the backward pass (from hooks on "
                f"them), and its optimizer step does nothing: the {widths.lower()} that the distill_terms train "
                f"would never move. Choose an optim that steps every parameter group (e.g. {instead!r}), or give "
                "the student the teacher's hidden size so that no projection is needed."
            )
        if self.accelerator.distributed_type == DistributedType.FSDP:
            raise ValueError(
                f"{widths} are not supported under FSDP yet: they are used by the loss, outside the student's "
                "forward, where FSDP has resharded its parameters. Use DeepSpeed or DDP, or give the student the "
                "teacher's hidden size so that no projection is needed."
            )
        if self._projections_in_engine():
            ds_config = self.accelerator.state.deepspeed_plugin.deepspeed_config
            if "optimizer" in ds_config and self.args.projection_lr is not None:
                raise ValueError(
                    f"projection_lr={self.args.projection_lr} cannot be honoured: the DeepSpeed config builds its "
                    "own optimizer (its 'optimizer' section), with one learning rate for the student and the "
                    f"{widths.lower()}. Remove projection_lr, or remove the config's 'optimizer' section so that "
                    "the Trainer builds the optimizer (then projection_lr applies)."
                )
        if self.optimizer is not None and self.lr_scheduler is not None:
            in_optimizer = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if not all(id(p) in in_optimizer for p in proj.parameters()):
                raise ValueError(
                    "optimizers=(optimizer, scheduler) was given, but the trainer also trains projections from the "
                    "student's width to the teacher's, which that scheduler cannot schedule. Pass "
                    "optimizers=(optimizer, None) (the trainer adds the projections to your optimizer and builds "
                    "the scheduler over every group), or use optimizer_cls_and_kwargs."
                )

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, plus the projections in their own groups: learning rate `projection_lr`,
        weight decay on their weights only (never on biases, as the Trainer does for the model)."""
        optimizer = super().create_optimizer(model)
        proj = self._projections()
        if proj is not None and self._attached():
            # Under DeepSpeed the Trainer saw them as the student's: take them out of its groups, add ours below.
            ids = {id(p) for p in proj.parameters()}
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) not in ids]
            optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
        in_optimizer = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g["params"]}  # DummyOptim: none
        if proj is not None and not any(id(p) in in_optimizer for p in proj.parameters()):
            decay = set(self.get_decay_parameter_names(proj))
            lr = self.args.projection_lr or self.args.learning_rate
            for names, wd in ((decay, self.args.weight_decay), (None, 0.0)):
                params = [p for n, p in proj.named_parameters() if (n in decay) == (names is not None)]
                if params:
                    optimizer.add_param_group({"params": params, "lr": lr, "weight_decay": wd})
        return optimizer

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)
        proj = self._projections()
        n = self.accelerator.num_processes
        if proj is not None and not self._attached() and n > 1 and self.accelerator.sync_gradients:
            # DDP averages the student's gradients in the last micro-batch's backward; the projections live
            # outside the wrapped model, so they are averaged here, before clipping and the optimizer step.
            for p in proj.parameters():
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= n
        return loss

    def _clip_grad_norm(self, model):
        """Clip the student and the projections together (TinyBERT clips `fit_dense` with the model)."""
        proj = self._projections()
        if proj is None or self._attached():  # attached: already among the model's parameters
            return super()._clip_grad_norm(model)
        params = [*model.parameters(), *proj.parameters()]
        return self.accelerator.clip_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        """The logged `grad_norm` counts the projections too."""
        proj = self._projections()
        if grad_norm is None and proj is not None and not self._attached():
            grad_norm = self.accelerator.clip_grad_norm_([*model.parameters(), *proj.parameters()], float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The student's files never hold the projections, also when DeepSpeed gathered them with it; the saved
        `training_args.bin` records the loss settings the run used (the arguments are not changed while training)."""
        if self._attached() and (state_dict is not None or self.args.should_save):
            if state_dict is None:
                state_dict = self.model.state_dict()
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith(PROJECTIONS_ATTR + ".")}
        if not save_early_exit(self, output_dir, state_dict):
            super()._save(output_dir, state_dict=state_dict)
        distiller = getattr(self, "distiller", None)
        if distiller is not None and self.args.should_save:  # the loss settings the run used, as a card reads them
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            torch.save(distiller.settings.record(self.args), os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _projection_file_state(self) -> dict | None:
        """What `distill_projections.pt` gets, gathered from ZeRO-3 partitions (a collective: every rank calls
        it); None when no file is written. Attached to the student (DeepSpeed), the engine's own checkpoint
        holds them, unless `save_only_model` keeps the Trainer from writing that checkpoint."""
        proj = self._projections()
        if proj is None or (self._attached() and not self.args.save_only_model):
            return None
        params = list(proj.parameters())
        gather = contextlib.nullcontext()
        if any(hasattr(p, "ds_id") for p in params):
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(params)
        with gather:
            return {k: v.detach().clone().cpu() for k, v in proj.state_dict().items()}

    def _save_checkpoint(self, model, trial) -> None:
        # Gathered before the Trainer's save, which may push the folder (see _push_from_checkpoint).
        self._pending_projections = self._projection_file_state()
        try:
            super()._save_checkpoint(model, trial)
            if self._pending_projections is not None and self.args.should_save:
                folder = os.path.join(checkpoint_parent(self, trial),
                                      f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
                torch.save(self._pending_projections, os.path.join(folder, PROJECTIONS_FILE))
        finally:
            self._pending_projections = None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not (self._loaded_early_exit(resume_from_checkpoint, model)
                or self._loaded_renamed(resume_from_checkpoint, model)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        if self._projections() is not None:
            engine_files = any(n.startswith("global_step") for n in os.listdir(resume_from_checkpoint))
            if not os.path.isfile(os.path.join(resume_from_checkpoint, PROJECTIONS_FILE)) and engine_files:
                raise FileNotFoundError(
                    f"{resume_from_checkpoint} was written under DeepSpeed: its projections are in the engine's "
                    "global_step*/ files, which only DeepSpeed reads. Resume it with the same DeepSpeed config."
                )
            self._load_projections(resume_from_checkpoint, (
                f"{resume_from_checkpoint} has no {PROJECTIONS_FILE}: it was not written by a run with the "
                "same projections, so resuming would restart them from scratch."
            ))

    def _load_best_model(self) -> None:
        """The best checkpoint's student, and its projections with it (else they stay at the last step's, paired with
        another student). Under DeepSpeed the engine loads them (attached to the student)."""
        best = self.state.best_model_checkpoint
        if not (self._loaded_early_exit(best, None) or self._loaded_renamed(best, None)):
            super()._load_best_model()
        if self._projections() is None or self._attached():
            return
        self._load_projections(self.state.best_model_checkpoint, (
            f"load_best_model_at_end: {self.state.best_model_checkpoint} has no {PROJECTIONS_FILE}, so its "
            "student would be paired with the last step's projections. Keep the file in the checkpoints."
        ))

    def _load_projections(self, folder: str, refusal: str) -> None:
        """The projections saved beside a checkpoint's student (by `_save_checkpoint`); a checkpoint without them is
        refused with `refusal` (the caller says what would go wrong), never trained on with other projections."""
        path = os.path.join(folder, PROJECTIONS_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(refusal)
        self._projections().load_state_dict(torch.load(path, map_location=self.args.device, weights_only=True))

    def _loaded_early_exit(self, folder: str, model: Any) -> bool:
        """An early-exit student saved in `EarlyExitModel.save_pretrained`'s layout (trainer_runs.save_early_exit):
        its backbone through the Trainer's own load, its branches from their file. Under DeepSpeed or FSDP the
        engine's own checkpoint is read instead."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        return load_early_exit(self, folder, model, super()._load_from_checkpoint)

    def _loaded_renamed(self, folder: str, model: Any) -> bool:
        """Loads a checkpoint saved under other weight names than the model's (ViT, DeiT in transformers 5), which
        the Trainer's own load would leave unloaded (see compat.load_renamed_checkpoint); False otherwise."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return False
        return load_renamed_checkpoint(self.accelerator.unwrap_model(model if model is not None else self.model),
                                       folder)


class _ClearProjectionGradients(TrainerCallback):
    """The Trainer zeroes only the model's gradients (when its loop starts and after each step); the projections'
    are cleared here at the same points. At the start matters: a retry of `auto_find_batch_size` after an
    out-of-memory error would otherwise add the failed try's projection gradients to its first update."""

    def __init__(self, projections: nn.Module) -> None:
        self.projections = projections

    def on_train_begin(self, args, state, control, **kwargs):
        self.projections.zero_grad(set_to_none=True)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.projections.zero_grad(set_to_none=True)
