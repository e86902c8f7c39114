"""The daemon's composition root: the one place that wires I/O, clock and threads to the sans-IO cores.

One asyncio loop (uvloop when installed) carries all network work: the aiohttp server (peer
routes under /v1 and the operator routes), one outbox worker per peer, the coordination timer
(`CoordinatorNode.tick(now)` every TICK_S on the monotonic clock) and the node's periodic jobs
(status, checkpoints, watchdog). JAX trains in ONE dedicated thread (learner_thread.py) that
never waits on the network; codecs, merges and hashing of big payloads run in a small thread pool.

Rule for coordination actions (bootstrap.coordinator_node): after every call into the core the
durable state is synced to disk *before* any resulting message leaves (replica_store.py).
See docs/DAEMON.md for the process model and message flows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import random
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from bootstrap import messages as coord
from bootstrap.coordinator_node import CoordinatorNode, NodeOptions, PersistentState
from bootstrap.election import LeaseTiming, Role
from bootstrap.entries import EntryKind, LogEntry, Snapshot
from diloco_node.clock import Clock, SystemClock
from diloco_node.learn import data as data_lib
from diloco_node.learn import model as model_lib
from diloco_node.ops.checkpoint import CheckpointError, CheckpointStore, read_checkpoint_file
from diloco_node.config.settings import ConfigError, EffectiveConfig, check_joiner_manifest
from diloco_node.daemon import peers
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.loop_monitor import LagWindow, watch_loop_lag
from diloco_node.daemon.join import (
    FragmentDownload,
    JoinRefused,
    manifest_bytes,
    manifest_digest,
    negotiate,
    snapshot_from_wire,
    snapshot_to_wire,
)
from diloco_node.learn.learner_thread import (
    DueFragment,
    LearnerThread,
    snapshot_from_checkpoint,
    snapshot_meta_and_arrays,
)
from diloco_node.daemon.notify import BackgroundNotifier
from diloco_node.sync.replica import CommitPayload, Replica
from diloco_node.daemon.rounds import RoundDriver
from diloco_node.daemon.tasks import TaskSet
from diloco_node.daemon.replica_store import ReplicaStore, ReplicaStoreError, compaction_point
from diloco_node.sync.syncer import Syncer
from diloco_node.sync.fragments import is_embedding, plan_fragments, wire_fit_problems
from diloco_node.learn.inner import InnerLearner
from diloco_node.sync.merge import Contribution
from diloco_node.config.manifest import RunManifest
from diloco_node.ops.status import FragmentStatus, MemberStatus, MetricsRegistry, QuorumStatus, StatusBuilder, operator_routes
from diloco_node.ops.systemd import SystemdNotifier, run_watchdog
from diloco_node.transport import ClientOptions, PeerClient, PeerRefused, PeerServer, PeerUnreachable, TransportError
from wire import messages as wire
from wire.auth import AuthContext, FrameVerifier, derive_frame_key
from wire.codecs import decode_named, encode_named
from wire.codecs.container import MAX_TENSOR_ELEMENTS
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.limits import MAX_CONTRIBUTION_BYTES, MAX_LOG_APPEND_BYTES

log = logging.getLogger("diloco_node.daemon")

# Coordination timer resolution: heartbeats are every 0.5 s and leases 3 s, so 50 ms of timer
# slack is small against both.
TICK_S = 0.05
# /status figures that need the coordination core are refreshed this often.
STATUS_REFRESH_S = 0.25
# Coordination messages (votes, appends, probes) give up after this; the next tick retries.
# Long enough for a log append of a few MB on a slow WAN link, short against a lease.
COORDINATION_DEADLINE_S = 2.5
# Worker threads for codecs, merges and big-frame hashing (they release the GIL); the learner
# has its own thread. Two is enough on a small host; more only competes with JAX.
POOL_THREADS = 2
# systemd STATUS= lines repeat at most this often while nothing but counters changes.
SYSTEMD_STATUS_EVERY_S = 10.0
# How long a refreshed address book is trusted before a peer is asked again for the member list.
MEMBER_REFRESH_S = 5.0
# A snapshot install whose download failed on every peer (a partition, say) tries again after
# this pause; the node stays not-ready meanwhile and keeps training on its last state.
INSTALL_RETRY_S = 2.0


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (Linux /proc; elsewhere, since this module was imported)."""
    try:
        fields_after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start_ticks = int(fields_after_name[19])  # field 22, starttime, in clock ticks after boot
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


def run_id_for(secret: bytes) -> str:
    """The run id stamped on every frame: derived from the run secret, so sites agree without config."""
    return "run-" + hashlib.sha256(b"diloco-node/run-id\0" + secret).hexdigest()[:16]


