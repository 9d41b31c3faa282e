"""A distillation run that can be killed: used by tests/test_kill_resume.py.

`python kill_run.py OUT [--resume] [--pause_after_save STEP]`: trains 12 steps (checkpoints every 4) with
intermediate terms and a learned projection, writes `final.pt` with the student and projection weights.
With --pause_after_save, the process announces the checkpoint of that step (a marker file) and then sleeps,
so the test can SIGKILL it in the middle of training.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).parent))
from helpers import args, bert, collate, teacher, token_dataset  # noqa: E402

from hf_distill import DistillationTrainer  # noqa: E402


class PauseAfterSave(TrainerCallback):
    def __init__(self, step: int, marker: Path) -> None:
        self.step, self.marker = step, marker

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.marker.write_text(str(state.global_step))
            time.sleep(120)  # the test kills the process here


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--pause_after_save", type=int)
    a = p.parse_args()
    torch.set_num_threads(1)
    train_args = args(a.out, distill_preset="tinybert_intermediate", max_steps=12,
                      save_strategy="steps", save_steps=4, learning_rate=5e-3)
    callbacks = [PauseAfterSave(a.pause_after_save, a.out / "paused")] if a.pause_after_save else None
    trainer = DistillationTrainer(model=bert(layers=2, hidden=16), teacher_model=teacher(), args=train_args,
                                  train_dataset=token_dataset(64), data_collator=collate, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=True if a.resume else None)
    torch.save({"student": trainer.model.state_dict(), "projections": trainer.intermediate.projections.state_dict(),
                "log_history": trainer.state.log_history}, a.out / "final.pt")


if __name__ == "__main__":
    main()
