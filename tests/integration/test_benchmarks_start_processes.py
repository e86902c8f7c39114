"""Every benchmark script starts and prints its usage.

Benchmarks live outside the default suite, so nothing else would notice one that no longer
imports. (That no benchmark is named like one of our packages, which would shadow it for every
other benchmark: tests/test_benchmarks_start.py.)
"""

import subprocess
import sys
from pathlib import Path

import pytest

from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration

BENCHMARKS = sorted((REPO / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_prints_usage(script: Path):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout.lower()
