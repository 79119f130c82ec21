"""``python -m services.inference`` bounds OpenMP's spin-wait before torch loads, unless told."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# Import the entry module (not run it) and report the variable and whether libgomp read it:
# torch must not be imported before the setting is made.
PROBE = ("import sys; import services.inference.__main__ as m, os; "
         "print(os.environ['GOMP_SPINCOUNT'], 'torch' in sys.modules)")


def run_probe(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=120, check=True)
    return done.stdout.split()


def test_the_entry_bounds_the_spin_before_importing_torch() -> None:
    source = (ROOT / "services" / "inference" / "__main__.py").read_text()
    assert source.index('setdefault("GOMP_SPINCOUNT"') < source.index("import main")
    assert run_probe() == ["20000", "True"]


def test_a_spin_count_set_in_the_environment_wins() -> None:
    assert run_probe(GOMP_SPINCOUNT="300000") == ["300000", "True"]
