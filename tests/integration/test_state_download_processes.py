"""The global-state download between real processes: benchmarks/state_transfer.py's servers behind
capped links, one link cut mid-download (the download's logic in-process:
tests/test_state_download.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration


def test_benchmark_download_survives_a_link_cut_and_verifies_the_state(tmp_path) -> None:
    """The benchmark's real processes: 3 servers behind capped links, one link killed mid-download."""
    script = REPO / "benchmarks" / "state_transfer.py"
    out = tmp_path / "transfer.json"
    done = subprocess.run([sys.executable, str(script), "--params", "2e6", "--fragments", "8", "--link-mbit", "20",
                           "--cut-after", "1.0", "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["digest_verified"] is True  # the run raises if the joiner's digest differs
    assert report["cut_after_s"] == 1.0
    # 16 MB over three 2.5 MB/s links takes over 2 s: the cut came mid-download, and what it cost
    # is at most the chunks in flight on the cut link, not a restart of its fragments.
    assert report["seconds"] > 1.0
    assert 0 <= report["refetched_bytes"] <= 3 * 4 * 1024 * 1024
