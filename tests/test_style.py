"""The code stays within the project's flake8 settings (setup.cfg), so style drift shows in CI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_flake8_reports_nothing():
    result = subprocess.run(
        [sys.executable, "-m", "flake8", "autoshard", "tests", "benchmarks"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr
