"""What the outer gradients cost, on /status and /metrics (issue 24 item 5): the run's codecs, error
feedback, and the encoded bytes and parameters of contributions sent and commits applied."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from bootstrap import messages as coord
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.state_transfer import StateKeeper
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn.learner_thread import DueFragment
from diloco_node.ops.status import OuterGradientStatus, StatusBuilder, StatusDocument, render_metrics
from diloco_node.sync.fragments import is_embedding, plan_fragments
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.sync.syncer import Syncer
from diloco_node.transport import TransportError
from wire import messages as wire
from wire.codecs import decode_named, encode_named
from wire.limits import Limits

from conftest import InlineExecutor, NullCounter

MANIFEST = RunManifest(model=ModelSpec.of(seq_len=16),
                       inner=InnerOptimizer(batch_size=2, warmup_steps=2, total_steps=64),
                       sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=2, codec_up="topk2",
                                     codec_down="union8"))
SHAPES = {"embed/table": (16, 8), "layer0/w": (8, 8), "layer1/w": (8, 8), "head/w": (8, 4)}
LEARNER = SimpleNamespace(role=coord.MemberRole.LEARNER, state=coord.MemberState.ALIVE)


def _sample(lines: list[str], prefix: str) -> float:
    [line] = [line for line in lines if line.startswith(prefix + " ")]
    return float(line.rsplit(" ", 1)[1])


# --- the document and its metrics ----------------------------------------------------------------


def test_outer_gradient_section_round_trips_and_renders_by_direction_and_codec() -> None:
    builder = StatusBuilder("site-a", "run-7f3a", "learner", started_at=100.0)
    builder.set_outer_gradients(OuterGradientStatus.of(codec_up="topk2", codec_down="union8", error_feedback=True,
                                                       sent_bytes=1_000, sent_parameters=40_000,
                                                       applied_bytes=3_000, applied_parameters=8_000))
    doc = builder.document(now=101.0)
    raw = json.loads(doc.to_json())
    assert raw["outer_gradients"] == {"codec_up": "topk2", "codec_down": "union8", "error_feedback": True,
                                      "sent_bytes": 1_000, "sent_parameters": 40_000, "applied_bytes": 3_000,
                                      "applied_parameters": 8_000, "bits_per_parameter_up": 0.2,
                                      "bits_per_parameter_down": 3.0}
    assert StatusDocument.from_json(doc.to_json()) == doc
    lines = render_metrics(doc).splitlines()
    assert "# TYPE diloco_outer_gradient_bytes_total counter" in lines
    assert _sample(lines, 'diloco_outer_gradient_bytes_total{codec="topk2",direction="up"}') == 1_000
    assert _sample(lines, 'diloco_outer_gradient_bytes_total{codec="union8",direction="down"}') == 3_000
    assert _sample(lines, 'diloco_outer_gradient_parameters_total{codec="topk2",direction="up"}') == 40_000
    assert _sample(lines, 'diloco_outer_gradient_parameters_total{codec="union8",direction="down"}') == 8_000
    del raw["outer_gradients"]  # a node from before the section: unknown codecs, nothing counted
    older = StatusDocument.from_dict(raw).outer_gradients
    assert older == OuterGradientStatus() and older.bits_per_parameter_up is None


# --- the daemon counts them ----------------------------------------------------------------------


def _driver(leader: str, client: object = None) -> RoundDriver:
    initial = {n: np.zeros(shape, np.float32) for n, shape in SHAPES.items()}
    plan = plan_fragments(SHAPES, MANIFEST.sync.fragments, MANIFEST.sync.period, MANIFEST.sync.overlap)
    core = SimpleNamespace(is_lease_holder=lambda now: leader == "lead", election=SimpleNamespace(leader_id=leader),
                           membership=SimpleNamespace(members={"lead": LEARNER, "b": LEARNER}))
    addresses = AddressBook()
    addresses.learn("b", "http://b.example:7070")
    driver = RoundDriver(node_id="lead", manifest=MANIFEST, plan=plan,
                         syncer=Syncer(MANIFEST, plan, [n for n in SHAPES if is_embedding(n)]),
                         replica=Replica(plan, initial, MANIFEST.outer), coordination=core, addresses=addresses,
                         client=client, executor=InlineExecutor(), clock=FakeClock(1000.0), tasks=TaskSet(),
                         dispatch=lambda actions: None, replica_behind=lambda proposal=None: "held in tests",
                         report_error=pytest.fail, contributions_sent=NullCounter(), merges_proposed=NullCounter())
    driver.limits = Limits(max_chunk_elements=16)  # several chunks per tensor
    driver.lease_check()
    return driver


def _due(driver: RoundDriver, p: int = 0) -> DueFragment:
    rng = np.random.default_rng(p)
    delta = {n: rng.standard_normal(SHAPES[n]).astype(np.float32) for n in driver.plan.fragments[p].names}
    return DueFragment(fragment=p, base_round=0, c_steps=8, c_tokens=8 * 32, delta=delta, step=8)


class _Client:
    """A transport stand-in that takes a streamed contribution whole and keeps its chunks."""

    limits = Limits(max_chunk_elements=16)

    def __init__(self) -> None:
        self.chunks: list[wire.ContributionChunk] = []

    async def send_sequence(self, url, frames, **_):
        self.chunks += [frame async for frame in frames if isinstance(frame, wire.ContributionChunk)]


async def test_contribution_bytes_count_both_to_a_peer_and_to_our_own_syncer() -> None:
    client = _Client()
    remote = _driver("b", client)
    await remote._send_contribution(_due(remote))  # what send_contribution runs as a task
    params = remote.plan.fragments[0].num_elements
    counted = remote.outer_gradient_bytes.status()
    assert len(client.chunks) > len(remote.plan.fragments[0].names)
    assert counted.sent_bytes == sum(len(c.payload) for c in client.chunks) > 0
    assert counted.sent_parameters == params
    assert counted.codec_up == "topk2" and counted.error_feedback
    # 16-value chunks: each frame's header outweighs its values, which is what the figure shows
    assert counted.bits_per_parameter_up == round(8 * counted.sent_bytes / params, 4)

    own = _driver("lead")
    await own._send_contribution(_due(own))
    assert set(own.syncer.rounds[0].pending) == {"lead"}  # handed to our own syncer, chunk by chunk
    assert own.outer_gradient_bytes.status().sent_bytes == counted.sent_bytes  # same delta, same codec
    assert own.outer_gradient_bytes.status().sent_parameters == params


class _FlakyClient(_Client):
    """Refuses the first `failures` contributions as a lease holder that is down does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def send_sequence(self, url, frames, **kwargs):
        if self.failures:
            self.failures -= 1
            raise TransportError(f"{url}/v1/contribution-open", "ServerDisconnectedError: Server disconnected")
        await super().send_sequence(url, frames, **kwargs)


