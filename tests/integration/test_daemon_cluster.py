"""Real `diloco-node run` processes on 127.0.0.1: commits, failover, restart, join, refusals.

One 3-site run (a founds, b and c join) is shared by the tests of this module, so JAX compiles
once, but no test relies on another having run: the `cluster` fixture hands each test a run in
which every site it holds is running, ready, a voter and agrees on one coordinator (restarting a
site a failed test left down), and a site a test adds to be refused is removed in a `finally`.
Agreement, refusals that change nothing, a fourth site joining, SIGKILL of the coordinator and its
restart from checkpoint, SIGTERM and restart, a witness. Every process is killed at teardown. Part
of the default suite (about 2-4 minutes on two cores; `-m integration` selects it).
"""

from __future__ import annotations

import re
import urllib.request
import signal
import socket
import time
from pathlib import Path

import pytest

from diloco_node.testbed.launcher import DEFAULT_SETTINGS, Site
from diloco_node.testbed.local_cluster import Cluster

from conftest import all_ready, eventually, voters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

STARTUP_S = 150.0  # several JAX processes compiling at once on two shared cores
FOUNDERS = {"a", "b", "c"}
# Half the testbed's commit rate (period 16, not 8): what these tests watch happens as soon, and
# the lease holder's per-commit work, most of a test cluster's CPU, is halved.
SETTINGS = (*DEFAULT_SETTINGS, "run.sync.period=16")


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory: pytest.TempPathFactory):
    c = Cluster.create(tmp_path_factory.mktemp("cluster"))
    # Site a runs as if under a Type=notify unit: its sd_notify datagrams land in this socket.
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(c.root / "notify.sock"))
    notify.setblocking(False)
    c.notify_socket = notify  # type: ignore[attr-defined]
    try:
        a = c.add("a", settings=SETTINGS, env={"NOTIFY_SOCKET": str(c.root / "notify.sock")})
        c.wait_for("a ready", lambda s: s.get("a", {}).get("ready", False), STARTUP_S)
        c.add("b", bootstrap=a, settings=SETTINGS)
        c.add("c", bootstrap=a, settings=SETTINGS)
        yield c
    finally:
        c.close()
        notify.close()


@pytest.fixture
def cluster(shared_run: Cluster) -> Cluster:
    """The shared run, healthy: every site it holds running (restarted if a test left it down),
    ready, a voter everywhere, and one coordinator named by all."""
    for site in shared_run.sites.values():
        if not site.running:
            site.start()
    names = set(shared_run.sites)

    def healthy(s: dict) -> bool:
        return (all_ready(names)(s) and all(voters(s[n]) == names for n in names)
                and len({s[n].get("coordinator") for n in names} - {None}) == 1
                and all(s[n].get("coordinator") for n in names))

    shared_run.wait_for(f"{sorted(names)} ready, all voters, one coordinator", healthy, STARTUP_S)
    return shared_run


def test_three_sites_commit_and_agree(cluster: Cluster) -> None:
    statuses = cluster.poll()
    assert FOUNDERS <= voters(statuses["a"])
    start = min(statuses[n]["commit_index"] for n in FOUNDERS)
    cluster.wait_for("10 more commits everywhere", lambda s: FOUNDERS <= set(s) and
                     min(s[n]["commit_index"] for n in FOUNDERS) >= start + 10, 60)
    index = cluster.common_commit_index(FOUNDERS, 60)
    assert len(cluster.history[index]) == 1, f"sites disagree at index {index}: {cluster.history[index]}"
    assert cluster.conflicting_indices() == {}
    # /status says what the outer gradients cost: every learner has sent and applied some.
    statuses = cluster.poll()
    for name in FOUNDERS:
        outer = statuses[name]["outer_gradients"]
        assert outer["codec_up"] and outer["codec_down"], (name, outer)
        assert outer["sent_bytes"] > 0 and outer["applied_bytes"] > 0, (name, outer)
        assert 0 < outer["bits_per_parameter_up"] < 32 and 0 < outer["bits_per_parameter_down"] < 32, (name, outer)
    # Contributions of all three learners are merged together in some round (with the learners
    # of other tests in it or not).
    all_three = re.compile(r"merged \d+ of \d+ contribution\(s\)[^\n]*\ba w=[^\n]*\bb w=[^\n]*\bc w=")
    deadline = time.monotonic() + 60
    while not any(all_three.search(site.log_text()) for site in cluster.sites.values()):
        assert time.monotonic() < deadline, "no round merged all three learners within 60 s"
        time.sleep(0.5)