@dataclass(slots=True)
class _Outbox:
    pending: list[Any] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Node:
    """One site's daemon. `await run()` returns the process exit code."""

    def __init__(self, effective: EffectiveConfig, *, environ: dict[str, str] | None = None,
                 clock: Clock | None = None) -> None:
        self.clock: Clock = clock or SystemClock()
        self.tasks = TaskSet()
        self.effective = effective
        self.cfg = effective.node
        self.node_id = self.cfg.node_id
        self.environ = dict(os.environ if environ is None else environ)
        self.role = coord.MemberRole.WITNESS if self.cfg.role == "witness" else coord.MemberRole.LEARNER
        self.started = self.clock.monotonic()
        self.status = StatusBuilder(self.node_id, "", self.cfg.role, self.started)
        self.metrics = MetricsRegistry()
        self._commits_metric = self.metrics.counter("diloco_daemon_commits_applied_total", "outer commits applied")
        self._contrib_metric = self.metrics.counter("diloco_daemon_contributions_sent_total", "contributions sent")
        self._merges_metric = self.metrics.counter("diloco_daemon_merges_proposed_total", "merges proposed as lease holder")
        self._compute_metric = self.metrics.gauge("diloco_daemon_learner_compute_seconds",
                                                  "training thread: seconds in the jitted step (cumulative)")
        self._learner_sync_metric = self.metrics.gauge(
            "diloco_daemon_learner_sync_seconds",
            "training thread: seconds applying committed fragments and computing due deltas (cumulative)")
        self.notifier = BackgroundNotifier(SystemdNotifier(self.environ))
        self.loop_lag = LagWindow()
        self.coord: CoordinatorNode | None = None
        self.replica: Replica | None = None
        self.learner: LearnerThread | None = None
        self.syncer: Syncer | None = None
        self.rounds: RoundDriver | None = None
        self.manifest: RunManifest | None = None
        self.addresses = peers.AddressBook({self.node_id: self.cfg.advertise})
        self.addresses.learn(self.node_id, self.cfg.advertise, self.cfg.role)
        self._outboxes: dict[str, _Outbox] = {}
        self._held_applies: list[LogEntry] | None = None  # buffered while the joiner downloads
        self._download: FragmentDownload | None = None
        self._stop = asyncio.Event()
        self._ready = False
        self._ready_reason = "starting"
        self._loss: float | None = None
        self._diverged_fetching: set[int] = set()
        self._systemd_shape, self._systemd_status_at = "", 0.0
        self._consistent_from = 0  # applied index from which our replica is one consistent state
        self._install_floor = 0  # newest snapshot index the state download must reach (0: none)
        self._leader_commit = 0  # highest commit index a lease holder told us
        self._frozen = False  # set while stopping: no message is handled, no entry applied
        self._bytes_reported = (0, 0)  # transport byte totals already added to the status document
        self._last_ok: dict[str, float] = {}  # peer -> last successful exchange (monotonic)
        self._repairs_done = 0  # fragments replaced by a repair (part of the digest cache key)
        self._digest_cache: tuple[Any, str] = (None, "")
        self.exit_reason = ""
        min_step = self.environ.get("DILOCO_X_MIN_STEP_S", "0")
        self._min_step_interval_s = float(min_step) if min_step else 0.0

    # ------------------------------------------------------------------ helpers

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
            secret = self.effective.read_secret()
            try:
                key = derive_frame_key(secret)
            except LocalProtocolError as error:
                raise ConfigError(f"run secret: {error}") from None
        except ConfigError as error:
            log.error("%s", error)
            self.exit_reason = str(error)
            return 2
        run_id = run_id_for(secret)
        self.status.set_run_id(run_id)
        auth = AuthContext(run_id, self.node_id, key)
        verifier = FrameVerifier(run_id, key)
        self.executor = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix=f"pool-{self.node_id}")
        # Checkpoints and log compaction write and fsync megabytes; in the codec pool they would
        # queue the merges, encodes and decodes of the round in progress behind the disk.
        self.disk_executor = ThreadPoolExecutor(1, thread_name_prefix=f"disk-{self.node_id}")
        self.client = PeerClient(auth, verifier, executor=self.executor,
                                 options=ClientOptions(source_address=self.cfg.source_address))
        self.server = PeerServer(auth, verifier, executor=self.executor)
        self._register_handlers()
        data_dir = Path(self.cfg.data_dir)
        try:
            self.checkpoints = CheckpointStore(data_dir / "checkpoints", self.cfg.checkpoint_keep)
        except CheckpointError as error:
            log.error("%s", error)
            self.exit_reason = str(error)
            return 1
        self.store = ReplicaStore(data_dir / "coordination")
        self.history = DaemonHistory.open(data_dir, self.node_id, pace_s=self._min_step_interval_s)
        app = web.Application(client_max_size=1024 ** 2)
        self.server.install(app)
        app.add_routes(operator_routes(self._status_document, self.metrics, self._live))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await self.client.start()
        code = 1
        try:
            site = web.TCPSite(runner, self.cfg.listen.host, self.cfg.listen.port)
            await site.start()
            log.info("%s listening on %s (advertised %s), %.2f s after process start", self.node_id,
                     self.cfg.listen, self.cfg.advertise, process_age_s())
            code = await self._main()
        except (JoinRefused, ConfigError) as error:
            log.error("%s", error)
            self.exit_reason = str(error)
            code = 3
        except OSError as error:
            log.error("cannot listen on %s: %s", self.cfg.listen, error)
            self.exit_reason = str(error)
            code = 1
        finally:
            await self.tasks.close()
            if self.learner is not None and self.learner.is_alive():
                self.learner.stop()
                await loop.run_in_executor(None, self.learner.join, 30.0)
            await self.client.close()
            await runner.cleanup()
            self.executor.shutdown(wait=False, cancel_futures=True)
            self.disk_executor.shutdown(wait=False, cancel_futures=True)
            self.store.close()
            self.history.close()
            self.checkpoints.close()
            self.notifier.close()
        return code

    def _on_signal(self, sig: int) -> None:
        log.info("%s: received %s, shutting down at the next step boundary", self.node_id, signal.Signals(sig).name)
        self._stop.set()

    async def _main(self) -> int:
        loop = asyncio.get_running_loop()
        mode = await self._establish_identity()
        self._mark_phase("identity")
        # Model set-up runs off the loop (JAX init, corpus): /status keeps answering meanwhile.
        await loop.run_in_executor(None, self._build_state)
        self._mark_phase("state built")
        restored = self._restore_checkpoint()
        # The learner's starting base: the global state as of now (copied; the download replaces it).
        self._learner_base = ({n: a.copy() for n, a in self.replica.state.all_params().items()},
                              list(self.replica.state.rounds()))
        if mode == "join":
            # Before coordination starts: entries (or a snapshot) may arrive from then on, and they
            # must find the download in place to be held by it (or to raise its floor).
            self._held_applies = []
            self._download = FragmentDownload(self.client, self.replica, self._download_peers)
        self._start_coordination()
        self._ticker_task = self.tasks.spawn(self._ticker(), name="coordination-ticker")
        self._periodic_task = self.tasks.spawn(self._periodic(), name="periodic")
        self.tasks.spawn(run_watchdog(self.notifier, self._live),  # type: ignore[arg-type]
                                               name="watchdog")
        self.tasks.spawn(watch_loop_lag(self.loop_lag, self.node_id), name="loop-lag")
        # The learner is built and its step compiled in a worker thread WHILE a joiner announces
        # itself and downloads the global state: the two are independent until training starts.
        preparing = (asyncio.ensure_future(loop.run_in_executor(None, self._prepare_learner, restored))
                     if self.role is coord.MemberRole.LEARNER else None)
        if mode == "join":
            await self._announce_to_members()
            download = self._download
            assert download is not None
            started = self.now()
            await download.run()
            log.info("%s: downloaded the global state (%d bytes) in %.2f s", self.node_id,
                     download.bytes_received, self.now() - started)
            self._mark_phase("state downloaded")
            self._finish_download(download)
        elif mode == "restart":
            await self._announce_to_members()
            if self._install_floor:
                self._start_install(self._install_floor)
        if preparing is not None:
            learner = await preparing
            self._start_training(learner, fresh=not restored)
        await self._stop.wait()
        await self._shutdown()
        return 0

    def _mark_phase(self, what: str) -> None:
        """Start-up timeline in the log (seconds since the process started): where join time goes."""
        log.info("%s: %s at %.2f s after process start", self.node_id, what, process_age_s())

    # ------------------------------------------------------------------ identity and state

    async def _establish_identity(self) -> str:
        if self.store.exists():
            identity = self.store.load_identity()
            if identity.get("node_id") != self.node_id:
                raise ConfigError(f"data_dir {self.cfg.data_dir} belongs to node {identity.get('node_id')!r}, "
                                  f"not {self.node_id!r}")
            self.manifest = RunManifest.from_dict(identity["manifest"])
            check_joiner_manifest(self.effective.run, self.manifest, self.effective.explicit_run_keys())
            for node_id, url in identity.get("addresses", {}).items():
                self.addresses.learn(node_id, url)
            self._persistent = self.store.load_persistent()
            return "restart"
        if self.cfg.is_founder:
            self.manifest = self.effective.run
            self._persistent = PersistentState.founding([self.node_id])
            self._save_identity()
            return "found"
        urls = [peer.url() for peer in self.cfg.bootstrap]
        self._ready_reason = f"joining through {', '.join(urls)}"
        manifest, membership, via = await negotiate(self.client, urls, self.effective, self.node_id,
                                                    self.cfg.advertise, peers.role_to_wire(self.role))
        self.manifest = manifest
        self._learn_members(membership)
        self._bootstrap_url = via
        self._persistent = PersistentState.joining()
        self._save_identity()
        return "join"

    def _save_identity(self) -> None:
        assert self.manifest is not None
        self.store.save_identity({"node_id": self.node_id, "role": self.cfg.role,
                                  "manifest": self.manifest.to_dict(), "addresses": self.addresses.to_dict()})

    def _learn_members(self, membership: wire.Membership) -> None:
        changed = False
        for member in membership.members:
            changed |= self.addresses.learn(member.node_id, member.advertise_url, member.role.value)
        if changed and self.manifest is not None:
            self._save_identity()

    def _build_state(self) -> None:
        manifest = self.manifest
        assert manifest is not None
        self.corpus = data_lib.load_corpus(manifest.data) if self.role is coord.MemberRole.LEARNER else None
        cfg = model_lib.model_config(manifest.model.size, manifest.model.seq_len)
        vocab = self.corpus.vocab_size if self.corpus is not None else cfg.vocab_size
        if vocab != cfg.vocab_size:
            cfg = dataclasses.replace(cfg, vocab_size=vocab)
        self.model_cfg = cfg
        if self.role is coord.MemberRole.LEARNER:
            # The learner's model, initialised once: its weights are also the run's initial state
            # (the same seed), so start-up does not initialise the model twice.
            self._inner = InnerLearner(cfg, manifest.inner, manifest.seed)
            initial = self._inner.get_flat()
        else:
            _, params = model_lib.split_model(model_lib.init_model(cfg, manifest.seed))
            initial = model_lib.flat_params(params)
        shapes = {n: a.shape for n, a in initial.items()}
        sync = manifest.sync
        self.plan = plan_fragments(shapes, sync.fragments, sync.period, sync.overlap)
        too_big = wire_fit_problems(self.plan, shapes, sync.codec_up, sync.codec_down,
                                    max_contribution_bytes=MAX_CONTRIBUTION_BYTES,
                                    max_log_append_bytes=MAX_LOG_APPEND_BYTES,
                                    max_decoded_elements=MAX_TENSOR_ELEMENTS)
        if too_big:
            raise ConfigError("the run's fragments do not fit the wire limits: " + "; ".join(too_big))
        self.replica = Replica(self.plan, initial, manifest.outer)
        self.syncer = Syncer(manifest, [n for n in initial if is_embedding(n)])
        self.state_bytes = sum(a.nbytes for a in initial.values()) * 2  # params + momentum

    def _restore_checkpoint(self) -> Any:
        """Global state and learner state from our newest good checkpoint (None if there is none).

        The durable log holds the entries after its snapshot point; the checkpoint must lie
        between that point and the log's end, so replaying the log from it is complete. A
        checkpoint older than the point (the newest failed verification and an older one was
        used, or the checkpoints were removed) cannot be replayed: the node then installs the
        global state from peers, as after a snapshot install (`_start_install`).
        """
        assert self.replica is not None
        snapshot_index = self._persistent.log.snapshot.last_index
        last = snapshot_index + len(self._persistent.log.entries)
        loaded = self.checkpoints.load_latest()
        if loaded is None:
            self._need_install_if_compacted(0, snapshot_index)
            return None
        meta, arrays = loaded.checkpoint.meta, loaded.checkpoint.arrays
        fragments = []
        for p, fragment in enumerate(self.plan.fragments):
            fragments.append({
                "fragment": p, "round": int(meta["rounds"][p]),
                "params": {n: np.array(arrays[f"global/params/{n}"]) for n in fragment.names},
                "momentum": {n: np.array(arrays[f"global/momentum/{n}"]) for n in fragment.names},
            })
        digest = self.replica.state.restore({"format": 1, "rounds": list(meta["rounds"]), "fragments": fragments},
                                            expected_digest=meta["state_digest"])
        applied = int(meta["applied_index"])
        if applied > last:
            raise ConfigError(f"checkpoint applied through {applied} but the durable log ends at {last}; "
                              "the coordination directory does not belong to this checkpoint")
        self.replica.applied_index = applied
        # Older checkpoints have none: the next commit of each fragment brings its reference.
        self.replica.norm_refs = {int(p): float(v) for p, v in meta.get("norm_refs", {}).items()}
        log.info("%s: resumed from checkpoint %s at index %d digest %s", self.node_id,
                 loaded.checkpoint.sequence, applied, digest)
        self._need_install_if_compacted(applied, snapshot_index)
        return meta.get("learner") and snapshot_from_checkpoint(meta["learner"], arrays)

    def _need_install_if_compacted(self, applied: int, snapshot_index: int) -> None:
        """The log starts after `snapshot_index`; a state older than that is replaced from peers."""
        if applied >= snapshot_index:
            return
        if not self.cfg.bootstrap and not any(n != self.node_id for n, _ in self.addresses.items()):
            raise ConfigError(f"the global state is as of index {applied} but the durable log was compacted "
                              f"through {snapshot_index}, and there is no peer to fetch the state from")
        log.warning("%s: the global state is as of index %d but the durable log starts after %d; "
                    "installing the global state from peers", self.node_id, applied, snapshot_index)
        self.replica.applied_index = snapshot_index
        self._install_floor = snapshot_index
        self._consistent_from = snapshot_index
        self._held_applies = []  # coordination may apply entries before the download starts

    def _start_coordination(self) -> None:
        assert self.replica is not None
        lease = LeaseTiming(lease_s=self.cfg.lease_timeout_s, heartbeat_interval_s=self.cfg.heartbeat_interval_s)
        options = NodeOptions(lease=lease, leave_timeout_s=max(3.0, 3 * self.cfg.lease_timeout_s))
        self.coord = CoordinatorNode(self.node_id, self._persistent, now=self.now(),
                                     rng=random.Random(os.urandom(16)), applied_index=self.replica.applied_index,
                                     role=self.role, address=self.cfg.advertise, options=options)
        self.store.sync(self._persistent)
        self.rounds = RoundDriver(
            node_id=self.node_id, manifest=self.manifest, plan=self.plan, syncer=self.syncer, replica=self.replica,
            coordination=self.coord, addresses=self.addresses, client=self.client, executor=self.executor,
            clock=self.clock, tasks=self.tasks, dispatch=self._dispatch, replica_behind=self._replica_behind,
            report_error=self._error, contributions_sent=self._contrib_metric, merges_proposed=self._merges_metric)
        self.history.start(self.coord, self.replica.applied_index, self.manifest.sync if self.manifest else None)

    def _prepare_learner(self, restored: Any) -> LearnerThread:
        """Build the learner and compile its step (in a worker thread; touches no loop state)."""
        assert self.manifest is not None and self.corpus is not None
        learner = LearnerThread(
            node_id=self.node_id, cfg=self.model_cfg, manifest=self.manifest, plan=self.plan, corpus=self.corpus,
            global_params=self._learner_base[0], global_rounds=self._learner_base[1],
            on_contribution=self._from_learner_contribution, on_progress=self._from_learner_progress,
            min_step_interval_s=self._min_step_interval_s, inner=self._inner)
        if restored:
            learner.restore(restored)
        seconds = learner.compile()
        log.info("%s: training step compiled in %.1f s (%.2f s after process start)", self.node_id, seconds,
                 process_age_s())
        return learner

    def _start_training(self, learner: LearnerThread, *, fresh: bool) -> None:
        """Bring the compiled learner up to the replica's current global state and start stepping.

        Training starts as soon as the global state is in place (founded, restored or downloaded):
        it does not wait for the replica to replay the log to the newest commit (that can be a long
        history, and a learner on a slightly older fragment is rebased by the syncer anyway).
        `/readyz` still waits for the replica rule in `_update_readiness`.
        """
        assert self.replica is not None
        state = self.replica.state
        if fresh:
            learner.adopt_global(state.all_params(), list(state.rounds()))
        else:  # a restored learner keeps its own weights; fragments committed since arrive as offers
            for p in range(self.plan.num_fragments):
                learner.offer_fragment(p, state.round(p), state.fragment_params(p))
        self.learner = learner
        learner.start()
        learner.begin_training()
        self._mark_phase("training started")

    async def _announce_to_members(self) -> None:
        """Tell every member we know that we are here (joiners, and restarts after a leave)."""
        assert self.manifest is not None
        request = wire.JoinRequest(self.node_id, self.cfg.advertise, peers.role_to_wire(self.role),
                                   manifest_digest(self.manifest))

        async def one(url: str) -> None:
            try:
                replies = await self.client.send(url, request, deadline_s=5.0)
                for reply in replies:
                    if isinstance(reply, wire.Membership):
                        self._learn_members(reply)
            except TransportError as error:
                log.info("announce to %s failed: %s", url, error)

        urls = [url for node_id, url in self.addresses.items() if node_id != self.node_id]
        await asyncio.gather(*(one(url) for url in urls))

    def _download_peers(self) -> list[str]:
        first = getattr(self, "_bootstrap_url", None)
        others = [url for node_id, url in self.addresses.items() if node_id != self.node_id and url != first]
        return ([first] if first else []) + others

    # ------------------------------------------------------------------ coordination plumbing

    async def _ticker(self) -> None:
        while True:
            self._dispatch(self.coord.tick(self.now()))
            self._after_coordination()
            await self.clock.sleep(TICK_S)

    def _handle(self, message: coord.Message) -> list[coord.Action]:
        return self.coord.handle(message, self.now())

    def _dispatch(self, actions: list[coord.Action], *, reply_to: str | None = None,
                  reply_type: type | None = None) -> coord.Message | None:
        """Persist, then perform actions; returns (not sends) the reply to `reply_to` if asked for one."""
        self.store.sync(self._persistent)
        self.history.observe(self.coord)  # after the sync: the history never claims more than the disk
        reply = None
        if self._frozen:
            return None
        for action in actions:
            if isinstance(action, coord.Send):
                if (reply_to is not None and reply is None and action.to == reply_to
                        and reply_type is not None and isinstance(action.message, reply_type)):
                    reply = action.message
                else:
                    self._send(action.to, action.message)
            elif isinstance(action, coord.ApplyEntry):
                self._apply(action.entry)
            elif isinstance(action, coord.RestoreSnapshot):
                self._on_restore_snapshot(action.snapshot)
        return reply

    def _send(self, to: str, message: coord.Message) -> None:
        if to == self.node_id:
            return
        outbox = self._outboxes.get(to)
        if outbox is None:
            outbox = self._outboxes[to] = _Outbox()
            self.tasks.spawn(self._peer_worker(to, outbox), name=f"outbox-{to}")
        if isinstance(message, (coord.AppendEntries, coord.InstallSnapshot)):
            # A newer replication message supersedes a queued older one (same leader state, later).
            outbox.pending = [m for m in outbox.pending
                              if not isinstance(m, (coord.AppendEntries, coord.InstallSnapshot))]
        outbox.pending.append(message)
        outbox.wake.set()

    async def _peer_worker(self, peer: str, outbox: _Outbox) -> None:
        while True:
            await outbox.wake.wait()
            outbox.wake.clear()
            batch, outbox.pending = outbox.pending, []
            for message in batch:
                try:
                    await self._deliver(peer, message)
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # one bad exchange must not stop the worker
                    log.exception("delivery of %s to %s failed: %s", type(message).__name__, peer, error)

    async def _deliver(self, peer: str, message: coord.Message) -> None:
        url = self.addresses.url(peer)
        if url is None:
            record = self.coord.membership.record(peer)
            url = record.address if record is not None and record.address else None
        if url is None:
            return  # learned from a configuration entry before its address: the member refresh fixes it
        assert self.coord is not None
        if (isinstance(message, (coord.AppendEntries, coord.InstallSnapshot))
                and not (message.epoch == self.coord.epoch and self.coord.election.may_act_as_leader(self.now()))):
            # Queued while we led, but our lease ran out before it could leave (the process was
            # paused, or the link stalled): a follower would take it as the holder being alive and
            # refuse every candidate for another lease time. Dropping a message is always safe.
            return
        if isinstance(message, coord.InstallSnapshot):
            out: wire.Message | None = snapshot_to_wire(message, self.coord.log.commit_index)
        else:
            out = peers.to_wire(message, epoch=self.coord.epoch, commit_index=self.coord.log.commit_index,
                                last_index=self.coord.log.last_index)
        if out is None:
            return
        try:
            replies = await self.client.send(url, out, peer=peer, deadline_s=COORDINATION_DEADLINE_S)
        except PeerRefused as error:
            if error.status not in (503,):
                self._error(f"{peer} refused {type(out).__name__}: {error.status} {error.reason}")
            return
        except PeerUnreachable:
            return
        self._last_ok[peer] = self.now()
        for reply in replies:
            self._on_reply(peer, message, reply)

    def _on_reply(self, peer: str, request: coord.Message, reply: wire.Message) -> None:
        try:
            if isinstance(reply, wire.VoteReply) and reply.voter == peer:
                self._dispatch(self._handle(peers.vote_response_from_wire(reply)))
            elif (isinstance(reply, wire.LogAck) and reply.follower == peer
                  and isinstance(request, (coord.AppendEntries, coord.InstallSnapshot))):
                self._dispatch(self._handle(peers.append_response_from_wire(reply, request.sent_at)))
            elif isinstance(reply, wire.HeartbeatAck) and reply.follower == peer and isinstance(request, coord.Ping):
                self._revive(peer)
                ack = coord.PingAck(request.seq, peer, peer, ())
                self._dispatch(self._handle(ack))
            else:
                self._error(f"unexpected {type(reply).__name__} from {peer} in answer to {type(request).__name__}")
        except (RemoteProtocolError, LocalProtocolError) as error:
            self._error(f"bad reply from {peer}: {error}")
        self._after_coordination()

    def _revive(self, peer: str, role: coord.MemberRole | None = None, *, even_if_left: bool = False) -> None:
        current = self.coord.membership.record(peer)
        if current is not None and current.state is coord.MemberState.LEFT and not even_if_left:
            return
        url = self.addresses.url(peer) or (current.address if current else "")
        role = role or (current.role if current else coord.MemberRole.LEARNER)
        record = peers.revived_record(current, peer, url, role)
        if record is not None:
            self._dispatch_dropping_replies(self._handle(coord.Ping(0, peer, (record,))))

    def _dispatch_dropping_replies(self, actions: list[coord.Action]) -> None:
        self._dispatch([a for a in actions if not (isinstance(a, coord.Send) and isinstance(a.message, coord.PingAck))])

    # ------------------------------------------------------------------ peer API handlers

    def _register_handlers(self) -> None:
        on = self.server.on_message
        on(wire.MessageKind.VOTE_REQUEST, self._on_vote_request)
        on(wire.MessageKind.LOG_APPEND, self._on_log_append)
        on(wire.MessageKind.HEARTBEAT, self._on_heartbeat)
        on(wire.MessageKind.LEAVE, self._on_leave)
        on(wire.MessageKind.JOIN_REQUEST, self._on_join_request)
        on(wire.MessageKind.SNAPSHOT_REQUEST, self._on_snapshot_request)
        on(wire.MessageKind.FRAGMENT_CONTRIBUTION, self._on_contribution)

    def _require_coordination(self) -> CoordinatorNode:
        if self.coord is None:
            raise RemoteProtocolError(f"{self.node_id} is still starting", 503)
        if self._frozen:
            raise RemoteProtocolError(f"{self.node_id} is stopping", 503)
        return self.coord

    def _same_sender(self, claimed: str, peer: Any, what: str) -> None:
        if claimed != peer.node_id:
            raise RemoteProtocolError(f"{what} names {claimed!r} but is signed by {peer.node_id!r}", 400)
        self._last_ok[peer.node_id] = self.now()

    async def _on_vote_request(self, message: wire.VoteRequest, peer: Any) -> wire.Message | None:
        self._require_coordination()
        self._same_sender(message.candidate, peer, "VoteRequest")
        reply = self._dispatch(self._handle(peers.vote_request_from_wire(message)), reply_to=peer.node_id,
                               reply_type=coord.VoteResponse)
        self._after_coordination()
        return peers.to_wire(reply, epoch=0, commit_index=0, last_index=0) if reply is not None else None

    async def _on_log_append(self, message: wire.LogAppend, peer: Any) -> wire.Message | None:
        coordination = self._require_coordination()
        self._same_sender(message.leader, peer, "LogAppend")
        self._leader_commit = max(self._leader_commit, message.leader_commit)
        install = snapshot_from_wire(message)
        incoming = install if install is not None else peers.append_from_wire(message)
        reply = self._dispatch(self._handle(incoming), reply_to=peer.node_id, reply_type=coord.AppendResponse)
        self._after_coordination()
        if reply is None:
            return None
        return peers.to_wire(reply, epoch=coordination.epoch, commit_index=0, last_index=0)

    async def _on_heartbeat(self, message: wire.Heartbeat, peer: Any) -> wire.Message | None:
        coordination = self._require_coordination()
        self._same_sender(message.leader, peer, "Heartbeat")
        self._revive(peer.node_id)
        reply = self._dispatch(self._handle(coord.Ping(message.seq, peer.node_id, ())), reply_to=peer.node_id,
                               reply_type=coord.PingAck)
        if reply is None:
            return None
        return peers.to_wire(reply, epoch=coordination.epoch, commit_index=coordination.log.commit_index,
                             last_index=coordination.log.last_index)

    async def _on_leave(self, message: wire.Leave, peer: Any) -> None:
        self._require_coordination()
        self._same_sender(message.node_id, peer, "Leave")
        record = peers.left_record(self.coord.membership.record(peer.node_id))
        if record is not None:
            self._dispatch_dropping_replies(self._handle(coord.Ping(0, peer.node_id, (record,))))
        log.info("%s leaves: %s", peer.node_id, message.reason)
        return None

    async def _on_join_request(self, message: wire.JoinRequest, peer: Any) -> wire.Message:
        coordination = self._require_coordination()
        self._same_sender(message.node_id, peer, "JoinRequest")
        assert self.manifest is not None
        if message.manifest_digest == manifest_digest(self.manifest):
            role = peers.role_from_wire(message.role)
            if self.addresses.learn(message.node_id, message.advertise_url, message.role.value):
                self._save_identity()
            self._revive(message.node_id, role, even_if_left=True)
            log.info("%s admitted %s (%s, %s)", self.node_id, message.node_id, message.role.value,
                     message.advertise_url)
        voters = coordination.log.config.voters
        members = tuple(wire.Member(node_id, url, wire.Role(self.addresses.role(node_id) or "learner"),
                                    node_id in voters)
                        for node_id, url in self.addresses.items())
        return wire.Membership(coordination.epoch, coordination.log.latest_config_index(), members,
                               manifest_bytes(self.manifest))

    async def _on_snapshot_request(self, message: wire.SnapshotRequest, peer: Any) -> wire.Message:
        self._require_coordination()
        replica = self.replica
        if replica is None or self._download is not None:
            raise RemoteProtocolError(f"{self.node_id} has no complete global state yet", 503)
        if not 0 <= message.fragment < replica.plan.num_fragments:
            raise RemoteProtocolError(f"fragment {message.fragment} does not exist", 400)
        if message.fragment in replica.diverged:
            raise RemoteProtocolError(f"fragment {message.fragment} is being repaired here", 503)
        _, data, digest = await asyncio.get_running_loop().run_in_executor(
            self.executor, replica.fragment_bytes, message.fragment)
        start = min(message.offset, len(data))
        part = data[start:start + message.max_length]
        return wire.SnapshotChunk(message.fragment, replica.applied_index, start, len(data), digest, part)

    # ------------------------------------------------------------------ snapshot install

    def _on_restore_snapshot(self, snapshot: Snapshot) -> None:
        """The lease holder's log no longer holds what we need: the core adopted its snapshot
        (our commit and applied index jumped to `snapshot.last_index`). The global state as of at
        least that index is downloaded from peers; entries committed meanwhile are held and applied
        after it, exactly as for a joiner."""
        floor = snapshot.last_index
        log.info("%s: snapshot through %d (epoch %d) installed from the lease holder; fetching the global "
                 "state (replica at %d)", self.node_id, floor, snapshot.last_epoch, self.replica.applied_index)
        if self._held_applies is not None:
            self._held_applies = [e for e in self._held_applies if e.index > floor]
        self._start_install(floor)

    def _start_install(self, floor: int) -> None:
        """Download the global state as of `floor` or newer (or raise a running download's floor)."""
        self._install_floor = max(self._install_floor, floor)
        self._consistent_from = max(self._consistent_from, floor)
        self.history.state_replaced()
        if self._download is not None:  # a join or an earlier install is downloading: it must reach this
            self._download.raise_floor(floor)
            return
        if self._held_applies is None:
            self._held_applies = []
        download = self._download = FragmentDownload(self.client, self.replica, self._repair_peers,
                                                     min_commit_index=self._install_floor)
        self.tasks.spawn(self._install_state(download), name="snapshot-install")

    async def _install_state(self, download: FragmentDownload) -> None:
        started = self.now()
        while True:
            try:
                await download.run()
                break
            except JoinRefused as error:
                self._error(f"snapshot install: {error}; retrying in {INSTALL_RETRY_S:.0f} s")
                await self.clock.sleep(INSTALL_RETRY_S)
        log.info("%s: snapshot install: global state downloaded (%d bytes, fragments as of index >= %d) "
                 "in %.2f s", self.node_id, download.bytes_received, download.min_commit_index,
                 self.now() - started)
        self._finish_download(download)

    def _finish_download(self, download: FragmentDownload) -> None:
        """The downloaded state is in place: apply what was held, rebase the learner."""
        replica = self.replica
        assert replica is not None
        self._consistent_from = max(self._consistent_from, download.max_commit_index, self._install_floor)
        if replica.applied_index < self._install_floor:
            replica.applied_index = self._install_floor
        held, self._held_applies = self._held_applies or [], None
        self._download = None
        self.history.state_replaced()
        for entry in held:
            if entry.index > replica.applied_index:
                self._apply(entry)
        if self.learner is not None:  # rebased on the new global state, as after a join download
            for p in range(self.plan.num_fragments):
                self.learner.offer_fragment(p, replica.state.round(p), replica.state.fragment_params(p))

    def _replacing_state(self) -> bool:
        """A download (join or snapshot install) is in progress, or its held entries not yet applied."""
        return self._download is not None or self.replica.applied_index < self._consistent_from

    def _state_consistent(self) -> bool:
        """The replica is one global state as of its applied index (not mid-download or repair)."""
        return self.replica is not None and not self._replacing_state() and not self.replica.diverged

    # ------------------------------------------------------------------ applying commits

    def _apply(self, entry: LogEntry) -> None:
        if self._held_applies is not None:
            self._held_applies.append(entry)
            return
        assert self.replica is not None
        outcome = self.replica.apply(entry)
        self.history.applied(entry, self.replica, self._consistent_from, self.coord.epoch)
        if entry.kind is EntryKind.OUTER_COMMIT:
            log.info("%s apply %s", self.node_id, outcome.reason)
            if outcome.applied:
                self._commits_metric.inc()
        if outcome.diverged and outcome.fragment is not None:
            self._error(outcome.reason)
            self._repair(outcome.fragment)
        if outcome.applied and outcome.fragment is not None and self.learner is not None:
            p = outcome.fragment
            self.learner.offer_fragment(p, self.replica.state.round(p), self.replica.state.fragment_params(p))

    def _repair(self, p: int) -> None:
        """Fetch fragment p from the lease holder (or any peer) after a digest mismatch or gap."""
        if p in self._diverged_fetching:
            return
        self._diverged_fetching.add(p)

        async def fetch() -> None:
            try:
                download = FragmentDownload(self.client, self.replica, self._repair_peers)
                await download._one(download.progress[p], attempts=10)
                log.info("%s repaired fragment %d from a peer", self.node_id, p)
                if self.learner is not None:
                    self.learner.offer_fragment(p, self.replica.state.round(p), self.replica.state.fragment_params(p))
            except JoinRefused as error:
                self._error(f"fragment {p} repair failed: {error}")
            finally:
                self._repairs_done += 1
                self._diverged_fetching.discard(p)

        self.tasks.spawn(fetch(), name=f"repair-{p}")

    def _repair_peers(self) -> list[str]:
        leader = self.coord.election.leader_id if self.coord else None
        urls = [self.addresses.url(leader)] if leader and leader != self.node_id and self.addresses.url(leader) else []
        return urls + [u for n, u in self.addresses.items() if n != self.node_id and u not in urls]

    # ------------------------------------------------------------------ learner -> network

    def _from_learner_progress(self, step: int, loss: float, tokens: int) -> None:
        self._loss = loss
        self.status.record_learner(step=step, loss=loss, tokens=tokens, now=self.now())
        learner = self.learner
        if learner is not None:
            self._compute_metric.set(learner.compute_seconds_total)
            self._learner_sync_metric.set(learner.sync_seconds_total)
        self.history.learner_step(step, loss, tokens, self.learner)

    def _from_learner_contribution(self, due: DueFragment) -> None:
        """Called in the learner thread: hand over to the loop (never block training)."""
        assert self.rounds is not None
        self.loop.call_soon_threadsafe(self.rounds.send_contribution, due)

    async def _on_contribution(self, message: wire.FragmentContribution, peer: Any) -> None:
        self._require_coordination()
        self._same_sender(message.learner_id, peer, "FragmentContribution")
        assert self.rounds is not None
        await self.rounds.on_contribution(message)

    def _replica_behind(self) -> str:
        """Why the replica cannot take a merge now ("" when it can): the round proposed must be the
        next one of its fragment, so the state must include every entry of our own log."""
        log_ = self.coord.log
        if log_.applied_index != log_.last_index:
            return f"replica behind its own log: applied {log_.applied_index} of {log_.last_index}"
        if self._replacing_state():
            return "the global state is being replaced (download or snapshot install)"
        return ""

    def _after_coordination(self) -> None:
        if self.rounds is not None:
            self.rounds.lease_check()

    # ------------------------------------------------------------------ periodic work

    async def _periodic(self) -> None:
        next_checkpoint = self.now() + self.cfg.checkpoint_interval_s
        next_refresh = self.now() + MEMBER_REFRESH_S
        while True:
            now = self.now()
            self._update_readiness()
            self._refresh_status()
            if now >= next_checkpoint and self._ready:
                next_checkpoint = now + self.cfg.checkpoint_interval_s
                saved = await self._checkpoint()
                if saved is not None:
                    try:
                        await self._compact_log(*saved)
                    except (OSError, ReplicaStoreError) as error:  # e.g. a full disk: keep the long log
                        self._error(f"log compaction failed, the log stays as it is: {error}")
            if now >= next_refresh:
                next_refresh = now + MEMBER_REFRESH_S
                await self._refresh_members()
            await self.clock.sleep(STATUS_REFRESH_S)

    async def _refresh_members(self) -> None:
        """Learn addresses of members we only know by id (from configuration entries)."""
        missing = [v for v in self.coord.log.config.voters if self.addresses.url(v) is None]
        if not missing:
            return
        await self._announce_to_members()

    def _update_readiness(self) -> None:
        coordination = self.coord
        if coordination is None:
            return
        reason = ""
        if self._download is not None:
            reason = self._download.describe()
        elif self.role is coord.MemberRole.LEARNER and self.learner is None:
            reason = "compiling the training step"
        elif not coordination.log.config.voters:
            reason = "waiting for the run's configuration to replicate"
        elif self.replica.applied_index < self._consistent_from:
            # A joiner's fragments were downloaded as of different indices: not one consistent
            # state (nor a digest worth showing) until the log is replayed through the newest.
            reason = f"replaying the log: applied {self.replica.applied_index} of {self._consistent_from}"
        elif coordination.log.applied_index < max(coordination.log.commit_index, self._leader_commit):
            reason = (f"catching up: applied {coordination.log.applied_index} of "
                      f"{max(coordination.log.commit_index, self._leader_commit)}")
        ready = not reason
        if ready and not self._ready:
            self._ready = True
            self.notifier.ready(f"{self.node_id} ready")
            log.info("%s ready, %.2f s after process start", self.node_id, process_age_s())
        # Once ready, a node stays ready while it catches up from the log (its state is always one
        # committed state); during a snapshot install it is not one state, so /status and /readyz
        # say not ready (and show no digest worth comparing) until the download is replayed.
        installing = self._ready and self._replacing_state()
        if installing:
            reason = f"installing a snapshot: {reason}"
        elif self._ready:
            role = "lease holder" if coordination.is_lease_holder(self.now()) else coordination.role.value
            reason = f"ready: {role}, epoch {coordination.epoch}, applied {self.replica.applied_index}"
        # systemd's STATUS= line: when the kind of state changes (numbers aside), else at most every
        # SYSTEMD_STATUS_EVERY_S; the notify socket is a blocking datagram socket, so never a flood.
        shape = re.sub(r"\d+", "#", reason)
        if shape != self._systemd_shape or self.now() - self._systemd_status_at >= SYSTEMD_STATUS_EVERY_S:
            self.notifier.status(reason)
            self._systemd_shape, self._systemd_status_at = shape, self.now()
        self._ready_reason = reason
        self.status.set_ready(self._ready and not installing, reason)

    def _refresh_status(self) -> None:
        coordination = self.coord
        if coordination is None or self.replica is None:
            return
        now = self.now()
        holder = coordination.election.leader_id
        voters = coordination.log.config.voters
        members = []
        for node_id, record in sorted(coordination.membership.members.items()):
            heard = self._last_ok.get(node_id) if node_id != self.node_id else None
            members.append(MemberStatus(node_id=node_id, url=self.addresses.url(node_id) or record.address,
                                        role=record.role.value, alive=record.state is coord.MemberState.ALIVE,
                                        voter=node_id in voters,
                                        last_seen_s=None if heard is None else round(now - heard, 3)))
        sent = self.client.counters.total_sent + self.server.counters.total_sent
        received = self.client.counters.total_received + self.server.counters.total_received
        self.status.add_bytes(sent=sent - self._bytes_reported[0], received=received - self._bytes_reported[1])
        self._bytes_reported = (sent, received)
        quorum = QuorumStatus()
        if self.syncer is not None and self.rounds is not None and coordination.is_lease_holder(now):
            quorum = QuorumStatus(have=sum(len(r.pending) for r in self.syncer.rounds.values()),
                                  need=self.syncer.policy.min_quorum, reason=self.rounds.quorum_reason()[:400])
        self.status.set_coordination(
            epoch=coordination.epoch, coordinator=holder if holder else None,
            commit_index=self.replica.applied_index, state_digest=self._state_digest(),
            members=members, quorum=quorum,
            fragments=[FragmentStatus(p, r) for p, r in enumerate(self.replica.state.rounds())])
        self.status.set_log(first_index=self.store.log_first_index, size_bytes=self.store.log_bytes)
        self.status.set_loop_lag(worst_s=self.loop_lag.worst_recent_s, stalls=self.loop_lag.stalls)

    def _state_digest(self) -> str:
        """The global state's digest for /status, recomputed only when the state changed (it hashes
        the whole state: ~1 MB for the tiny model, every STATUS_REFRESH_S otherwise)."""
        replica = self.replica
        key = (replica.applied_index, replica.state.rounds(), self._repairs_done)
        if self._download is not None:  # fragments change under a download: never cached
            self._digest_cache = (None, replica.state.digest())
        elif self._digest_cache[0] != key:
            self._digest_cache = (key, replica.state.digest())
        return self._digest_cache[1]

    def _status_document(self) -> Any:
        return self.status.document(self.now())

    def _live(self) -> bool:
        learner = self.learner
        return learner is None or learner.error is None

    async def _checkpoint(self, *, final: bool = False) -> tuple[Path, int] | None:
        """Local weights, AdamW state, counters, applied index and the global state, atomically.

        Returns (file, applied index), or None when skipped: a periodic checkpoint waits while the
        global state is not one consistent state (a download or repair in progress), since the
        log is compacted below checkpoints. The final one at shutdown is always written (its
        learner state matters; a restart re-installs an inconsistent global state from peers).
        """
        replica = self.replica
        assert replica is not None
        if not final and not self._state_consistent():
            log.info("%s: checkpoint deferred: the global state is being downloaded or repaired", self.node_id)
            return None
        state = replica.state
        meta: dict[str, Any] = {"node_id": self.node_id, "applied_index": replica.applied_index,
                                "rounds": list(state.rounds()), "state_digest": state.digest(),
                                "norm_refs": {str(p): v for p, v in sorted(replica.norm_refs.items())}}
        arrays: dict[str, np.ndarray] = {}
        for p in range(self.plan.num_fragments):
            for n, a in state.fragment_params(p).items():
                arrays[f"global/params/{n}"] = a
            for n, a in state.momentum(p).items():
                arrays[f"global/momentum/{n}"] = a
        if self.learner is not None:
            future = self.learner.request_state()
            snap = await asyncio.wrap_future(future)
            learner_meta, learner_arrays = snapshot_meta_and_arrays(snap)
            meta["learner"] = learner_meta
            arrays.update(learner_arrays)
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(self.disk_executor, self.checkpoints.save, meta, arrays)
        log.info("%s checkpoint %s at index %d", self.node_id, path.name, meta["applied_index"])
        return path, int(meta["applied_index"])

    async def _compact_log(self, path: Path, checkpointed: int) -> None:
        """Compact the log below a checkpoint once the checkpoint reads back intact.

        The new `log.bin` (snapshot header + the kept committed entries) is written in a worker
        thread while the log keeps growing; the core then drops the prefix and `store.sync` appends
        the entries added meanwhile and renames the file into place (replica_store.py).
        """
        coordination, loop = self.coord, asyncio.get_running_loop()
        assert coordination is not None
        replog = coordination.log
        # Decided first: most checkpoints cut nothing, and those need not read their file back.
        through, reason = compaction_point(checkpoint_index=checkpointed, commit_index=replog.commit_index,
                                           snapshot_index=replog.store.snapshot.last_index,
                                           retain=self.cfg.log_retain_entries)
        if through is None:
            log.debug("%s: %s", self.node_id, reason)
            return
        try:
            checkpoint = await loop.run_in_executor(self.disk_executor, read_checkpoint_file, path)
            verified = int(checkpoint.meta["applied_index"])
        except (CheckpointError, KeyError, TypeError, ValueError) as error:
            self._error(f"checkpoint {path.name} did not verify; log not compacted: {error}")
            return
        if verified != checkpointed:
            self._error(f"checkpoint {path.name} holds index {verified}, expected {checkpointed}; log not compacted")
            return
        epoch = replog.epoch_at(through)
        assert epoch is not None
        snapshot = Snapshot(through, epoch, replog.config_at(through))
        committed = [e for i in range(through + 1, replog.commit_index + 1) if (e := replog.entry_at(i)) is not None]
        prepared = await loop.run_in_executor(self.disk_executor, self.store.prepare_compaction, snapshot,
                                              committed)
        if self._frozen or replog.store.snapshot.last_index >= through or replog.applied_index < through:
            self.store.discard_prepared()  # stopping, or a snapshot was installed meanwhile
            return
        before = self.store.log_bytes
        coordination.compact(through, b"")
        self.store.sync(self._persistent, prepared)
        log.info("%s: log %s; log.bin %d -> %d bytes, first index %d", self.node_id, reason, before,
                 self.store.log_bytes, self.store.log_first_index)

    # ------------------------------------------------------------------ shutdown

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        self.notifier.stopping(f"{self.node_id} stopping")
        self._ready_reason = "stopping"
        if self.learner is not None:
            self.learner.stop()
            await loop.run_in_executor(None, self.learner.join, 60.0)
            log.info("%s: learner stopped at step %s", self.node_id, self.learner.stopped_at_step)
        coordination = self.coord
        self._periodic_task.cancel()  # no periodic checkpoint racing the final one
        if coordination is not None and set(coordination.log.config.voters) - {self.node_id}:
            self._dispatch(coordination.leave(self.now()))
            deadline = self.now() + coordination.options.leave_timeout_s
            while not coordination.left and self.now() < deadline:
                await self.clock.sleep(TICK_S)  # the ticker drives the leave to its commit
            log.info("%s: %s", self.node_id, coordination.last_membership_reason or "left")
            self.history.leave(coordination, coordination.last_membership_reason or "left")
        # Freeze the replica: nothing may be applied between the final checkpoint and exit, so a
        # restart resumes at exactly the index and digest logged below.
        self._frozen = True
        self._ticker_task.cancel()
        await self._checkpoint(final=True)
        self.store.sync(self._persistent)
        log.info("%s: stopped cleanly at index %d digest %s", self.node_id, self.replica.applied_index,
                 self.replica.state.digest())
        self.history.stop(self.coord, self.replica.applied_index)

