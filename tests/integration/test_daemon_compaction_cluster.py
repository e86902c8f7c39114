"""Real `diloco-node run` processes with a small log tail: compaction, snapshot install, join after it.

One 3-site run (a founds, b and c join) with `log_retain_entries=16` and a checkpoint every 3 s,
shared by the tests of this module, none of which relies on another having run (each waits for
the founders to be running and ready, restarting one a failed test left down, and for what it
needs, compaction included): the logs compact and stay bounded; a follower
SIGSTOPped until the lease holder compacted past it comes back by snapshot install; a follower
SIGKILLed until then restarts and does the same; a fourth site joins after compaction. Every
site must agree on the state digest at every index any two of them reported, and the chaos
checker must find no violation in the nodes' histories. Every process is killed at teardown.
The default suite runs the snapshot install after a SIGSTOP and the checker (~1-2 minutes); the
bounded-log run, the restart behind the cut and the late joiner are `slow` (`-m slow`: ~4-6
minutes in all, several JAX processes on shared cores).
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from diloco_node.ops.history import load_histories
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.launcher import DEFAULT_SETTINGS, Site
from diloco_node.testbed.local_cluster import Cluster

from conftest import all_ready, eventually

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

STARTUP_S = 150.0  # several JAX processes compiling at once on two shared cores
RETAIN = 16
SETTINGS = (*DEFAULT_SETTINGS, f"log_retain_entries={RETAIN}")
FOUNDERS = {"a", "b", "c"}
MEASURED: dict[str, object] = {}  # figures printed at the end (the report quotes them)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory):
    with Cluster.create(tmp_path_factory.mktemp("compaction")) as c:
        a = c.add("a", settings=SETTINGS)
        c.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        c.add("b", bootstrap=a, settings=SETTINGS)
        c.add("c", bootstrap=a, settings=SETTINGS)
        yield c
    print("\nmeasured:", json.dumps(MEASURED, indent=1))


@pytest.fixture
def cluster(shared_run: Cluster) -> Cluster:
    """The shared run with every site it holds running (restarted if a failed test left it down,
    continued if it left it stopped) and ready."""
    for site in shared_run.sites.values():
        site.signal(signal.SIGCONT)
        if not site.running:
            site.start()
    shared_run.wait_for("every site ready", all_ready(set(shared_run.sites)), STARTUP_S)
    return shared_run


def _agree(c: Cluster, names: set[str], timeout: float = 90) -> int:
    """Poll until one commit index was reported ready by every site in `names`; digests must agree."""
    index = c.common_commit_index(names, timeout)
    assert len(c.history[index]) == 1, f"sites disagree at index {index}: {c.history[index]}"
    assert c.conflicting_indices() == {}
    return index


def _leader_and_follower(c: Cluster) -> tuple[str, str]:
    statuses = c.wait_for("one coordinator", lambda s: c.coordinator(s) is not None, 60)
    leader = c.coordinator(statuses)
    assert leader is not None
    follower = next(n for n in sorted(statuses) if n != leader and c.sites[n].running)
    return leader, follower


def _compacted_past(c: Cluster, leader: str, index: int, timeout: float = 120) -> dict:
    return c.wait_for(f"{leader} compacted past index {index}",
                      lambda s: leader in s and s[leader].get("log_first_index", 1) > index + 1, timeout)


def _snapshot_applies(site_dir: Path) -> list[dict]:
    text = (site_dir / "history.jsonl").read_text()
    lines = text[:text.rfind("\n") + 1].splitlines()  # whole lines: the node may be writing one
    events = [json.loads(line) for line in lines if line.strip()]
    return [e for e in events if e.get("kind") == "apply" and (e.get("detail") or {}).get("snapshot")]


def _wait_for_log(site: Site, needle: str, after: int, timeout: float) -> str:
    """Poll a site's log until `needle` appears more than `after` times; returns the log text."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = site.log_text()
        if text.count(needle) > after:
            return text
        time.sleep(0.3)
    raise AssertionError(f"{site.node_id}: no {needle!r} within {timeout:.0f} s:\n{site.log_text()[-3000:]}")


