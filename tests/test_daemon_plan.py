"""The daemon's plan (daemon/plan.py): every timing, limit and pool size derived once from the
config, named; the parts built complete from it (daemon/services.py, daemon/parts.py); and the one
gate that answers 503 with the start-up phase until they exist (daemon/gate.py)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco_node.config.settings import ConfigError, NodeConfig, load_config
from diloco_node.config.site_devices import ClusterSpec
from diloco_node.daemon.gate import StartingGate
from diloco_node.daemon.peer_api import PeerApi
from diloco_node.daemon.plan import DaemonPlan, plan_from
from diloco_node.transport import PeerClient, PeerRefused, PeerServer
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.errors import RemoteProtocolError
from wire.messages import VoteReply, VoteRequest

from conftest import node_config, serve_peer_server

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("lease, leave, relay_hold, relay_timeout, twice_lease", [
    (3.0, 9.0, 0.75, 0.375, 6.0),  # the default lease
    (0.9, 3.0, 0.225, 0.1125, 1.8),  # a short lease: leaving still gets 3 s
    (8.0, 24.0, 1.0, 0.5, 16.0),  # a long lease: the relay hold and fetch are capped
])
def test_the_lease_sets_the_leave_the_relay_hold_and_the_waits(lease: float, leave: float, relay_hold: float,
                                                               relay_timeout: float, twice_lease: float) -> None:
    plan = plan_from(node_config(lease_timeout_s=lease, heartbeat_interval_s=lease / 3))
    assert plan.lease_s == lease and plan.heartbeat_interval_s == pytest.approx(lease / 3)
    assert plan.leave_timeout_s == pytest.approx(leave)
    assert (plan.relay_hold_s, plan.relay_timeout_s) == (pytest.approx(relay_hold), pytest.approx(relay_timeout))
    assert plan.evict_wait_s == plan.completion_linger_s == pytest.approx(twice_lease)


def test_the_other_keys_reach_the_plan() -> None:
    plan = plan_from(node_config(checkpoint_interval_s=45.0, relay_fanout=3, connect_timeout_s=1.5,
                                 read_timeout_s=7.0, source_address="127.0.0.9",
                                 cluster=ClusterSpec(heartbeat_timeout_s=40)))
    assert plan.checkpoint_interval_s == 45.0 and plan.relay_fanout == 3
    assert (plan.client_options.connect_timeout_s, plan.limits.read_timeout_s) == (1.5, 7.0)
    assert plan.client_options.source_address == "127.0.0.9"
    assert plan.cluster_stall_warn_s == 10.0  # a quarter of the cluster's heartbeat timeout
    # Each child of a relayed commit reads its spool file in the io pool: one more thread each.
    assert plan.io_threads == plan_from(node_config()).io_threads + 3


def test_the_learners_minimum_step_comes_from_the_environment_and_a_bad_one_is_named() -> None:
    assert plan_from(node_config()).min_step_interval_s == 0.0
    assert plan_from(node_config(), {"DILOCO_X_MIN_STEP_S": "0.2"}).min_step_interval_s == 0.2
    with pytest.raises(ConfigError, match="DILOCO_X_MIN_STEP_S = 'fast'"):
        plan_from(node_config(), {"DILOCO_X_MIN_STEP_S": "fast"})


CONFIGS = [node_config(lease_timeout_s=lease, heartbeat_interval_s=lease / beats, relay_fanout=fanout,
                       cluster=ClusterSpec(heartbeat_timeout_s=timeout))
           for lease, beats, fanout, timeout in itertools.product((0.9, 3.0, 10.0, 60.0), (3, 6), (0, 2, 8), (1, 30))]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"lease{c.lease_timeout_s}-hb{c.heartbeat_interval_s:.2f}"
                                                       f"-fanout{c.relay_fanout}-hbt{c.cluster.heartbeat_timeout_s}")
def test_every_figure_is_positive_and_they_come_in_the_order_the_protocol_needs(cfg: NodeConfig) -> None:
    plan = plan_from(cfg)
    for field in dataclasses.fields(DaemonPlan):
        value = getattr(plan, field.name)
        if isinstance(value, (int, float)) and field.name not in ("relay_fanout", "min_step_interval_s"):
            assert value > 0, field.name
    assert all(size >= 1 for size in plan.pools().values())
    assert plan.coordination_tick_s < plan.heartbeat_interval_s < plan.lease_s < plan.leave_timeout_s
    assert plan.relay_timeout_s <= plan.relay_hold_s < plan.lease_s  # a held append is fetched within a lease
    assert plan.lease_s < plan.evict_wait_s and plan.lease_s < plan.completion_linger_s
    assert plan.status_refresh_s < plan.member_refresh_s
    assert plan.cluster_check_s < plan.cluster_stall_warn_s < cfg.cluster.heartbeat_timeout_s
    assert plan.learner_abort_wait_s <= plan.learner_stop_wait_s


def test_every_figure_of_the_plan_says_what_it_is() -> None:
    source = (ROOT / "diloco_node" / "daemon" / "plan.py").read_text()
    for field in dataclasses.fields(DaemonPlan):
        assert re.search(rf"\n    {field.name}: [^\n]+\n    \"\"\"[^\n]+", source), f"{field.name} has no docstring line"


def test_docs_list_every_pool_with_its_size() -> None:
    """docs/DAEMON.md's table of pools names each pool the plan sizes, with the default size."""
    text = (ROOT / "docs" / "DAEMON.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` pool \| (\d+|[^|]*?) \|", text, flags=re.M))
    defaults = plan_from(node_config()).pools()
    assert set(rows) == set(defaults)
    assert rows["codec"] == str(defaults["codec"]) and rows["disk"] == str(defaults["disk"])
    assert rows["eval"] == str(defaults["eval"]) and rows["setup"] == str(defaults["setup"])
    assert rows["io"].startswith(str(defaults["io"]))  # "4 + relay_fanout"


