"""Three real daemons; two of them have log.bin cut at rest, and a lease holder is elected again.

Sites a, b, c (synthetic learners) commit rounds. All three are killed. The two that did not hold
the lease have their log.bin cut: one exactly at a record boundary about halfway through its
entries (what a torn append looks like, but below what it had fsynced: its high-water mark, its
vote floor and its checkpoints witness it), the other as the chaos soak's `log:truncate` does (its
last eighth). All three restart from their data directories. Each cut node reports the damage
(log.bin quarantined, named on /status) and does not stand, but votes for a candidate whose log
is at least as up to date as its vote floor (the newest entry its log held): the old holder, whose
log is whole, is elected again with their votes (a node that refused every vote would leave one
voter of three, and no holder ever again). The cut nodes get their entries back (catch-up, or an
older checkpoint or the peers' state), vote freely again, and commits go on: no commit index any
site reported is lost or reported with another digest, and the chaos checker finds no violation.
"""

from __future__ import annotations

import random
import time

import pytest

from diloco_node.daemon.log_records import _scan_log
from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.chaos.harness import corrupt_file
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
# The lease holder never backs its next index for a follower below what that follower acknowledged
# (bootstrap/replog.py), so b's lost entries come back by a snapshot install once the holder's log
# is compacted past them: a short retained tail makes that seconds, not a minute.
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=20", "log_retain_entries=16")
NAMES = {"a", "b", "c"}


def _cut_halfway_at_a_boundary(log_bin, committed_through: int) -> int:
    """Cut log.bin where an entry halfway through those below `committed_through` starts; returns
    the last index it keeps."""
    with open(log_bin, "rb") as handle:
        _, located, _, _ = _scan_log(handle, log_bin.stat().st_size, log_bin)
    committed = [item for item in located if item[0].index < committed_through]
    entry, offset, _ = committed[len(committed) // 2]
    log_bin.write_bytes(log_bin.read_bytes()[:offset])  # exactly at a record boundary
    return entry.index - 1


def test_two_voters_logs_cut_at_rest_still_elect_a_lease_holder_and_lose_no_committed_index(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        cluster.start_voters(sorted(NAMES), settings=SYNTHETIC, timeout=STARTUP_S)
        cluster.wait_for("all hold 30 entries", lambda s: all(s.get(n, {}).get("commit_index", 0) >= 30
                                                               for n in NAMES), 120)
        time.sleep(2.5)  # past the high-water mark's interval (and a checkpoint's)
        statuses = cluster.wait_for("one lease holder", lambda s: cluster.coordinator(s) in NAMES, 60)
        holder = cluster.coordinator(statuses)
        halfway, soak_cut = sorted(NAMES - {holder})
        for name in (halfway, soak_cut, holder):  # the holder last: it alone commits nothing
            cluster.sites[name].kill()
        before = max(cluster.history)

        cut_after = _cut_halfway_at_a_boundary(cluster.sites[halfway].data_dir / "coordination" / "log.bin",
                                               statuses[halfway]["commit_index"])
        assert cut_after < statuses[halfway]["commit_index"]
        note = corrupt_file(cluster.sites[soak_cut].data_dir / "coordination" / "log.bin", "truncate",
                            random.Random(0))
        assert "truncated" in note, note

        for name in (holder, halfway, soak_cut):  # the same data directories: restarts
            cluster.sites[name].start()
        recovered = cluster.wait_for("a lease holder again, all caught up", lambda s: NAMES <= s.keys() and all(
            s[n].get("ready") and s[n]["commit_index"] > before for n in NAMES) and cluster.coordinator(s), STARTUP_S)
        for name in (halfway, soak_cut):
            quarantined = recovered[name]["storage"]["quarantined"]
            assert any(q["file"].endswith("log.bin") and "cut at rest" in q["reason"] for q in quarantined), quarantined
            text = cluster.sites[name].log_text().split("===== start")[-1]
            assert "it votes only for a candidate whose log is at least as up to date as" in text
            assert "votes again" in text and "Traceback" not in text
        text = cluster.sites[halfway].log_text().split("===== start")[-1]
        assert f"it lost the entries after {cut_after};" in text
        assert cluster.common_commit_index(NAMES, 90) > before
        assert cluster.conflicting_indices() == {}, cluster.conflicting_indices()
    violations = check_histories(load_histories(find_history_files(tmp_path)))
    assert violations == [], "\n".join(str(v) for v in violations[:10])
