"""The daemon's lifecycle: open the services, listen, become a member, build the parts, train, stop.

One asyncio loop (uvloop when installed) carries all network work: the aiohttp server (peer
routes under /v1 and the operator routes), one outbox worker per peer, the coordination timer and
the node's periodic jobs (status, checkpoints, watchdog). JAX trains in ONE dedicated thread
(learn/learner_thread.py) that never waits on the network; everything else that leaves the loop
runs in a named pool of a stated size (pools.py).

Every timing and limit comes from the plan (plan.py, `plan_from(config)`). What the node opens
before it knows its run is services.py, its listeners listeners.py, and the parts that need the
site's model parts.py (built complete, in one place). This module is the order of events only.
See docs/ARCHITECTURE.md and docs/DAEMON.md.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

from bootstrap import messages as coord
from diloco_node.clock import Clock, SystemClock, process_age_s
from diloco_node.config.settings import ConfigError, EffectiveConfig
from diloco_node.daemon.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, EXIT_STORAGE
from diloco_node.daemon.exits import START_STORAGE_ERRORS, exit_status_for, start_error_line
from diloco_node.daemon.gate import StartingGate
from diloco_node.daemon.join import JoinRefused
from diloco_node.daemon.listeners import Listeners
from diloco_node.daemon.loop_monitor import watch_loop_lag
from diloco_node.daemon.notify import StatusLineThrottle
from diloco_node.daemon.parts import SiteParts
from diloco_node.daemon.plan import plan_from
from diloco_node.daemon.readiness import readiness
from diloco_node.daemon.services import Services
from diloco_node.daemon.site_model import DATA_CACHE_DIR, build_site_model, prepare_learner, prepare_synthetic_learner
from diloco_node.daemon.training import Learner, watch_cluster_learner
from diloco_node.learn.cluster import share_manifest
from diloco_node.ops.checkpoint import CheckpointError
from diloco_node.ops.systemd import extend_while_progressing, run_watchdog
from diloco_node.transport.orphaned_uploads import quiet_orphaned_uploads

log = logging.getLogger("diloco_node.daemon")


class Node:
    """One site's daemon. `await run()` returns the process exit code."""

    def __init__(self, effective: EffectiveConfig, *, environ: dict[str, str] | None = None,
                 clock: Clock | None = None) -> None:
        self.effective = effective
        self.cfg = effective.node
        self.node_id = self.cfg.node_id
        self.environ = dict(os.environ if environ is None else environ)
        self.clock: Clock = clock or SystemClock()
        self.plan = plan_from(self.cfg, self.environ)
        self.role = coord.MemberRole.WITNESS if self.cfg.role == "witness" else coord.MemberRole.LEARNER
        self.gate: StartingGate[SiteParts] = StartingGate(self.node_id)  # 503 on every route that needs the parts
        self.exit_reason = ""
        self._stop = asyncio.Event()
        self._site_failed = False  # a multi-host site lost a host: exit 1 without leaving the run
        self._ready = False
        self._running = False  # set once started: an OSError before that is a start error (EXIT_STORAGE)
        self._status_line = StatusLineThrottle()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        quiet_orphaned_uploads(loop)  # a peer that hangs up mid-upload is already reported, once per streak
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            services = Services.open(self.effective, self.plan, self.clock, self.environ, self.gate)
        except ConfigError as error:
            return self._exit(EXIT_CONFIG, str(error))
        except CheckpointError as error:  # the data directory is locked: another node uses it, for now
            return self._exit(EXIT_FAILED, str(error))
        except START_STORAGE_ERRORS as error:  # a directory it cannot create, a history it cannot read
            return self._exit(EXIT_STORAGE, start_error_line(error))
        services.pools.install_default(loop)
        listeners = Listeners(services, self.plan, self.gate)
        await listeners.setup()
        code = EXIT_FAILED
        try:
            try:
                await listeners.listen()
            except OSError as error:  # only the listen: every later OSError is a file's
                return self._exit(EXIT_FAILED, f"cannot listen on {self.cfg.listen}: {error}")
            code = await self._main(services)
        except (JoinRefused, ConfigError) as error:
            code = self._exit(exit_status_for(error), str(error))
        except START_STORAGE_ERRORS as error:
            # Before the node runs: a coordination, checkpoint or identity file it cannot read or
            # write (one line naming it, no traceback). Once running, the failure is a crash's.
            code = (self._exit(EXIT_FAILED, f"stopping: {start_error_line(error).removeprefix('cannot start: ')}")
                    if self._running else self._exit(EXIT_STORAGE, start_error_line(error)))
        finally:
            await services.tasks.close()
            learner = services.slot.learner
            if learner is not None and learner.is_alive():
                learner.stop()
                await loop.run_in_executor(services.pools.io, learner.join, self.plan.learner_abort_wait_s)
            await listeners.close()
        return code

    def _exit(self, code: int, reason: str) -> int:
        """The one line a failed start or run ends with (the log's; `diloco-node run` repeats it)."""
        log.error("%s", reason)
        self.exit_reason = reason
        return code

    async def _main(self, services: Services) -> int:
        loop = asyncio.get_running_loop()
        cfg, identity, pools = self.cfg, services.identity, services.pools
        if not services.store.exists() and not cfg.is_founder:
            joining = f"joining through {', '.join(p.url(cfg.peer_scheme) for p in cfg.bootstrap)}"
            services.status.set_ready(False, joining)
            self.gate.starting(joining)
        mode, persistent, manifest = await identity.establish()
        self._mark_phase("identity")
        learner_site = self.role is coord.MemberRole.LEARNER
        if cfg.cluster.enabled and learner_site:
            # The other hosts of this site wait for the manifest to build the same learner.
            await loop.run_in_executor(pools.io, share_manifest, manifest.canonical_bytes().decode())
        self.gate.starting("building the site's model")
        # Model set-up runs off the loop (JAX init, corpus): /status keeps answering meanwhile.
        site = await loop.run_in_executor(pools.setup, lambda: build_site_model(
            manifest, learner=learner_site, data=cfg.data, cache_dir=cfg.data_dir / DATA_CACHE_DIR,
            mesh_shape=cfg.mesh, synthetic=cfg.learner == "synthetic",
            initial_values=mode != "join",  # a fresh joiner downloads every fragment: no model init
            version_rings=services.version_rings))
        if site.devices is not None:
            services.status.set_devices(site.devices)
            log.info("%s: training on %s", self.node_id, site.devices)
            if cfg.learner != "synthetic":
                services.tasks.spawn(services.reports.resolve_site_flops(
                    manifest.model, site.devices, cfg.mesh.peak_tflops, pools.setup), name="site-flops")
        self._mark_phase("state built")
        parts = SiteParts(services=services, plan=self.plan, site=site, persistent=persistent,
                          on_complete=lambda reason: self._on_complete(services, reason), on_evicted=self._on_evicted)
        # A training learner's starting base: its own copy of the global state as of now (a download
        # replaces it). Nobody else keeps one: a synthetic learner reads only the shapes, a witness
        # nothing, and a reference held here would keep every fragment's first arrays alive after
        # a download replaced them (4 bytes a parameter).
        rounds = list(parts.replica.state.rounds())
        trains = learner_site and cfg.learner != "synthetic"
        base = (parts.replica.state.all_params(), rounds) if trains else None
        download = parts.keeper.begin_join() if mode == "join" else None
        self.gate.open(parts)
        parts.start()
        tasks = services.tasks
        periodic = tasks.spawn(self._periodic(services, parts), name="periodic")
        tasks.spawn(run_watchdog(services.notifier, services.live), name="watchdog")  # type: ignore[arg-type]
        # The loop's lag is real time whatever clock the node was given: the host's clock measures it.
        tasks.spawn(watch_loop_lag(services.loop_lag, self.node_id, SystemClock(), self.plan.loop_lag_tick_s),
                    name="loop-lag")
        if cfg.cluster.enabled and learner_site:
            tasks.spawn(self._watch_cluster_learner(services), name="cluster-learner")
        # The learner is built and its step compiled in the set-up pool WHILE a joiner announces
        # itself and downloads the global state: the two are independent until training starts.
        preparing = self._prepare_learner(services, parts, base, rounds) if learner_site else None
        if download is not None:
            await identity.announce()
            started = self.clock.monotonic()
            # A big state on a slow link outlasts TimeoutStartSec=: extend it while bytes arrive.
            extending = tasks.spawn(extend_while_progressing(services.notifier, lambda: download.bytes_received),
                                    name="extend-start-timeout")
            try:
                await download.run()
            finally:
                extending.cancel()
            seconds = self.clock.monotonic() - started
            services.series.transfer_seconds.observe(seconds, kind="state_download")
            log.info("%s: downloaded the global state (%d bytes) in %.2f s", self.node_id,
                     download.bytes_received, seconds)
            self._mark_phase("state downloaded")
            parts.keeper.finish_download(download)
        elif mode == "restart":
            await identity.announce()
            if parts.restart.install_floor:
                parts.keeper.start_install(parts.restart.install_floor)
        if preparing is not None and not parts.completed:
            parts.start_training(await preparing, fresh=parts.restored is None)
            self._mark_phase("training started")
        parts.after_apply(parts.replica.applied_index)  # a restart of a complete run ends at once
        self._running = True
        await self._stop.wait()
        return await self._outcome(services, parts, periodic)

    def _prepare_learner(self, services: Services, parts: SiteParts, base: Any,
                         rounds: list[int]) -> asyncio.Future[Learner]:
        """Build the learner and compile its step in the set-up pool (it touches no loop state)."""
        hooks = {"node_id": self.node_id, "restored": parts.restored,
                 "on_contribution": parts.contribution_from_learner, "on_progress": services.reports.on_progress}
        if self.cfg.learner == "synthetic":  # benchmarks and tests of the data plane only
            build = functools.partial(prepare_synthetic_learner, parts.site, rounds=rounds,
                                      steps_per_s=self.cfg.synthetic_steps_per_s, **hooks)
        else:
            build = functools.partial(prepare_learner, parts.site, base=base,
                                      min_step_interval_s=self.plan.min_step_interval_s, **hooks)
        return asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(services.pools.setup, build))

    async def _outcome(self, services: Services, parts: SiteParts, periodic: asyncio.Task[Any]) -> int:
        """Why the node stops decides how: evicted (exit 3), a lost host (1), else a clean stop (0)."""
        if parts.evicted:
            log.error("%s: %s; stopping", self.node_id, parts.evicted)
            self.exit_reason = parts.evicted
            await self._shutdown(services, parts, periodic)
            return EXIT_REFUSED
        if self._site_failed:
            # No leave and no final checkpoint (the learner's state is gone with its host): the
            # site restarts from its last periodic checkpoint and catches up, like a crashed site.
            return EXIT_FAILED
        if parts.completed:
            # Stay a member a little longer so followers learn the final commit, then stop
            # without leaving: the run is over, its membership stays as it ended.
            await self.clock.sleep(self.plan.completion_linger_s)
        await self._shutdown(services, parts, periodic)
        return EXIT_OK

    async def _shutdown(self, services: Services, parts: SiteParts, periodic: asyncio.Task[Any]) -> None:
        """SIGTERM: stop training, leave the run, freeze the replica, write the final checkpoint."""
        services.notifier.stopping(f"{self.node_id} stopping")
        services.status.set_ready(False, "stopping")
        learner = services.slot.learner
        if learner is not None:
            learner.stop()
            await asyncio.get_running_loop().run_in_executor(services.pools.io, learner.join,
                                                             self.plan.learner_stop_wait_s)
            log.info("%s: learner stopped at step %s", self.node_id, learner.stopped_at_step)
        periodic.cancel()  # no periodic checkpoint racing the final one
        await parts.stop()

    # ------------------------------------------------------------------ events

    def _on_signal(self, sig: int) -> None:
        log.info("%s: received %s, shutting down at the next step boundary", self.node_id, signal.Signals(sig).name)
        self._stop.set()

    def _on_complete(self, services: Services, reason: str) -> None:
        """The run reached [run.stop]: the learner stops at its next step boundary (joined on shutdown)."""
        services.status.set_ready(False, f"run complete: {reason}")
        if services.slot.learner is not None:
            services.slot.learner.stop()
        self._stop.set()

    def _on_evicted(self, refusal: str) -> None:
        self._stop.set()

    async def _watch_cluster_learner(self, services: Services) -> None:
        """A multi-host site's learner failed: the site goes down (exit 1), see training.py."""
        reason = await watch_cluster_learner(
            services.slot, node_id=self.node_id, cluster=self.cfg.cluster, check_s=self.plan.cluster_check_s,
            stall_warn_s=self.plan.cluster_stall_warn_s, clock=self.clock, status=services.status,
            executor=services.pools.io)
        message = f"{self.node_id}: the site is going down: {reason}; restart every host of the site"
        log.error("%s", message)
        services.status.record_error(message, self.clock.monotonic())
        self.exit_reason = reason
        self._site_failed = True
        self._stop.set()

    def _mark_phase(self, what: str) -> None:
        """Start-up timeline in the log (seconds since the process started): where join time goes."""
        log.info("%s: %s at %.2f s after process start", self.node_id, what, process_age_s())

    # ------------------------------------------------------------------ periodic work

    async def _periodic(self, services: Services, parts: SiteParts) -> None:
        plan, clock = self.plan, self.clock
        next_checkpoint = clock.monotonic() + plan.checkpoint_interval_s
        next_refresh = clock.monotonic() + plan.member_refresh_s
        while True:
            now = clock.monotonic()
            self._update_readiness(services, parts, now)
            parts.feed.refresh(now)
            services.samples.observe(services.status_document)
            if now >= next_checkpoint and self._ready:
                next_checkpoint = now + plan.checkpoint_interval_s
                await _survived("the periodic checkpoint", parts.periodic_checkpoint(), services)
            if now >= next_refresh:
                next_refresh = now + plan.member_refresh_s
                await _survived("the member refresh", services.identity.refresh_members(parts.core.log.config.voters),
                                services)
            await clock.sleep(plan.status_refresh_s)

    def _update_readiness(self, services: Services, parts: SiteParts, now: float) -> None:
        verdict = readiness(parts.readiness_facts(now, was_ready=self._ready))
        if verdict.became_ready:
            self._ready = True
            services.notifier.ready(f"{self.node_id} ready")
            log.info("%s ready, %.2f s after process start", self.node_id, process_age_s())
        if self._status_line.due(verdict.reason, now):
            services.notifier.status(verdict.reason)
        services.status.set_ready(verdict.ready, verdict.reason)


async def _survived(what: str, job: Coroutine[Any, Any, Any], services: Services) -> None:
    """Run one periodic job; its failure is reported (log with traceback, /status errors) and the
    loop goes on: the same loop refreshes /status and readiness, which must never freeze because a
    checkpoint or a compaction raised (the next interval tries again)."""
    try:
        await job
    except Exception as error:
        log.exception("%s: %s failed", services.node_id, what)
        services.report_error(f"{what} failed: {type(error).__name__}: {error}; tried again at the next interval")
