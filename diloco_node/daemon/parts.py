"""The parts that need the site's model, built in dependency order and connected in one place.

`SiteParts(...)` restores the newest checkpoint, then builds the coordination core, the state
keeper, the evaluator, the coordination I/O, the round driver and the status feed, each with its
collaborators, timings (the plan's) and hooks in its constructor: once built, every part is
complete. Where two parts call each other (the keeper tells the round driver of a commit, the round
driver dispatches through the coordination I/O, which applies through the keeper) the hook is a
method of this class that reaches the other part; none runs before the node opens its gate and
starts the coordination ticker. What the node itself must hear of is passed in as `on_complete`
(the run reached [run.stop]) and `on_evicted` (the run evicted this site).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable
from typing import Any

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, NodeOptions, PersistentState
from bootstrap.election import LeaseTiming
from bootstrap.entries import LogEntry
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.evaluation import GlobalEvaluator
from diloco_node.daemon.join import JoinRefused
from diloco_node.daemon.persistence import Checkpointer, learner_to_resume
from diloco_node.daemon.plan import DaemonPlan
from diloco_node.daemon.readiness import ReadinessFacts, storage_failures
from diloco_node.daemon.relay_spool import SPOOL_SUBDIR
from diloco_node.daemon.relays import run_payload_bound
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.services import Services
from diloco_node.daemon.site_model import SiteModel
from diloco_node.daemon.state_transfer import StateKeeper
from diloco_node.daemon.status_feed import StatusFeed
from diloco_node.daemon.training import Learner
from diloco_node.learn.learner_thread import DueFragment
from diloco_node.ops.storage_health import STORAGE
from wire.limits import MAX_RELAYED_PAYLOAD_BYTES

log = logging.getLogger("diloco_node.daemon")


class SiteParts:
    def __init__(self, *, services: Services, plan: DaemonPlan, site: SiteModel, persistent: PersistentState,
                 on_complete: Callable[[str], None], on_evicted: Callable[[str], None]) -> None:
        cfg, clock = services.cfg, services.clock
        self.node_id = node_id = services.node_id
        self.services = services
        self.plan = plan
        self.site = site
        self.manifest = site.manifest
        self.loop = asyncio.get_running_loop()  # learner hand-offs are posted to it
        self.on_complete = on_complete
        self.on_evicted = on_evicted
        self.completed = ""  # why the run is complete ([run.stop] reached), "" while it goes on
        self.evicted = ""  # the refusal once an applied EVICTION entry names this site
        replica = self.replica = site.replica
        self.checkpointer = Checkpointer(node_id=node_id, checkpoints=services.checkpoints, store=services.store,
                                         replica=replica, disk_executor=services.pools.disk,
                                         retain_entries=cfg.log_retain_entries, report_error=services.report_error)
        self.restart, restored = self.checkpointer.restore(persistent, services.identity.has_peers())
        self.restored = learner_to_resume(restored, cfg.learner, node_id)
        refused = replica.evictions.record(node_id)
        if refused is not None:
            raise JoinRefused(refused.refusal(), permanent=True)  # every member refuses us anyway
        core = self.core = CoordinatorNode(
            node_id, persistent, now=clock.monotonic(), rng=random.Random(os.urandom(16)),
            applied_index=replica.applied_index, role=services.role, address=cfg.advertise,
            options=NodeOptions(lease=LeaseTiming(lease_s=plan.lease_s, heartbeat_interval_s=plan.heartbeat_interval_s),
                                leave_timeout_s=plan.leave_timeout_s),
            is_evicted=replica.evictions.__contains__)
        addresses = services.identity.addresses
        self.keeper = keeper = StateKeeper(
            node_id=node_id, replica=replica, client=services.client, addresses=addresses,
            executor=services.pools.codec, clock=clock, tasks=services.tasks, history=services.history,
            leader_id=lambda: core.election.leader_id, epoch=lambda: core.epoch, report_error=services.report_error,
            commits_applied=services.series.commits_applied, learner=services.slot, after_apply=self.after_apply,
            on_fragment_commit=self._fragment_committed, on_commit_applied=self._commit_applied,
            bootstrap_url=services.identity.bootstrap_url)
        if self.restart.install_floor:
            keeper.plan_install(self.restart.install_floor)
        corpus = site.corpus
        self.evaluator = GlobalEvaluator.for_site(
            node_id=node_id, manifest=site.manifest, eval_tokens=corpus.eval if corpus else None,
            every_commits=cfg.eval_interval_commits, batches=cfg.eval_batches, replica=replica,
            consistent=keeper.state_consistent, tasks=services.tasks, executor=services.pools.eval,
            status=services.status, series=services.series, history=services.history,
            also=services.reports.track_evaluation, eval_sets=corpus.eval_sets if corpus else ())
        services.store.sync(persistent)
        self.coordination = coordination = CoordinationIO(
            core=core, persistent=persistent, store=services.store, history=services.history, client=services.client,
            addresses=addresses, clock=clock, tasks=services.tasks, on_apply=keeper.apply,
            on_restore_snapshot=keeper.on_restore_snapshot, after_step=self._after_coordination_step,
            remember_member=services.identity.remember, report_error=services.report_error,
            relay_fanout=plan.relay_fanout, relay_hold_s=plan.relay_hold_s, relay_timeout_s=plan.relay_timeout_s,
            relay_max_payload_bytes=(run_payload_bound(site.plan, site.shapes, site.manifest.sync.codec_down)
                                     if site.shapes is not None else MAX_RELAYED_PAYLOAD_BYTES),
            relay_spool_dir=services.store.directory / SPOOL_SUBDIR,
            tick_s=plan.coordination_tick_s, deadline_s=plan.coordination_deadline_s)
        series = services.series
        self.rounds = RoundDriver(
            node_id=node_id, manifest=site.manifest, plan=site.plan, syncer=site.syncer, replica=replica,
            coordination=core, addresses=addresses, client=services.client, executor=services.pools.codec,
            clock=clock, tasks=services.tasks, dispatch=coordination.dispatch,
            replica_behind=lambda proposal=None: keeper.merge_blocker(core.log.applied_index, core.log.last_index,
                                                                      proposal),
            report_error=services.report_error, contributions_sent=series.contributions_sent,
            merges_proposed=series.merges_proposed, round_latency=series.round_latency_seconds,
            transfer=series.transfer_seconds, merge_window=(keeper.defer_applies, keeper.resume_applies))
        self.feed = StatusFeed(status=services.status, coordination=coordination, keeper=keeper, rounds=self.rounds,
                               store=services.store, client=services.client, server=services.server,
                               loop_lag=services.loop_lag)
        services.history.start(core, replica.applied_index, site.manifest.sync)
        self._ticker: asyncio.Task[Any] | None = None  # the coordination timer, from `start` to `stop`

    def start(self) -> None:
        """Start the coordination timer: from now on the core votes, replicates and applies."""
        self._ticker = self.services.tasks.spawn(self.coordination.ticker(), name="coordination-ticker")

    # ------------------------------------------------------------------ hooks between the parts

    def _fragment_committed(self, p: int, contributors: tuple[str, ...]) -> None:
        self.rounds.fragment_committed(p, contributors)

    def _commit_applied(self, entry: LogEntry) -> None:
        self.rounds.commit_applied(entry)

    def _after_coordination_step(self) -> None:
        self.rounds.lease_check()
        if not self.evicted:
            record = self.replica.evictions.record(self.node_id)
            if record is not None:
                self.evicted = record.refusal()
                self.on_evicted(self.evicted)

    def after_apply(self, applied_index: int) -> None:
        """After every applied commit (and once at start: a restart of a complete run ends at once)."""
        self.evaluator.after_apply(applied_index)
        services = self.services
        if services.tracking.enabled:
            sent = services.status.byte_counts()
            services.tracking.log(services.slot.tracked_step(), {
                "sync/commit_index": applied_index, "sync/bytes_sent": sent.sent, "sync/bytes_received": sent.received})
        completion = self.replica.completion()
        if completion and not self.completed:
            self.completed = completion
            at = self.replica.completed_at_index or applied_index  # a downloaded state: as of its index
            log.info("%s: the run is complete at commit %d: %s", self.node_id, at, completion)
            self.on_complete(completion)

    def contribution_from_learner(self, due: DueFragment) -> None:
        """Called in the learner thread: hand over to the loop (never block training)."""
        self.loop.call_soon_threadsafe(self.rounds.send_contribution, due)

    # ------------------------------------------------------------------ what the node and the routes ask

    def eviction_refusal(self, node_id: str | None, fingerprint: str | None) -> str | None:
        return self.replica.evictions.refusal(node_id, fingerprint)

    async def evict(self, node_id: str, reason: str) -> tuple[int, dict[str, Any]]:
        """`POST /evict` on the operator listener (`diloco-node evict`): see CoordinationIO.evict."""
        fingerprints = sorted(self.services.server.seen_certificates.get(node_id, ()))
        return await self.coordination.evict(node_id, reason, fingerprints, self.replica.evictions.record,
                                             wait_s=self.plan.evict_wait_s)

    def start_training(self, learner: Learner, *, fresh: bool) -> None:
        """Bring the compiled learner up to the replica's current global state and start stepping.

        Training starts as soon as the global state is in place (founded, restored or downloaded):
        it does not wait for the replica to replay the log to the newest commit (a learner on a
        slightly older fragment is rebased by the syncer anyway); `/readyz` still waits for that.
        """
        state = self.replica.state
        if fresh:
            # The state's own read-only arrays, as offers carry them (a step replaces them, never
            # changes them): a copy here was 4 bytes a parameter and, at 1B, a 3.9 s stall of the
            # event loop at the moment training starts. A learner that keeps weights copies them.
            learner.adopt_global(state.all_params(copies=False), list(state.rounds()))
        self.services.slot.fill(learner)
        if not fresh:
            # A restored learner keeps its own weights; the fragments committed since arrive as offers,
            # and only from a current state (a restart that installs or repairs it offers them after).
            self.keeper.rebase_learner()
        learner.start()
        learner.begin_training()

    async def periodic_checkpoint(self) -> None:
        """A periodic checkpoint waits while the global state is not one consistent state (a download
        or repair in progress), since the log is compacted below checkpoints."""
        if not self.keeper.state_consistent():
            log.info("%s: checkpoint deferred: the global state is being downloaded or repaired", self.node_id)
            return
        coordination = self.coordination
        await self.checkpointer.checkpoint_and_compact(self.services.slot.learner, coordination.core,
                                                       coordination.persistent, stopping=lambda: coordination.frozen)

    def readiness_facts(self, now: float, *, was_ready: bool) -> ReadinessFacts:
        core, keeper = self.core, self.keeper
        return ReadinessFacts(
            download=keeper.download.describe() if keeper.download is not None else None,
            learner_compiling=self.services.role is coord.MemberRole.LEARNER and self.services.slot.learner is None,
            has_voters=bool(core.log.config.voters), applied_index=keeper.replica.applied_index,
            consistent_from=keeper.consistent_from, log_applied_index=core.log.applied_index,
            commit_target=max(core.log.commit_index, self.coordination.leader_commit),
            replacing_state=keeper.replacing_state(), was_ready=was_ready,
            role="lease holder" if core.is_lease_holder(now) else core.role.value, epoch=core.epoch,
            coordination_silent_s=self._coordination_silent_s(now), lease_s=self.plan.lease_s,
            storage_failing=storage_failures(STORAGE.to_status()), not_current=keeper.current_reason())

    def _coordination_silent_s(self, now: float) -> float | None:
        """Seconds since a lease holder was last heard from (0 while we hold the lease)."""
        core = self.core
        if core.is_lease_holder(now):
            return 0.0
        heard = core.election.heard_leader_at
        return None if heard is None else max(0.0, now - heard)

    async def stop(self) -> None:
        """Leave the run (unless it is complete), freeze the replica, write the final checkpoint."""
        coordination, services = self.coordination, self.services
        if not self.completed:
            await coordination.leave()
        # Freeze the replica: nothing may be applied between the final checkpoint and exit, so a
        # restart resumes at exactly the index and digest logged below.
        coordination.frozen = True
        if self._ticker is not None:
            self._ticker.cancel()
        # Always written, even while the state is not current (a stale fragment, a download): its
        # learner state matters. Such a checkpoint says so, and a restart installs the global state
        # (or replays from an older checkpoint) instead of replaying onto it (`restart_plan`).
        await self.checkpointer.checkpoint(services.slot.learner, not_current=self.keeper.current_reason())
        services.store.sync(coordination.persistent)
        coordination.relays.close()  # its spool files: the log holds every payload it took
        replica = self.replica
        log.info("%s: stopped cleanly at index %d digest %s", self.node_id, replica.applied_index,
                 replica.state.digest())
        services.history.stop(coordination.core, replica.applied_index)
