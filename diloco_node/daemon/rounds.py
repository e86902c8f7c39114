"""The fragment round on the real clock: contributions to and from the network, the lease holder's merges.

Both directions of a round live here:
- learner -> lease holder: a due fragment's delta is streamed to the current lease holder, one
  chunk encoded in the codec pool at a time (wire 2.1, wire/contribution_stream.py), or handed
  chunk by chunk to our own syncer when we hold the lease;
- lease holder: the `Syncer` admits or refuses a contribution before any byte of it is read
  (`sync/admission.py`: members only, the lease, one in flight per learner; the refusal's kind
  becomes the HTTP status here); each chunk is checked and decoded in the codec pool as it arrives
  and kept encoded; the whole contribution goes to the syncer, whose round decisions this module
  only turns into timers (wake-at) or a merge in the codec pool followed by a log proposal. The
  merge is pure; its result is adopted here, on the loop, once proposed, so a round dropped on the
  way (the lease lost, the state moved, the proposal refused) changes nothing in the syncer.
  Single-frame contributions of wire 2.0 senders are still decoded whole.
Lease changes reset or seed the syncer. What the outer gradients cost both ways (chunks encoded up,
commit payloads applied down) is counted in `OuterGradientBytes` for /status and /metrics.
Everything this driver needs is handed to its constructor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from concurrent.futures import Executor
from typing import Any

import numpy as np

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode
from bootstrap.entries import EntryKind, LogEntry
from diloco_node.clock import Clock, Timer
from diloco_node.config.manifest import RunManifest
from diloco_node.daemon import peers
from diloco_node.daemon.tasks import TaskSet
from diloco_node.learn.learner_thread import DueFragment
from diloco_node.ops.status import Counter, Histogram, OuterGradientStatus
from diloco_node.sync import admission
from diloco_node.sync.admission import Admitted, Member, Refused
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.sync.merge import Contribution
from diloco_node.sync.replica import Replica
from diloco_node.sync.syncer import CommitPlan, Syncer, TakenRound
from diloco_node.transport import PeerClient, TransportError
from diloco_node.transport.streaks import FailureStreaks
from wire import messages as wire
from wire.codecs import decode_named
from wire.contribution_stream import (
    ContributionAssembler,
    EncodedDelta,
    contribution_chunks,
    max_encoded_bytes,
    open_for,
)
from wire.errors import RemoteProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import STREAM_ID_BYTES

log = logging.getLogger("diloco_node.daemon")

# A contribution upload may take this long before it is dropped (the learner sends again at its
# next slot, with the steps of both) ...
CONTRIBUTION_DEADLINE_S = 60.0
# ... plus the time its largest possible size takes at this rate (4 Mbit/s, the slowest inter-site
# link planned for): a 7B model's int4 fragment at P = 24 (~160 MB) may take ~5 minutes there.
CONTRIBUTION_MIN_RATE_BYTES_PER_S = 512 * 1024
# The HTTP status of each admission refusal (sync/admission.py): 403 the sender may never
# contribute, 409 ask the lease holder instead, 429 one at a time, 400 a bad contribution.
REFUSAL_STATUS = {admission.NOT_MEMBER: 403, admission.NOT_LEARNER: 403, admission.LEFT: 403,
                  admission.NOT_LEASE_HOLDER: 409, admission.IN_FLIGHT: 429, admission.UNKNOWN_FRAGMENT: 400,
                  admission.MALFORMED: 400}


class OuterGradientBytes:
    """What the outer gradients cost this node, both ways, for /status and /metrics: the encoded
    bytes of every contribution chunk it produced (up, whether streamed to a peer or handed to its
    own syncer) and of every commit payload it applied (down), each with the parameters it carried.
    Written on the event loop only."""

    def __init__(self, manifest: RunManifest) -> None:
        self.codec_up = manifest.sync.codec_up
        self.codec_down = manifest.sync.codec_down
        self.error_feedback = manifest.sync.uses_error_feedback
        self.sent_bytes = self.sent_parameters = 0
        self.applied_bytes = self.applied_parameters = 0

    def chunk_produced(self, head: wire.ContributionOpen, chunk: wire.ContributionChunk) -> None:
        spec = head.tensors[chunk.tensor]
        self.sent_bytes += len(chunk.payload)
        self.sent_parameters += min(head.chunk_elements, spec.num_elements - chunk.offset)

    def commit_applied(self, payload_bytes: int, parameters: int) -> None:
        self.applied_bytes += payload_bytes
        self.applied_parameters += parameters

    def status(self) -> OuterGradientStatus:
        return OuterGradientStatus.of(codec_up=self.codec_up, codec_down=self.codec_down,
                                      error_feedback=self.error_feedback, sent_bytes=self.sent_bytes,
                                      sent_parameters=self.sent_parameters, applied_bytes=self.applied_bytes,
                                      applied_parameters=self.applied_parameters)


class RoundDriver:
    """The daemon's side of every fragment round; the decisions are the `Syncer`'s."""

    def __init__(self, *, node_id: str, manifest: RunManifest, plan: FragmentPlan, syncer: Syncer,
                 replica: Replica, coordination: CoordinatorNode, addresses: peers.AddressBook,
                 client: PeerClient, executor: Executor, clock: Clock, tasks: TaskSet,
                 dispatch: Callable[[list[coord.Action]], Any], replica_behind: Callable[..., str],
                 report_error: Callable[[str], None], contributions_sent: Counter,
                 merges_proposed: Counter, round_latency: Histogram | None = None,
                 transfer: Histogram | None = None, merge_window: tuple[Callable[[], None], Callable[[], None]]
                 | None = None) -> None:
        self.node_id = node_id
        self.manifest = manifest
        self.plan = plan
        self.syncer = syncer
        self.replica = replica
        self.coordination = coordination
        self.addresses = addresses
        self.client = client
        # Chunk sizes and per-chunk limits: the transport's, so what we send passes what peers check.
        self.limits: Limits = client.limits if client is not None else DEFAULT_LIMITS
        self.executor = executor
        self.clock = clock
        self.tasks = tasks
        self.dispatch = dispatch
        # Why the replica cannot be merged on ("" when it can): `replica_behind()` before a merge,
        # `replica_behind(proposal=(fragment, round))` before proposing what it merged. The rule is
        # the state keeper's (`StateKeeper.merge_blocker`): nothing here reads the replica's rounds.
        self.replica_behind = replica_behind
        # Called as a merge starts and once it has ended: the replica holds its applies in between,
        # so the merge's and an apply's fp32 copies of a fragment never coexist (memory_bound.py).
        self.merge_window = merge_window
        self.report_error = report_error
        self.contributions_sent = contributions_sent
        self.merges_proposed = merges_proposed
        self.round_latency = round_latency
        self.transfer = transfer
        # fragment -> when our oldest contribution to it not yet followed by a commit was sent.
        self._sent_at: dict[int, float] = {}
        self.merging = False
        self._wake_timers: dict[int, Timer] = {}
        self._held_lease = False
        self._shapes: dict[int, dict[str, tuple[int, ...]]] = {}
        self.outer_gradient_bytes = OuterGradientBytes(manifest)
        # One line when contributions to a lease holder start failing, one with the count when one
        # arrives again: a holder that is down is offered every fragment every few steps.
        self._undelivered = FailureStreaks(log, f"{node_id}: contributions to", "delivered again",
                                           clock=clock.monotonic)

    # ------------------------------------------------------------------ learner -> network

    def send_contribution(self, due: DueFragment) -> None:
        """On the loop: send a due fragment in the background (training never waits for it)."""
        self.tasks.spawn(self._send_contribution(due), name=f"contribution-{due.fragment}")

    async def _send_contribution(self, due: DueFragment) -> None:
        leader = self.coordination.election.leader_id
        if leader is None:
            return  # no lease holder: the next slot carries these steps too
        head = open_for({name: np.shape(values) for name, values in due.delta.items()}, fragment=due.fragment,
                        base_index=self.replica.applied_index, base_round=due.base_round, c_steps=due.c_steps,
                        c_tokens=due.c_tokens, codec=self.manifest.sync.codec_up, learner_id=self.node_id,
                        stream=os.urandom(STREAM_ID_BYTES), limits=self.limits)
        self.contributions_sent.inc()
        self._sent_at.setdefault(due.fragment, self.clock.monotonic())
        if leader == self.node_id:
            try:
                receiving = self.receive_contribution(head, transfer_s=0.0)
            except RemoteProtocolError as error:  # e.g. the lease ran out just now
                log.info("%s: own contribution for fragment %d not taken: %s", self.node_id, due.fragment, error)
                return
            try:
                async for chunk in self._encoded_chunks(head, due.delta):
                    await receiving.part(chunk)
            except BaseException as error:
                await receiving.abort(f"{type(error).__name__}: {error}")
                raise
            await receiving.finish()
            return
        url = self.addresses.url(leader)
        if url is None:
            return
        started = self.clock.monotonic()
        try:
            deadline_s = CONTRIBUTION_DEADLINE_S + max_encoded_bytes(head) / CONTRIBUTION_MIN_RATE_BYTES_PER_S
            await self.client.send_sequence(url, self._frames(head, due.delta), peer=leader, deadline_s=deadline_s)
        except TransportError as error:
            self._undelivered.failed(leader, f"fragment {due.fragment} not delivered: {error}")
            return
        self._undelivered.succeeded(leader)
        if self.transfer is not None:
            self.transfer.observe(self.clock.monotonic() - started, kind="contribution")

    async def _frames(self, head: wire.ContributionOpen, delta: Mapping[str, np.ndarray]) -> AsyncIterator[wire.Message]:
        yield head
        async for chunk in self._encoded_chunks(head, delta):
            yield chunk

    async def _encoded_chunks(self, head: wire.ContributionOpen,
                              delta: Mapping[str, np.ndarray]) -> AsyncIterator[wire.ContributionChunk]:
        """The chunks, each encoded in the codec pool when the consumer is ready for it."""
        loop = asyncio.get_running_loop()
        chunks: Iterator[wire.ContributionChunk] = contribution_chunks(head, delta)
        while (chunk := await loop.run_in_executor(self.executor, next, chunks, None)) is not None:
            self.outer_gradient_bytes.chunk_produced(head, chunk)
            yield chunk

    def commit_applied(self, entry: LogEntry) -> None:
        """An outer commit was applied to the replica: its payload (the codec_down outer gradient and
        the few bytes naming its contributors) counts as the downlink's cost of the fragment."""
        if entry.kind is EntryKind.OUTER_COMMIT and entry.fragment is not None:
            parameters = self.plan.fragments[entry.fragment].num_elements
            self.outer_gradient_bytes.commit_applied(entry.payload_size, parameters)

    def fragment_committed(self, p: int, contributors: tuple[str, ...]) -> None:
        """A commit of fragment p was applied: the round latency of our contribution, if it is in."""
        sent_at = self._sent_at.pop(p, None)  # not in it: that contribution was late or lost
        if sent_at is not None and self.node_id in contributors and self.round_latency is not None:
            self.round_latency.observe(self.clock.monotonic() - sent_at)

    # ------------------------------------------------------------------ the syncer (lease holder)

    def _member(self, learner: str) -> Member | None:
        record = self.coordination.membership.members.get(learner)
        if record is None:
            return None
        return Member(record.role.value, record.state is coord.MemberState.LEFT)

    def _admit(self, learner: str, p: int, *, local: bool = False) -> Admitted:
        """The syncer's admission of a contribution about to be received, or the refusal raised
        with its HTTP status (counted by kind for /status)."""
        not_holder = ""
        if not self.coordination.is_lease_holder(self.clock.monotonic()):
            leader = self.coordination.election.leader_id
            not_holder = f"{self.node_id} does not hold the lease (lease holder: {leader})"
        ticket = self.syncer.admit(learner, p, member=self._member(learner), not_holder=not_holder, local=local)
        if isinstance(ticket, Refused):
            raise RemoteProtocolError(ticket.reason, REFUSAL_STATUS[ticket.kind])
        return ticket

    def refuse_malformed(self, error: RemoteProtocolError, what: str) -> RemoteProtocolError:
        """A contribution refused for its bytes: counted with the admission refusals, said with `what`."""
        self.syncer.admission.refuse(admission.MALFORMED, f"{what}: {error}")
        return RemoteProtocolError(f"{what}: {error}", error.status_hint)

    def open_contribution(self, head: wire.ContributionOpen) -> ContributionReceiver:
        """A peer's streamed contribution opens (its sender already checked against the frame's signer):
        admitted or refused here, before any chunk is read."""
        return self.receive_contribution(head, transfer_s=None,
                                         ticket=self._admit(head.learner_id, head.fragment))

    def receive_contribution(self, head: wire.ContributionOpen, *, transfer_s: float | None,
                             ticket: Admitted | None = None) -> ContributionReceiver:
        """A contribution about to arrive chunk by chunk; without a `ticket` it is our own learner's,
        admitted here."""
        if ticket is None:
            ticket = self._admit(head.learner_id, head.fragment, local=True)
        try:
            assembler = ContributionAssembler(head, self._fragment_shapes(head.fragment), self.limits)
        except RemoteProtocolError as error:
            self.syncer.release(ticket)
            what = f"contribution from {head.learner_id} for fragment {head.fragment}"
            raise self.refuse_malformed(error, what) from None
        return ContributionReceiver(self, assembler, ticket, transfer_s)

    async def on_contribution(self, message: wire.FragmentContribution) -> None:
        """A wire 2.0 single-frame contribution (its sender already checked against the frame's
        signer), decoded whole: bounded by MAX_CONTRIBUTION_BYTES and the fragment's own shapes."""
        p = message.fragment
        ticket = self._admit(message.learner_id, p)
        try:
            loop = asyncio.get_running_loop()
            # Names and shapes are checked against the fragment before anything is decompressed, and the
            # decode is bounded by the fragment's own elements (a 33 KB message once declared 1 GiB).
            decode = functools.partial(decode_named, message.payload, expected=self._fragment_shapes(p))
            try:
                delta = await loop.run_in_executor(self.executor, decode)
            except (RemoteProtocolError, ValueError) as error:
                raise self.refuse_malformed(RemoteProtocolError(str(error), 400),
                                      f"contribution from {message.learner_id} for fragment {p}") from None
            self.accept(message.learner_id, p, message.base_round, delta, message.c_steps, message.c_tokens,
                        transfer_s=None, ticket=ticket)
        finally:
            self.syncer.release(ticket)

    def _fragment_shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        shapes = self._shapes.get(p)
        if shapes is None:
            # The state's own arrays (no copy of the fragment just to read its shapes).
            shapes = self._shapes[p] = {n: tuple(a.shape) for n, a in
                                        self.replica.state.fragment_params(p, copies=False).items()}
        return shapes

    def accept(self, learner: str, p: int, base_round: int, delta: Mapping[str, np.ndarray], c_steps: int,
               c_tokens: int, *, transfer_s: float | None, ticket: Admitted | None = None) -> None:
        """A whole, checked contribution: to the syncer (which caps its steps claim), then look at the round."""
        contribution = Contribution(learner, p, base_round, delta, c_steps, c_tokens)
        capped = self.syncer.add(contribution, self.clock.monotonic(), transfer_s=transfer_s, ticket=ticket)
        if capped:
            log.info("%s: %s", self.node_id, capped)
        self.evaluate(p)

    def _live_learners(self) -> list[str]:
        return [node_id for node_id, record in self.coordination.membership.members.items()
                if record.role is coord.MemberRole.LEARNER
                and record.state in (coord.MemberState.ALIVE, coord.MemberState.SUSPECT)]

    def evaluate(self, p: int) -> None:
        """Ask the syncer about fragment p's round; a wake-at answer becomes a timer, a merge a task."""
        now = self.clock.monotonic()
        if not self.coordination.is_lease_holder(now):
            return
        # One merge at a time, and only on a state that includes every entry of our own log, so the
        # round we propose is exactly the next one for this fragment.
        blocked = "a merge of another fragment is in flight" if self.merging else self.replica_behind()
        step = self.syncer.step_round(p, now, self._live_learners(), blocked=blocked)
        if step is None:
            return
        if step.wake_at is not None:
            timer = self._wake_timers.pop(p, None)
            if timer is not None:
                timer.cancel()
            self._wake_timers[p] = self.clock.call_at(step.wake_at, lambda: self.evaluate(p))
            return
        if step.taken is None:
            return
        self.merging = True
        self.tasks.spawn(self._merge_and_propose(step.taken), name=f"merge-{p}")

    async def _merge_and_propose(self, taken: TakenRound) -> None:
        p = taken.fragment
        if self.merge_window is not None:
            self.merge_window[0]()  # here, not at the spawn: a task cancelled unstarted never resumes them
        try:
            loop = asyncio.get_running_loop()
            # Pure: the pool's thread writes nothing of the syncer; the result is adopted below, on the loop.
            plan: CommitPlan = await loop.run_in_executor(
                self.executor, self.syncer.plan_commit, taken, self.replica.state, self.replica.digest_after,
                self.clock.wall())
            if not self.syncer.is_current(taken):
                log.info("%s syncer: fragment %d: the lease changed during the merge; round dropped", self.node_id, p)
                return
            if plan.merged is not None:
                # Every rejection and cap with its own reason (the round's summary names only who).
                for _, why in plan.merged.result.rejected:
                    self.report_error(f"fragment {p} round {plan.merged.round}: {why}")
                for learner, what in plan.merged.result.capped:
                    log.info("%s syncer: fragment %d: %s capped: %s", self.node_id, p, learner, what)
            if not plan.proposes:
                if plan.failed:
                    self.report_error(plan.reason)
                else:
                    log.info("%s syncer: %s", self.node_id, plan.reason)
                    self.syncer.adopt(taken, plan, self.clock.monotonic())  # the norm reference follows
                return
            log.info("%s syncer: %s", self.node_id, plan.reason)
            merged = plan.merged
            assert merged is not None
            # The replica may have moved while the pool merged: a commit applied, or one that could
            # not be applied (the round stays put then, but the fragment is stale: proposing the
            # same round again would waste the contributions on a round every peer already has).
            blocked = self.replica_behind(proposal=(p, merged.round))
            if blocked:
                self.report_error(f"fragment {p} round {merged.round} dropped: {blocked}")
                return
            entry, why, actions = self.coordination.propose(self.clock.monotonic(), EntryKind.OUTER_COMMIT, plan.payload,
                                                            fragment=p, round=merged.round, digest=plan.digest)
            if entry is None:
                self.report_error(f"fragment {p} merge not proposed: {why}")
                return
            self.syncer.adopt(taken, plan, self.clock.monotonic())
            self.merges_proposed.inc()
            self.dispatch(actions)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # never die unobserved in a task: drop the round, say why
            log.exception("fragment %d merge failed", p)
            self.report_error(f"fragment {p}: merge failed ({type(error).__name__}: {error}); round dropped")
        finally:
            self.merging = False
            if self.merge_window is not None:
                self.merge_window[1]()  # after the proposal: the state did not move under the merge

    # ------------------------------------------------------------------ lease changes

    def lease_check(self) -> None:
        """After every coordination step: a lost lease drops open rounds and timers (learners resend at
        their next slot); a gained one continues from the norm references the log committed."""
        holder = self.coordination.is_lease_holder(self.clock.monotonic())
        if self._held_lease and not holder:
            self.syncer.lease_lost()
            for timer in self._wake_timers.values():
                timer.cancel()
            self._wake_timers.clear()
        if holder and not self._held_lease:
            self.syncer.lease_gained(self.replica.norm_refs, self.clock.monotonic())
        self._held_lease = holder

    def quorum_reason(self) -> str:
        """The syncer's last decision per fragment (held ones say why), for /status."""
        return "; ".join(f"p{p}: {reason}" for p, reason in sorted(self.syncer.last_decision.items()))


