"""Run one of ``tools/`` as a user would: a fresh interpreter in the repository root, its output captured."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(name: str, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python tools/<name> args...`` (text output captured, never raising on its exit status)."""
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env=env)
