"""Import direction: ops <- layers <- models <- train / evaluation / generation <- cli. Checkpoint
files are gdn.checkpoint's, which train and evaluation both use; evaluation never imports train."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

GDN = Path(__file__).resolve().parents[2] / "gdn"

#: What each part of the package must not import.
FORBIDDEN = {
    "models": {"train", "evaluation", "generation", "checkpoint", "cli", "demo"},
    "checkpoint": {"train", "evaluation", "generation", "cli", "demo"},
    "generation": {"train", "evaluation", "checkpoint", "cli", "demo"},
    "evaluation": {"train", "cli", "demo"},
    "train": {"cli", "demo"},
}


def gdn_imports(path: Path) -> set[str]:
    """The top-level ``gdn`` subpackages or modules a file imports (relative imports resolved)."""
    package = list(path.relative_to(GDN.parent).parts[:-1])  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                parts = base + (node.module.split(".") if node.module else [])
                names = [parts + [a.name] for a in node.names] if not node.module else [parts]
            else:
                names = [(node.module or "").split(".")]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".") for a in node.names]
        else:
            continue
        found |= {n[1] for n in names if len(n) > 1 and n[0] == "gdn"}
    return found


def files(part: str) -> list[Path]:
    return sorted((GDN / part).rglob("*.py")) if (GDN / part).is_dir() else [GDN / f"{part}.py"]


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_imports_follow_the_dependency_direction(part):
    for path in files(part):
        bad = gdn_imports(path) & FORBIDDEN[part]
        assert not bad, f"{path.relative_to(GDN.parent)} imports gdn.{sorted(bad)}"


def test_the_import_scan_sees_relative_imports():
    assert "checkpoint" in gdn_imports(GDN / "evaluation" / "perplexity.py")
    assert {"checkpoint", "evaluation", "models"} <= gdn_imports(GDN / "train" / "loop.py")
    assert "models" in gdn_imports(GDN / "generation.py")
