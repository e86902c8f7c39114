"""Three real daemons; the lease holder's disk fails with EIO between appending a commit and applying it.

Sites a, b, c (synthetic learners) commit rounds; a founds the run and holds the lease. Then
`log.read` fails with EIO on a (armed at run time through the loopback debug route) until a
commits an entry it cannot read back to apply (an entry it sent before the fault, acknowledged
since): that fragment must come from a peer. The fault is lifted at once and a goes on applying;
then `log.append` fails on a: it cannot persist its log, steps down, and the lease moves to b or
c. Its disk heals, and a catches up under the new holder.

The rule: a replica applies index i only onto the state after i - 1. The peers had not heard of
the commit when a asked them for the fragment (a commits first and tells them with its next
append): their copy, served as of an older index, must be refused, and a's state is not current
(it records no apply) until a copy that includes the entry is in. Before the fix a installed the
older copy at once and went on applying later indices onto it, recording state digests no other
replica had (`digest_divergence`, the issue's signature). The three histories must agree on every
state digest at every index, and a is repaired.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime
import urllib.request

import pytest

from diloco_node.ops.history import find_history_files, load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster
from diloco_node.storage import failpoints

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


FAILED = re.compile(r"^(\S+ \S+) a WARNING .* could not be applied: .*entry (\d+): ", re.M)
REPAIRED = re.compile(r"^(\S+ \S+) a INFO .* repaired fragment", re.M)


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _failed_apply(site) -> tuple[int, float] | None:
    """(index, time) of a's first committed entry it could not apply, from its log."""
    found = FAILED.search(site.log_text())
    return (int(found.group(2)), _stamp(found.group(1))) if found else None


def _repaired_at(site, since: float) -> float | None:
    times = [_stamp(m.group(1)) for m in REPAIRED.finditer(site.log_text())]
    return next((t for t in times if t >= since), None)


def test_a_holder_that_cannot_read_back_a_committed_entry_never_applies_onto_a_stale_state(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a, settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.add("c", bootstrap=a, settings=SYNTHETIC, env=ALLOW_DEBUG)
        cluster.wait_for("three ready voters committing", lambda s: NAMES <= {n for n, d in s.items() if d.get("ready")}
                         and all({m["node_id"] for m in s[n]["members"] if m["voter"]} == NAMES for n in NAMES)
                         and s["a"].get("coordinator") == "a" and min(s[n]["commit_index"] for n in NAMES) > 4,
                         STARTUP_S)

        for _ in range(ATTEMPTS):  # until a commits an entry it cannot read back
            _post(a, {"arm": "log.read=eio"})
            deadline = time.monotonic() + ATTEMPT_S
            while time.monotonic() < deadline and not _failed_apply(a):
                time.sleep(0.02)
            _post(a, {"disarm": "all"})
            if _failed_apply(a):
                break
            time.sleep(1.0)
        failed = _failed_apply(a)
        assert failed, f"no committed entry's apply failed on a in {ATTEMPTS} tries"
        failed_index, failed_at = failed
        cluster.wait_for("a applies past the failed entry", lambda s: s.get("a", {}).get("commit_index", 0)
                         > failed_index + 2, 60, interval=0.05)
        _post(a, {"arm": "log.append=eio"})  # a cannot persist its log: it steps down
        moved = cluster.wait_for("the lease moved off a", lambda s: s.get("b", {}).get("coordinator") in ("b", "c"), 60)
        _post(a, {"disarm": "all"})
        holder = moved["b"]["coordinator"]
        before = moved[holder]["commit_index"]
        cluster.wait_for("a caught up, one state again", lambda s: "a" in s and s["a"].get("ready")
                         and s["a"]["commit_index"] > before + 2, 90)
        conflicts = cluster.conflicting_indices()  # indices /status showed with two state digests
        repaired = _repaired_at(a, failed_at)
    histories = load_histories(find_history_files(tmp_path))
    violations = check_histories(histories)
    assert violations == [] and conflicts == {}, "\n".join([*(str(v) for v in violations[:10]), str(conflicts)])
    # a records no state for the entry it could not apply: it had no state that included it.
    assert not [e for e in histories["a"] if e.kind == "apply" and e.index == failed_index]
    # Repaired (how soon is a figure, not an assertion: 0.5 to 1.7 s on a shared machine, within
    # one 3 s lease, in the runs of issue 32).
    assert repaired is not None and repaired >= failed_at
