"""The chaos harness: N sites as real processes behind link emulators, a seeded nemesis, then the
checker and the metrics, in decoupled and synchronous mode. The composition root of the chaos
package: the only module here that touches processes, sockets, files and the clock together.

One mode run, step by step (docs/CHAOS.md has the picture):
1. a `LinkEmulator` per node on loopback; the node listens on its own port and advertises the
   emulator's address, so every byte a peer sends it crosses the emulator (bandwidth caps act on
   a node's inbound link); each node makes its outbound connections from its own loopback address
   (127.0.0.(10+i), `--source-address`), so an emulator tells senders apart and a partition is
   its source filters (`set_blocked_sources`) on both sides; the harness polls the node's port
   directly from 127.0.0.1 so a partition never blinds it;
2. the founding node starts without a bootstrap peer, the others bootstrap from it; the run
   waits until every node is ready (`Launcher.probe`), and fails with the reasons if it is not;
3. the schedule runs on the clock: each fault is injected and healed on time, `@coordinator`
   resolved to the lease holder at that moment, every injection written as a `fault`/`heal`
   event into the harness's own history (node "nemesis");
4. after the last heal it waits for every live node to report the same commit index and state
   digest, writes one `final` event per node, stops every process (SIGTERM, then SIGKILL) and
   reads all histories back for the checker and the metrics.

Storage and clock faults go through the launcher: a daemon is started with failpoints allowed
(`DILOCO_X_DEBUG_ROUTES=1`, nothing armed) and the harness arms and disarms them, and skews its wall clock,
through its loopback debug routes (ops/debug_routes.py); a stand-in reads the same requests from
files in its data directory. A `corrupt` fault damages a file at rest while the node is down, or
(`log:flip-running`) a bit of its log while it runs.
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from diloco_node.ops.debug_routes import DEBUG_ENV_VAR
from diloco_node.ops.history import (
    HISTORY_FILE_NAME,
    HistoryEvent,
    HistoryWriter,
    load_histories,
    read_history,
)
from diloco_node.storage import failpoints
from diloco_node.testbed.chaos.checker import (
    Violation,
    check_histories,
    final_states_from,
)
from diloco_node.testbed.chaos.metrics import (
    ModeMetrics,
    commit_times,
    lease_holder_at,
    measure,
)
from diloco_node.testbed.chaos.schedule import (
    COORDINATOR,
    CORRUPTIONS,
    DEFAULT_WEIGHTS,
    FOLLOWER,
    RUNNING_CORRUPTIONS,
    STORAGE_FAULT_WEIGHTS,
    Fault,
    Schedule,
    ScheduleSpec,
    check_schedule,
    generate,
    one_learner_down,
)
from diloco_node.testbed.chaos.supervisor import (
    ProcessSpec,
    Supervisor,
    SupervisorError,
)
from diloco_node.testbed.launcher import SiteSpec, free_port, node_env, write_secret
from diloco_node.testbed.linkemu import LinkEmulator

NEMESIS = "nemesis"
MODES = ("decoupled", "synchronous")
SCENARIOS = ("random", "learner-down")
# A daemon compiles its JAX step before it says ready, and several share two cores here.
READY_TIMEOUT_S = 180.0
# After the last heal: time for restarted nodes to catch up before convergence is judged.
CONVERGE_TIMEOUT_S = 90.0
# One /status request; a stopped or partitioned node must not hold the harness up.
STATUS_TIMEOUT_S = 2.0
POLL_S = 0.25
# Between tries to arm a fault's failpoints or clock skew in a node that does not answer yet.
ARM_RETRY_S = 0.5
# Targets from the issue (docs/CHAOS.md).
TARGET_DECOUPLED_GOODPUT = 0.85
TARGET_SYNCHRONOUS_GOODPUT_MAX = 0.6
TARGET_GAP_LEASES = 3.0
# Node i (1-based) sends from 127.0.0.(SOURCE_HOST_BASE + i): every 127.0.0.0/8 address is loopback
# on Linux, and 127.0.0.1 (the harness, the emulators' upstream side) stays apart from all of them.
SOURCE_HOST_BASE = 10
MAX_NODES = 254 - SOURCE_HOST_BASE
# A clock_jump also drifts the node's wall clock this fast (500 ppm, a bad oscillator) on top of its step.
CLOCK_DRIFT_RATE = 0.0005
# The history is the checker's evidence, not the node's state: a full or failing disk spares it, so
# the checker still sees everything the node did (how the daemon copes with a failing history
# file is tested on its own).
SPARED_POINTS = frozenset({"history.write"})


def storage_fault_spec(action: str) -> str:
    """The failpoints a `disk_full` (ENOSPC on every durable write) or an `io_error` (EIO on every
    durable read and write) arms, as `point=action,...`."""
    if action not in ("disk_full", "io_error"):
        raise ValueError(f"no failpoint spec for {action!r}")
    errno_action = "enospc" if action == "disk_full" else "eio"
    return ",".join(f"{point}={errno_action}" for point in sorted(failpoints.POINTS)
                    if point not in SPARED_POINTS and (action == "io_error" or not point.endswith(".read")))


def corrupt_file(path: Path | None, how: str, rng: random.Random) -> str:
    """Damage `path` at rest: `flip` one bit in its second half, `truncate` its last eighth (at
    least one byte). Returns what was done, as the fault's note."""
    if path is None or not path.exists() or path.stat().st_size == 0:
        return f"skipped: no file to {how}"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if how == "flip":
            offset = rng.randrange(size // 2, size)
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
            what = f"flipped a bit at byte {offset} of {size}"
        elif how == "truncate":
            keep = size - max(1, size // 8)
            f.truncate(keep)
            what = f"truncated from {size} to {keep} bytes"
        else:
            raise ValueError(f"corruption {how!r}: expected flip or truncate")
    return f"{path.name}: {what}"


class HarnessError(RuntimeError):
    """The run could not be carried out (cluster never ready, bad config); names what and why."""


# ---------------------------------------------------------------------------------------------
# What is launched


@dataclass(frozen=True, slots=True)
class NodeSlot:
    node_id: str
    role: str
    port: int  # the node listens here; the harness polls it directly
    link: str  # HOST:PORT of the emulator in front of it: what peers use
    source: str  # the loopback IP its outbound connections come from (partitions key on it)
    data_dir: Path
    log_path: Path
    founder: bool

    @property
    def history_path(self) -> Path:
        return self.data_dir / HISTORY_FILE_NAME


@dataclass(frozen=True, slots=True)
class NodeProbe:
    ready: bool
    reason: str
    index: int | None = None
    state_digest: str | None = None
    coordinator: str | None = None


class Launcher(Protocol):
    """How nodes of one kind are configured, started and asked how they are."""

    name: str
    status_lag_s: float  # how old a status answer may be when it arrives

    def prepare(self, mode_dir: Path, min_quorum: int, lease_s: float, heartbeat_s: float, seed: int) -> None: ...

    def argv(self, slot: NodeSlot, bootstrap: str | None) -> list[str]: ...

    def env(self) -> dict[str, str] | None: ...

    async def probe(self, slot: NodeSlot, since: float) -> NodeProbe: ...

    async def arm_failpoints(self, slot: NodeSlot, spec: str) -> str:
        """Arm `point=action,...` in the running node; returns a note ("ok" or what went wrong)."""
        ...

    async def disarm_failpoints(self, slot: NodeSlot) -> str: ...

    async def skew_clock(self, slot: NodeSlot, offset_s: float, drift_rate: float) -> str:
        """Skew the running node's wall clock (0, 0 restores it); returns a note."""
        ...

    def damage_target(self, slot: NodeSlot, kind: str) -> Path | None:
        """The file a `corrupt` fault of `kind` ("checkpoint", "log") damages (None: none yet)."""
        ...

    async def freeze(self, sup: Supervisor, node: str) -> None:
        """SIGSTOP `node` for a `stop` fault (a launcher may pick the moment, see StandinLauncher)."""
        ...

    async def close(self) -> None: ...


class _HistoryTail:
    """Follows one history file incrementally (a probe every 0.25 s must not re-read a file that
    grows by thousands of events); keeps the last start time and the last apply."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.last_start = -1.0
        self.last_apply: HistoryEvent | None = None
        self.max_commit = 0
        self.commit_steps: list[tuple[float, int]] = []  # (t_mono, max_commit from then on)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < self.offset:  # replaced: start over
                self.offset, self.last_start, self.last_apply, self.max_commit = 0, -1.0, None, 0
                self.commit_steps = []
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        for line in complete.splitlines():
            event = HistoryEvent.from_dict(json.loads(line))
            if event.kind == "start":
                self.last_start = event.t_mono
            elif event.kind == "apply":
                self.last_apply = event
            elif event.kind == "commit" and event.index is not None and event.index > self.max_commit:
                self.max_commit = event.index
                self.commit_steps.append((event.t_mono, event.index))

    def max_commit_before(self, t: float) -> int:
        """The highest index this node had recorded as committed by time `t`."""
        i = bisect.bisect_right(self.commit_steps, (t, float("inf")))
        return self.commit_steps[i - 1][1] if i else 0


FREEZE_ATTEMPTS = 200


def lock_is_free(path: Path) -> bool:
    """Whether no process holds the exclusive flock on `path` (taken and released at once)."""
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


class StandinLauncher:
    """Stand-in processes (`diloco_node.testbed.chaos.standin`): exercises the engine without the daemon."""

    name = "standin"
    status_lag_s = 0.0  # it reads its files on every /status request

    def __init__(self, commit_interval_s: float = 0.25) -> None:
        self.commit_interval_s = commit_interval_s
        self._cluster: Path | None = None
        self._min_quorum = 1
        self._lease_s = 1.0
        self._tails: dict[str, _HistoryTail] = {}

    def prepare(self, mode_dir: Path, min_quorum: int, lease_s: float, heartbeat_s: float, seed: int) -> None:
        self._tails = {}
        self._cluster = mode_dir / "standin-cluster"
        self._cluster.mkdir(parents=True, exist_ok=True)
        self._min_quorum = min_quorum
        self._lease_s = lease_s

    def argv(self, slot: NodeSlot, bootstrap: str | None) -> list[str]:
        assert self._cluster is not None, "prepare() first"
        return [sys.executable, "-m", "diloco_node.testbed.chaos.standin", "--node-id", slot.node_id,
                "--data-dir", str(slot.data_dir), "--cluster-dir", str(self._cluster),
                "--lease-s", str(self._lease_s), "--commit-interval-s", str(self.commit_interval_s),
                "--min-quorum", str(self._min_quorum), "--role", slot.role]

    def env(self) -> dict[str, str] | None:
        return None

    async def freeze(self, sup: Supervisor, node: str) -> None:
        """SIGSTOP `node`, but never while it holds the stand-ins' shared file lock: a frozen
        stand-in inside it would stall every other stand-in too (nobody could take the lease), which
        is not the fault being injected, since a frozen daemon blocks no peer. Measured in CI: a
        SIGSTOP landed inside the lock on a loaded machine and no failover happened."""
        assert self._cluster is not None, "prepare() first"
        for _ in range(FREEZE_ATTEMPTS):
            sup.stop(node)
            if lock_is_free(self._cluster / "lock"):
                return
            sup.cont(node)  # caught inside the lock: let it leave, then try again
            await asyncio.sleep(0.002)
        raise RuntimeError(f"{node} held the stand-in cluster lock at each of {FREEZE_ATTEMPTS} tries")

    async def probe(self, slot: NodeSlot, since: float) -> NodeProbe:
        """Readiness and state from the node's own history: a start since launch, the last apply."""
        tail = self._tails.setdefault(slot.node_id, _HistoryTail(slot.history_path))
        tail.poll()
        started = tail.last_start >= since
        last = tail.last_apply
        return NodeProbe(started, "started" if started else "no start event since launch",
                         last.index if last else 0, last.state_digest if last else "")

    # A stand-in has no HTTP: it reads these files in its data directory on every tick.
    async def arm_failpoints(self, slot: NodeSlot, spec: str) -> str:
        _write_atomically(slot.data_dir / STANDIN_FAILPOINTS_FILE, spec)
        return "ok"

    async def disarm_failpoints(self, slot: NodeSlot) -> str:
        _write_atomically(slot.data_dir / STANDIN_FAILPOINTS_FILE, "")
        return "ok"

    async def skew_clock(self, slot: NodeSlot, offset_s: float, drift_rate: float) -> str:
        _write_atomically(slot.data_dir / STANDIN_CLOCK_FILE, json.dumps({"offset_s": offset_s, "drift_rate": drift_rate}))
        return "ok"

    def damage_target(self, slot: NodeSlot, kind: str) -> Path | None:
        return slot.data_dir / "checkpoint.json"  # its only durable file (its log is the cluster's)

    async def close(self) -> None:
        return None


# The files a stand-in polls for the harness's storage and clock faults (standin.py reads them).
STANDIN_FAILPOINTS_FILE = "failpoints.spec"
STANDIN_CLOCK_FILE = "clock.json"


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# The daemon's run manifest for chaos runs: a tiny model so three JAX processes fit two cores.
DAEMON_CONFIG = """\
[node]
checkpoint_interval_s = 3.0
log_level = "info"

[run]
seed = {seed}

[run.model]
size = "tiny"
seq_len = 32

[run.inner]
batch_size = 4
total_steps = 1000000

[run.sync]
fragments = 2
period = 8
"""


class DaemonLauncher:
    """The real thing: each node a `launcher.SiteSpec` (`python -m diloco_node run ...`) behind
    the harness's in-process link emulator, status from `GET /status`."""

    name = "daemon"
    # How old a /status answer may be: the daemon refreshes the document every 0.25 s
    # (daemon/plan.py `DaemonPlan.status_refresh_s`).
    status_lag_s = 0.25

    def __init__(self, config_template: Path | None = None, extra_settings: tuple[str, ...] = ()) -> None:
        """`extra_settings`: `key=value` node settings for every daemon (e.g. `relay_fanout=2`)."""
        self.config_template = config_template
        self.extra_settings = tuple(extra_settings)
        self._config: Path | None = None
        self._secret: Path | None = None
        self._overrides: list[str] = []
        self._session: Any = None

    def prepare(self, mode_dir: Path, min_quorum: int, lease_s: float, heartbeat_s: float, seed: int) -> None:
        mode_dir.mkdir(parents=True, exist_ok=True)
        self._secret = write_secret(mode_dir / "run.secret")
        self._config = mode_dir / "node.toml"
        text = self.config_template.read_text() if self.config_template else DAEMON_CONFIG.format(seed=seed)
        self._config.write_text(text)
        # Mode and timing always come from the harness, whatever the template says.
        self._overrides = [f"run.sync.min_quorum={min_quorum}", f"lease_timeout_s={lease_s}",
                           f"heartbeat_interval_s={heartbeat_s}", *self.extra_settings]
        from diloco_node.config.settings import ConfigError, load_config

        try:
            load_config(self._config, {}, {"node_id": "check", "data_dir": str(mode_dir / "check"),
                                           "secret_file": str(self._secret),
                                           **dict(o.split("=", 1) for o in self._overrides)})
        except ConfigError as exc:
            raise HarnessError(f"chaos node config {self._config}: {exc}") from None

    def spec(self, slot: NodeSlot, bootstrap: str | None) -> SiteSpec:
        assert self._config is not None and self._secret is not None, "prepare() first"
        return SiteSpec(slot.node_id, slot.data_dir, slot.log_path, self._secret, port=slot.port,
                        settings=tuple(self._overrides), config_file=self._config, role=slot.role,
                        bootstrap=bootstrap, advertise=slot.link, source_address=slot.source)

    def argv(self, slot: NodeSlot, bootstrap: str | None) -> list[str]:
        return self.spec(slot, bootstrap).argv()

    async def freeze(self, sup: Supervisor, node: str) -> None:
        sup.stop(node)

    def env(self) -> dict[str, str] | None:
        # Failpoints allowed (none armed): the harness arms them at run time on loopback.
        return node_env({DEBUG_ENV_VAR: "1"})

    async def _post(self, slot: NodeSlot, path: str, body: dict[str, Any]) -> str:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S))
        try:
            async with self._session.post(f"http://127.0.0.1:{slot.port}{path}", json=body) as response:
                if response.status != 200:
                    return f"skipped: {path} answered {response.status}: {(await response.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            return f"skipped: {path}: {type(exc).__name__}: {exc}"
        return "ok"

    async def arm_failpoints(self, slot: NodeSlot, spec: str) -> str:
        return await self._post(slot, "/debug/failpoints", {"arm": spec})

    async def disarm_failpoints(self, slot: NodeSlot) -> str:
        return await self._post(slot, "/debug/failpoints", {"disarm": "all"})

    async def skew_clock(self, slot: NodeSlot, offset_s: float, drift_rate: float) -> str:
        return await self._post(slot, "/debug/clock", {"offset_s": offset_s, "drift_rate": drift_rate})

    def damage_target(self, slot: NodeSlot, kind: str) -> Path | None:
        if kind == "log":
            return slot.data_dir / "coordination" / "log.bin"
        checkpoints = sorted((slot.data_dir / "checkpoints").glob("ckpt-*.bin"))
        return checkpoints[-1] if checkpoints else None

    async def probe(self, slot: NodeSlot, since: float) -> NodeProbe:
        import aiohttp

        from diloco_node.ops.status import StatusDocument, StatusFormatError

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=STATUS_TIMEOUT_S))
        try:
            async with self._session.get(f"http://127.0.0.1:{slot.port}/status") as response:
                doc = StatusDocument.from_dict(await response.json())
        except (TimeoutError, aiohttp.ClientError, StatusFormatError, ValueError) as exc:
            return NodeProbe(False, f"/status: {type(exc).__name__}: {exc}")
        return NodeProbe(doc.ready, doc.ready_reason or ("ready" if doc.ready else "not ready"),
                         doc.commit_index, doc.state_digest, doc.coordinator)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# ---------------------------------------------------------------------------------------------
