"""A multi-host site: its processes joined into one JAX cluster, and process 0's decisions at step
boundaries followed by every other process through JAX's own collectives.

Process 0 is the site to the rest of the run (peers, coordination, the syncer role, /status); the
other processes run the learner only. Every process steps the same jitted program on the site's
global mesh, so they must also take the same actions between steps, in the same order. At each
step boundary process 0 decides (stop? a checkpoint copy? which merged fragments to write?) and
`BoundaryFollowing.decide` broadcasts the decision; the merged tensors travel the same way
(`share`), and fragment or state reads are gathered from every process's shards (`gather`). There
is no second protocol between hosts: all of it is `jax.experimental.multihost_utils`, and the
processes meet (`meet`, a barrier of JAX's coordination service) before each first collective
whose start they reach at their own pace.

The training thread of every process reads only values of its own devices: a device value that
spans other processes' devices cannot be fetched there (JAX raises). Figures read a replicated
scalar's local copy (the loss, the gradient norm); the learning rate is computed on the host
(`inner.host_learning_rate`); state reads are `gather`ed.

A JAX cluster never spans sites: when one process dies, the site goes down and comes back like
any restarted site (restart, checkpoint, catch-up from the run's log). How it goes down: a killed
follower breaks the collectives' connections, so process 0's learner fails within a step and the
daemon exits 1 naming the lost process (`lost_processes`); a dead process 0 takes the coordination
service with it, and JAX aborts every follower at once; a host that hangs instead is declared dead
after `[node.cluster] heartbeat_timeout_s`, and JAX aborts the rest.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from diloco_node.config.site_devices import AUTO_COORDINATOR, ClusterSpec

log = logging.getLogger(__name__)

# How long process 0 waits at start-up for every host of the site to connect (seconds). Hosts of
# one site start together (one unit per host) but JAX import and device discovery take a while.
INITIALIZATION_TIMEOUT_S = 300
# How long `lost_processes` waits for the coordination service's answer. Its query is a meeting
# of the live processes: it answered at once after a host was killed in one run and not within
# 5 s in another (measured on loopback), so it is only asked briefly, on the way down.
LIVENESS_QUERY_TIMEOUT_S = 2.0


def initialize(spec: ClusterSpec, *, initialization_timeout_s: int = INITIALIZATION_TIMEOUT_S) -> bool:
    """Join this process to its site's JAX cluster (before anything else touches JAX's devices).
    Returns whether a cluster was initialised (False: a one-host site, nothing to do)."""
    if not spec.enabled:
        return False
    # CPU devices need a collectives backend to talk across processes (GPUs and TPUs bring their
    # own); gloo over TCP is what makes a multi-host site testable on one machine.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if spec.coordinator == AUTO_COORDINATOR:
        jax.distributed.initialize(initialization_timeout=initialization_timeout_s,
                                   heartbeat_timeout_seconds=spec.heartbeat_timeout_s)
    else:
        jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                                   initialization_timeout=initialization_timeout_s,
                                   heartbeat_timeout_seconds=spec.heartbeat_timeout_s)
    log.info("joined the site's JAX cluster as process %d of %d (%d devices, %d local)", jax.process_index(),
             jax.process_count(), jax.device_count(), jax.local_device_count())
    return True


def lost_processes(timeout_s: float = LIVENESS_QUERY_TIMEOUT_S) -> tuple[int, ...] | None:
    """The site's processes the coordination service no longer counts as alive (after a collective
    failed: a killed host's connections are gone before its heartbeats are missed). None when it
    cannot tell (no cluster, no answer in time, or JAX's internals changed)."""
    found: list[tuple[int, ...]] = []

    def ask() -> None:
        try:
            # jax.distributed has no public liveness query; its client's does what we need.
            from jax._src import distributed

            client = distributed.global_state.client
            if client is None:
                return
            everyone = list(range(jax.process_count()))
            live = client.get_live_nodes(everyone)
            found.append(tuple(i for i in everyone if i not in live))
        except Exception as error:  # only a better log line is lost
            log.debug("liveness query failed: %r", error)

    # A daemon thread: a query the service never answers must not keep the process from exiting.
    asker = threading.Thread(target=ask, name="cluster-liveness", daemon=True)
    asker.start()
    asker.join(timeout_s)
    return found[0] if found else None


def suspected_lost() -> tuple[int, ...]:
    """The processes the coordination service reports lost, or on a two-process site the other
    one (the only peer our collectives have); () when neither tells."""
    lost = lost_processes()
    if not lost and jax.process_count() == 2:
        lost = (1 - jax.process_index(),)
    return lost or ()


def failure_reason(error: BaseException) -> str:
    """Why a multi-host site's learner failed, naming the lost processes: those the coordination
    service reports, or on a two-process site the other one (the only peer a collective has)."""
    lost = suspected_lost()
    first_line = (str(error).splitlines() or [""])[0]
    if lost:
        who = f"lost process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of the site's JAX cluster"
    else:
        who = "a collective of the site's JAX cluster failed (no process reported lost)"
    return f"{who}: {type(error).__name__}: {first_line}"


# How long a process of the site waits at a meeting (`meet`) for the others: process 0 may catch
# up from the run's log or download a state before it starts training. A process that never comes
# is found dead by JAX's heartbeats (`heartbeat_timeout_s`) long before this ends.
MEETING_TIMEOUT_S = 3600


def meet(name: str, timeout_s: float = MEETING_TIMEOUT_S) -> None:
    """Wait until every process of the site has called `meet(name)` (a barrier of JAX's
    coordination service, not a collective; nothing to do without a cluster).

    Why: the first collective over a set of devices also sets up its connections, and on CPUs (gloo)
    that set-up gives up after a fixed 30 s when a peer is later than that: a process that compiled
    the step more slowly (a loaded host), or a process 0 still catching up, would fail the site's
    first step. Meeting first makes every process start such a collective together; once set up,
    a collective waits for a late peer as long as it takes.
    """
    from jax._src import distributed  # the public API has no barrier; its client has one

    client = distributed.global_state.client
    if client is None:
        return
    client.wait_at_barrier(f"diloco-node:{name}", int(timeout_s * 1000))


# Per-fragment actions in a decision: nothing, overwrite with the shared values, or gather the
# local values first (the apply rule needs them: mix, or a merge without our unsent work).
APPLY_NONE, APPLY_WRITE, APPLY_AFTER_READ = 0, 1, 2


@dataclass(frozen=True, slots=True)
class BoundaryDecision:
    """What every process of the site does at one step boundary, as process 0 decided it."""

    stop: bool = False
    snapshot: bool = False  # gather the whole learner state (process 0 checkpoints it)
    apply: tuple[int, ...] = ()  # per fragment: APPLY_NONE, APPLY_WRITE or APPLY_AFTER_READ

    def encode(self, num_fragments: int) -> np.ndarray:
        apply = self.apply or (APPLY_NONE,) * num_fragments
        if len(apply) != num_fragments:
            raise ValueError(f"decision for {len(apply)} fragments, the plan has {num_fragments}")
        return np.array([int(self.stop), int(self.snapshot), *apply], dtype=np.int32)

    @classmethod
    def decode(cls, array: np.ndarray) -> BoundaryDecision:
        values = [int(v) for v in np.asarray(array)]
        return cls(bool(values[0]), bool(values[1]), tuple(values[2:]))


def share_manifest(text: str | None) -> str:
    """The run manifest's canonical JSON from process 0 to every process of the site, before the
    learner is built: only process 0 founds, joins or restarts, so only it knows the manifest."""
    meet("manifest")  # process 0 gets here after its start-up, the others at once
    return BoundaryFollowing(0).share_text(text)


def is_follower() -> bool:
    """Whether this process is one of a multi-host site's followers (not process 0)."""
    return jax.process_index() != 0


class BoundaryFollowing:
    """The collectives one site's processes meet in at step boundaries. Every method is a
    collective: every process calls it, in the same order; process 0's arguments are what count."""

    def __init__(self, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self.leader = jax.process_index() == 0
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()

    def decide(self, decision: BoundaryDecision | None) -> BoundaryDecision:
        """Process 0 passes its decision, the others None; every process gets process 0's."""
        if self.leader and decision is None:
            raise ValueError("process 0 must decide")
        mine = (decision or BoundaryDecision()).encode(self.num_fragments)
        return BoundaryDecision.decode(multihost_utils.broadcast_one_to_all(mine))

    def share(self, values: Mapping[str, np.ndarray] | None,
              template: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray]:
        """Process 0's host tensors to every process; `template` is name -> (shape, dtype)."""
        if self.leader:
            if values is None:
                raise ValueError("process 0 must share its values")
            mine = {n: np.asarray(values[n], dtype=dtype) for n, (_, dtype) in template.items()}
        else:
            mine = {n: np.zeros(shape, dtype) for n, (shape, dtype) in template.items()}
        shared = multihost_utils.broadcast_one_to_all(mine)
        return {n: np.asarray(v) for n, v in shared.items()}

    def share_list(self, values: Sequence[np.ndarray] | None,
                   template: Sequence[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
        named = self.share(None if values is None else {f"{i:05d}": v for i, v in enumerate(values)},
                           {f"{i:05d}": t for i, t in enumerate(template)})
        return [named[f"{i:05d}"] for i in range(len(template))]

    def share_text(self, text: str | None) -> str:
        """A string from process 0 (its length first, so the others can size their buffer)."""
        data = np.frombuffer((text or "").encode(), dtype=np.uint8) if self.leader else np.zeros(0, np.uint8)
        length = int(multihost_utils.broadcast_one_to_all(np.array([len(data)], np.int64))[0])
        buffer = data if self.leader else np.zeros(length, np.uint8)
        if length == 0:
            return ""
        return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buffer), dtype=np.uint8)).decode()

    def gather(self, arrays: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
        """Full host copies of global arrays, assembled from every process's shards."""
        if not arrays:
            return {}
        gathered = multihost_utils.process_allgather(dict(arrays), tiled=True)
        return {n: np.array(v, dtype=np.float32) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.array(v)
                for n, v in gathered.items()}
