"""Three real daemons; the lease holder's disk fails with EIO between appending a commit and applying it.

Sites a, b, c (synthetic learners) commit rounds; a founds the run and holds the lease. Then
`log.read` fails with EIO on a (armed at run time through the loopback debug route): an entry a
already sent and has acknowledged commits, but a cannot read its payload back to apply it, so
its fragment must be fetched from a peer. Then `log.append` fails too: a cannot persist its log,
steps down, and the lease moves to b or c. Its disk heals, a catches up.

The rule this holds a to: a replica applies index i only to the state after i - 1, so the
fragment it fetches must be at least the round the failed entry made, never an older one a
follower still held because it had not heard of the commit yet. The three histories must agree on
every state digest at every index (the chaos checker's `digest_divergence`), and a must be one
consistent state again within one lease of the lease moving.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster
from diloco_node.ops import failpoints

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STARTUP_S = 120.0
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=40")
ALLOW_DEBUG = {failpoints.ENV_VAR: ""}  # no failpoint armed at start, the debug route present
NAMES = {"a", "b", "c"}
# How long one arming of `log.read` waits for a committed entry whose apply fails: entries a
# sent before the arming commit within a round trip; one it appends after cannot leave (its
# payload cannot be read back either), so a try that caught none disarms and tries again.
ATTEMPT_S = 4.0
ATTEMPTS = 10


def _post(site, body: dict) -> dict:
    request = urllib.request.Request(f"{site.url}/debug/failpoints", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def _apply_failed(site) -> bool:
    return "could not be applied" in site.log_text()


def test_a_holder_that_cannot_read_back_a_committed_entry_never_applies_onto_a_stale_state(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a, settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.add("c", bootstrap=a, settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.wait_for("three ready voters committing", lambda s: NAMES <= {n for n, d in s.items() if d.get("ready")}
                         and all({m["node_id"] for m in s[n]["members"] if m["voter"]} == NAMES for n in NAMES)
                         and s["a"].get("coordinator") == "a" and min(s[n]["commit_index"] for n in NAMES) > 8,
                         STARTUP_S)

        for _ in range(ATTEMPTS):  # until a commits an entry it cannot read back
            _post(a, {"arm": "log.read=eio"})
            deadline = time.monotonic() + ATTEMPT_S
            while time.monotonic() < deadline and not _apply_failed(a):
                time.sleep(0.05)
            if _apply_failed(a):
                break
            _post(a, {"disarm": "all"})
            time.sleep(1.0)
        assert _apply_failed(a), f"no committed entry's apply failed on a in {ATTEMPTS} tries"
        _post(a, {"arm": "log.read=eio,log.append=eio"})  # a cannot persist its log: it steps down
        moved = cluster.wait_for("the lease moved off a", lambda s: s.get("b", {}).get("coordinator") in ("b", "c"), 60)
        _post(a, {"disarm": "all"})
        holder = moved["b"]["coordinator"]
        before = moved[holder]["commit_index"]
        cluster.wait_for("a caught up, one state again", lambda s: "a" in s and s["a"].get("ready")
                         and s["a"]["commit_index"] > before + 4, 90)
        assert cluster.conflicting_indices() == {}, cluster.conflicting_indices()
    violations = check_histories(load_histories(find_history_files(tmp_path)))
    assert violations == [], "\n".join(str(v) for v in violations[:10])