# Configuration and results


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    workdir: Path
    seed: int = 0
    nodes: int = 3
    joiners: int = 0
    duration_s: float = 60.0
    faults: int = 4
    lease_s: float = 3.0
    heartbeat_s: float = 0.5
    scenario: str = "random"
    coordinator_partition: bool = False  # the schedule must cut the lease holder off (with a minority)
    storage_faults: bool = False  # random schedules also draw disk, fsync, corruption and clock faults
    corruptions: tuple[str, ...] = CORRUPTIONS  # the damage a `corrupt` fault may do
    modes: tuple[str, ...] = MODES
    warmup_s: float = 10.0
    settle_s: float = 15.0
    recovery_s: float = 8.0
    degrade_s: tuple[float, float] = (3.0, 10.0)  # how long bandwidth caps and slowdowns last
    ready_timeout_s: float = READY_TIMEOUT_S
    converge_timeout_s: float = CONVERGE_TIMEOUT_S
    stall_after_s: float | None = None  # None: twice the median gap between commits
    terminate_grace_s: float = 10.0

    def __post_init__(self) -> None:
        if self.scenario not in SCENARIOS:
            raise HarnessError(f"scenario {self.scenario!r}: expected one of {SCENARIOS}")
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise HarnessError(f"modes {self.modes}: expected some of {MODES}")
        if self.nodes + self.joiners > MAX_NODES:
            raise HarnessError(f"{self.nodes + self.joiners} nodes: at most {MAX_NODES} (one loopback source address each)")

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(f"n{i + 1}" for i in range(self.nodes))

    @property
    def joiner_ids(self) -> tuple[str, ...]:
        return tuple(f"n{self.nodes + i + 1}" for i in range(self.joiners))

    def schedule_spec(self) -> ScheduleSpec:
        return ScheduleSpec(
            nodes=self.node_ids, joiners=self.joiner_ids, duration_s=self.duration_s,
            lease_s=self.lease_s, faults=max(self.faults, 2 + int(self.coordinator_partition) + self.joiners),
            warmup_s=self.warmup_s, settle_s=self.settle_s, recovery_s=self.recovery_s, degrade_s=self.degrade_s,
            coordinator_partition=self.coordinator_partition,
            weights={**DEFAULT_WEIGHTS, **(STORAGE_FAULT_WEIGHTS if self.storage_faults else {})},
            corruptions=self.corruptions,
        )