def test_every_learner_evaluates_the_global_model_and_reports_it(cluster: Cluster) -> None:
    """Every 10 commits (the test cluster's setting) each learner evaluates the global model on its
    own eval split: /status, /metrics and the history carry the loss; a witness would not."""
    done = cluster.wait_for("an evaluation on every founder", lambda s: FOUNDERS <= set(s) and all(
        s[n]["evaluation"]["loss"] is not None for n in FOUNDERS), 90)
    for node_id in FOUNDERS:
        evaluation = done[node_id]["evaluation"]
        assert 0.0 < evaluation["loss"] < 10.0 and evaluation["commit_index"] >= 10, evaluation
        site = cluster.sites[node_id]

        def metrics() -> str:
            with urllib.request.urlopen(site.url + "/metrics", timeout=5) as response:
                return response.read().decode()

        # /status shows an evaluation first; the gauge and the history event follow it.
        eval_gauge = re.compile(r'^diloco_eval_loss\{set="held_out"\} [0-9.e+-]+', re.M)
        assert eventually(lambda: eval_gauge.search(metrics()), 10, 0.2), metrics()[:500]
        history = site.data_dir / "history.jsonl"
        assert eventually(lambda: '"kind":"eval"' in history.read_text(), 10, 0.2)


def test_systemd_hears_ready_and_status(cluster: Cluster) -> None:
    received: list[str] = []

    def heard_both() -> bool:
        """Reads what has arrived; whether READY=1 and a STATUS= line saying ready are among it
        (a's STATUS= line may be sent a moment after /status says ready)."""
        while True:
            try:
                received.append(cluster.notify_socket.recv(4096).decode())  # type: ignore[attr-defined]
            except BlockingIOError:
                break
        return (any("READY=1" in m for m in received)
                and any(m.startswith("STATUS=") and "ready: lease holder" in m for m in received))

    assert eventually(heard_both, 30, 0.2), received


def test_wrong_secret_is_refused_and_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    before = cluster.poll()
    other_secret = tmp_path / "other-secret"
    other_secret.write_bytes(b"x" * 48)
    other_secret.chmod(0o600)
    intruder = cluster.add("intruder", bootstrap=cluster.sites["a"], settings=SETTINGS, secret_file=other_secret)
    try:
        code = intruder.wait(60)
        text = intruder.log_text()
    finally:
        cluster.remove("intruder")
    assert code == 3, f"intruder exited with {code}"
    assert "refused with 409" in text or "refused with 401" in text, text[-2000:]
    after = cluster.poll()
    for node_id in before:
        assert "intruder" not in {m["node_id"] for m in after[node_id]["members"]}
        assert voters(after[node_id]) == voters(before[node_id])


def test_contradicting_manifest_is_refused_with_a_clear_error(cluster: Cluster) -> None:
    odd = cluster.add("odd", bootstrap=cluster.sites["a"], settings=SETTINGS, extra=["--set", "run.sync.period=32"])
    try:
        code = odd.wait(90)
        text = odd.log_text()
    finally:
        cluster.remove("odd")
    assert code == 3, f"odd exited with {code}"
    assert "contradict" in text and "sync.period: 32 != 16" in text, text[-2000:]
    after = cluster.poll()
    assert all("odd" not in {m["node_id"] for m in d["members"]} for d in after.values())


