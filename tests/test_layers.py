"""The architecture as checked rules (issue #28, docs/architecture.md): the import-linter layers contract
in pyproject.toml, no import circle inside rlhf/, no function-local import of the project's own modules
(except a deferred heavy dependency, said so in a `# deferred:` comment), no private name used across
packages, and a config import that loads no torch (scripts/stage_plan.py relies on it)."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env

# the test extra installs it; a machine without it (the GPU image, whose lane deselects these tests) still
# collects the suite
grimp = pytest.importorskip("grimp", reason="the layer checks need import-linter's grimp (pip install -e '.[test]')")

PROJECT = ("rlhf", "engine", "kernels")


def python_files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """The unit a private name must not leave: rlhf.<package> (rlhf.sft for a command), engine, kernels."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "rlhf" and len(parts) > 1 else parts[0]


def test_import_linter_contracts_are_kept():
    proc = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_the_layers_contract_fails_an_upward_import(tmp_path):
    """The contract can fail: a copy of the tree where core/ imports the RL layer is refused."""
    for top in ("rlhf", "engine", "kernels", "scripts"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "rlhf" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom rlhf.rl import rollout  # noqa: E402\n")
    proc = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                           "sys.exit(lint_imports_command())"], cwd=tmp_path,
                          env={**cli_env(), "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "rlhf.core.errors -> rlhf.rl.rollout" in proc.stdout


def _cycles(graph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for w in edges[v]:
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_inside_rlhf():
    graph = grimp.build_graph("rlhf")
    modules = set(graph.modules)
    for m in modules:  # a package's __init__ importing its own modules is not a circle between modules
        for child in graph.find_children(m):
            if graph.direct_import_exists(importer=m, imported=child):
                graph.remove_import(importer=m, imported=child)
    assert _cycles(graph, modules) == []


def test_the_cycle_finder_finds_a_circle():
    graph = grimp.ImportGraph()
    for m in ("a", "b", "c", "d"):
        graph.add_module(m)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert _cycles(graph, {"a", "b", "c", "d"}) == [["a", "b", "c"]]


def _local_project_imports(tree: ast.Module, lines: list[str]) -> list[tuple[int, str]]:
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            elif isinstance(node, ast.ImportFrom):  # relative: inside the project by definition
                names = ["."]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "." or n.split(".")[0] in PROJECT for n in names):
                if "# deferred:" not in lines[node.lineno - 1]:
                    out.append((node.lineno, lines[node.lineno - 1].strip()))
    return out


def test_no_function_local_imports_of_the_project_in_rlhf():
    found = []
    for path in python_files("rlhf"):
        src = path.read_text()
        found += [f"{path.relative_to(ROOT)}:{n}: {line}"
                  for n, line in _local_project_imports(ast.parse(src), src.splitlines())]
    assert found == [], "\n".join(found)


def test_a_function_local_import_is_found():
    src = "def f():\n    from rlhf.core import errors\n    import json\n\ndef g():\n    import kernels  # deferred: why\n"
    assert _local_project_imports(ast.parse(src), src.splitlines()) == [(2, "from rlhf.core import errors")]


def _private_names_across(path: Path, root: Path = ROOT) -> list[str]:
    """`from other_package... import _name` and `alias._name` where alias is another package's module."""
    here = package_of(module_of(path, root))
    tree = ast.parse(path.read_text())
    out, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                node.module.split(".")[0] in PROJECT:
            for a in node.names:
                target = f"{node.module}.{a.name}"
                if package_of(node.module) != here and a.name.startswith("_") and not a.name.startswith("__"):
                    out.append(f"{path.relative_to(root)}:{node.lineno}: imports {target}")
                aliases[a.asname or a.name] = target
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PROJECT:
                    aliases[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = aliases[node.value.id]
            if package_of(owner) != here:
                out.append(f"{path.relative_to(root)}:{node.lineno}: uses {owner}.{node.attr}")
    return out


def test_no_private_name_used_across_packages():
    found = [x for path in python_files(*PROJECT) for x in _private_names_across(path)]
    assert found == [], "\n".join(found)


def test_a_private_name_across_packages_is_found(tmp_path):
    pkg = tmp_path / "rlhf" / "run"
    pkg.mkdir(parents=True)
    f = pkg / "x.py"
    f.write_text("from rlhf.modeling.load import _secret, public\nfrom rlhf.run import stage\n"
                 "from rlhf.data import packing\nstage._fine()\npacking._packed([])\n")
    assert _private_names_across(f, tmp_path) == ["rlhf/run/x.py:1: imports rlhf.modeling.load._secret",
                                                  "rlhf/run/x.py:5: uses rlhf.data.packing._packed"]


def test_the_config_loads_no_torch():
    """scripts/stage_plan.py composes a stage's config on every run_all.sh stage in well under a second."""
    proc = subprocess.run([sys.executable, "-c", "import sys, rlhf.config\nfrom rlhf.config import SCHEMAS, "
                           "compose, to_config\nto_config(compose('ppo', ['algorithm=grpo']), SCHEMAS['ppo'])\n"
                           "print('torch' in sys.modules)"], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