def build_schedule(config: ChaosConfig) -> Schedule:
    spec = config.schedule_spec()
    if config.scenario == "learner-down":
        return one_learner_down(config.seed, spec)
    return generate(config.seed, spec)


@dataclass(slots=True)
class ModeResult:
    mode: str
    metrics: ModeMetrics
    violations: list[Violation]
    applied: list[dict[str, Any]] = field(default_factory=list)
    torn_tails: int = 0
    silent_nodes: list[str] = field(default_factory=list)  # launched but wrote no history
    dead_at_end: dict[str, int | None] = field(default_factory=dict)  # node -> exit code


# ---------------------------------------------------------------------------------------------
# One mode


def source_address(node_number: int) -> str:
    """The loopback IP node `node_number` (1-based) sends from."""
    return f"127.0.0.{SOURCE_HOST_BASE + node_number}"


def partition_cuts(minorities: Iterable[frozenset[str]], nodes: Iterable[str]) -> dict[str, frozenset[str]]:
    """For each node, the nodes it must not hear from while these partitions last: in each, a
    minority node is cut from everyone outside it and the others from the minority. Two at once
    (each within the schedule's bound on nodes down) compose: the cuts add up."""
    everyone = frozenset(nodes)
    cuts: dict[str, set[str]] = {n: set() for n in everyone}
    for minority in minorities:
        for node in everyone:
            cuts[node] |= (everyone - minority) if node in minority else (minority & everyone)
    return {n: frozenset(c) for n, c in cuts.items()}


