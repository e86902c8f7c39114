"""Three real daemons; a follower crashes at an fsync of its log appends and comes back.

Sites a, b, c (synthetic learners) commit rounds. b was started with a crash failpoint at its
`log.append` fsync (the K-th after its start, before the fsync: what it appended and had not
fsynced is dropped, as a power cut would). It exits with the failpoint's status, a and c carry on,
and b restarted from its data directory loads, survives a full disk (its appends fail with ENOSPC
for a while: nothing acknowledged, /status names the point, it recovers by itself), catches up and
agrees: no commit index any site reported is lost or reported with another digest, b reaches past
the highest one seen before, and the chaos checker finds no violation in the three histories.

The failpoints are armed by b's environment (`DILOCO_X_FAILPOINTS`, read at start).
"""

from __future__ import annotations

import pytest

from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.storage import failpoints
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.local_cluster import Cluster

from conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=20")
NAMES = {"a", "b", "c"}


def _voters_everywhere(statuses: dict, names: set[str]) -> bool:
    return names <= {n for n, d in statuses.items() if d.get("ready")} and all(
        {m["node_id"] for m in statuses[n]["members"] if m["voter"]} == NAMES for n in names)


def test_a_follower_crashing_at_a_log_append_fsync_loses_no_committed_index(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SYNTHETIC)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        crash = {failpoints.ENV_VAR: "log.append=crash-before@40*1"}
        b = cluster.add("b", bootstrap=a, settings=SYNTHETIC, env=crash)
        cluster.add("c", bootstrap=a, settings=SYNTHETIC)
        cluster.wait_for("three ready voters", lambda s: _voters_everywhere(s, NAMES), STARTUP_S)

        assert eventually(lambda: not b.running, 120, 0.3), "b never reached its 40th append"
        assert b.wait(10) == failpoints.CRASH_EXIT_CODE
        assert "failpoint log.append: crashing" in b.log_text()
        before = max(cluster.history)  # the highest commit index any site reported so far
        cluster.wait_for("a and c commit without b", lambda s: min(s[n]["commit_index"] for n in ("a", "c")
                                                                     if n in s) > before + 2, 90)

        # The same data directory: a restart. Its disk is full for its 10th to 29th appends.
        cluster.remove("b")
        full = {failpoints.ENV_VAR: "log.append=enospc@10*20"}
        b = cluster.add("b", bootstrap=a, settings=SYNTHETIC, env=full)
        recovered = cluster.wait_for("b back after a full disk, caught up", lambda s: "b" in s and s["b"].get("ready")
                                     and s["b"]["storage"].get("failures_total", {}).get("log.append") == 20
                                     and not s["b"]["storage"]["failing"] and s["b"]["commit_index"] > before,
                                     STARTUP_S)
        assert recovered["b"]["storage"]["quarantined"] == []
        # One warning per failure streak (the peers' refused requests are logged at INFO), no traceback.
        text = b.log_text().split("===== start")[-1]
        warned = text.count("WARNING diloco_node.daemon: b cannot persist its coordination state")
        assert 1 <= warned <= text.count("persists its coordination state again") and "Traceback" not in text
        index = cluster.common_commit_index(NAMES, 90)
        assert index > before
        assert cluster.conflicting_indices() == {}, cluster.conflicting_indices()
    violations = check_histories(load_histories(find_history_files(tmp_path)))
    assert violations == [], "\n".join(str(v) for v in violations[:10])
