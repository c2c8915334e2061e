"""The package rules of docs/architecture.md, checked on the source: imports point down, data/ and kernels/
stand alone, nothing imports the programs, and importing the packages does nothing."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from tests.helpers import ROOT

# package -> the first-party packages it must not import
FORBIDDEN = {
    "kernels": {"parallel", "engine", "data", "tools", "launch"},
    "data": {"parallel", "engine", "tools", "launch"},
    "parallel": {"engine", "data", "tools", "launch"},
    "engine": {"tools", "launch"},
}


def first_party_imports(path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    wrong = {str(path.relative_to(ROOT)): sorted(first_party_imports(path) & FORBIDDEN[package])
             for path in (ROOT / package).rglob("*.py")}
    assert not {path: names for path, names in wrong.items() if names}


def first_party_modules(path) -> set[str]:
    """The full dotted names of the first-party modules `path` imports (engine.config.schema, ...)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in FORBIDDEN}


def test_the_optimizer_package_reads_only_the_configuration():
    """engine/optim/ sits below the rest of engine/: it may use the configuration, kernels and parallel layers,
    and itself — never the model, the train loop or the checkpoints (which use it)."""
    allowed = ("engine.config", "engine.optim", "kernels", "parallel")
    wrong = {str(path.relative_to(ROOT)): sorted(m for m in first_party_modules(path)
                                                 if not any(m == a or m.startswith(a + ".") for a in allowed))
             for path in (ROOT / "engine" / "optim").rglob("*.py")}
    assert not {path: names for path, names in wrong.items() if names}


def test_importing_the_packages_loads_nothing_else():
    probe = ("import sys; before = set(sys.modules); import engine, parallel, kernels, data; "
             "print(sorted(m for m in set(sys.modules) - before))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.strip() == str(sorted(["engine", "parallel", "kernels", "data"]))
