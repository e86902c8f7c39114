"""Commits too big for one frame stream with relays off: two real daemons, a 25M-parameter model
in one fragment, fp32 commits (~97 MiB each, over the 32 MiB inline threshold).

The lease holder must send each commit by digest and stream its bytes to the other site itself
(a star), the other site must spool, verify and apply them, and both must agree on every commit.
Marked `slow`: two daemons holding a 25M-parameter state take a few GB and a minute.
"""

from __future__ import annotations

import pytest

from diloco_node.daemon.relays import INLINE_PAYLOAD_MAX_BYTES
from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STARTUP_S = 240.0
NAMES = ["a", "b"]
SETTINGS = (*DEFAULT_SETTINGS, "run.model.size=medium", "run.sync.fragments=1", "run.sync.period=8",
            "run.sync.codec_down=fp32", "learner=synthetic", "synthetic_steps_per_s=4", "relay_fanout=0",
            "checkpoint_interval_s=600", "eval_interval_commits=0")


def _round(doc: dict) -> int:
    """The committed round of the one fragment (outer commits applied; other entries do not count)."""
    return doc["fragments"][0]["round"] if doc.get("fragments") else 0


def test_commits_over_the_inline_threshold_stream_from_the_holder_to_every_site(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SETTINGS)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a, settings=SETTINGS, role="witness")
        cluster.wait_for("both ready, one holder", lambda s: set(NAMES) <= {n for n, d in s.items() if d.get("ready")}
                         and cluster.coordinator(s) is not None, STARTUP_S)
        before = cluster.poll()
        holder = cluster.coordinator(before)
        assert holder is not None
        follower = next(n for n in NAMES if n != holder)
        start = before[holder]["commit_index"]
        first_round = max(_round(before[n]) for n in NAMES)
        # Four commits applied on both: at least three of them were pushed after `before`.
        after = cluster.wait_for("4 more outer commits on both", lambda s: set(NAMES) <= set(s)
                                 and min(_round(s[n]) for n in NAMES) >= first_round + 4, 240)
        # Whichever site held the lease for a commit streamed it to the other (the lease may move
        # between the two on a loaded machine): count over both.
        pushed = sum(after[n]["relays"]["pushed"] - before[n]["relays"]["pushed"] for n in NAMES)
        pushed_bytes = sum(after[n]["relays"]["pushed_bytes"] - before[n]["relays"]["pushed_bytes"] for n in NAMES)
        logged = after[follower]["log_bytes"] - before[follower]["log_bytes"]
        print(f"{pushed} commits streamed, {pushed_bytes / 2**20:.0f} MiB; {logged / 2**20:.0f} MiB logged by "
              f"{follower}; relays {[after[n]['relays'] for n in NAMES]}; loop lag "
              f"{[after[n]['loop_lag_s'] for n in NAMES]} s, stalls {[after[n]['loop_stalls'] for n in NAMES]}; "
              f"epochs {before[holder]['epoch']} -> {after[holder]['epoch']}")
        assert pushed >= 3 and pushed_bytes > 3 * INLINE_PAYLOAD_MAX_BYTES
        assert all(after[n]["relays"]["refused"] == 0 and after[n]["relays"]["forwarded"] == 0 for n in NAMES)
        index = cluster.common_commit_index(set(NAMES), 120)
        assert index >= start + 3 and len(cluster.history[index]) == 1, cluster.history.get(index)
        assert cluster.conflicting_indices() == {}
