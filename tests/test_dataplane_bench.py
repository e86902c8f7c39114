"""benchmarks/dataplane.py: `--fanout` reaching the sites (the script run as a user runs it:
tests/integration/test_dataplane_bench_processes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "dataplane.py"


def test_the_fanout_becomes_every_sites_relay_fanout() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import dataplane
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert "relay_fanout=2" in dataplane.settings_for(dataplane.RunSpec("1m", 4, fanout=2))
    assert "relay_fanout=0" in dataplane.settings_for(dataplane.RunSpec("1m", 4))
