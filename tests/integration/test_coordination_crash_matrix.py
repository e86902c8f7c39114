"""A crash just before and just after each fsync of the coordination store, in a real process.

A child process drives a `CoordinationStore` through a node's life (found, append, vote, learn an
address, truncate a conflicting suffix, compact) and prints each state it is about to persist
(INTENT) and each one `sync()` returned for (ACK: what the node may now acknowledge). A failpoint
crashes it at the K-th fsync of one point; `durable` drops whatever was not fsynced, as a power
cut would. The restarted store must load, and hold exactly the last acknowledged state or the
one in progress: nothing acknowledged is lost, nothing half-written is read as good.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.storage import failpoints

LIFE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from bootstrap.coordinator_node import PersistentState
    from bootstrap.election import ElectionState
    from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
    from diloco_node.daemon.coordination_store import CoordinationStore
    from diloco_node.storage import failpoints

    failpoints.load_from_env()
    store = CoordinationStore(Path(sys.argv[1]))
    identity = {"node_id": "a", "manifest": {"run": "r"}, "addresses": {}}

    def view(state):
        return {"election": [state.election.current_epoch, state.election.voted_for],
                "snapshot": state.log.snapshot.last_index,
                "log": [[e.index, e.epoch] for e in state.log.entries], "identity": identity}

    def step(state, persist, intent=None):
        print("INTENT " + json.dumps(intent or view(state)), flush=True)
        persist()
        print("ACK " + json.dumps(view(state)), flush=True)

    def entry(index, epoch):
        return LogEntry(epoch, index, EntryKind.OUTER_COMMIT, bytes([index]) * 6000, fragment=0, round=index)

    state = PersistentState.founding(["a", "b", "c"])
    step(state, lambda: (store.save_identity(identity), store.sync(state)))  # founding
    for index in range(2, 7):
        state.log.entries.append(entry(index, 1))
        step(state, lambda: store.sync(state))
    state.election = ElectionState(2, "b")
    step(state, lambda: store.sync(state))
    identity = {**identity, "addresses": {"b": "https://b:7070"}}
    step(state, lambda: store.save_identity(identity))
    del state.log.entries[4:]  # a leader of epoch 2 replaces 5 and 6
    state.log.entries.extend([entry(5, 2), entry(6, 2)])
    step(state, lambda: store.sync(state))
    through = Snapshot(3, 1, ClusterConfig.of(["a", "b", "c"]))

    def compact():
        prepared = store.prepare_compaction(through, state.log.entries[3:])
        state.log.snapshot = through
        del state.log.entries[:3]
        store.sync(state, prepared)

    step(state, compact, intent={**view(state), "snapshot": 3, "log": view(state)["log"][3:]})
    print("DONE", flush=True)
""")

# (point, the fsync at it that crashes): every fsync the life above makes at each point.
CRASHES = [("manifest.write", 1), ("election.write", 1), ("election.write", 2), ("log.append", 1),
           ("log.append", 4), ("election.write", 3), ("election.write", 4), ("identity.write", 1),
           ("log.truncate", 1), ("log.compact", 1), ("log.compact", 2)]


def _loaded(directory: Path) -> dict:
    store = CoordinationStore(directory)
    identity = store.load_identity() if store.exists() else None
    state = store.load_persistent()
    return {"election": [state.election.current_epoch, state.election.voted_for],
            "snapshot": state.log.snapshot.last_index,
            "log": [[e.index, e.epoch] for e in state.log.entries], "identity": identity}


@pytest.mark.parametrize("action", ["crash-before", "crash-after"])
@pytest.mark.parametrize(("point", "hit"), CRASHES)
def test_a_crash_at_an_fsync_keeps_every_acknowledged_state(tmp_path, point, hit, action):
    done = subprocess.run([sys.executable, "-c", LIFE, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, failpoints.ENV_VAR: f"{point}={action}@{hit}*1"})
    assert done.returncode == failpoints.CRASH_EXIT_CODE, done.stderr
    assert f"failpoint {point}: crashing" in done.stderr and "DONE" not in done.stdout
    lines = done.stdout.splitlines()
    acked = [json.loads(line.removeprefix("ACK ")) for line in lines if line.startswith("ACK ")]
    in_progress = json.loads(lines[-1].removeprefix("INTENT "))
    assert lines[-1].startswith("INTENT ")
    loaded = _loaded(tmp_path)
    if not acked:  # crashed persisting the very first state: nothing was promised
        assert loaded["identity"] in (None, in_progress["identity"])
        return
    # The step in progress survives only where its last durable act happened: an append's fsync
    # (crash after it), or the vote's first copy renamed into place (crash at the second copy's
    # fsync). A crash before an append's fsync really loses the appended bytes, and a crash
    # between a temp file's fsync and its rename leaves the old file.
    survives = (point == "log.append" and action == "crash-after") or (point == "election.write" and hit == 4)
    expected = in_progress if survives else acked[-1]
    assert loaded == expected, f"acknowledged {acked[-1]}, in progress {in_progress}, loaded {loaded}"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # the load removed temp files
    assert _loaded(tmp_path) == loaded  # and a second restart reads the same


def test_the_life_runs_to_its_end_without_a_failpoint(tmp_path):
    done = subprocess.run([sys.executable, "-c", LIFE, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != failpoints.ENV_VAR})
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "DONE", done.stderr
    last = json.loads([line for line in done.stdout.splitlines() if line.startswith("ACK ")][-1].removeprefix("ACK "))
    assert _loaded(tmp_path) == last and last["snapshot"] == 3 and last["log"][-1] == [6, 2]
