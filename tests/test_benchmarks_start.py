"""Every benchmark script starts and prints its usage.

Benchmarks live outside the default suite, so nothing else would notice one that no longer
imports. A script's own folder comes first on sys.path, so a benchmark file named like one of
our packages would shadow it for every other benchmark (a `benchmarks/wire.py` once broke
`benchmarks/chaos.py` this way); the second test forbids such names.
"""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 5


def test_no_benchmark_is_named_like_a_package():
    packages = {"wire", "bootstrap", "diloco_node"}
    assert not [p.name for p in BENCHMARKS if p.stem in packages]


@pytest.mark.integration
@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_prints_usage(script: Path):
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout.lower()
