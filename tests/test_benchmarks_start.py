"""The benchmark scripts' names: a script's own folder comes first on sys.path, so a benchmark
file named like one of our packages would shadow it for every other benchmark (a
`benchmarks/wire.py` once broke `benchmarks/chaos.py` this way). That every script starts and
prints its usage: tests/integration/test_benchmarks_start_processes.py.
"""

from pathlib import Path

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks_to_check():
    assert len(BENCHMARKS) >= 5


def test_no_benchmark_is_named_like_a_package():
    packages = {"wire", "bootstrap", "diloco_node"}
    assert not [p.name for p in BENCHMARKS if p.stem in packages]