@pytest.mark.slow
def test_logs_compact_and_stay_bounded(cluster: Cluster) -> None:
    def compacted_everywhere(s: dict) -> bool:
        return {"a", "b", "c"} <= set(s) and all(s[n].get("log_first_index", 1) > 1 for n in ("a", "b", "c"))

    cluster.wait_for("every site compacted its log", compacted_everywhere, 120)
    first = cluster.poll()
    start_commit = min(d["commit_index"] for d in first.values())
    # Run on: the log keeps being cut, so what is held stays near the tail plus one interval.
    statuses = cluster.wait_for("200 more commits", lambda s: {"a", "b", "c"} <= set(s) and min(
        s[n]["commit_index"] for n in ("a", "b", "c")) >= start_commit + 200, 240)
    for n in ("a", "b", "c"):
        doc = statuses[n]
        held = doc["commit_index"] - doc["log_first_index"] + 1
        assert doc["log_first_index"] > first[n]["log_first_index"], f"{n} compacted only once"
        assert held < 200, f"{n} holds {held} entries: the log is not bounded"
        path = cluster.sites[n].data_dir / "coordination" / "log.bin"
        cuts = [(int(b), int(a)) for b, a in re.findall(r"log\.bin (\d+) -> (\d+) bytes", cluster.sites[n].log_text())]
        assert cuts and all(after < before for before, after in cuts)
        MEASURED[f"{n}.compactions"] = len(cuts)
        MEASURED[f"{n}.log_bytes_max_before_a_cut"] = max(b for b, _ in cuts)
        MEASURED[f"{n}.log_bytes_max_after_a_cut"] = max(a for _, a in cuts)
        MEASURED[f"{n}.log_bytes_now"] = path.stat().st_size
        MEASURED[f"{n}.entries_held_now"] = held
        # What log.bin would hold uncompacted: every entry since index 1, at the mean size held now.
        MEASURED[f"{n}.log_bytes_if_uncompacted_est"] = path.stat().st_size * doc["commit_index"] // max(held, 1)
        MEASURED[f"{n}.commit_index_now"] = doc["commit_index"]
    _agree(cluster, {"a", "b", "c"})


def test_stopped_follower_returns_by_snapshot_install(cluster: Cluster) -> None:
    leader, follower = _leader_and_follower(cluster)
    site = cluster.sites[follower]
    installs = site.log_text().count("installed from the lease holder")
    downloads = site.log_text().count("snapshot install: global state downloaded")
    site.signal(signal.SIGSTOP)
    stopped = time.monotonic()
    stopped_at = max(d["commit_index"] for d in cluster.poll().values())
    try:
        # Past whatever it had appended but not applied: a few entries beyond its commit index.
        _compacted_past(cluster, leader, stopped_at + RETAIN)
    finally:
        site.signal(signal.SIGCONT)
    MEASURED["stopped.follower"], MEASURED["stopped.at_index"] = follower, stopped_at
    MEASURED["stopped.seconds"] = round(time.monotonic() - stopped, 1)
    _wait_for_log(site, "installed from the lease holder", installs, 60)
    _wait_for_log(site, "snapshot install: global state downloaded", downloads, 120)
    cluster.wait_for(f"{follower} ready again", all_ready({follower}), 120)
    assert eventually(lambda: _snapshot_applies(site.data_dir), 30, 0.3), "no apply after the install says snapshot: true"
    _agree(cluster, {"a", "b", "c"})


@pytest.mark.slow
def test_killed_follower_restarts_behind_the_compaction_point(cluster: Cluster) -> None:
    leader, follower = _leader_and_follower(cluster)
    site = cluster.sites[follower]
    killed_at = cluster.poll()[follower]["commit_index"]
    site.kill()
    _compacted_past(cluster, leader, killed_at + 2 * RETAIN)
    before = site.log_text().count("installed from the lease holder")
    downloads = site.log_text().count("snapshot install: global state downloaded")
    site.start()
    _wait_for_log(site, "snapshot install: global state downloaded", downloads, STARTUP_S)
    assert site.log_text().count("installed from the lease holder") > before
    assert "resumed from checkpoint" in site.log_text().split("===== start")[-1]
    cluster.wait_for(f"{follower} back and ready", lambda s: follower in s and s[follower].get("ready")
                     and s[follower]["commit_index"] > killed_at, STARTUP_S)
    MEASURED["killed.follower"], MEASURED["killed.at_index"] = follower, killed_at
    _agree(cluster, {"a", "b", "c"})


@pytest.mark.slow
def test_fourth_site_joins_after_compaction(cluster: Cluster) -> None:
    cluster.wait_for("every site compacted its log", lambda s: FOUNDERS <= set(s)
                     and all(s[n].get("log_first_index", 1) > 1 for n in FOUNDERS), 120)
    d = cluster.add("d", bootstrap=cluster.sites["b"], settings=SETTINGS)
    cluster.wait_for("d ready", all_ready({"a", "b", "c", "d"}), STARTUP_S)
    text = d.log_text()
    assert "downloaded the global state" in text and "installed from the lease holder" in text, text[-3000:]
    _agree(cluster, {"a", "b", "c", "d"})


def test_histories_pass_the_chaos_checker(cluster: Cluster) -> None:
    paths = [site.data_dir / "history.jsonl" for site in cluster.sites.values()]
    violations = check_histories(load_histories(paths))
    assert violations == [], "\n".join(f"{v.invariant}: {v.message}" for v in violations[:10])
