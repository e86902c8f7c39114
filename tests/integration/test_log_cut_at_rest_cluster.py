"""Three real daemons; a stopped follower's log.bin is cut at rest at a record boundary, and it comes back.

Sites a, b, c (synthetic learners) commit rounds. b is killed, its log.bin cut exactly at a record
boundary about halfway through its entries (what a torn append looks like, but below what b had
fsynced: its high-water mark and its checkpoints witness it), and restarted from its data
directory. It reports the damage (log.bin quarantined, named on /status), neither votes nor stands
until a lease holder gave the entries back, recovers (from an older checkpoint or the peers' state)
instead of exiting, and catches up: no commit index any site reported is lost or reported with
another digest, and the chaos checker finds no violation in the three histories.
"""

from __future__ import annotations

import time

import pytest

from diloco_node.daemon.log_records import _scan_log
from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
# The lease holder never backs its next index for a follower below what that follower acknowledged
# (bootstrap/replog.py), so b's lost entries come back by a snapshot install once the holder's log
# is compacted past them: a short retained tail makes that seconds, not a minute.
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=20", "log_retain_entries=16")
NAMES = {"a", "b", "c"}


def _voters_everywhere(statuses: dict, names: set[str]) -> bool:
    return names <= {n for n, d in statuses.items() if d.get("ready")} and all(
        {m["node_id"] for m in statuses[n]["members"] if m["voter"]} == NAMES for n in names)


def test_a_followers_log_cut_at_rest_is_found_and_recovered_without_losing_a_committed_index(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SYNTHETIC)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        b = cluster.add("b", bootstrap=a, settings=SYNTHETIC)
        cluster.add("c", bootstrap=a, settings=SYNTHETIC)
        cluster.wait_for("three ready voters", lambda s: _voters_everywhere(s, NAMES), STARTUP_S)
        first = cluster.wait_for("b holds 30 entries", lambda s: s.get("b", {}).get("commit_index", 0) >= 30, 120)
        time.sleep(2.5)  # past the high-water mark's interval (and a checkpoint's)
        b.kill()
        before = max(cluster.history)

        log_bin = b.data_dir / "coordination" / "log.bin"
        with open(log_bin, "rb") as handle:
            _, located, _, _ = _scan_log(handle, log_bin.stat().st_size, log_bin)
        # halfway through what b had committed 2.5 s before the kill, so surely below its mark (the
        # log's middle can lie past it: the log keeps growing while the test sleeps)
        committed = [item for item in located if item[0].index < first["b"]["commit_index"]]
        entry, offset, _ = committed[len(committed) // 2]
        log_bin.write_bytes(log_bin.read_bytes()[:offset])  # exactly at a record boundary
        cut_after = entry.index - 1
        assert cut_after < first["b"]["commit_index"]

        b.start()  # the same data directory: a restart
        recovered = cluster.wait_for("b back, caught up", lambda s: "b" in s and s["b"].get("ready")
                                     and s["b"]["commit_index"] > before, STARTUP_S)
        quarantined = recovered["b"]["storage"]["quarantined"]
        assert any(q["file"].endswith("log.bin") and "cut at rest" in q["reason"] for q in quarantined), quarantined
        text = b.log_text().split("===== start")[-1]
        assert f"no vote until a lease holder has given back the entries after {cut_after}" in text
        assert "votes again" in text and "Traceback" not in text
        assert cluster.common_commit_index(NAMES, 90) > before
        assert cluster.conflicting_indices() == {}, cluster.conflicting_indices()
    violations = check_histories(load_histories(find_history_files(tmp_path)))
    assert violations == [], "\n".join(str(v) for v in violations[:10])
