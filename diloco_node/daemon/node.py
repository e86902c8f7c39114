"""The daemon's composition root and lifecycle: start, wire the parts together, run, stop.

One asyncio loop (uvloop when installed) carries all network work: the aiohttp server (peer
routes under /v1 and the operator routes), one outbox worker per peer, the coordination timer and
the node's periodic jobs (status, checkpoints, watchdog). JAX trains in ONE dedicated thread
(learn/learner_thread.py) that never waits on the network; codecs, merges and hashing of big
payloads run in a small thread pool; checkpoints and compaction on a disk thread.

The parts, each in its own module: who the site is (identity.py), the coordination core's I/O
(coordination.py), the fragment round (rounds.py), keeping the replica whole (state_transfer.py),
checkpoints and compaction (persistence.py), readiness (readiness.py) and the status document
(status_feed.py). This module builds them in order and is the only place that connects them.
See docs/ARCHITECTURE.md and docs/DAEMON.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, NodeOptions
from bootstrap.election import LeaseTiming
from diloco_node.clock import Clock, SystemClock, process_age_s
from diloco_node.config.settings import ConfigError, EffectiveConfig, NodeConfig, run_id_for
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_REFUSED, exit_status_for
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.history_ring import HISTORY_RING_DIR, DiskHistories
from diloco_node.daemon.identity import SiteIdentity
from diloco_node.daemon.join import JoinRefused
from diloco_node.daemon.learner_figures import SiteFlops
from diloco_node.daemon.loop_monitor import LagWindow, watch_loop_lag
from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.daemon.notify import BackgroundNotifier, StatusLineThrottle
from diloco_node.daemon.peer_api import PeerApi
from diloco_node.daemon.persistence import Checkpointer, learner_to_resume
from diloco_node.daemon.readiness import ReadinessFacts, readiness
from diloco_node.daemon.relay_spool import SPOOL_SUBDIR
from diloco_node.daemon.relays import run_payload_bound
from diloco_node.daemon.replica_store import ReplicaStore
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.site_model import SiteModel, build_site_model, prepare_learner, prepare_synthetic_learner
from diloco_node.daemon.state_transfer import StateKeeper
from diloco_node.daemon.status_feed import StatusFeed
from diloco_node.daemon.evaluation import GlobalEvaluator
from diloco_node.daemon.tasks import TaskSet, closed_on_cleanup
from diloco_node.learn.cluster import failure_reason, share_manifest
from diloco_node.learn.learner_thread import DueFragment, LearnerThread
from diloco_node.learn.synthetic_learner import SyntheticLearner
from diloco_node.ops.checkpoint import CheckpointError, CheckpointStore
from diloco_node.ops.liveness import Liveness, StepPace, liveness
from diloco_node.ops.page import StatusSeries
from diloco_node.ops.profiling import ProfileCapture
from diloco_node.ops.status import MetricsRegistry, StatusBuilder, operator_routes
from diloco_node.ops.systemd import SystemdNotifier, extend_while_progressing, run_watchdog
from diloco_node.ops import tracking as tracking_lib
from diloco_node.ops.tracking import Tracking, check_available
from diloco_node.transport import ClientOptions, ConnectionGuard, PeerClient, PeerServer
from diloco_node.transport.tls import SiteTls, TlsError, TlsFiles
from wire.auth import AuthContext, FrameVerifier, RunSecretError, derive_frame_key, load_run_secret
from wire.errors import LocalProtocolError
from wire.limits import DEFAULT_LIMITS, MAX_RELAYED_PAYLOAD_BYTES, Limits

log = logging.getLogger("diloco_node.daemon")

# /status figures that need the coordination core are refreshed this often.
STATUS_REFRESH_S = 0.25
# Worker threads for codecs, merges and big-frame hashing (they release the GIL); the learner
# has its own thread. Two is enough on a small host; more only competes with JAX.
POOL_THREADS = 2
# Text a learner tokenizes is cached here, under data_dir, so a restart maps it instead of
# tokenizing again (learn/data.py names each cache by its files and encoder).
DATA_CACHE_DIR = "data-cache"
# How long a refreshed address book is trusted before a peer is asked again for the member list.
MEMBER_REFRESH_S = 5.0
# TLS files are checked for changes this often (certificates reload without a restart; SIGHUP
# reloads at once). A renewal is planned days ahead, so seconds of delay cost nothing.
TLS_RELOAD_CHECK_S = 5.0
# A multi-host site's learner is checked this often for a failure: a lost host ends the site.
CLUSTER_LEARNER_CHECK_S = 0.25


def transport_bounds(cfg: NodeConfig) -> tuple[ClientOptions, Limits]:
    """The peer transport's bounds from [node]: `connect_timeout_s` bounds each TCP connect of the
    client; `read_timeout_s` the silence tolerated on an open stream, both ways (the client's
    `sock_read` and stall guard, the server's per-read timeout)."""
    options = ClientOptions(connect_timeout_s=cfg.connect_timeout_s, source_address=cfg.source_address)
    return options, dataclasses.replace(DEFAULT_LIMITS, read_timeout_s=cfg.read_timeout_s)


class Node:
    """One site's daemon. `await run()` returns the process exit code."""

    def __init__(self, effective: EffectiveConfig, *, environ: dict[str, str] | None = None,
                 clock: Clock | None = None) -> None:
        self.effective = effective
        self.cfg = effective.node
        self.node_id = self.cfg.node_id
        self.environ = dict(os.environ if environ is None else environ)
        self.clock: Clock = clock or SystemClock()
        self.tasks = TaskSet()
        self.role = coord.MemberRole.WITNESS if self.cfg.role == "witness" else coord.MemberRole.LEARNER
        self.status = StatusBuilder(self.node_id, "", self.cfg.role, self.clock.monotonic())
        self.metrics = MetricsRegistry()
        self.series = DaemonSeries.register(self.metrics)
        self.samples = StatusSeries(self.clock.monotonic)  # recent figures for the page at `/` (/series)
        self.notifier = BackgroundNotifier(SystemdNotifier(self.environ))
        self.loop_lag = LagWindow()
        self.pace = StepPace()  # the learner's step interval: a stalled learner fails /livez
        self._counted_seconds = (0.0, 0.0)  # learner compute and sync seconds already in the counters
        min_step = self.environ.get("DILOCO_X_MIN_STEP_S", "0")
        self._min_step_interval_s = float(min_step) if min_step else 0.0
        self._stop = asyncio.Event()
        self.exit_reason = ""
        self._site_failed = False  # a multi-host site lost a host: exit 1 without leaving the run
        self._evicted = ""  # the run evicted this site (an applied EVICTION entry names it): exit 3
        # Built by run(), in this order; None until then.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.executor: ThreadPoolExecutor | None = None
        self.disk_executor: ThreadPoolExecutor | None = None
        self.client: PeerClient | None = None
        self.server: PeerServer | None = None
        self.store: ReplicaStore | None = None
        self.history: DaemonHistory | None = None
        self.identity: SiteIdentity | None = None
        self.site: SiteModel | None = None
        self.evaluator: GlobalEvaluator | None = None  # the global model's held-out loss, every N commits
        self.completed = ""  # why the run is complete ([run.stop] reached), "" while it goes on
        self.checkpointer: Checkpointer | None = None
        self.keeper: StateKeeper | None = None
        self.coordination: CoordinationIO | None = None
        self.rounds: RoundDriver | None = None
        self.feed: StatusFeed | None = None
        self.learner: LearnerThread | SyntheticLearner | None = None
        # MFU's fixed inputs (model FLOPs, devices, peak), resolved off the loop once the site's
        # model is built; None until then and on a site without a training learner.
        self.site_flops: SiteFlops | None = None
        self._figures_seen: Any = None  # the learner's last StepFigures already reported
        self.tracking = Tracking()  # [node.tracking]: none until run() opens the configured ones
        self._ready = False
        self._status_line = StatusLineThrottle()
        self._periodic_task: asyncio.Task[Any] | None = None
        self._ticker_task: asyncio.Task[Any] | None = None

    def now(self) -> float:
        return self.clock.monotonic()

    def _error(self, message: str) -> None:
        log.warning("%s", message)
        self.status.record_error(message, self.now())

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> int:
        loop = self.loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            self.effective.read_secret()  # configured and readable: ConfigError naming the setting's source
            try:
                # The wire's rules (docs/WIRE.md section 4): not accessible by "other", one trailing
                # newline stripped; the same bytes every member derives its key from.
                assert self.cfg.secret_file is not None
                secret = load_run_secret(self.cfg.secret_file)
            except RunSecretError as error:
                raise ConfigError(str(error)) from None
            try:
                key = derive_frame_key(secret)
            except LocalProtocolError as error:
                raise ConfigError(f"run secret: {error}") from None
            checkpoints = CheckpointStore(Path(self.cfg.data_dir) / "checkpoints", self.cfg.checkpoint_keep)
            tls = self._load_tls()
            check_available(self.cfg.tracking)  # a missing extra: ConfigError saying what to install
        except (ConfigError, CheckpointError) as error:
            log.error("%s", error)
            self.exit_reason = str(error)
            return EXIT_CONFIG if isinstance(error, ConfigError) else EXIT_FAILED
        run_id = run_id_for(secret)
        self.status.set_run_id(run_id)
        if tls is not None:
            self._show_tls(tls)
        auth = AuthContext(run_id, self.node_id, key)
        verifier = FrameVerifier(run_id, key, node_id=self.node_id)  # frames must be addressed to us
        self.executor = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix=f"pool-{self.node_id}")
        self.disk_executor = ThreadPoolExecutor(1, thread_name_prefix=f"disk-{self.node_id}")
        client_options, limits = transport_bounds(self.cfg)
        self.client = PeerClient(auth, verifier, executor=self.executor, limits=limits, options=client_options,
                                 tls=tls)
        self.server = PeerServer(auth, verifier, executor=self.executor, limits=limits,
                                 certified_senders=tls is not None)
        PeerApi(self.node_id, coordination=lambda: self.coordination, keeper=lambda: self.keeper,
                rounds=lambda: self.rounds, manifest=lambda: self.site.manifest if self.site else None
                ).install(self.server)
        data_dir = Path(self.cfg.data_dir)
        self.store = ReplicaStore(data_dir / "coordination")
        self.histories = DiskHistories(data_dir / HISTORY_RING_DIR)  # fragment versions for rebasing
        self.history = DaemonHistory.open(data_dir, self.node_id, pace_s=self._min_step_interval_s)
        self.tracking = Tracking.open(self.cfg.tracking, data_dir, self.node_id,
                                      {"node_id": self.node_id, "run_id": run_id, "role": self.cfg.role})
        self.status.tracking = self.tracking.status
        self.identity = SiteIdentity(self.effective, self.store, self.client, self.role)
        app = web.Application(client_max_size=1024 ** 2)
        guard = ConnectionGuard()
        guard.install(app)
        self.server.install(app)
        operator_listen = self.cfg.operator_listen  # None: operator routes share the peer port
        operator_app = app if operator_listen is None else web.Application(client_max_size=1024 ** 2)
        operator_app.add_routes(operator_routes(self._status_document, self.metrics, self._live, self.samples,
                                                evict=self._evict, profile=ProfileCapture(data_dir).capture))
        self.server.gate = self._eviction_gate
        # Resources live as long as the app; cleanup runs in reverse order of set-up.
        app.cleanup_ctx.append(closed_on_cleanup(
            lambda: self.executor.shutdown(wait=False, cancel_futures=True),
            lambda: self.disk_executor.shutdown(wait=False, cancel_futures=True),
            self.store.close, self.histories.close, self.history.close, checkpoints.close, self.notifier.close,
            lambda: self.evaluator is not None and self.evaluator.close(), self.tracking.close))
        app.cleanup_ctx.append(self.client.cleanup_ctx)  # the peer session
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        assert runner.server is not None
        self.tasks.spawn(guard.run(runner.server), name="connection-guard")
        operator_runner = None if operator_listen is None else web.AppRunner(operator_app, access_log=None)
        code = EXIT_FAILED
        try:
            if operator_runner is not None:
                await self._start_operator_listener(operator_runner, operator_app)
            if tls is not None:
                loop.add_signal_handler(signal.SIGHUP, self._reload_tls, tls, "SIGHUP")
                self.tasks.spawn(self._watch_tls(tls), name="tls-reload")
            site = web.TCPSite(runner, self.cfg.listen.host, self.cfg.listen.port,
                               ssl_context=tls.server_context if tls is not None else None)
            await site.start()
            log.info("%s listening on %s (advertised %s), %.2f s after process start", self.node_id,
                     self.cfg.listen, self.cfg.advertise, process_age_s())
            code = await self._main(checkpoints)
        except (JoinRefused, ConfigError) as error:
            log.error("%s", error)
            self.exit_reason = str(error)
            code = exit_status_for(error)
        except OSError as error:
            log.error("cannot listen on %s: %s", self.cfg.listen, error)
            self.exit_reason = str(error)
            code = EXIT_FAILED
        finally:
            await self.tasks.close()
            if self.learner is not None and self.learner.is_alive():
                self.learner.stop()
                await loop.run_in_executor(None, self.learner.join, 30.0)
            if operator_runner is not None:
                await operator_runner.cleanup()
            await runner.cleanup()
        return code

    # ------------------------------------------------------------------ TLS and the operator listener

    def _load_tls(self) -> SiteTls | None:
        """The site's TLS contexts when [node] tls_* are set (ConfigError naming the file otherwise)."""
        cfg = self.cfg
        if not cfg.tls_enabled:
            return None
        assert cfg.tls_key_file is not None and cfg.tls_ca_file is not None and cfg.tls_cert_file is not None
        try:
            return SiteTls(TlsFiles(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file, cfg.tls_crl_file))
        except TlsError as error:
            raise ConfigError(str(error)) from None

    async def _start_operator_listener(self, runner: web.AppRunner, app: web.Application) -> None:
        """/status, /metrics, /livez, /readyz and / on their own (plain HTTP, loopback by default)
        listener, as etcd separates its peer and metrics URLs: the peer port speaks TLS only."""
        listen = self.cfg.operator_listen
        assert listen is not None
        guard = ConnectionGuard()
        guard.install(app)
        await runner.setup()
        assert runner.server is not None
        self.tasks.spawn(guard.run(runner.server), name="operator-connection-guard")
        try:
            await web.TCPSite(runner, listen.host, listen.port).start()
        except OSError as error:  # named, so the log does not blame the peer port
            raise OSError(error.errno, f"status_listen {listen}: {error.strerror}") from None
        log.info("%s: operator routes on http://%s", self.node_id, listen)

    def _reload_tls(self, tls: SiteTls, why: str) -> None:
        self._report_tls_reload(tls, why, tls.reload())

    async def _watch_tls(self, tls: SiteTls) -> None:
        while True:
            await self.clock.sleep(TLS_RELOAD_CHECK_S)
            outcome = tls.reload_if_changed()
            if outcome is not None:
                self._report_tls_reload(tls, "TLS files changed", outcome)

    def _show_tls(self, tls: SiteTls) -> None:
        facts = tls.facts
        self.status.set_tls(node_id=facts.node_id, fingerprint=facts.fingerprint, not_after_unix=facts.not_after_unix,
                            ca_subject=facts.ca_subject, crl_loaded=facts.crl_loaded,
                            loaded_at_unix=tls.loaded_at_unix, reloads=tls.reloads, reload_error=tls.last_reload_error)

    def _report_tls_reload(self, tls: SiteTls, why: str, outcome: str) -> None:
        self._show_tls(tls)
        if tls.last_reload_error:
            self._error(f"{why}: {outcome}")  # shown in /status: the site still runs on the old files
        else:
            log.info("%s: %s: %s", self.node_id, why, outcome)

    def _on_signal(self, sig: int) -> None:
        log.info("%s: received %s, shutting down at the next step boundary", self.node_id, signal.Signals(sig).name)
        self._stop.set()

    def _mark_phase(self, what: str) -> None:
        """Start-up timeline in the log (seconds since the process started): where join time goes."""
        log.info("%s: %s at %.2f s after process start", self.node_id, what, process_age_s())

    async def _main(self, checkpoints: CheckpointStore) -> int:
        loop = asyncio.get_running_loop()
        identity = self.identity
        assert identity is not None and self.store is not None and self.history is not None
        if not self.store.exists() and not self.cfg.is_founder:
            self.status.set_ready(False, f"joining through "
                                  f"{', '.join(p.url(self.cfg.peer_scheme) for p in self.cfg.bootstrap)}")
        mode, persistent = await identity.establish()
        self._mark_phase("identity")
        manifest = identity.manifest
        assert manifest is not None
        if self.cfg.cluster.enabled and self.role is coord.MemberRole.LEARNER:
            # The other hosts of this site wait for the manifest to build the same learner.
            await loop.run_in_executor(None, share_manifest, manifest.canonical_bytes().decode())
        # Model set-up runs off the loop (JAX init, corpus): /status keeps answering meanwhile.
        site = self.site = await loop.run_in_executor(
            None, lambda: build_site_model(manifest, learner=self.role is coord.MemberRole.LEARNER,
                                           data=self.cfg.data, cache_dir=self.cfg.data_dir / DATA_CACHE_DIR,
                                           mesh_shape=self.cfg.mesh, synthetic=self.cfg.learner == "synthetic",
                                           # a fresh joiner downloads every fragment: no model init
                                           initial_values=mode != "join"))
        if site.devices is not None:
            self.status.set_devices(site.devices)
            log.info("%s: training on %s", self.node_id, site.devices)
            if self.cfg.learner != "synthetic":
                self.tasks.spawn(self._resolve_site_flops(manifest.model, site.devices), name="site-flops")
        self._mark_phase("state built")
        replica = site.replica
        replica.state.use_history(self.histories)  # on disk: no fp32 copy of the model per kept round
        self.checkpointer = Checkpointer(node_id=self.node_id, checkpoints=checkpoints, store=self.store,
                                         replica=replica, disk_executor=self.disk_executor,
                                         retain_entries=self.cfg.log_retain_entries, report_error=self._error)
        keeper = self.keeper = StateKeeper(
            node_id=self.node_id, replica=replica, client=self.client, addresses=identity.addresses,
            executor=self.executor, clock=self.clock, tasks=self.tasks, history=self.history,
            leader_id=lambda: self.coordination.core.election.leader_id if self.coordination else None,
            epoch=lambda: self.coordination.core.epoch if self.coordination else 0,
            report_error=self._error, commits_applied=self.series.commits_applied)
        keeper.bootstrap_url = identity.bootstrap_url
        self.evaluator = GlobalEvaluator.for_site(
            node_id=self.node_id, manifest=manifest, eval_tokens=site.corpus.eval if site.corpus else None,
            every_commits=self.cfg.eval_interval_commits, batches=self.cfg.eval_batches, replica=replica,
            consistent=keeper.state_consistent, tasks=self.tasks, status=self.status, series=self.series,
            history=self.history, also=self._track_evaluation,
            eval_sets=site.corpus.eval_sets if site.corpus else ())
        keeper.after_apply = self._after_apply
        plan, restored = self.checkpointer.restore(persistent, identity.has_peers())
        restored = learner_to_resume(restored, self.cfg.learner, self.node_id)
        evicted = replica.evictions.record(self.node_id)
        if evicted is not None:
            raise JoinRefused(evicted.refusal(), permanent=True)  # every member refuses us anyway
        if plan.install_floor:
            keeper.plan_install(plan.install_floor)
        # A training learner's starting base: its own copy of the global state as of now (a
        # download replaces it). Nobody else keeps one: a synthetic learner reads only the shapes,
        # a witness nothing, and a reference held here would keep every fragment's first arrays
        # alive after a download replaced them (4 bytes a parameter).
        rounds = list(replica.state.rounds())
        trains = self.role is coord.MemberRole.LEARNER and self.cfg.learner != "synthetic"
        base = (replica.state.all_params(), rounds) if trains else None
        download = keeper.begin_join() if mode == "join" else None
        self._start_coordination(persistent)
        assert self.coordination is not None
        self._ticker_task = self.tasks.spawn(self.coordination.ticker(), name="coordination-ticker")
        self._periodic_task = self.tasks.spawn(self._periodic(), name="periodic")
        self.tasks.spawn(run_watchdog(self.notifier, self._live), name="watchdog")  # type: ignore[arg-type]
        self.tasks.spawn(watch_loop_lag(self.loop_lag, self.node_id), name="loop-lag")
        if self.cfg.cluster.enabled and self.role is coord.MemberRole.LEARNER:
            self.tasks.spawn(self._watch_cluster_learner(), name="cluster-learner")
        # The learner is built and its step compiled in a worker thread WHILE a joiner announces
        # itself and downloads the global state: the two are independent until training starts.
        preparing = None
        if self.role is coord.MemberRole.LEARNER:
            if self.cfg.learner == "synthetic":  # benchmarks and tests of the data plane only
                preparing = asyncio.ensure_future(loop.run_in_executor(None, lambda: prepare_synthetic_learner(
                    site, node_id=self.node_id, rounds=rounds, restored=restored,
                    on_contribution=self._from_learner_contribution, on_progress=self._from_learner_progress,
                    steps_per_s=self.cfg.synthetic_steps_per_s)))
            else:
                assert base is not None
                preparing = asyncio.ensure_future(loop.run_in_executor(None, lambda: prepare_learner(
                    site, node_id=self.node_id, base=base, restored=restored,
                    on_contribution=self._from_learner_contribution, on_progress=self._from_learner_progress,
                    min_step_interval_s=self._min_step_interval_s)))
        if download is not None:
            await identity.announce()
            started = self.now()
            # A big state on a slow link outlasts TimeoutStartSec=: extend it while bytes arrive.
            extending = self.tasks.spawn(extend_while_progressing(self.notifier, lambda: download.bytes_received),
                                         name="extend-start-timeout")
            try:
                await download.run()
            finally:
                extending.cancel()
            self.series.transfer_seconds.observe(self.now() - started, kind="state_download")
            log.info("%s: downloaded the global state (%d bytes) in %.2f s", self.node_id,
                     download.bytes_received, self.now() - started)
            self._mark_phase("state downloaded")
            keeper.finish_download(download)
        elif mode == "restart":
            await identity.announce()
            if plan.install_floor:
                keeper.start_install(plan.install_floor)
        if preparing is not None and not self.completed:
            self._start_training(await preparing, fresh=restored is None)
        self._after_apply(replica.applied_index)  # a restart of a complete run ends at once
        await self._stop.wait()
        if self._evicted:
            log.error("%s: %s; stopping", self.node_id, self._evicted)
            self.exit_reason = self._evicted
            await self._shutdown()
            return EXIT_REFUSED
        if self._site_failed:
            # No leave and no final checkpoint (the learner's state is gone with its host): the
            # site restarts from its last periodic checkpoint and catches up, like a crashed site.
            return EXIT_FAILED
        if self.completed:
            # Stay a member a little longer so followers learn the final commit, then stop
            # without leaving: the run is over, its membership stays as it ended.
            await asyncio.sleep(2 * self.cfg.lease_timeout_s)
        await self._shutdown()
        return EXIT_OK

    def _after_apply(self, applied_index: int) -> None:
        assert self.site is not None and self.evaluator is not None
        self.evaluator.after_apply(applied_index)
        if self.tracking.enabled:
            sent = self.status.byte_counts()
            self.tracking.log(self._tracked_step(), {"sync/commit_index": applied_index, "sync/bytes_sent": sent.sent,
                                                     "sync/bytes_received": sent.received})
        completion = self.site.replica.completion()
        if completion and not self.completed:
            self.completed = completion
            at = self.site.replica.completed_at_index or applied_index  # a downloaded state: as of its index
            log.info("%s: the run is complete at commit %d: %s", self.node_id, at, completion)
            self.status.set_ready(False, f"run complete: {completion}")
            if self.learner is not None:
                self.learner.stop()  # at its next step boundary; joined in _shutdown
            self._stop.set()

    def _start_coordination(self, persistent: Any) -> None:
        assert self.site is not None and self.keeper is not None and self.identity is not None
        lease = LeaseTiming(lease_s=self.cfg.lease_timeout_s, heartbeat_interval_s=self.cfg.heartbeat_interval_s)
        options = NodeOptions(lease=lease, leave_timeout_s=max(3.0, 3 * self.cfg.lease_timeout_s))
        replica = self.site.replica
        core = CoordinatorNode(self.node_id, persistent, now=self.now(), rng=random.Random(os.urandom(16)),
                               applied_index=replica.applied_index, role=self.role, address=self.cfg.advertise,
                               options=options)
        core.is_evicted = replica.evictions.__contains__
        self.store.sync(persistent)
        coordination = self.coordination = CoordinationIO(
            core=core, persistent=persistent, store=self.store, history=self.history, client=self.client,
            addresses=self.identity.addresses, clock=self.clock, tasks=self.tasks, on_apply=self.keeper.apply,
            on_restore_snapshot=self.keeper.on_restore_snapshot, after_step=self._after_coordination_step,
            remember_member=self.identity.remember, report_error=self._error,
            relay_fanout=self.cfg.relay_fanout, relay_hold_s=min(1.0, self.cfg.lease_timeout_s / 4),
            relay_max_payload_bytes=(run_payload_bound(self.site.plan, self.site.shapes, self.site.manifest.sync.codec_down)
                                     if self.site.shapes is not None else MAX_RELAYED_PAYLOAD_BYTES),
            relay_spool_dir=self.store.directory / SPOOL_SUBDIR)
        self.rounds = RoundDriver(
            node_id=self.node_id, manifest=self.site.manifest, plan=self.site.plan, syncer=self.site.syncer,
            replica=replica, coordination=core, addresses=self.identity.addresses, client=self.client,
            executor=self.executor, clock=self.clock, tasks=self.tasks, dispatch=coordination.dispatch,
            replica_behind=lambda: self.keeper.merge_blocker(core.log.applied_index, core.log.last_index),
            report_error=self._error, contributions_sent=self.series.contributions_sent,
            merges_proposed=self.series.merges_proposed, round_latency=self.series.round_latency_seconds,
            transfer=self.series.transfer_seconds)
        self.keeper.on_fragment_commit = self.rounds.fragment_committed
        self.feed = StatusFeed(status=self.status, coordination=coordination, keeper=self.keeper, rounds=self.rounds,
                               store=self.store, client=self.client, server=self.server, loop_lag=self.loop_lag)
        self.history.start(core, replica.applied_index, self.site.manifest.sync)

    def _start_training(self, learner: LearnerThread | SyntheticLearner, *, fresh: bool) -> None:
        """Bring the compiled learner up to the replica's current global state and start stepping.

        Training starts as soon as the global state is in place (founded, restored or downloaded):
        it does not wait for the replica to replay the log to the newest commit (a learner on a
        slightly older fragment is rebased by the syncer anyway); `/readyz` still waits for that.
        """
        assert self.site is not None and self.keeper is not None
        state = self.site.replica.state
        if fresh:
            # The state's own read-only arrays, as offers carry them (a step replaces them, never
            # changes them): a copy here was 4 bytes a parameter and, at 1B, a 3.9 s stall of the
            # event loop at the moment training starts. A learner that keeps weights copies them.
            learner.adopt_global(state.all_params(copies=False), list(state.rounds()))
        else:  # a restored learner keeps its own weights; fragments committed since arrive as offers
            for p in range(self.site.plan.num_fragments):
                learner.offer_fragment(p, state.round(p), state.fragment_params(p, copies=False))
        self.learner = self.keeper.learner = learner
        learner.start()
        learner.begin_training()
        self._mark_phase("training started")

    # ------------------------------------------------------------------ connections between parts

    def _tracked_step(self) -> int:
        """The trackers' x axis: the learner's step (0 on a witness or before training)."""
        learner = self.learner
        return int(learner.steps) if learner is not None else 0

    def _track_evaluation(self, result: Any) -> None:
        scalars = {"eval/loss": result.loss} | {tracking_lib.eval_set_scalar(name): figure.loss
                                                 for name, figure in result.sets.items()}
        self.tracking.log(self._tracked_step(), scalars)

    async def _resolve_site_flops(self, model: Any, devices: Any) -> None:
        """MFU's inputs, off the loop (a user's model is compiled for XLA's cost analysis)."""
        loop = asyncio.get_running_loop()
        self.site_flops = site_flops = await loop.run_in_executor(
            None, lambda: SiteFlops.resolve(model, devices, self.cfg.mesh.peak_tflops))
        log.info("%s: %s", self.node_id, site_flops.describe())

    def _from_learner_progress(self, step: int, loss: float, tokens: int) -> None:
        """Called in the learner thread after every step (status and history are thread-safe)."""
        self.pace.step(self.now())
        self.status.record_learner(step=step, loss=loss, tokens=tokens, now=self.now())
        learner = self.learner
        window = self._learner_window(learner)
        if learner is not None:
            # The learner keeps cumulative seconds; the counters take what was added since.
            compute, sync = learner.compute_seconds_total, learner.sync_seconds_total
            self.series.learner_compute_seconds.inc(max(0.0, compute - self._counted_seconds[0]))
            self.series.learner_sync_seconds.inc(max(0.0, sync - self._counted_seconds[1]))
            self._counted_seconds = (compute, sync)
            self.series.step_seconds.observe(learner.step_seconds)
        self.history.learner_step(step, loss, tokens, learner, figures=window)
        if window is not None:
            self.tracking.log(step, {"learner/loss": loss, "learner/tokens": tokens,
                                     **{f"learner/{name}": value for name, value in window.items()}})

    def _learner_window(self, learner: Any) -> dict[str, float | None] | None:
        """The figures of a step window the learner closed since the last call (None: none), with
        MFU; published on /status (the gauges follow) and returned for the history."""
        figures = getattr(learner, "figures", None)  # the synthetic learner has none
        if figures is None or figures is self._figures_seen:
            return None
        self._figures_seen = figures
        site_flops = self.site_flops
        mfu = site_flops.mfu(figures.tokens_per_s) if site_flops is not None else None
        self.status.set_learner_figures(step_time_s=figures.step_time_s, mfu=mfu, grad_norm=figures.grad_norm,
                                        lr=figures.lr)
        return {"tokens_per_s": figures.tokens_per_s, "step_time_s": figures.step_time_s, "mfu": mfu,
                "grad_norm": figures.grad_norm, "lr": figures.lr}

    def _from_learner_contribution(self, due: DueFragment) -> None:
        """Called in the learner thread: hand over to the loop (never block training)."""
        assert self.loop is not None and self.rounds is not None
        self.loop.call_soon_threadsafe(self.rounds.send_contribution, due)

    def _after_coordination_step(self) -> None:
        if self.rounds is not None:
            self.rounds.lease_check()
        if not self._evicted and self.site is not None:
            record = self.site.replica.evictions.record(self.node_id)
            if record is not None:
                self._evicted = record.refusal()
                self._stop.set()

    # ------------------------------------------------------------------ eviction

    def _eviction_gate(self, node_id: str | None, fingerprint: str | None) -> str | None:
        """The transport's check of every peer: refused for good once the run evicted it."""
        return self.site.replica.evictions.refusal(node_id, fingerprint) if self.site is not None else None

    async def _evict(self, node_id: str, reason: str) -> tuple[int, dict[str, Any]]:
        """`POST /evict` on the operator listener (`diloco-node evict`): see CoordinationIO.evict."""
        if self.coordination is None or self.site is None or self.server is None:
            return 503, {"error": f"{self.node_id} is still starting"}
        fingerprints = sorted(self.server.seen_certificates.get(node_id, ()))
        return await self.coordination.evict(node_id, reason, fingerprints, self.site.replica.evictions.record,
                                             wait_s=2 * self.cfg.lease_timeout_s)

    async def _watch_cluster_learner(self) -> None:
        """A multi-host site cannot train on without one of its hosts (its JAX cluster is broken
        for good), so a learner failure ends the process: /livez fails at once, and the daemon
        exits 1 so the unit's Restart=on-failure brings the site back.

        A collective can also hang instead of failing (a killed host's broken connection is not
        always noticed); then JAX aborts the process when the lost host's heartbeats are overdue.
        A quarter of that time into one step we say so first, so our log names the host before
        JAX's abort (which came 7.6-9 s after a kill with a 10 s timeout, on loopback). A step
        that is merely long only costs one warning.
        """
        stall_s = self.cfg.cluster.heartbeat_timeout_s / 4
        first_steps, warned = None, False
        while self.learner is None or self.learner.error is None:
            await self.clock.sleep(CLUSTER_LEARNER_CHECK_S)
            learner = self.learner
            if learner is None or warned:
                continue
            if first_steps is None:  # a stall counts only once the learner has trained
                first_steps = learner.steps
            # The learner stamps its steps with time.monotonic(), not the node's clock.
            stalled_s = time.monotonic() - learner.last_step_at
            if learner.steps > first_steps and stalled_s > stall_s and learner.is_alive():
                warned = True
                # Not the coordination service's liveness query: it can block, and this line must
                # come before JAX's abort. On two processes the suspect is the other one.
                who = "process 1" if self.cfg.cluster.num_processes == 2 else "another of the site's processes"
                message = (f"{self.node_id}: the learner has waited {stalled_s:.1f} s in one step: the site's JAX "
                           f"cluster may have lost {who}; JAX stops the site when a host misses its heartbeats "
                           f"for cluster.heartbeat_timeout_s = {self.cfg.cluster.heartbeat_timeout_s} s")
                log.warning("%s", message)
                self.status.record_error(message, self.now())
        error = self.learner.error
        reason = await asyncio.get_running_loop().run_in_executor(None, failure_reason, error)
        message = f"{self.node_id}: the site is going down: {reason}; restart every host of the site"
        log.error("%s", message)
        self.status.record_error(message, self.now())
        self.exit_reason = reason
        self._site_failed = True
        self._stop.set()

    # ------------------------------------------------------------------ periodic work

    async def _periodic(self) -> None:
        next_checkpoint = self.now() + self.cfg.checkpoint_interval_s
        next_refresh = self.now() + MEMBER_REFRESH_S
        while True:
            now = self.now()
            self._update_readiness()
            self.feed.refresh(now)
            self.samples.observe(self._status_document)
            if now >= next_checkpoint and self._ready:
                next_checkpoint = now + self.cfg.checkpoint_interval_s
                await self._periodic_checkpoint()
            if now >= next_refresh:
                next_refresh = now + MEMBER_REFRESH_S
                await self.identity.refresh_members(self.coordination.core.log.config.voters)
            await self.clock.sleep(STATUS_REFRESH_S)

    async def _periodic_checkpoint(self) -> None:
        """A periodic checkpoint waits while the global state is not one consistent state (a download
        or repair in progress), since the log is compacted below checkpoints."""
        if not self.keeper.state_consistent():
            log.info("%s: checkpoint deferred: the global state is being downloaded or repaired", self.node_id)
            return
        coordination = self.coordination
        await self.checkpointer.checkpoint_and_compact(self.learner, coordination.core, coordination.persistent,
                                                       stopping=lambda: coordination.frozen)

    def _update_readiness(self) -> None:
        core, keeper = self.coordination.core, self.keeper
        now = self.now()
        facts = ReadinessFacts(
            download=keeper.download.describe() if keeper.download is not None else None,
            learner_compiling=self.role is coord.MemberRole.LEARNER and self.learner is None,
            has_voters=bool(core.log.config.voters), applied_index=keeper.replica.applied_index,
            consistent_from=keeper.consistent_from, log_applied_index=core.log.applied_index,
            commit_target=max(core.log.commit_index, self.coordination.leader_commit),
            replacing_state=keeper.replacing_state(), was_ready=self._ready,
            role="lease holder" if core.is_lease_holder(now) else core.role.value, epoch=core.epoch,
            coordination_silent_s=self._coordination_silent_s(now), lease_s=self.cfg.lease_timeout_s)
        verdict = readiness(facts)
        if verdict.became_ready:
            self._ready = True
            self.notifier.ready(f"{self.node_id} ready")
            log.info("%s ready, %.2f s after process start", self.node_id, process_age_s())
        if self._status_line.due(verdict.reason, now):
            self.notifier.status(verdict.reason)
        self.status.set_ready(verdict.ready, verdict.reason)

    def _coordination_silent_s(self, now: float) -> float | None:
        """Seconds since a lease holder was last heard from (0 while we hold the lease)."""
        core = self.coordination.core
        if core.is_lease_holder(now):
            return 0.0
        heard = core.election.heard_leader_at
        return None if heard is None else max(0.0, now - heard)

    def _status_document(self) -> Any:
        return self.status.document(self.now())

    def _live(self) -> Liveness:
        learner = self.learner
        return liveness(now=self.now(), learner_error=learner.error if learner is not None else None,
                        training=learner is not None and not learner.stop_requested, pace=self.pace)

    # ------------------------------------------------------------------ shutdown

    async def _shutdown(self) -> None:
        """SIGTERM: stop training, leave the run, freeze the replica, write the final checkpoint."""
        loop = asyncio.get_running_loop()
        self.notifier.stopping(f"{self.node_id} stopping")
        self.status.set_ready(False, "stopping")
        if self.learner is not None:
            self.learner.stop()
            await loop.run_in_executor(None, self.learner.join, 60.0)
            log.info("%s: learner stopped at step %s", self.node_id, self.learner.stopped_at_step)
        self._periodic_task.cancel()  # no periodic checkpoint racing the final one
        coordination = self.coordination
        if not self.completed:
            await coordination.leave()
        # Freeze the replica: nothing may be applied between the final checkpoint and exit, so a
        # restart resumes at exactly the index and digest logged below.
        coordination.frozen = True
        self._ticker_task.cancel()
        # Always written, even mid-download: its learner state matters, and a restart re-installs
        # an inconsistent global state from peers.
        await self.checkpointer.checkpoint(self.learner)
        self.store.sync(coordination.persistent)
        coordination.relays.close()  # its spool files: the log holds every payload it took
        replica = self.site.replica
        log.info("%s: stopped cleanly at index %d digest %s", self.node_id, replica.applied_index,
                 replica.state.digest())
        self.history.stop(coordination.core, replica.applied_index)
