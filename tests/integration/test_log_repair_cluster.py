"""Three real daemons; a record of one follower's log.bin is damaged while it runs, and repaired.

Sites a, b, c (synthetic learners, a checkpoint every 3 s and a short retained tail, so each
compaction rewrites the last entries by reading their records back). A byte flips inside a
committed entry's record in a follower's log.bin, on disk, while the process runs. Its next
compaction reads that record, which fails its checksum; without a restart (the same process) the
follower quarantines the file (kept aside whole), keeps its good prefix, says so on /status
(`storage.log_repair`, the quarantined file) and in its log, and gets the lost entries back from
the lease holder. Commits go on meanwhile; afterwards its log holds the same entries, byte for
byte, as the holder's, no commit index any site reported has two digests, and the chaos checker
finds no violation.
"""

from __future__ import annotations

import pytest

from diloco_node.daemon.log_records import _scan_log
from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

from conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=20", "log_retain_entries=16")
NAMES = {"a", "b", "c"}
# Records smaller than this stay in memory as well (coordination_store.INLINE_PAYLOAD_BYTES) and
# are never read back while running: the damaged one must be bigger.
READ_BACK_BYTES = 8192


def _records(log_bin) -> dict[int, tuple[int, bytes, int, int]]:
    """index -> (epoch, payload, record offset, record length) of each entry in `log_bin`."""
    with open(log_bin, "rb") as handle:
        _, located, _, _ = _scan_log(handle, log_bin.stat().st_size, log_bin)
    return {e.index: (e.epoch, e.payload_bytes(), offset, length) for e, offset, length in located}


def _flip_a_committed_record(log_bin, commit_index: int) -> int:
    """Flip one byte in the middle of the newest big committed entry's record, in place (the
    process keeps the file open); returns its index."""
    records = _records(log_bin)
    index = max(i for i, (_, payload, _, _) in records.items() if i <= commit_index and len(payload) > READ_BACK_BYTES)
    _, _, offset, length = records[index]
    with open(log_bin, "r+b") as handle:
        handle.seek(offset + length // 2)
        byte = handle.read(1)
        handle.seek(offset + length // 2)
        handle.write(bytes([byte[0] ^ 0x10]))
    return index


def test_a_record_damaged_while_running_is_fetched_again_without_a_restart(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        cluster.start_voters(sorted(NAMES), settings=SYNTHETIC, timeout=STARTUP_S)
        statuses = cluster.wait_for("12 entries and a lease holder", lambda s: all(
            s.get(n, {}).get("commit_index", 0) >= 12 for n in NAMES) and cluster.coordinator(s) in NAMES, 120)
        holder = cluster.coordinator(statuses)
        follower = sorted(NAMES - {holder})[0]
        site = cluster.sites[follower]
        pid, log_bin = site.pid, site.data_dir / "coordination" / "log.bin"

        repaired = None
        for _ in range(3):  # a compaction renaming a new log.bin over the flipped one undoes the flip
            damaged = _flip_a_committed_record(log_bin, statuses[follower]["commit_index"])
            if eventually(lambda: (cluster.poll().get(follower, {}).get("storage") or {}).get("log_repair"), 20, 0.3):
                repaired = cluster.poll()[follower]["storage"]["log_repair"]
                break
            statuses = cluster.poll()
        assert repaired is not None, f"{follower} never reported a repair of its log"
        assert repaired["lost_after"] < damaged and repaired["dropped"] >= 1, repaired
        before = max(cluster.history)

        recovered = cluster.wait_for(f"{follower} refilled, commits on", lambda s: follower in s
                                     and s[follower]["storage"]["log_repair"]["refilled"]
                                     and min(s[n]["commit_index"] for n in NAMES) > before + 2, 90)
        assert site.running and site.pid == pid  # the same process: no restart
        storage = recovered[follower]["storage"]
        assert storage["vote_barrier"] is None and "log.read" not in storage["failing"]
        [kept] = [q for q in storage["quarantined"] if q["file"].endswith("log.bin")]
        assert "fails its checksum" in kept["reason"] and (log_bin.parent / "log.bin.corrupt-1").exists()
        text = site.log_text()
        assert text.count("===== start") == 1 and "Traceback" not in text
        assert f"log repaired while running: {repaired['dropped']} entries after {repaired['lost_after']}" in text
        assert "votes again" in text
        index = cluster.common_commit_index(NAMES, 90)
        assert index > before
        assert cluster.conflicting_indices() == {}, cluster.conflicting_indices()
        for name in (follower, holder):
            cluster.sites[name].kill()
        ours, theirs = _records(log_bin), _records(cluster.sites[holder].data_dir / "coordination" / "log.bin")
        shared = set(ours) & set(theirs)
        assert len(shared) >= 8, (sorted(ours), sorted(theirs))
        assert all(ours[i][:2] == theirs[i][:2] for i in shared)  # epoch and payload, byte for byte
    violations = check_histories(load_histories(find_history_files(tmp_path)))
    assert violations == [], "\n".join(str(v) for v in violations[:10])
