"""The package's layers, read from its own import statements (issue 40, item 4): every `import` and `from ... import`
anywhere in a module (module level, inside functions, under TYPE_CHECKING; relative or absolute, and
`from hf_distill import Name` resolved through the package's lazy names) makes an edge. No import circle; the lower
layers (features, losses, data, publish) import nothing from the higher ones; the ground floor (`hf_distill.base`,
`hf_distill.compat`) imports nothing else from hf_distill and is where batch keys, counted positions and the
generation checks are defined."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

import hf_distill

PACKAGE = Path(hf_distill.__file__).parent
GROUND = ("hf_distill.base", "hf_distill.compat")
LOW = ("hf_distill.features", "hf_distill.losses", "hf_distill.data", "hf_distill.publish")
HIGH = ("hf_distill.distiller", "hf_distill.trainer", "hf_distill.on_policy", "hf_distill.trl", "hf_distill.seq2seq",
        "hf_distill.students", "hf_distill.auto", "hf_distill.callbacks", "hf_distill.schedules", "hf_distill.cli",
        "hf_distill.demo", "hf_distill.kd_paths", "hf_distill.teacher_sources", "hf_distill.task_loss",
        "hf_distill.settings", "hf_distill.model_inputs", "hf_distill.serving", "hf_distill.sentence",
        "hf_distill.sentence_loss", "hf_distill.sentence_cache", "hf_distill.routing", "hf_distill.routed_signal")
# What the ground floor holds: each name is defined (assigned, or a def / class) there and nowhere else.
GROUND_NAMES = {"TEACHER_PREFIX": "hf_distill.base.batch_keys", "SIGNAL_PREFIX": "hf_distill.base.batch_keys",
                "ROUTE_COLUMN": "hf_distill.base.batch_keys",
                "PROMPT_KEYS": "hf_distill.base.batch_keys", "require_tensors": "hf_distill.base.batch_keys",
                "kd_positions": "hf_distill.base.positions", "same_sequence": "hf_distill.base.positions",
                "GENERATION_FIELDS": "hf_distill.base.generation_checks",
                "validate_generation_arguments": "hf_distill.base.generation_checks"}


def modules(root: Path, name: str = "hf_distill") -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `root` (a package's __init__ is the package)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = [name, *path.relative_to(root).with_suffix("").parts]
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path, lazy: dict[str, str] | None = None, name: str = "hf_distill") -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its file. The package itself (its __init__: lazy
    names only) is not a node: `from hf_distill import X` is an edge to the module `lazy` maps X to, or to the
    submodule X."""
    mods = modules(root, name)
    lazy = lazy or {}

    def known(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted if dotted and dotted != name else None

    edges: dict[str, set[str]] = {m: set() for m in mods if m != name}
    for mod in edges:
        package = mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(mods[mod].read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if source == name and alias.name in lazy:
                        targets.append(f"{name}.{lazy[alias.name]}")
                    elif full in mods:
                        targets.append(full)  # `from . import prune`: the submodule
                    else:
                        targets.append(source)  # a name defined in `source`
            for target in targets:
                hit = known(target) if target == name or target.startswith(name + ".") else None
                if hit is not None and hit != mod:
                    edges[mod].add(hit)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer into a higher one, and from the ground floor into anything above it."""
    wrong = [f"{a} -> {b}" for a in edges for b in edges[a] if under(a, LOW) and under(b, HIGH)]
    wrong += [f"{a} -> {b}" for a in edges for b in edges[a] if under(a, GROUND) and not under(b, GROUND)]
    return sorted(wrong)


def lazy_names() -> dict[str, str]:
    return {**hf_distill._CLASSES, **hf_distill._MODULES}


def test_no_import_circle():
    assert circles(imports(PACKAGE, lazy_names())) == []


def test_lower_layers_import_nothing_higher():
    assert upward(imports(PACKAGE, lazy_names())) == []


def test_every_module_has_a_layer():
    """A new top-level module or package must be placed (ground, low, high, or one of the middle modules below)."""
    middle = ("hf_distill.arguments", "hf_distill.argument_checks", "hf_distill.presets", "hf_distill.teacher",
              "hf_distill.placement", "hf_distill.tracking", "hf_distill.trainer_projections",
              "hf_distill.trainer_runs", "hf_distill.trainer_teacher_eval")
    loose = [m for m in imports(PACKAGE) if not under(m, GROUND + LOW + HIGH + middle)]
    assert loose == []


def test_ground_floor_defines_the_shared_names():
    defined: dict[str, list[str]] = {name: [] for name in GROUND_NAMES}
    for mod, path in modules(PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [e.id for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])
                         if isinstance(e, ast.Name)]
            for name in names:
                if name in defined:
                    defined[name].append(mod)
    assert defined == {name: [mod] for name, mod in GROUND_NAMES.items()}


# ---------------------------------------------------------------- the reader itself, on a made-up package


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.mark.parametrize("statement", [
    "from .b import f",  # relative, module level
    "def g():\n    from . import b",  # relative, inside a function
    "def g():\n    import pkg.b",  # absolute, inside a function
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import f",
    "from pkg import B",  # a lazy name of the package
])
def test_reader_sees_every_kind_of_import(tmp_path, statement):
    root = _package(tmp_path, {"__init__.py": "", "a.py": statement, "b.py": "from .a import x\n"})
    edges = imports(root, {"B": "b"}, name="pkg")
    assert edges["pkg.a"] == {"pkg.b"} and circles(edges) == [["pkg.a", "pkg.b"]]


def test_reader_resolves_parent_relative_imports(tmp_path):
    root = _package(tmp_path, {"__init__.py": "", "low/__init__.py": "", "high.py": "", "base/__init__.py": "",
                               "low/x.py": "def f():\n    from ..high import y\n",
                               "base/k.py": "from ..low import x\n"})
    edges = imports(root, name="pkg")
    assert edges["pkg.low.x"] == {"pkg.high"} and edges["pkg.base.k"] == {"pkg.low.x"}
