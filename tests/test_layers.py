"""The import graph has no arrow from a lower layer to a higher one (README, Layout).

Every `import` and `from ... import` of every module is read with `ast` (function-level
imports included), so a lazy import cannot hide an upward dependency.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Package -> layer. A package may import packages of a lower layer only (and itself).
LAYERS = {
    "drafting": 0,    # drafters and the proposals they emit
    "controller": 1,  # latency model, stopping rule, gate (reads proposal types only)
    "engine": 2,      # decode loop, tree builder, verifier, step accounting
    "bench": 3,       # benchmark harness (gets drafters and controllers from its caller)
    "server": 3,      # HTTP layer and scheduler
    "training": 4,    # drafter training (decodes with the engine, avoids benchmark prompts)
    "bastion": 5,     # composition root and command line
}


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages a module imports (absolute imports; relative ones stay inside)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out & set(LAYERS)


def test_every_package_is_listed_and_exists():
    for pkg in LAYERS:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg


@pytest.mark.parametrize("pkg", sorted(LAYERS))
def test_no_import_from_a_higher_or_equal_layer(pkg):
    bad = []
    for path in sorted((ROOT / pkg).rglob("*.py")):
        for dep in imported_packages(path):
            if dep != pkg and LAYERS[dep] >= LAYERS[pkg]:
                bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_lazy_imports(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text("def f():\n    from server.app import create_app\n    import controller.budget\n")
    assert imported_packages(mod) == {"server", "controller"}


def test_engine_knows_neither_controller_nor_server():
    deps = set().union(*(imported_packages(p) for p in (ROOT / "engine").rglob("*.py")))
    assert deps <= {"engine", "drafting"}, deps
    deps = set().union(*(imported_packages(p) for p in (ROOT / "drafting").rglob("*.py")))
    assert deps <= {"drafting"}, deps
