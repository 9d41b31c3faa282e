"""Private names of transformers, TRL, DeepSpeed, torch and datasets in one room (issue 40, item 6): every one that
hf_distill uses is listed in `hf_distill.compat.PRIVATE` and still exists in the installed versions, and no module
but hf_distill/compat.py uses one (an AST scan of every attribute, import and getattr-style name)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import datasets
import pytest
import torch

import hf_distill
from hf_distill import compat
from hf_distill.compat import PRIVATE

PACKAGE = Path(hf_distill.__file__).parent
LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "trl", "peft", "datasets")
# Private names with a public equivalent hf_distill uses instead.
PUBLIC_INSTEAD = {"_name_or_path": "config.name_or_path"}
# The standard library's private names are not in scope: argparse's subparsers type, in annotations.
STANDARD_LIBRARY = {"_SubParsersAction"}


def _owner(path: str):
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _instance(owner: type):
    """A cheap instance of `owner`, for fields that exist on instances only (None where none is cheap)."""
    param = torch.nn.Parameter(torch.ones(1))
    makers = {
        torch.nn.Module: lambda: torch.nn.Linear(1, 1),
        torch.Tensor: lambda: torch.ones(1),
        torch.optim.lr_scheduler.LRScheduler: lambda: torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD([param], lr=0.1), lambda step: 1.0),
        datasets.Dataset: lambda: datasets.Dataset.from_dict({"a": [1, 2]}),
    }
    if owner.__name__ == "OptimizedModule":
        return torch.compile(torch.nn.Linear(1, 1))  # compiles lazily, at the first call: not here
    return makers[owner]() if owner in makers else None


def _assigned_in_source(owner: type, name: str) -> bool:
    """Whether a class of `owner`'s MRO assigns `self.<name>` (fields set in __init__ or later, e.g. Trainer's)."""
    for klass in owner.__mro__:
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if f"self.{name} =" in source or f"self.{name}:" in source:
            return True
    return False


@pytest.mark.parametrize("entry", PRIVATE, ids=lambda e: f"{e.owner}.{e.name}")
def test_every_listed_private_name_exists_in_the_installed_versions(entry):
    if entry.owner.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    owner = _owner(entry.owner)
    if entry.kind == "method":
        assert callable(getattr(owner, entry.name, None)), f"{entry.owner} has no method {entry.name}"
    elif entry.kind == "module attribute":
        assert hasattr(owner, entry.name), f"{entry.owner} has no {entry.name}"
    else:
        instance = _instance(owner)
        found = (hasattr(owner, entry.name) or (instance is not None and hasattr(instance, entry.name))
                 or (instance is None and _assigned_in_source(owner, entry.name)))
        assert found, f"{entry.owner} objects have no field {entry.name}"
    for function in entry.used_by.split(", "):
        assert callable(getattr(compat, function, None)), f"compat.{function} (listed as using {entry.name})"


def test_the_list_is_complete_and_tight():
    """Each private name compat.py touches is listed, and each listed one is touched there."""
    tree = ast.parse((PACKAGE / "compat.py").read_text(encoding="utf-8"))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    listed = {(e.name, f) for e in PRIVATE for f in e.used_by.split(", ") if _private(e.name)}
    used = set()
    for name, node in functions.items():
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and _private(sub.attr):
                used.add((sub.attr, name))
            elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and _private(sub.value):
                used.add((sub.value, name))
    assert used == listed


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _ours() -> set[str]:
    """The private names hf_distill defines itself: functions, classes, module globals, attributes set on self/cls
    and __slots__ entries."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "module")):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def uses_outside_compat(root: Path = PACKAGE) -> list[str]:
    """Every use of a library's private name outside compat.py: a listed one anywhere, an attribute no hf_distill
    code defines, a getattr/hasattr/setattr of such a name, a private module or name imported from a library."""
    listed = {e.name for e in PRIVATE if _private(e.name)} | set(PUBLIC_INSTEAD)
    ours = (_ours() - listed) | STANDARD_LIBRARY
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "compat.py" and path.parent == root:
            continue
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = None
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours:
                overriding = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super"
                name = None if overriding else node.attr  # super()._x(...) inside an override of _x
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value) and node.args[1].value not in ours):
                name = node.args[1].value
            elif isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for module in modules:
                    parts = module.split(".")
                    if parts[0] in LIBRARIES and (any(_private(p) for p in parts) or (
                            isinstance(node, ast.ImportFrom) and any(_private(a.name) for a in node.names))):
                        name = module
            if name is not None:
                found.append((str(where), node.lineno, name))
    return [f"{w}:{line} {name}" for w, line, name in sorted(found)]