# ------------------------------------------------------------------ the gate

RUN = "run-gate"
KEY = derive_frame_key(b"g" * 32)


async def test_the_peer_routes_answer_503_with_the_phase_until_the_gate_opens() -> None:
    gate: StartingGate[object] = StartingGate("b")
    server = PeerServer(AuthContext(RUN, "b", KEY), FrameVerifier(RUN, KEY, node_id="b"))
    PeerApi(gate).install(server)
    votes: list[VoteRequest] = []

    async def on_vote_request(message: VoteRequest, peer: object) -> VoteReply:
        votes.append(message)
        return VoteReply(epoch=message.epoch, voter="b", granted=True, reason="ok")

    runner, port = await serve_peer_server(server)
    request = VoteRequest(epoch=3, candidate="a", last_log_epoch=1, last_log_index=1)
    try:
        async with PeerClient(AuthContext(RUN, "a", KEY), FrameVerifier(RUN, KEY, node_id="a")) as client:
            gate.starting("building the site's model")
            with pytest.raises(PeerRefused) as refused:
                await client.send(f"http://127.0.0.1:{port}", request, peer="b")
            gate.open(SimpleNamespace(coordination=SimpleNamespace(on_vote_request=on_vote_request)))
            replies = await client.send(f"http://127.0.0.1:{port}", request, peer="b")
    finally:
        await runner.cleanup()
    assert refused.value.status == 503 and "b is still starting: building the site's model" in refused.value.reason
    assert votes == [request] and isinstance(replies[0], VoteReply) and replies[0].granted


def test_the_gate_names_its_phase_and_hands_out_the_parts_once_open() -> None:
    gate: StartingGate[str] = StartingGate("n1")
    assert gate.parts_if_open() is None and not gate.is_open
    with pytest.raises(RemoteProtocolError, match="n1 is still starting: starting") as starting:
        gate.parts()
    assert starting.value.status_hint == 503
    gate.starting("joining through http://p1:7070")
    with pytest.raises(RemoteProtocolError, match="still starting: joining through http://p1:7070"):
        gate.parts()
    gate.open("the parts")
    assert gate.parts() == gate.parts_if_open() == "the parts" and gate.is_open


# ------------------------------------------------------------------ parts built complete


async def test_the_node_and_its_parts_are_built_complete(tmp_path: Path) -> None:
    """No part is left None to be filled in later: the node holds its plan and gate from the start,
    the services and the site's parts are complete once constructed (only the learner to resume,
    absent without a checkpoint, and the coordination timer, from `start` on, may be None)."""
    from diloco_node.daemon.node import Node
    from diloco_node.daemon.parts import SiteParts
    from diloco_node.daemon.services import Services
    from diloco_node.daemon.site_model import build_site_model
    from diloco_node.testbed.launcher import write_secret

    secret = write_secret(tmp_path / "secret")
    effective = load_config(None, {}, {"node_id": "a", "listen": "127.0.0.1:7070", "data_dir": str(tmp_path / "d"),
                                       "secret_file": str(secret), "role": "witness"})
    daemon = Node(effective, environ={})
    assert [name for name, value in vars(daemon).items() if value is None] == []
    services = Services.open(effective, daemon.plan, daemon.clock, {}, daemon.gate)
    try:
        assert [name for name, value in vars(services).items() if value is None] == []
        mode, persistent, manifest = await services.identity.establish()
        site = build_site_model(manifest, learner=False, version_rings=services.version_rings)
        parts = SiteParts(services=services, plan=daemon.plan, site=site, persistent=persistent,
                          on_complete=lambda reason: None, on_evicted=lambda refusal: None)
        assert mode == "found"
        assert sorted(name for name, value in vars(parts).items() if value is None) == ["_ticker", "restored"]
        # The plan's figures are what the parts run on.
        assert parts.core.options.leave_timeout_s == daemon.plan.leave_timeout_s
        assert parts.coordination.tick_s == daemon.plan.coordination_tick_s
        assert services.pools.codec._max_workers == daemon.plan.codec_threads
    finally:
        for close in services.closers():
            close()
        services.pools.io.shutdown()