def test_sigkill_coordinator_fails_over_and_restarts_from_checkpoint(cluster: Cluster) -> None:
    statuses = cluster.poll()
    leader = cluster.coordinator(statuses)
    assert leader is not None, f"no single coordinator: {[d.get('coordinator') for d in statuses.values()]}"
    before = max(d["commit_index"] for d in statuses.values())
    victim: Site = cluster.sites[leader]
    victim.kill()
    killed_at = time.monotonic()
    survivors = {n for n in cluster.sites if n != leader and cluster.sites[n].running}

    def new_leader_commits(s: dict) -> bool:
        live = [s[n] for n in survivors if n in s]
        holders = {doc.get("coordinator") for doc in live}
        return (len(live) == len(survivors) and len(holders) == 1 and leader not in holders and None not in holders
                and min(doc["commit_index"] for doc in live) > before + 2)

    cluster.wait_for("a new coordinator and commits past the old index", new_leader_commits, 60)
    failover_s = time.monotonic() - killed_at
    assert failover_s < 60
    assert cluster.conflicting_indices() == {}
    # The killed site restarts from its own checkpoint and catches up.
    victim.start()
    cluster.wait_for(f"{leader} back, ready and caught up", lambda s: leader in s and s[leader].get("ready")
                     and s[leader]["commit_index"] >= before, STARTUP_S)
    assert "resumed from checkpoint" in victim.log_text()
    index = cluster.common_commit_index({leader, *survivors}, 60)
    assert len(cluster.history[index]) == 1
    assert cluster.conflicting_indices() == {}


def test_sigterm_then_restart_resumes_at_the_same_index_with_identical_state(cluster: Cluster) -> None:
    statuses = cluster.poll()
    leader = cluster.coordinator(statuses)
    follower = next(n for n in sorted(FOUNDERS) if n != leader)  # a founding learner, whatever other tests added
    site = cluster.sites[follower]
    site.signal(signal.SIGTERM)
    assert site.wait(60) == 0, "SIGTERM must end the node with exit code 0"
    stopped = re.findall(r"stopped cleanly at index (\d+) digest ([0-9a-f]+)", site.log_text())
    assert stopped, site.log_text()[-2000:]
    index, digest = int(stopped[-1][0]), stopped[-1][1]
    site.start()
    cluster.wait_for(f"{follower} ready again", lambda s: follower in s and s[follower].get("ready"), STARTUP_S)
    resumed = re.findall(r"resumed from checkpoint \d+ at index (\d+) digest ([0-9a-f]+)", site.log_text())
    assert resumed and (int(resumed[-1][0]), resumed[-1][1]) == (index, digest)
    common = cluster.common_commit_index(set(cluster.poll()), 60)
    assert len(cluster.history[common]) == 1
    assert cluster.conflicting_indices() == {}


def test_sigterm_of_the_coordinator_resigns_and_it_rejoins_after_restart(cluster: Cluster) -> None:
    statuses = cluster.poll()
    leader = cluster.coordinator(statuses)
    assert leader is not None
    site = cluster.sites[leader]
    site.signal(signal.SIGTERM)
    assert site.wait(60) == 0, "SIGTERM must end the coordinator with exit code 0"
    text = site.log_text()
    assert "left: our removal is committed" in text, text[-2000:]
    others = {n for n, s in cluster.sites.items() if s.running}
    cluster.wait_for("another coordinator without the resigned one", lambda s: others <= set(s) and len(
        {s[n].get("coordinator") for n in others} - {None, leader}) == 1 and all(leader not in voters(s[n])
                                                                                  for n in others), 60)
    site.start()
    cluster.wait_for(f"{leader} re-added as a voter", lambda s: leader in s and s[leader].get("ready")
                     and all(leader in voters(doc) for doc in s.values()), STARTUP_S)
    common = cluster.common_commit_index(set(cluster.poll()), 60)
    assert len(cluster.history[common]) == 1
    assert cluster.conflicting_indices() == {}


# ---- strangers (issue 13) ---------------------------------------------------------------------


def _slow_strangers(url: str, streams: int, hold_s: float) -> list[tuple[int, float]]:
    """`streams` forged-sender streams from their own loopback addresses, each sending a frame
    prefix one byte per 0.5 s; (status, seconds until answered) of each (0: still open at `hold_s`)."""
    import asyncio

    from diloco_node.transport import SENDER_HEADER, kind_path
    from wire.messages import MessageKind

    host, port = url.removeprefix("http://").split(":")

    async def one(i: int) -> tuple[int, float]:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(f"127.0.1.{i + 1}", 0))
        opened = time.monotonic()
        try:
            writer.write(f"POST {kind_path(MessageKind.VOTE_REQUEST)} HTTP/1.1\r\nHost: x\r\n"
                         f"{SENDER_HEADER}: {'abc'[i % 3]}\r\nContent-Length: 4096\r\n\r\n".encode())
            for byte in b"DLCO\x02\x00\x00\x05" + bytes(64):
                writer.write(bytes([byte]))
                try:
                    line = await asyncio.wait_for(reader.readline(), 0.5)
                except TimeoutError:
                    if time.monotonic() - opened > hold_s:
                        return 0, hold_s
                    continue
                return (int(line.split()[1]) if line else -1), time.monotonic() - opened
            return 0, hold_s
        finally:
            writer.close()

    async def main() -> list[tuple[int, float]]:
        return await asyncio.gather(*(one(i) for i in range(streams)))

    return asyncio.run(main())


