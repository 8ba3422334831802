"""The layout rules of docs/DESIGN.md §4, checked on the source: ops and layers import nothing above
them, no private name is imported from another package, nothing in the library looks a module up
by a string, and the ops do not build modules."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

GDN = Path(__file__).resolve().parents[1] / "gdn"
FILES = sorted(GDN.rglob("*.py"))

#: What the lower parts of the package must not import (the train side is tests/train/test_layout.py's).
FORBIDDEN = {
    "ops": {"distributed", "layers", "models", "data", "train", "evaluation", "generation", "checkpoint", "compat", "cli",
            "demo"},
    "distributed": {"layers", "models", "data", "train", "evaluation", "generation", "checkpoint", "compat", "cli",
                    "demo"},
    "layers": {"models", "data", "train", "evaluation", "generation", "checkpoint", "compat", "cli", "demo"},
    "data": {"ops", "layers", "models", "train", "evaluation", "generation", "checkpoint", "compat", "cli"},
}


def _module(path: Path) -> list[str]:
    parts = list(path.relative_to(GDN.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imports(path: Path):
    """(dotted gdn module imported from, name) pairs of a file, relative imports resolved."""
    package = list(path.relative_to(GDN.parent).parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = node.module.split(".")
            if target and target[0] == "gdn":
                for alias in node.names:
                    yield target, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "gdn":
                    yield alias.name.split("."), None


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(GDN)))
def test_no_import_back_up(path):
    part = _module(path)[1] if len(_module(path)) > 1 else None
    banned = FORBIDDEN.get(part, set())
    for target, name in imports(path):
        dest = target[1] if len(target) > 1 else name
        assert dest not in banned, f"{path.relative_to(GDN)} imports gdn.{dest}: {part} must not depend on it"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(GDN)))
def test_no_private_name_from_another_package(path):
    mine = _module(path)[:2]
    for target, name in imports(path):
        private = (name or "").startswith("_") and name != "__version__"
        private = private or any(p.startswith("_") and p != "__init__" for p in target)
        assert not (private and target[:2] != mine), \
            f"{path.relative_to(GDN)} imports the private {'.'.join(target)}:{name} from another package"


def test_no_lookup_by_string_in_ops_and_layers():
    for path in FILES:
        if _module(path)[1:2] in (["ops"], ["layers"]):
            src = path.read_text()
            assert "importlib" not in src and "getattr(ops," not in src, path.relative_to(GDN)


def test_ops_build_no_modules():
    for path in (GDN / "ops").rglob("*.py"):
        assert "nn.Module" not in path.read_text().replace("no nn.Module", ""), path.relative_to(GDN)
