"""Relayed commits with real daemons: four synthetic-learner sites, `relay_fanout = 1` (a chain).

The lease holder must send each commit payload about once (its byte counter over its log's growth),
every site must apply the same commits (equal digests), and after the holder's first relay is
stalled (SIGSTOP) or SIGKILLed, the sites below it must fetch from higher up so commits go on.
"""

from __future__ import annotations

import signal
import time
import urllib.request

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS
from diloco_node.testbed.local_cluster import Cluster

from conftest import voters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 200.0  # four JAX processes starting at once on two shared cores
FANOUT = 1
NAMES = ["a", "b", "c", "d"]
RELAYED = (*DEFAULT_SETTINGS, "learner=synthetic", "synthetic_steps_per_s=20", f"relay_fanout={FANOUT}",
           "checkpoint_interval_s=600", "eval_interval_commits=0")


@pytest.fixture(scope="module")
def relayed_run(tmp_path_factory: pytest.TempPathFactory):
    with Cluster.create(tmp_path_factory.mktemp("relays")) as cluster:
        a = cluster.add("a", settings=RELAYED)
        cluster.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        for name in NAMES[1:]:
            cluster.add(name, bootstrap=a, settings=RELAYED)
        names = set(NAMES)
        cluster.wait_for("all ready, all voters, one holder", lambda s: names <= {n for n, d in s.items() if d.get("ready")}
                         and all(voters(s[n]) == names for n in names) and cluster.coordinator(s) is not None,
                         STARTUP_S)
        yield cluster


def test_relayed_commits_leave_the_holder_fanout_times_and_agree(relayed_run: Cluster) -> None:
    cluster = relayed_run
    before = cluster.poll()
    holder = cluster.coordinator(before)
    assert holder is not None
    start = before[holder]["commit_index"]
    after = cluster.wait_for("12 more commits everywhere", lambda s: set(NAMES) <= set(s)
                             and min(s[n]["commit_index"] for n in NAMES) >= start + 12, 120)
    assert cluster.coordinator(after) == holder, "the holder changed: the byte count would mix two holders"
    sent = after[holder]["bytes"]["sent"] - before[holder]["bytes"]["sent"]
    logged = after[holder]["log_bytes"] - before[holder]["log_bytes"]
    assert logged > 0
    # Without relays this is about 3 (one copy per follower); with a fan-out of 1 about 1, plus
    # the appends' metadata and heartbeats.
    copies = sent / logged
    print(f"holder {holder}: sent {sent} bytes for {logged} logged bytes: {copies:.2f} copies per commit")
    assert copies <= FANOUT + 0.5, copies
    index = cluster.common_commit_index(set(NAMES), 60)
    assert index >= start + 12 and len(cluster.history[index]) == 1, cluster.history.get(index)
    assert cluster.conflicting_indices() == {} and cluster.shared_indices() >= 1
    # /status "relays": the holder pushed one streamed copy per commit (a chain), the first relay
    # forwarded them, nobody refused a stream; /metrics carries the same counters.
    relays = {name: after[name]["relays"] for name in NAMES}
    pushed = relays[holder]["pushed"] - before[holder]["relays"]["pushed"]
    assert pushed >= 12 and relays[holder]["pushed_bytes"] > 0, relays[holder]
    first_relay = sorted(n for n in NAMES if n != holder)[0]
    assert relays[first_relay]["forwarded"] > 0 and relays[first_relay]["forwarded_bytes"] > 0, relays[first_relay]
    assert all(r["refused"] == 0 for r in relays.values()), relays
    metrics = urllib.request.urlopen(cluster.sites[holder].url + "/metrics", timeout=10).read().decode()
    counted = [line for line in metrics.splitlines() if line.startswith("diloco_relay_pushed_total ")]
    assert counted and float(counted[0].split()[1]) >= relays[holder]["pushed"], counted


def test_a_stalled_relay_is_routed_around_and_catches_up_when_it_resumes(relayed_run: Cluster) -> None:
    cluster = relayed_run
    statuses = cluster.poll()
    holder = cluster.coordinator(statuses)
    assert holder is not None
    relay = sorted(n for n in NAMES if n != holder)[0]  # the first relay: every other follower is below it
    start = max(d["commit_index"] for d in statuses.values())
    cluster.sites[relay].signal(signal.SIGSTOP)
    stalled_at = time.monotonic()
    others = {n for n in NAMES if n != relay}
    try:
        # `poll` skips a site that does not answer, so the stalled one is simply absent.
        cluster.wait_for("8 more commits on every site but the stalled relay", lambda s: others <= set(s)
                         and min(s[n]["commit_index"] for n in others) >= start + 8, 120)
        print(f"8 commits past the stalled relay {relay} in {time.monotonic() - stalled_at:.1f} s")
    finally:
        cluster.sites[relay].signal(signal.SIGCONT)
    target = max(d["commit_index"] for d in cluster.poll().values())
    cluster.wait_for(f"{relay} resumed and caught up", lambda s: relay in s and s[relay]["commit_index"] >= target, 60)
    index = cluster.common_commit_index(set(NAMES), 60)
    assert len(cluster.history[index]) == 1
    assert cluster.conflicting_indices() == {}


def test_a_killed_relay_is_routed_around_and_commits_go_on(relayed_run: Cluster) -> None:
    cluster = relayed_run
    statuses = cluster.poll()
    holder = cluster.coordinator(statuses)
    assert holder is not None
    # The holder's tree is its followers in id order, each the parent of the next (fan-out 1):
    # the first of them relays to every other one.
    relay = sorted(n for n in NAMES if n != holder)[0]
    start = max(d["commit_index"] for d in statuses.values())
    cluster.sites[relay].kill()
    killed_at = time.monotonic()
    survivors = {n for n in NAMES if n != relay}
    cluster.wait_for("8 more commits on every survivor", lambda s: survivors <= set(s)
                     and min(s[n]["commit_index"] for n in survivors) >= start + 8, 120)
    print(f"8 commits past the killed relay {relay} in {time.monotonic() - killed_at:.1f} s")
    index = cluster.common_commit_index(survivors, 60)
    assert index >= start + 8 and len(cluster.history[index]) == 1
    assert cluster.conflicting_indices() == {}