class ModeRun:
    """Runs one schedule in one mode; `run()` returns the checked, measured result."""

    def __init__(self, config: ChaosConfig, schedule: Schedule, mode: str, launcher: Launcher) -> None:
        self.config = config
        self.schedule = schedule
        self.mode = mode
        self.launcher = launcher
        self.dir = config.workdir / mode
        self.rng = random.Random(config.seed)
        self.slots: dict[str, NodeSlot] = {}
        self.links: dict[str, LinkEmulator] = {}
        self.launched_at: dict[str, float] = {}
        self.learner_windows: dict[str, tuple[float, float]] = {}
        self.resolved: dict[int, str] = {}  # fault number -> node it hit
        self.partitions: dict[int, frozenset[str]] = {}  # fault number -> minority side, while it lasts
        self.applied: list[dict[str, Any]] = []
        self.t0 = 0.0
        self.dead_at_end: dict[str, int | None] = {}
        self.tails: dict[str, _HistoryTail] = {}
        # fault number -> the task arming its failpoints or clock skew (a node still starting
        # cannot be reached yet: it is tried again until the fault's heal time)
        self.arming: dict[int, asyncio.Task[str]] = {}

    def run(self) -> ModeResult:
        self.dir.mkdir(parents=True, exist_ok=True)
        # Synchronous: K = M, the founding learners (the manifest is fixed at founding; a site
        # that joins later adds a learner the quorum does not wait for).
        min_quorum = self.config.nodes if self.mode == "synchronous" else 1
        self.launcher.prepare(self.dir, min_quorum, self.config.lease_s, self.config.heartbeat_s, self.config.seed)
        nemesis = HistoryWriter(self.dir / NEMESIS / HISTORY_FILE_NAME, NEMESIS)
        # The supervisor is outside the event loop so that whatever happens to the loop
        # (an exception, Ctrl-C), leaving this block reaps every process.
        with Supervisor(terminate_grace_s=self.config.terminate_grace_s) as sup:
            try:
                t0, t1 = asyncio.run(self._main(sup, nemesis))
            finally:
                nemesis.close()
        return self._evaluate(t0, t1)

    async def _main(self, sup: Supervisor, nemesis: HistoryWriter) -> tuple[float, float]:
        try:
            for number, node in enumerate(self.config.node_ids + self.config.joiner_ids, start=1):
                link = LinkEmulator("127.0.0.1", free_port(), seed=self.config.seed)
                await link.start()
                self.links[node] = link
                founder = node in self.config.node_ids
                self.slots[node] = NodeSlot(
                    node, "learner", link.upstream[1], link.address, source_address(number),
                    self.dir / "nodes" / node / "data", self.dir / "nodes" / node / "node.log", founder,
                )
            founders = self.config.node_ids
            self._launch(sup, founders[0], None)
            await self._wait_ready(sup, founders[:1])
            for node in founders[1:]:
                self._launch(sup, node, self.slots[founders[0]].link)
            await self._wait_ready(sup, founders)
            t0 = self.t0 = time.monotonic()
            for node in founders:
                self.learner_windows[node] = (t0, t0 + self.schedule.duration_s)
            await self._run_schedule(sup, nemesis, t0)
            t1 = t0 + self.schedule.duration_s
            await asyncio.sleep(max(0.0, t1 - time.monotonic()))
            await self._converge(sup, nemesis)
            return t0, t1
        finally:
            await self.launcher.close()
            # Graceful stop first, in a thread so the links keep carrying the nodes' goodbyes.
            await asyncio.to_thread(sup.close)
            for link in self.links.values():
                await link.close()

    def _launch(self, sup: Supervisor, node: str, bootstrap: str | None) -> None:
        slot = self.slots[node]
        slot.data_dir.mkdir(parents=True, exist_ok=True)
        self.launched_at[node] = time.monotonic()
        sup.start(ProcessSpec(node, self.launcher.argv(slot, bootstrap), slot.log_path, self.launcher.env()))

    async def _wait_ready(self, sup: Supervisor, nodes: Sequence[str]) -> None:
        started = time.monotonic()
        deadline = started + self.config.ready_timeout_s
        while True:
            probes = await self._probe_all(nodes)
            if all(p.ready for p in probes.values()):
                return
            dead = [n for n in nodes if not sup.alive(n)]
            if dead or time.monotonic() > deadline:
                why = "; ".join(
                    f"{n}: {'exited with ' + str(sup.returncode(n)) if n in dead else probes[n].reason} "
                    f"(log {self.slots[n].log_path})" for n in nodes if not probes[n].ready
                )
                raise HarnessError(f"{self.mode}: cluster not ready after {time.monotonic() - started:.0f}s: {why}")
            await asyncio.sleep(POLL_S)

    async def _probe_all(self, nodes: Sequence[str]) -> dict[str, NodeProbe]:
        """All at once: the cluster keeps committing, so a slow sweep never sees one index."""
        results = await asyncio.gather(*(self.launcher.probe(self.slots[n], self.launched_at[n]) for n in nodes))
        return dict(zip(nodes, results))

    # ---- the nemesis ---------------------------------------------------------------------

    async def _run_schedule(self, sup: Supervisor, nemesis: HistoryWriter, t0: float) -> None:
        steps: list[tuple[float, int, int, Fault]] = []  # (time, order, fault number, fault)
        for number, fault in enumerate(self.schedule.faults):
            steps.append((fault.at_s, 1, number, fault))
            if fault.action != "join":
                steps.append((fault.end_s, 0, number, fault))  # heals sort before injections
        for at_s, order, number, fault in sorted(steps, key=lambda s: (s[0], s[1], s[2])):
            await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
            if order == 1:
                await self._inject(sup, nemesis, number, fault)
            else:
                await self._heal(sup, nemesis, number, fault)

    async def _resolve(self, sup: Supervisor, target: str) -> tuple[str, bool]:
        """The node a fault hits: `@coordinator` is the lease holder now (waiting up to three
        lease times for one); if none shows up, a live founder, and the fault is marked so."""
        if target != COORDINATOR:
            return target, False
        deadline = time.monotonic() + 3 * self.config.lease_s
        while True:
            holder = self._lease_holder(sup) or await self._reported_holder(sup)
            if holder is not None:
                return holder, True
            if time.monotonic() > deadline:
                live = [n for n in self.config.node_ids if sup.alive(n) and not sup.stopped(n)]
                return self.rng.choice(live), False
            await asyncio.sleep(POLL_S)

    async def _reported_holder(self, sup: Supervisor) -> str | None:
        """The lease holder a majority of live nodes name in their status (when histories
        name none, e.g. a daemon that does not write its lease events)."""
        live = [n for n in self.slots if n in self.launched_at and sup.alive(n) and not sup.stopped(n)]
        named = [(await self.launcher.probe(self.slots[n], self.launched_at[n])).coordinator for n in live]
        for candidate in set(named) - {None}:
            if named.count(candidate) * 2 > len(live) and candidate in live:
                return candidate
        return None

    def _lease_holder(self, sup: Supervisor) -> str | None:
        histories = self._read_histories(nodes_only=True)
        holder = lease_holder_at(histories, time.monotonic())
        if holder is not None and sup.alive(holder) and not sup.stopped(holder):
            return holder
        return None

    def _resolve_side(self, sup: Supervisor, node: str, side: Sequence[str]) -> tuple[list[str], str]:
        """A partition's other minority nodes: named ones as they are, each `FOLLOWER` a live
        founder not yet on the side (seeded choice); a note if too few were live."""
        named = [n for n in side if n != FOLLOWER]
        chosen = [node, *named]
        wanted = len(side) - len(named)
        live = [n for n in self.config.node_ids if sup.alive(n) and not sup.stopped(n) and n not in chosen]
        picked = self.rng.sample(live, min(wanted, len(live)))
        note = "ok" if len(picked) == wanted else f"only {len(picked)} of {wanted} followers live to join the minority"
        return named + picked, note

    def _apply_cuts(self) -> dict[str, list[str]]:
        """Set every emulator's source filter from the partitions in force; returns node -> cut-off
        nodes (recorded with each partition's fault and heal)."""
        cuts = partition_cuts(self.partitions.values(), self.slots)
        for node, cut in cuts.items():
            self.links[node].set_blocked_sources(self.slots[n].source for n in cut)
        return {n: sorted(c) for n, c in sorted(cuts.items()) if c}

    def _bootstrap_for_joiner(self, sup: Supervisor) -> str:
        """A live founder the joiner can reach: on the majority side of every partition in force."""
        cut_off = set().union(*self.partitions.values())
        live = [n for n in self.config.node_ids if sup.alive(n) and not sup.stopped(n)]
        reachable = [n for n in live if n not in cut_off] or live
        return self.slots[reachable[0]].link

    async def _inject(self, sup: Supervisor, nemesis: HistoryWriter, number: int, fault: Fault) -> None:
        node, is_coordinator = await self._resolve(sup, fault.target)
        self.resolved[number] = node
        note = "ok"
        extra: dict[str, Any] = {}
        try:
            if fault.action == "kill":
                sup.kill(node)
            elif fault.action == "stop":
                await self.launcher.freeze(sup, node)
            elif fault.action in ("isolate", "partition"):
                side, note = self._resolve_side(sup, node, fault.side)
                self.partitions[number] = frozenset([node, *side])
                extra = {"side": side, "cuts": self._apply_cuts()}
            elif fault.action == "bandwidth":
                self.links[node].set_bandwidth_mbit(fault.param)
            elif fault.action == "slow":
                assert fault.param is not None
                sup.slow(node, fault.param)
            elif fault.action == "join":
                self._launch(sup, node, self._bootstrap_for_joiner(sup))
                now = time.monotonic()
                self.learner_windows[node] = (now, now + self.schedule.duration_s)
            elif fault.action in ("disk_full", "io_error", "crash_at_fsync"):
                spec = fault.how or storage_fault_spec(fault.action)
                note = self._arm(number, fault, lambda: self.launcher.arm_failpoints(self.slots[node], spec))
            elif fault.action == "corrupt":
                kind, how = fault.how.split(":")
                if fault.how not in RUNNING_CORRUPTIONS:
                    sup.kill(node)
                note = corrupt_file(self.launcher.damage_target(self.slots[node], kind),
                                    how.removesuffix("-running"), self.rng)
            elif fault.action == "clock_jump":
                assert fault.param is not None
                offset = fault.param
                note = self._arm(number, fault, lambda: self.launcher.skew_clock(self.slots[node], offset, CLOCK_DRIFT_RATE))
        except SupervisorError as exc:
            note = f"skipped: {exc}"
        detail = {"action": fault.action, "target": node, "scheduled": fault.target, "coordinator": is_coordinator,
                  "duration_s": fault.duration_s, "param": fault.param, "fault": number, "note": note, **extra}
        nemesis.record("fault", detail=detail)
        self.applied.append({"t_s": round(time.monotonic() - self.t0, 2), **detail})

    async def _heal(self, sup: Supervisor, nemesis: HistoryWriter, number: int, fault: Fault) -> None:
        node = self.resolved.get(number)
        if node is None:
            return
        note = "ok"
        extra: dict[str, Any] = {}
        try:
            if fault.action == "kill":
                sup.restart(node)
                self.launched_at[node] = time.monotonic()
            elif fault.action == "stop":
                sup.cont(node)
            elif fault.action in ("isolate", "partition"):
                self.partitions.pop(number, None)
                extra = {"cuts": self._apply_cuts()}  # what other partitions still cut
            elif fault.action == "bandwidth":
                self.links[node].set_bandwidth(None)
            elif fault.action == "slow":
                sup.unslow(node)
            elif fault.action in ("disk_full", "io_error"):
                extra = {"armed": await self._armed(number)}
                if sup.alive(node):
                    note = await self.launcher.disarm_failpoints(self.slots[node])
                else:  # it exited on its failing disk (e.g. unreadable at start): restarted, as systemd would
                    extra["exit_code"] = sup.returncode(node)
                    sup.restart(node)
                    self.launched_at[node] = time.monotonic()
            elif fault.action == "crash_at_fsync":
                extra = {"armed": await self._armed(number)}
                if sup.alive(node):  # it never reached that fsync in time: nothing to restart
                    note = "not hit; " + await self.launcher.disarm_failpoints(self.slots[node])
                else:
                    extra["exit_code"] = sup.returncode(node)
                    sup.restart(node)
                    self.launched_at[node] = time.monotonic()
            elif fault.action == "corrupt" and fault.how in RUNNING_CORRUPTIONS and sup.alive(node):
                note = "running"  # it repaired its log while running, or has not read the record back yet
            elif fault.action == "corrupt":  # damaged at rest (or it exited on a damage it found): restarted
                if fault.how in RUNNING_CORRUPTIONS:
                    extra["exit_code"] = sup.returncode(node)
                sup.restart(node)
                self.launched_at[node] = time.monotonic()
            elif fault.action == "clock_jump":
                extra = {"armed": await self._armed(number)}
                note = await self.launcher.skew_clock(self.slots[node], 0.0, 0.0)
        except SupervisorError as exc:
            note = f"skipped: {exc}"
        nemesis.record("heal", detail={"action": fault.action, "target": node, "fault": number, "note": note, **extra})

    def _arm(self, number: int, fault: Fault, call: Callable[[], Awaitable[str]]) -> str:
        """Start arming a fault in the node (failpoints or clock skew), retried until it answers
        or the fault's heal time: a node restarted by an earlier fault may still be starting.
        The heal records how it went (`armed`)."""
        deadline = self.t0 + fault.end_s

        async def keep_trying() -> str:
            note = await call()
            while note.startswith("skipped") and time.monotonic() + ARM_RETRY_S < deadline:
                await asyncio.sleep(ARM_RETRY_S)
                note = await call()
            return note

        self.arming[number] = asyncio.create_task(keep_trying())
        return "arming"

    async def _armed(self, number: int) -> str:
        """How arming fault `number` went, by its heal (a try still running is abandoned)."""
        task = self.arming.pop(number, None)
        if task is None:
            return "never tried"
        if not task.done():
            task.cancel()
            return "not armed before the heal"
        return task.result()

    # ---- the end ---------------------------------------------------------------------------

    async def _converge(self, sup: Supervisor, nemesis: HistoryWriter) -> None:
        """Wait until every live node is ready at the same index and digest, at or past the
        highest committed index; then write the `final` events either way (the checker judges)."""
        live = [n for n in self.slots if n in self.launched_at and sup.alive(n)]
        # Every kill is followed by a restart, so a node dead now exited on its own.
        self.dead_at_end = {n: sup.returncode(n) for n in self.launched_at if n not in live}
        deadline = time.monotonic() + self.config.converge_timeout_s
        # A node's answer describes it as of this long before the probe: its /status may be one
        # refresh old, and a follower learns a commit at the next append or heartbeat. The cluster
        # keeps committing, so the finals are compared with what was committed before that.
        lag = self.launcher.status_lag_s + self.config.heartbeat_s
        while True:
            probed_at = time.monotonic() - lag
            probes = await self._probe_all(live)
            committed = self._max_committed(before=probed_at)
            states = {(p.index, p.state_digest) for p in probes.values()}
            if (all(p.ready for p in probes.values()) and len(states) == 1
                    and all((p.index or 0) >= committed for p in probes.values())):
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(POLL_S)
        for node, p in probes.items():
            nemesis.record("final", index=p.index or 0, state_digest=p.state_digest or "",
                           detail={"target": node, "ready": p.ready, "reason": p.reason, "probed_at": probed_at})

    def _max_committed(self, before: float | None = None) -> int:
        """The highest index any node has recorded as committed (by time `before` if given;
        files followed incrementally)."""
        for node, slot in self.slots.items():
            self.tails.setdefault(node, _HistoryTail(slot.history_path)).poll()
        if before is None:
            return max((t.max_commit for t in self.tails.values()), default=0)
        return max((t.max_commit_before(before) for t in self.tails.values()), default=0)

    def _history_paths(self) -> list[Path]:
        paths = [s.history_path for s in self.slots.values() if s.history_path.exists()]
        nemesis = self.dir / NEMESIS / HISTORY_FILE_NAME
        return paths + ([nemesis] if nemesis.exists() else [])

    def _read_histories(self, nodes_only: bool = False) -> dict[str, list[HistoryEvent]]:
        paths = self._history_paths()
        if nodes_only:
            paths = [p for p in paths if p.parent.name != NEMESIS]
        return load_histories(paths)

    def _evaluate(self, t0: float, t1: float) -> ModeResult:
        histories = self._read_histories()
        torn = sum(read_history(p).torn_tail for p in self._history_paths())
        violations = check_histories(histories, final_states_from(histories))
        stall_after = self.config.stall_after_s
        if stall_after is None:
            times = [c.t_mono for c in commit_times(histories) if t0 <= c.t_mono <= t1]
            gaps = [b - a for a, b in zip(times, times[1:])]
            stall_after = 2 * statistics.median(gaps) if gaps else 0.0
        metrics = measure(histories, self.learner_windows, t0, t1, stall_after)
        # Without a node's history the checker cannot see it: say so rather than pass quietly.
        silent = sorted(n for n in self.launched_at if not histories.get(n))
        return ModeResult(self.mode, metrics, violations, self.applied, torn, silent, self.dead_at_end)


