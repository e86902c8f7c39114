"""Every benchmark script starts and prints its usage.

Benchmarks live outside the default suite, so nothing else would notice one that no longer
imports. Running them as scripts also guards against `benchmarks/wire.py` shadowing the `wire`
package (a script's own folder comes first on sys.path unless it puts the repo root first).
"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 5


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_prints_usage(script: Path):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout.lower()