class ContributionReceiver:
    """One streamed contribution arriving at the lease holder (a transport SequenceConsumer).

    Each chunk is checked and decoded in the codec pool as it arrives (one chunk's values in memory),
    and kept encoded; once the stream is complete the contribution, still encoded, goes to the syncer.
    """

    def __init__(self, driver: RoundDriver, assembler: ContributionAssembler, ticket: Admitted,
                 transfer_s: float | None) -> None:
        self._driver = driver
        self._assembler = assembler
        self._ticket = ticket
        self._transfer_s = transfer_s

    @property
    def max_remaining_bytes(self) -> int:
        return self._assembler.max_remaining_bytes

    @property
    def frames_left(self) -> int:
        return self._assembler.chunks_left

    def _what(self) -> str:
        head = self._assembler.head
        return f"contribution from {head.learner_id} for fragment {head.fragment}"

    async def part(self, message: wire.Message) -> None:
        if not isinstance(message, wire.ContributionChunk):
            raise self._driver.refuse_malformed(RemoteProtocolError(
                f"a contribution continues with ContributionChunk frames, got {type(message).__name__}", 400),
                self._what())
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._driver.executor, self._assembler.add, message)
        except RemoteProtocolError as error:
            raise self._driver.refuse_malformed(error, self._what()) from None

    async def finish(self) -> None:
        try:
            try:
                delta: EncodedDelta = self._assembler.finish()
            except RemoteProtocolError as error:
                raise self._driver.refuse_malformed(error, self._what()) from None
            head = self._assembler.head
            self._driver.accept(head.learner_id, head.fragment, head.base_round, delta, head.c_steps, head.c_tokens,
                                transfer_s=self._transfer_s, ticket=self._ticket)
        finally:
            self._driver.syncer.release(self._ticket)

    async def abort(self, reason: str) -> None:
        log.info("%s: %s dropped: %s", self._driver.node_id, self._what(), reason)
        self._driver.syncer.release(self._ticket)