# ---------------------------------------------------------------------------------------------
# The whole run and its report


def run_chaos(config: ChaosConfig, launcher: Launcher | None = None, schedule: Schedule | None = None) -> dict[str, Any]:
    """Run the schedule in every configured mode; return the JSON report (see docs/CHAOS.md)."""
    launcher = launcher if launcher is not None else DaemonLauncher()
    schedule = schedule if schedule is not None else build_schedule(config)
    if config.scenario == "random":
        problems = check_schedule(schedule, config.schedule_spec())
        if problems:
            raise HarnessError("schedule breaks its constraints: " + "; ".join(problems))
    config.workdir.mkdir(parents=True, exist_ok=True)
    (config.workdir / "schedule.json").write_text(schedule.to_json())
    results = {mode: ModeRun(config, schedule, mode, launcher).run() for mode in config.modes}
    report: dict[str, Any] = {
        "seed": config.seed,
        "nodes": launcher.name,
        "scenario": config.scenario,
        "faults": len(schedule.faults),
        "lease_s": config.lease_s,
        "schedule": schedule.describe(),
        "violations": [f"{mode}: {v}" for mode, r in results.items() for v in r.violations],
    }
    for mode, result in results.items():
        report[mode] = {**result.metrics.to_report(), "torn_history_lines": result.torn_tails,
                        "nodes_without_history": result.silent_nodes, "nodes_dead_at_end": result.dead_at_end,
                        "faults_applied": result.applied}
    report["targets"] = evaluate_targets(report, config)
    return report


