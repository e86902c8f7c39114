"""Two real daemons with the synthetic learner (`[node] learner = "synthetic"`) commit rounds of
their random deltas through the real codecs, transport and log, and agree on every digest."""

from __future__ import annotations

import time

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

from conftest import eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STARTUP_S = 150.0
STEPS_PER_S = 20.0
SYNTHETIC = (*DEFAULT_SETTINGS, "learner=synthetic", f"synthetic_steps_per_s={STEPS_PER_S}")


def test_two_synthetic_learners_commit_rounds_with_equal_digests(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SYNTHETIC)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a, settings=SYNTHETIC)
        names = {"a", "b"}
        statuses = cluster.wait_for("a and b ready and voters", lambda s: names <= {n for n, d in s.items() if d.get(
            "ready")} and all({m["node_id"] for m in s[n]["members"] if m["voter"]} == names for n in names), STARTUP_S)
        start = min(statuses[n]["commit_index"] for n in names)
        steps0, started = {n: statuses[n]["learner"]["step"] for n in names}, time.monotonic()
        done = cluster.wait_for("8 more commits on both", lambda s: names <= set(s) and min(
            s[n]["commit_index"] for n in names) >= start + 8, 90)
        elapsed = time.monotonic() - started
        index = cluster.common_commit_index(names, 60)
        assert index >= start + 8 and len(cluster.history[index]) == 1, cluster.history.get(index)
        assert cluster.conflicting_indices() == {} and cluster.shared_indices() >= 1
        for n in names:
            # The learner steps at synthetic_steps_per_s (loose: a shared machine), reports the
            # synthetic loss, and says in its log that it does not train.
            rate = (done[n]["learner"]["step"] - steps0[n]) / elapsed
            assert 0.3 * STEPS_PER_S <= rate <= 1.3 * STEPS_PER_S, (n, rate)
            assert done[n]["learner"]["loss"] == 0.0
            assert "SYNTHETIC learner at 20 steps/s" in cluster.sites[n].log_text()
        # Both learners' contributions are merged (their names appear among the contributors):
        # eight commits need not include one of b's, so wait for it.
        def logs() -> str:
            return "".join(site.log_text() for site in cluster.sites.values())

        assert eventually(lambda: " a w=" in logs() and " b w=" in logs(), 60, 0.5), logs()[-3000:]
