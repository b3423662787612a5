"""Who may know whom (shared/architecture.md), checked on the source: the oracle imports
NumPy and ml_dtypes only; no backend imports the oracle; reports know the results schema,
not frameworks or the oracle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def files(folder):
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", files("spec"), ids=lambda p: p.name)
def test_the_oracle_imports_numpy_and_ml_dtypes_only(path):
    outside = {m for m in imported_modules(path)
               if not m.startswith((".", "numpy", "ml_dtypes", "__future__", "numbers",
                                    "functools", "collections"))}
    assert set() == outside


@pytest.mark.parametrize("path", files("impls"), ids=lambda p: p.name)
def test_no_backend_imports_the_oracle(path):
    assert set() == {m for m in imported_modules(path)
                     if "spec" in m.split(".") or m.startswith("..spec")}


@pytest.mark.parametrize("path", files("reports"), ids=lambda p: p.name)
def test_reports_know_the_results_schema_only(path):
    bad = {m for m in imported_modules(path)
           if m.split(".")[0] in ("torch", "jax", "flax", "numba", "triton")
           or "spec" in m.split(".") or "impls" in m.split(".")}
    assert set() == bad


def test_every_subpackage_is_installed():
    """pyproject lists the packages by hand (the repository root is the package): a new
    folder of modules missing there works in an editable install and nowhere else. Data
    folders (no __init__.py) are listed too, each with its package data, so that
    setuptools installs them without warning."""
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    found = {"normspec" + "".join("." + p for p in init.parent.relative_to(ROOT).parts)
             for init in ROOT.rglob("__init__.py")
             if not {"tests", ".venv", ".tox", "build"} & set(init.relative_to(ROOT).parts)}
    data = {name for name in setup["package-data"] if name not in found}
    assert all((ROOT.joinpath(*name.split(".")[1:])).is_dir() for name in data)
    assert found | data == set(setup["packages"])
