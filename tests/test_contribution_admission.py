"""Only learners contribute, claims are real, and a contribution decodes no more than its fragment holds
(issue 13): the lease holder's `RoundDriver` with a stand-in coordination core and a fake clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import tracemalloc
from concurrent.futures import Executor, Future
from types import SimpleNamespace

import numpy as np
import pytest
import zstandard

from bootstrap import messages as coord
from diloco_node.clock import FakeClock
from diloco_node.config.manifest import InnerOptimizer, ModelSpec, RunManifest, SyncSpec
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.tasks import TaskSet
from diloco_node.sync.fragments import is_embedding, plan_fragments
from diloco_node.sync.merge import token_weight
from diloco_node.sync.replica import Replica
from diloco_node.sync.syncer import Syncer, contribution_caps
from wire import messages as wire
from wire.codecs import decode_named, encode_named
from wire.codecs.layout import DIM, FIXED_HEADER, NAME_LEN, NDIM
from wire.errors import RemoteProtocolError
from wire.limits import Limits

from conftest import InlineExecutor, NullCounter

MANIFEST = RunManifest(model=ModelSpec.of(seq_len=16),
                       inner=InnerOptimizer(batch_size=2, warmup_steps=2, total_steps=64),
                       sync=SyncSpec(fragments=2, period=8, overlap=2, min_quorum=2, grace_gamma=0.5,
                                     grace_cap_s=5.0))
SHAPES = {"embed/table": (16, 8), "layer0/w": (8, 8), "layer1/w": (8, 8), "head/w": (8, 4)}
START = 1000.0


def _driver(members: dict[str, tuple[coord.MemberRole, coord.MemberState]], executor: Executor | None = None,
            step_s: float | None = None, manifest: RunManifest = MANIFEST) -> tuple[RoundDriver, Syncer, FakeClock]:
    initial = {n: np.zeros(shape, np.float32) for n, shape in SHAPES.items()}
    plan = plan_fragments(SHAPES, manifest.sync.fragments, manifest.sync.period, manifest.sync.overlap)
    syncer = Syncer(manifest, plan, [n for n in SHAPES if is_embedding(n)])
    if step_s is not None:
        syncer.prime(step_s=step_s)
    clock = FakeClock(START)
    records = {name: SimpleNamespace(role=role, state=state) for name, (role, state) in members.items()}
    core = SimpleNamespace(is_lease_holder=lambda now: True, election=SimpleNamespace(leader_id="lead"),
                           membership=SimpleNamespace(members=records))
    driver = RoundDriver(node_id="lead", manifest=manifest, plan=plan, syncer=syncer,
                         replica=Replica(plan, initial, manifest.outer), coordination=core,
                         addresses=AddressBook(), client=None, executor=executor or InlineExecutor(), clock=clock,
                         tasks=TaskSet(), dispatch=lambda actions: None, replica_behind=lambda proposal=None: "held in tests",
                         report_error=pytest.fail, contributions_sent=NullCounter(), merges_proposed=NullCounter())
    driver.lease_check()
    return driver, syncer, clock


LEARNER = (coord.MemberRole.LEARNER, coord.MemberState.ALIVE)


def _message(driver: RoundDriver, learner: str, p: int = 0, c_steps: int = 8, c_tokens: int = 8 * 32,
             payload: bytes | None = None) -> wire.FragmentContribution:
    if payload is None:
        names = driver.plan.fragments[p].names
        payload = encode_named({n: np.full(SHAPES[n], 0.01, np.float32) for n in names}, MANIFEST.sync.codec_up)
    return wire.FragmentContribution(p, 0, 0, c_steps, c_tokens, MANIFEST.sync.codec_up, learner, payload)


@pytest.mark.parametrize(("members", "reason"), [
    ({}, "contribution refused: stranger is not a member of this run"),
    ({"stranger": (coord.MemberRole.WITNESS, coord.MemberState.ALIVE)},
     "contribution refused: stranger is a witness, not a learner"),
    ({"stranger": (coord.MemberRole.LEARNER, coord.MemberState.LEFT)}, "contribution refused: stranger has left the run"),
])
async def test_only_learner_members_contribute_and_others_never_count_toward_quorum(members, reason) -> None:
    driver, syncer, _ = _driver({"a": LEARNER, **members})
    with pytest.raises(RemoteProtocolError) as refused:
        await driver.on_contribution(_message(driver, "stranger", c_tokens=2**40))
    assert refused.value.status_hint == 403 and str(refused.value) == reason
    assert syncer.rounds == {}  # nothing opened, nothing counted toward the quorum
    assert syncer.admission.counts.last_reason == reason  # counted by kind for /status
    assert sum(syncer.admission.counts.refused.values()) == 1
    await driver.on_contribution(_message(driver, "a"))
    assert set(syncer.rounds[0].pending) == {"a"}


def test_an_inflated_token_claim_is_capped_to_what_the_manifest_allows() -> None:
    caps = contribution_caps(MANIFEST)
    assert caps.max_tokens_per_step == MANIFEST.inner.batch_size * MANIFEST.model.seq_len == 32
    honest = token_weight(8 * 32, 8, caps)
    assert token_weight(2**40, 8, caps) == honest  # 2^40 tokens buys nothing past batch x context


async def test_a_steps_claim_is_capped_by_the_period_and_the_time_since_the_previous_contribution() -> None:
    driver, syncer, clock = _driver({"a": LEARNER}, step_s=1.0)
    await driver.on_contribution(_message(driver, "a", c_steps=8))
    assert syncer.rounds[0].pending["a"][0].c_steps == 8  # within H + 2 x elapsed / step
    clock.advance(8.0)
    await driver.on_contribution(_message(driver, "a", c_steps=1_000_000, c_tokens=1_000_000 * 32))
    claimed = syncer.rounds[0].pending["a"][0]
    period = MANIFEST.sync.period
    assert claimed.c_steps == period + math.ceil(2.0 * 8.0 / 1.0) == 24
    assert claimed.c_tokens == 24 * 32
    assert syncer.admission.counts.capped == 1
    assert syncer.admission.counts.last_reason == ("a claims 1000000 steps for fragment 0; 24 are possible since "
                                                   "its previous contribution: capped")


async def test_a_contribution_that_is_not_the_fragment_is_refused_before_decompression() -> None:
    driver, syncer, _ = _driver({"a": LEARNER})
    names = driver.plan.fragments[0].names
    wrong_shape = encode_named({n: np.zeros((SHAPES[n][0] + 1, SHAPES[n][1]), np.float32) for n in names}, "fp32")
    with pytest.raises(RemoteProtocolError, match="has shape .* expected") as refused:
        await driver.on_contribution(_message(driver, "a", payload=wrong_shape))
    assert refused.value.status_hint == 400
    other_fragment = encode_named({n: np.zeros(SHAPES[n], np.float32) for n in driver.plan.fragments[1].names}, "fp32")
    with pytest.raises(RemoteProtocolError, match="expected"):
        await driver.on_contribution(_message(driver, "a", payload=other_fragment))
    assert syncer.rounds == {}
    assert syncer.admission.counts.refused["malformed"] == 2 and syncer.admission.in_flight() == {}
    assert syncer.admission.counts.last_reason.startswith("contribution from a for fragment 0: ")
    with pytest.raises(RemoteProtocolError, match="fragment 7 does not exist in this run") as refused:
        await driver.on_contribution(dataclasses.replace(_message(driver, "a"), fragment=7))
    assert refused.value.status_hint == 400 and syncer.admission.counts.refused["unknown_fragment"] == 1


async def test_a_node_without_the_lease_refuses_with_409_and_counts_it() -> None:
    driver, syncer, _ = _driver({"a": LEARNER})
    driver.coordination.is_lease_holder = lambda now: False
    with pytest.raises(RemoteProtocolError) as refused:
        await driver.on_contribution(_message(driver, "a"))
    assert refused.value.status_hint == 409 and str(refused.value) == "lead does not hold the lease (lease holder: lead)"
    assert syncer.admission.counts.refused["not_lease_holder"] == 1 and syncer.rounds == {}


def _bomb(name: str, elements: int) -> bytes:
    """A fp32 tensor message of `elements` zeros in one zstd frame: tiny on the wire."""
    header = FIXED_HEADER.pack(b"DLTC", 1, 1, 1, 0, 0, 1)  # version 1, fp32, zstd flag, no block, one tensor
    raw_name = name.encode()
    header += NAME_LEN.pack(len(raw_name)) + raw_name + NDIM.pack(1) + DIM.pack(elements)
    compressor = zstandard.ZstdCompressor(level=19).compressobj(size=elements * 4)
    zeros = bytes(1 << 20)
    body = b"".join(compressor.compress(zeros) for _ in range(elements * 4 // len(zeros))) + compressor.flush()
    return header + body


def test_a_decompression_bomb_allocates_nothing_once_the_fragment_is_known() -> None:
    bomb = _bomb("layer0/w", 1 << 26)  # 256 MiB of fp32 from ~8 KB (the 1 GiB one is in benchmarks/)
    assert len(bomb) < 64 * 1024
    expected = {"layer0/w": SHAPES["layer0/w"]}
    tracemalloc.start()
    try:
        with pytest.raises(RemoteProtocolError, match=r"has shape \(67108864,\), expected \(8, 8\)"):
            decode_named(bomb, expected=expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024  # nothing near the declared 256 MiB was allocated


async def test_one_decode_at_a_time_per_learner() -> None:
    class Parked(Executor):
        """Decodes wait until released: a second contribution arrives while the first decodes."""

        def __init__(self) -> None:
            self.parked: list[tuple[Future, object]] = []

        def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
            future: Future = Future()
            self.parked.append((future, lambda: fn(*args, **kwargs)))
            return future

    executor = Parked()
    driver, syncer, _ = _driver({"a": LEARNER, "b": LEARNER}, executor=executor)
    first = asyncio.create_task(driver.on_contribution(_message(driver, "a")))
    while not executor.parked:
        await asyncio.sleep(0)
    with pytest.raises(RemoteProtocolError, match="a contribution from a is already being received") as refused:
        await driver.on_contribution(_message(driver, "a", p=1))
    assert refused.value.status_hint == 429 and syncer.admission.counts.refused["in_flight"] == 1
    other = asyncio.create_task(driver.on_contribution(_message(driver, "b")))  # another learner is not held
    while len(executor.parked) < 2:
        await asyncio.sleep(0)
    for future, work in executor.parked:
        future.set_result(work())
    await asyncio.gather(first, other)
    assert set(syncer.rounds[0].pending) == {"a", "b"}


def test_round_latency_is_observed_when_a_commit_includes_our_contribution() -> None:
    from diloco_node.ops.status import ROUND_SECONDS_BUCKETS, MetricsRegistry

    driver, _, clock = _driver({"a": LEARNER})
    latency = MetricsRegistry(process_metrics=False).histogram("diloco_round_latency_seconds", "Latency.",
                                                               ROUND_SECONDS_BUCKETS)
    driver.round_latency = latency
    driver._sent_at[0] = clock.monotonic()  # as _send_contribution records a contribution it sends
    clock.advance(12.0)
    driver.fragment_committed(0, ("a",))  # merged without ours (it was late): nothing observed
    assert latency.value() == 0.0
    driver._sent_at[1] = clock.monotonic()
    clock.advance(7.0)
    driver.fragment_committed(1, ("a", "lead"))
    assert latency.value() == 1.0
    assert driver.round_latency._registry.registry.get_sample_value("diloco_round_latency_seconds_sum") == 7.0


# ------------------------------------------------------------------ streamed contributions (wire 2.1)


def _stream(driver: RoundDriver, learner: str, p: int = 0, c_steps: int = 8, value: float = 0.01):
    from wire.contribution_stream import contribution_chunks, open_for

    names = driver.plan.fragments[p].names
    delta = {n: np.full(SHAPES[n], value, np.float32) for n in names}
    head = open_for({n: SHAPES[n] for n in names}, fragment=p, base_index=0, base_round=0, c_steps=c_steps,
                    c_tokens=c_steps * 32, codec=MANIFEST.sync.codec_up, learner_id=learner, stream=bytes(16),
                    limits=Limits(max_chunk_elements=16))  # several chunks per tensor
    return head, list(contribution_chunks(head, delta))


async def _deliver(driver: RoundDriver, head, chunks) -> None:
    receiving = driver.open_contribution(head)
    try:
        for chunk in chunks:
            await receiving.part(chunk)
    except BaseException as error:
        await receiving.abort(str(error))
        raise
    await receiving.finish()


async def test_a_streamed_contribution_is_admitted_like_one_frame_and_kept_encoded() -> None:
    from wire.contribution_stream import EncodedDelta

    driver, syncer, _ = _driver({"a": LEARNER, "w": (coord.MemberRole.WITNESS, coord.MemberState.ALIVE)})
    with pytest.raises(RemoteProtocolError) as refused:
        driver.open_contribution(_stream(driver, "w")[0])
    assert refused.value.status_hint == 403 and str(refused.value) == "contribution refused: w is a witness, not a learner"
    head, chunks = _stream(driver, "a")
    assert len(chunks) > len(head.tensors)
    await _deliver(driver, head, chunks)
    contribution = syncer.rounds[0].pending["a"][0]
    assert isinstance(contribution.delta, EncodedDelta)  # the syncer holds the encoded bytes, not fp32
    for name in driver.plan.fragments[0].names:
        np.testing.assert_allclose(contribution.delta[name], 0.01, rtol=0.08)
    assert syncer.admission.in_flight() == {}


async def test_a_bad_chunk_refuses_the_stream_and_frees_the_learners_slot() -> None:
    driver, syncer, _ = _driver({"a": LEARNER})
    head, chunks = _stream(driver, "a")
    receiving = driver.open_contribution(head)
    with pytest.raises(RemoteProtocolError, match="already being received") as refused:
        driver.open_contribution(_stream(driver, "a", p=1)[0])  # its first is still arriving
    assert refused.value.status_hint == 429
    await receiving.part(chunks[0])
    with pytest.raises(RemoteProtocolError, match="expected tensor 0 .* at offset 16, got tensor 0 at offset 0"):
        await receiving.part(chunks[0])
    await receiving.abort("the transport refused the stream")
    assert syncer.admission.in_flight() == {} and syncer.rounds == {}
    with pytest.raises(RemoteProtocolError, match="1 chunk\\(s\\) missing"):
        await _deliver(driver, head, chunks[:-1])
    assert syncer.admission.in_flight() == {} and syncer.rounds == {}
    other = _stream(driver, "a", p=1)[0]
    wrong = dataclasses.replace(other, tensors=other.tensors[1:])
    with pytest.raises(RemoteProtocolError, match="for fragment 1: .*missing") as refused:
        driver.open_contribution(wrong)
    assert refused.value.status_hint == 400 and syncer.admission.in_flight() == {}
    await _deliver(driver, head, chunks)
    assert set(syncer.rounds[0].pending) == {"a"}