async def test_contributions_a_down_holder_refuses_are_logged_once_per_streak_with_a_count(caplog) -> None:
    remote = _driver("b", _FlakyClient(failures=5))
    with caplog.at_level("INFO", logger="diloco_node.daemon"):
        for i in range(6):
            await remote._send_contribution(_due(remote, i % 2))
    lines = [r.getMessage() for r in caplog.records if "contributions to b" in r.getMessage()]
    assert len(lines) == 2, lines  # the first failure, then the end of the streak: not one line per try
    assert "fragment 0 not delivered" in lines[0] and "Server disconnected" in lines[0]
    assert "delivered again after 5 failure(s)" in lines[1] and "(last: fragment 0 not delivered" in lines[1]
    assert remote._undelivered.failing("b") == 0


class _History:
    def applied(self, entry, replica, consistent_from, epoch, current=True) -> None:
        pass


class _Learner:
    def offer_fragment(self, p, round_, params, contributors=()) -> None:
        pass


def test_an_applied_union8_commit_counts_its_payload_once_and_a_skipped_one_not_at_all() -> None:
    driver = _driver("lead")
    replica = driver.replica
    keeper = StateKeeper(node_id="lead", replica=replica, client=None, addresses=None, executor=None, clock=None,
                         tasks=None, history=_History(), leader_id=lambda: "lead", epoch=lambda: 1,
                         report_error=pytest.fail, commits_applied=NullCounter(), learner=_Learner(),
                         on_commit_applied=driver.commit_applied)
    p = 1
    gradient = {n: np.zeros(replica.state.fragment_params(p)[n].shape, np.float32)
                for n in replica.plan.fragments[p].names}
    for values in gradient.values():
        values.reshape(-1)[::7] = 0.01  # sparse: the union travels as such
    encoded = encode_named(gradient, "union8")
    payload = CommitPayload(encoded, ("a",), (1.0,)).encode()
    entry = LogEntry(1, 1, EntryKind.OUTER_COMMIT, payload, fragment=p, round=1,
                     digest=replica.digest_after(p, decode_named(encoded)))
    keeper.apply(entry)
    keeper.apply(LogEntry(1, 2, EntryKind.OUTER_COMMIT, payload, fragment=p, round=1, digest=entry.digest))
    counted = driver.outer_gradient_bytes.status()
    assert replica.state.round(p) == 1  # the second, a round already in the state, was skipped
    assert counted.codec_down == "union8"
    assert counted.applied_bytes == len(payload)
    assert counted.applied_parameters == replica.plan.fragments[p].num_elements
    assert counted.sent_bytes == 0
    lines = render_metrics(StatusDocument("lead", "r", "learner", True, 1, "lead", 1, "",
                                          outer_gradients=counted)).splitlines()
    assert _sample(lines, 'diloco_outer_gradient_bytes_total{codec="union8",direction="down"}') == len(payload)