def test_strangers_slow_streams_are_cut_and_commits_go_on(cluster: Cluster) -> None:
    statuses = cluster.poll()
    coordinator = next(iter(statuses.values()))["coordinator"]
    follower = sorted(set(cluster.sites) - {coordinator})[0]
    before = cluster.poll()[coordinator]["commit_index"]
    answers = _slow_strangers(cluster.sites[follower].url, 64, hold_s=20.0)
    # Every stream was answered: none could hold a slot past the 5 s authentication deadline.
    assert {status for status, _ in answers} <= {408, 429}, answers
    assert all(status for status, _ in answers)
    during = cluster.poll()
    assert during[coordinator]["commit_index"] > before  # the run kept committing meanwhile
    assert during[follower]["ready"], during[follower].get("ready_reason")


def test_a_non_members_contribution_is_refused_with_403(cluster: Cluster) -> None:
    import asyncio

    import numpy as np

    from diloco_node.config.settings import run_id_for
    from diloco_node.transport import PeerClient, PeerRefused
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key, load_run_secret
    from wire.codecs import encode_named
    from wire.messages import FragmentContribution

    coordinator = next(iter(cluster.poll().values()))["coordinator"]
    secret = load_run_secret(cluster.secret_file)
    run_id, key = run_id_for(secret), derive_frame_key(secret)

    async def send() -> PeerRefused:
        async with PeerClient(AuthContext(run_id, "mallory", key), FrameVerifier(run_id, key, node_id="mallory")) as client:
            message = FragmentContribution(0, 0, 0, 8, 2**40, "int4", "mallory",
                                           encode_named({"x": np.zeros(4, np.float32)}, "int4"))
            with pytest.raises(PeerRefused) as refused:
                await client.send(cluster.sites[coordinator].url, message, peer=coordinator, deadline_s=10)
            return refused.value

    refused = asyncio.run(send())
    assert refused.status == 403 and "mallory is not a member of this run" in refused.reason


# ---- sites added to the run: last, so the tests above run with three learners, not five processes


def test_fourth_site_joins_mid_run_and_is_merged(cluster: Cluster) -> None:
    d = cluster.add("d", bootstrap=cluster.sites["b"], settings=SETTINGS)
    cluster.wait_for("d ready and a voter everywhere", lambda s: all_ready({"a", "b", "c", "d"})(s)
                     and all("d" in voters(doc) for doc in s.values()), STARTUP_S)
    deadline = time.monotonic() + 60
    pattern = re.compile(r"syncer: fragment \d+: .*merged \d+ of \d+ contribution\(s\).*\bd w=")
    while time.monotonic() < deadline:
        logs = "\n".join(site.log_text() for site in cluster.sites.values())
        if pattern.search(logs):
            break
        time.sleep(0.5)
    else:
        pytest.fail("no merge included d's contribution within 60 s")
    assert re.search(r"downloaded the global state \(\d+ bytes\)", d.log_text()), "d did not download the state"
    index = cluster.common_commit_index({"a", "d"}, 60)
    assert len(cluster.history[index]) == 1
    assert cluster.conflicting_indices() == {}


def test_witness_votes_and_replicates_without_training(cluster: Cluster) -> None:
    names = {n for n, s in cluster.sites.items() if s.running}
    cluster.add("w", bootstrap=cluster.sites["a"], settings=SETTINGS, extra=["--role", "witness"])
    cluster.wait_for("w ready and a voter everywhere", lambda s: all_ready(names | {"w"})(s)
                     and all("w" in voters(doc) for doc in s.values()), STARTUP_S)
    index = cluster.common_commit_index({"w", *names}, 60)
    assert len(cluster.history[index]) == 1
    doc = cluster.poll()["w"]
    assert doc["role"] == "witness" and doc["learner"]["step"] == 0
    assert cluster.conflicting_indices() == {}