def evaluate_targets(report: Mapping[str, Any], config: ChaosConfig) -> dict[str, dict[str, Any]]:
    """Each target of the issue with its measured value and whether it is met."""
    targets: dict[str, dict[str, Any]] = {
        "violations": {"value": len(report["violations"]), "target": "== 0", "ok": not report["violations"]},
    }
    if report["violations"]:  # the summary line names the first (every one is in the report's list)
        targets["violations"]["first"] = report["violations"][0]
    silent = sorted({n for mode in MODES if mode in report for n in report[mode].get("nodes_without_history", [])})
    targets["histories"] = {"value": silent, "target": "every node writes <data_dir>/history.jsonl", "ok": not silent}
    dead = {f"{mode}:{n}": rc for mode in MODES if mode in report for n, rc in report[mode].get("nodes_dead_at_end", {}).items()}
    targets["nodes_alive"] = {"value": dead, "target": "no node exits on its own", "ok": not dead}
    decoupled = report.get("decoupled")
    outages = 0 if decoupled is None else len(decoupled["failover_s"]["all"]) + decoupled["failover_s"]["unrecovered"]
    if decoupled is not None and outages:
        worst = max(decoupled["failover_s"]["all"], default=None)
        limit = TARGET_GAP_LEASES * config.lease_s
        targets["failover_gap"] = {
            "value": worst, "target": f"<= {limit:g}s (3 x lease)",
            "ok": worst is not None and worst <= limit and decoupled["failover_s"]["unrecovered"] == 0,
        }
    if decoupled is not None and config.scenario == "learner-down":
        targets["decoupled_goodput"] = {"value": decoupled["goodput"], "target": f">= {TARGET_DECOUPLED_GOODPUT}",
                                        "ok": decoupled["goodput"] >= TARGET_DECOUPLED_GOODPUT}
    synchronous = report.get("synchronous")
    if synchronous is not None and config.scenario == "learner-down":
        targets["synchronous_goodput"] = {"value": synchronous["goodput"], "target": f"<= {TARGET_SYNCHRONOUS_GOODPUT_MAX}",
                                          "ok": synchronous["goodput"] <= TARGET_SYNCHRONOUS_GOODPUT_MAX}
    return targets


def standin_config(config: ChaosConfig) -> ChaosConfig:
    """Timings that suit stand-ins (they start in a fraction of a second, commit every 0.25 s)."""
    return replace(config, ready_timeout_s=min(config.ready_timeout_s, 20.0),
                   converge_timeout_s=min(config.converge_timeout_s, 10.0), terminate_grace_s=3.0)


__all__ = [
    "ChaosConfig", "DaemonLauncher", "HarnessError", "Launcher", "ModeResult", "ModeRun", "NodeProbe",
    "NodeSlot", "StandinLauncher", "build_schedule", "evaluate_targets", "partition_cuts", "run_chaos",
    "source_address", "standin_config",
]
