"""What a node opens before it knows its run's model: credentials, pools, peer client and server,
durable stores, history, trackers, the status document, the learner's slot and the site's identity.

`Services.open` checks what a configuration can get wrong first (the run secret, TLS files, the
checkpoint directory, a tracker's missing extra: ConfigError or CheckpointError, nothing opened
yet), then builds every service complete, each with its collaborators in its constructor. The peer
server's routes and its eviction check go through the node's one `StartingGate` (gate.py), so they
answer 503 until the site's parts exist. `closers()` lists what the listeners close at exit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bootstrap import messages as coord
from diloco_node.clock import Clock
from diloco_node.config.settings import ConfigError, EffectiveConfig, NodeConfig, run_id_for
from diloco_node.daemon.coordination_store import CoordinationStore
from diloco_node.daemon.gate import StartingGate
from diloco_node.daemon.history_hooks import DaemonHistory
from diloco_node.daemon.history_ring import HISTORY_RING_DIR, DiskVersionRings
from diloco_node.daemon.identity import SiteIdentity
from diloco_node.daemon.loop_monitor import LagWindow
from diloco_node.daemon.metrics import DaemonSeries
from diloco_node.daemon.notify import BackgroundNotifier
from diloco_node.daemon.peer_api import PeerApi
from diloco_node.daemon.plan import DaemonPlan
from diloco_node.daemon.pools import Pools
from diloco_node.daemon.start_check import CHECKPOINTS_DIR, COORDINATION_DIR
from diloco_node.daemon.tasks import TaskSet
from diloco_node.daemon.training import LearnerReports, LearnerSlot
from diloco_node.ops.checkpoint import CheckpointStore
from diloco_node.ops.liveness import Liveness, StepPace
from diloco_node.ops.page import StatusSeries
from diloco_node.ops.status import MetricsRegistry, StatusBuilder, StatusDocument
from diloco_node.ops.systemd import SystemdNotifier
from diloco_node.ops.tracking import Tracking, check_available
from diloco_node.transport import PeerClient, PeerServer
from diloco_node.transport.tls import SiteTls, TlsError, TlsFiles
from wire.auth import AuthContext, FrameVerifier, RunSecretError, derive_frame_key, load_run_secret
from wire.errors import LocalProtocolError

log = logging.getLogger("diloco_node.daemon")


@dataclass(frozen=True, slots=True)
class Credentials:
    """The run this node belongs to, as its secret says, and its TLS contexts (None: plain HTTP)."""

    run_id: str
    key: bytes
    tls: SiteTls | None


def load_credentials(effective: EffectiveConfig) -> Credentials:
    """The run secret and TLS files, checked (ConfigError naming the setting's source or the file)."""
    effective.read_secret()  # configured and readable
    cfg = effective.node
    assert cfg.secret_file is not None  # read_secret raised otherwise
    try:
        # The wire's rules (docs/WIRE.md section 4): not accessible by "other", one trailing
        # newline stripped; the same bytes every member derives its key from.
        secret = load_run_secret(cfg.secret_file)
    except RunSecretError as error:
        raise ConfigError(str(error)) from None
    try:
        key = derive_frame_key(secret)
    except LocalProtocolError as error:
        raise ConfigError(f"run secret: {error}") from None
    return Credentials(run_id_for(secret), key, load_tls(cfg))


def load_tls(cfg: NodeConfig) -> SiteTls | None:
    """The site's TLS contexts when [node] tls_* are set (ConfigError naming the file otherwise)."""
    if not cfg.tls_enabled:
        return None
    assert cfg.tls_key_file is not None and cfg.tls_ca_file is not None and cfg.tls_cert_file is not None
    try:
        return SiteTls(TlsFiles(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file, cfg.tls_crl_file))
    except TlsError as error:
        raise ConfigError(str(error)) from None


class Services:
    @classmethod
    def open(cls, effective: EffectiveConfig, plan: DaemonPlan, clock: Clock, environ: dict[str, str],
             gate: StartingGate[Any]) -> Services:
        """Check the configuration's files, then build every service (ConfigError, CheckpointError)."""
        credentials = load_credentials(effective)
        cfg = effective.node
        checkpoints = CheckpointStore(Path(cfg.data_dir) / CHECKPOINTS_DIR, cfg.checkpoint_keep)
        check_available(cfg.tracking)  # a missing extra: ConfigError saying what to install
        return cls(effective, plan, clock, environ, gate, credentials, checkpoints)

    def __init__(self, effective: EffectiveConfig, plan: DaemonPlan, clock: Clock, environ: dict[str, str],
                 gate: StartingGate[Any], credentials: Credentials, checkpoints: CheckpointStore) -> None:
        cfg = self.cfg = effective.node
        node_id = self.node_id = cfg.node_id
        data_dir = Path(cfg.data_dir)
        self.clock = clock
        self.gate = gate
        self.credentials = credentials
        self.checkpoints = checkpoints
        self.role = coord.MemberRole.WITNESS if cfg.role == "witness" else coord.MemberRole.LEARNER
        self.tasks = TaskSet()
        self.tracking = Tracking.open(cfg.tracking, data_dir, node_id,
                                      {"node_id": node_id, "run_id": credentials.run_id, "role": cfg.role})
        self.status = new_status(cfg, credentials.run_id, clock, self.tracking)
        self.metrics = MetricsRegistry()
        self.series = DaemonSeries.register(self.metrics)
        self.samples = StatusSeries(clock.monotonic)  # recent figures for the page at `/` (/series)
        self.notifier = BackgroundNotifier(SystemdNotifier(environ))
        self.loop_lag = LagWindow()
        self.pace = StepPace()
        self.pools = Pools.open(plan, node_id)
        auth = AuthContext(credentials.run_id, node_id, credentials.key)
        verifier = FrameVerifier(credentials.run_id, credentials.key, node_id=node_id)  # addressed to us
        tls = credentials.tls
        self.client = PeerClient(auth, verifier, executor=self.pools.codec, limits=plan.limits,
                                 options=plan.client_options, tls=tls)
        self.server = PeerServer(auth, verifier, executor=self.pools.codec, limits=plan.limits,
                                 certified_senders=tls is not None, gate=self._eviction_refusal)
        PeerApi(gate).install(self.server)
        self.store = CoordinationStore(data_dir / COORDINATION_DIR)
        self.version_rings = DiskVersionRings(data_dir / HISTORY_RING_DIR)  # fragment versions for rebasing
        self.history = DaemonHistory.open(data_dir, node_id, pace_s=plan.min_step_interval_s,
                                          mono_clock=clock.monotonic)
        self.identity = SiteIdentity(effective, self.store, self.client, self.role, clock=clock,
                                     executor=self.pools.setup)
        self.slot = LearnerSlot()
        self.reports = LearnerReports(node_id=node_id, slot=self.slot, status=self.status, series=self.series,
                                      history=self.history, tracking=self.tracking, pace=self.pace, clock=clock)

    def _eviction_refusal(self, node_id: str | None, fingerprint: str | None) -> str | None:
        """The transport's check of every peer: refused for good once the run evicted it (the
        register is the replica's, so nobody is refused before the parts exist)."""
        parts = self.gate.parts_if_open()
        return parts.eviction_refusal(node_id, fingerprint) if parts is not None else None

    def report_error(self, message: str) -> None:
        log.warning("%s", message)
        self.status.record_error(message, self.clock.monotonic())

    def status_document(self) -> StatusDocument:
        return self.status.document(self.clock.monotonic())

    def live(self) -> Liveness:
        return self.slot.live(self.clock.monotonic(), self.pace)

    def closers(self) -> tuple[Callable[[], object], ...]:
        """What the node closes at exit, in order (the pools first: no work starts after)."""
        return (self.pools.close, self.store.settle_mark, self.store.close, self.version_rings.close,
                self.history.close, self.checkpoints.close, self.notifier.close, self.tracking.close)


def new_status(cfg: NodeConfig, run_id: str, clock: Clock, tracking: Tracking) -> StatusBuilder:
    """The node's /status document builder: who it is, and its trackers' counters."""
    return StatusBuilder(cfg.node_id, run_id, cfg.role, clock.monotonic(), tracking=tracking.status)
