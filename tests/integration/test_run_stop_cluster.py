"""A run with [run.stop] ends by itself: every site stops at the same final commit with the same
state, exits 0, and a site started again on the finished run exits 0 at once.

Every merge needs both learners (`run.sync.min_quorum=2`): a founder alone cannot spend the
budget before the joiner is in, however long the joiner takes to start on a loaded machine."""

from __future__ import annotations

import re

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

from conftest import one_final_state

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0
# 4 x 32 tokens per step; each contribution of a fragment carries about 8 steps: 12,000 tokens
# merged into every fragment is some ten rounds of two learners.
STOP_TOKENS = 12_000
SETTINGS = (*DEFAULT_SETTINGS, f"run.stop.tokens={STOP_TOKENS}", "run.sync.min_quorum=2")
FINAL = re.compile(r"stopped cleanly at index (\d+) digest ([0-9a-f]+)")


def test_the_run_stops_everywhere_at_one_final_commit_and_exits_0(tmp_path) -> None:
    with Cluster.create(tmp_path) as cluster:
        a = cluster.add("a", settings=SETTINGS)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        cluster.add("b", bootstrap=a, settings=SETTINGS)
        cluster.add("w", bootstrap=a, settings=SETTINGS, role="witness")
        codes = {name: site.wait(STARTUP_S + 240) for name, site in cluster.sites.items()}
        assert codes == {"a": 0, "b": 0, "w": 0}, {n: s.log_text()[-2000:] for n, s in cluster.sites.items()}
        logs = {name: site.log_text() for name, site in cluster.sites.items()}
        assert all(f"stop.tokens = {STOP_TOKENS}" in text for text in logs.values())
        one_final_state(logs)  # one completing commit and one state everywhere
        finals = {name: FINAL.findall(text)[-1] for name, text in logs.items()}
        # Started again, a site of the finished run sees it from its checkpoint and exits 0 at once.
        again = cluster.sites["a"]
        again.start()
        assert again.wait(STARTUP_S) == 0
        assert FINAL.findall(again.log_text())[-1] == finals["a"]
