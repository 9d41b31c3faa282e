"""No global state at import (issue 40, item 7): importing hf_distill and every submodule adds no import hook and no
optimizer hook; the optimizer-step watch behind the teacher-fingerprint memo and the exit branches' folded weights
registers torch's process-wide step hook only while a cached value needs it, and removes it after."""

from __future__ import annotations

import copy
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.optim import optimizer as torch_optimizer

from hf_distill.base.optimizer_steps import StepWatch, _Hook
from hf_distill.data.cache_key import teacher_fingerprint
from hf_distill.students.exit_branches import ExitBranch

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ALL = """
import importlib, json, pkgutil, sys
from torch.optim import optimizer as o
before = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))
import hf_distill
names = [m.name for m in pkgutil.walk_packages(hf_distill.__path__, "hf_distill.")]
for name in names:
    importlib.import_module(name)
after = (len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))
print(json.dumps({"modules": len(names), "before": before, "after": after,
                  "finders": [type(f).__module__ for f in sys.meta_path]}))
"""


def _ours() -> list:
    """The process-wide optimizer hooks hf_distill has registered (torch keeps them in these two dicts)."""
    hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
             *torch_optimizer._global_optimizer_post_hooks.values()]
    return [h for h in hooks if getattr(h, "__module__", "").startswith("hf_distill")]


def test_importing_every_module_installs_no_hook():
    """A fresh interpreter: importing the package and all its modules leaves sys.meta_path and torch's global
    optimizer hooks as they were (before: an old-path finder and data.cache_key's step counter)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["modules"] > 50  # every module was imported, trainers and recipes' helpers included
    assert seen["after"] == seen["before"], seen  # no optimizer hook, from hf_distill or a library it imports
    assert not [m for m in seen["finders"] if m.startswith("hf_distill")], seen  # (transformers adds one of its own)


def test_no_hook_without_a_cached_value():
    gc.collect()
    assert _Hook.watches == 0 and _ours() == []


def test_watch_sees_any_optimizer_step_and_its_hook_goes_with_it():
    w = StepWatch()
    assert _ours() == [_Hook.step] and not w.stepped()
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.SGD([p], lr=0.1).step()
    assert w.stepped()
    copied, later = copy.deepcopy(w), StepWatch()  # a copy watches from the original's moment, not from now
    assert copied.stepped() and not later.stepped() and _Hook.watches == 3 and len(_ours()) == 1
    del w, copied, later
    gc.collect()
    assert _Hook.watches == 0 and _ours() == []  # the last watch removed the hook


def test_teacher_fingerprint_memo_holds_the_hook_while_the_teacher_lives():
    teacher = torch.nn.Linear(4, 3)
    fp = teacher_fingerprint(teacher)
    assert len(_ours()) == 1
    teacher.weight.grad = torch.ones_like(teacher.weight)
    torch.optim.AdamW([teacher.weight], lr=1e-3, fused=True).step()  # fused: leaves _version alone
    assert teacher_fingerprint(teacher) != fp  # the step was seen
    del teacher
    gc.collect()
    assert _ours() == []


def test_exit_branch_fold_holds_the_hook_until_dropped():
    torch.manual_seed(0)
    branch = ExitBranch(hidden_size=8, num_labels=2, width=8, heads=2).eval()
    hidden = torch.randn(2, 5, 8)
    with torch.no_grad():
        branch(hidden)
    assert branch._fold is not None and len(_ours()) == 1
    twin = copy.deepcopy(branch)
    with torch.no_grad():
        twin(hidden)
    assert twin._fold is not None and len(_ours()) == 1  # one hook for every watch
    for p in twin.parameters():
        p.grad = torch.randn_like(p)
    torch.optim.SGD(twin.parameters(), lr=0.5).step()
    assert twin._fold is None  # the copy's step was seen (in place, same addresses)
    with torch.no_grad():
        torch.testing.assert_close(twin(hidden), twin._reference(hidden, None))
    branch.drop_fold()
    del twin
    gc.collect()
    assert _ours() == []
