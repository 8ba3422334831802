"""The package itself: version, registration on import, console script."""
from __future__ import annotations

import subprocess
import sys


def test_import_gdn_registers_auto_classes():
    code = (
        "import gdn, transformers\n"
        "cfg = transformers.AutoConfig.for_model('gdn')\n"
        "print(type(cfg).__name__, gdn.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "GDNConfig"


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "gdn.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout.lower()