def test_no_module_but_compat_uses_a_private_name():
    assert uses_outside_compat() == []


def test_the_scan_sees_each_kind_of_use(tmp_path):
    """On a made-up package: each line below is one use the scan must report."""
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "compat.py").write_text("x = trainer._prepare_inputs\n")  # the one room: not reported
    (root / "a.py").write_text(
        "trainer._prepare_inputs(batch)\n"  # a listed private method
        "config._name_or_path\n"  # a private field with a public equivalent
        "getattr(model, '_no_split_modules', None)\n"  # by name
        "from torch._dynamo import config\n"  # a private module
        "from transformers.trainer import _is_peft_model\n"  # a private name
        "engine._some_new_private()\n"  # a private name no hf_distill code defines
    )
    assert [line.split(" ", 1)[0] for line in uses_outside_compat(root)] == [f"pkg/a.py:{i}" for i in range(1, 7)]


def test_a_checkpoint_saved_under_old_names_loads_every_weight(tmp_path):
    """ViT is saved as vit.encoder.layer.0.attention.attention.query (its pre-5 names) and lives as vit.layers.0...:
    the Trainer's load_state_dict(strict=False) leaves those weights as they were; load_renamed_checkpoint loads all."""
    from helpers import bert
    from safetensors.torch import load_file
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=16, image_size=8, patch_size=4, num_channels=1))
    vit.save_pretrained(tmp_path / "vit")
    expected = {k: v.clone() for k, v in vit.state_dict().items()}
    with torch.no_grad():
        for p in vit.parameters():
            p.add_(1.0)
    plain = vit.load_state_dict(load_file(str(tmp_path / "vit" / "model.safetensors")), strict=False)
    assert plain.missing_keys  # what the Trainer's own load would leave behind
    assert compat.load_renamed_checkpoint(vit, str(tmp_path / "vit"))
    for name, value in vit.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0)
    text = bert(layers=1)
    text.save_pretrained(tmp_path / "bert")
    assert not compat.load_renamed_checkpoint(text, str(tmp_path / "bert"))  # its own names: the Trainer's load
    from transformers import T5Config, T5ForConditionalGeneration

    tied = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=16, num_layers=1, num_heads=2))
    tied.save_pretrained(tmp_path / "t5")  # lm_head and embed_tokens are saved once, as shared.weight
    assert not compat.load_renamed_checkpoint(tied, str(tmp_path / "t5"))


@pytest.mark.parametrize("family", ["vit-sharded", "mixtral"])
def test_sharded_and_converted_checkpoints_load_every_weight(tmp_path, family):
    """A sharded checkpoint (an index and its files), and Mixtral, whose fused experts are saved one by one (a
    conversion, not a renaming): the Trainer's strict=False load leaves them unloaded; these load them all."""
    from transformers import MixtralConfig, MixtralForCausalLM, ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(vocab_size=50, hidden_size=16, intermediate_size=16,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                 num_local_experts=2, num_experts_per_tok=1))
        model.save_pretrained(tmp_path / "m")
    else:
        model = ViTForImageClassification(ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                    intermediate_size=16, image_size=8, patch_size=4, num_channels=1))
        model.save_pretrained(tmp_path / "m", max_shard_size="4KB")
        assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert compat.load_renamed_checkpoint(model, str(tmp_path / "m"))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], atol=0, rtol=0)
