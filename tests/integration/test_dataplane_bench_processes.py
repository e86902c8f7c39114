"""benchmarks/dataplane.py run as a user runs it: the flags it refuses, and (slow) a `--quick`
run's JSON schema (how `--fanout` reaches the sites: tests/test_dataplane_bench.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_node.testbed.launcher import REPO

pytestmark = pytest.mark.integration

SCRIPT = REPO / "benchmarks" / "dataplane.py"


def test_a_fanout_outside_0_to_16_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "x.json"), "--fanout", "17"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--fanout 17: must be in [0, 16]" in done.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_quick_run_writes_every_field_of_the_schema(tmp_path: Path) -> None:
    out = tmp_path / "dataplane.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=580)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 1
    run = runs[0]
    for key in ("params", "sites", "fanout", "commits", "coordinator_egress_per_commit_over_delta",
                "commit_to_applied_s", "peak_rss_mb", "state_mb", "link_utilization"):
        assert key in run, key
    assert run["sites"] == 3 and run["fanout"] == 2 and run["commits"] > 0 and run["digests_agree"]
    # Today the holder sends each commit to every other site: about sites - 1 deltas per commit.
    assert 1.5 <= run["coordinator_egress_per_commit_over_delta"] <= 4.0
    assert 0 <= run["commit_to_applied_s"]["p50"] <= run["commit_to_applied_s"]["p99"]
    assert set(run["peak_rss_mb"]) == {"s0", "s1", "s2"} and all(v > 50 for v in run["peak_rss_mb"].values())
    assert run["state_mb"] == pytest.approx(8 * run["params"] / 2**20, rel=0.01)
    assert 0 < run["link_utilization"]["holder_egress"] < 1.5
