"""Is this node ready, and why (not): one pure function of what the node knows, with the reason.

`/readyz`, `/status` and systemd's READY=1 and STATUS= lines all come from `readiness()`. A node is
ready once its replica is one committed global state caught up with what the lease holder told
it, and (for a learner) its training step is compiled. Once ready it stays ready while it catches
up from the log (its state is always one committed state); during a snapshot install it is not
one state, so it says not ready until the downloaded state has been replayed. A ready node also
says not ready while its coordination is stalled: it holds no lease and has heard from no lease
holder for longer than the lease (it cannot commit, nor learn of commits), with how long.

The disk counts too (ops/storage_health.py): while a step that the coordination state needs fails
(the election record, the log's appends and rewrites) the node acknowledges nothing, so it says
not ready and names the failing points; a failing step it can do without (history, checkpoints,
spool, export, a payload read) leaves it ready, and the reason names that point as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Durable steps without which the node can acknowledge nothing (coordination_store.py).
BLOCKING_POINTS = frozenset({"election.write", "log.append", "log.truncate", "vote_floor.write"})


@dataclass(frozen=True, slots=True)
class ReadinessFacts:
    download: str | None  # a running download's progress line, None when none runs
    learner_compiling: bool  # a learner site whose training step is not compiled yet
    has_voters: bool  # the run's configuration has replicated to us
    applied_index: int  # the replica's
    consistent_from: int  # applied index from which the replica is one consistent state
    log_applied_index: int  # the coordination log's
    commit_target: int  # the newest commit index we know of (ours or the lease holder's)
    replacing_state: bool  # a download runs or its held entries are not yet applied
    was_ready: bool  # this node has been ready before (readiness latches)
    role: str  # "lease holder", "follower", ...
    epoch: int
    # Seconds since a lease holder was last heard from (0 while we hold the lease ourselves), and
    # the lease: beyond it coordination is stalled. None: not known yet.
    coordination_silent_s: float | None = None
    lease_s: float = float("inf")
    # (failpoint name, error) of each durable step whose last attempt failed (`storage_failures`)
    storage_failing: tuple[tuple[str, str], ...] = ()
    # Why the replica is not the run's state at its applied index ("" when it is: a stale fragment,
    # a repaired one ahead of the rest; the state keeper's `current_reason`).
    not_current: str = ""


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool  # /readyz and the status document
    became_ready: bool  # first time: tell systemd READY=1
    reason: str


def readiness(facts: ReadinessFacts) -> Readiness:
    reason = ""
    if facts.download is not None:
        reason = facts.download
    elif facts.learner_compiling:
        reason = "compiling the training step"
    elif not facts.has_voters:
        reason = "waiting for the run's configuration to replicate"
    elif facts.applied_index < facts.consistent_from:
        # A joiner's fragments were downloaded as of different indices: not one consistent state
        # (nor a digest worth showing) until the log is replayed through the newest.
        reason = f"replaying the log: applied {facts.applied_index} of {facts.consistent_from}"
    elif facts.log_applied_index < facts.commit_target:
        reason = f"catching up: applied {facts.log_applied_index} of {facts.commit_target}"
    latched = facts.was_ready or not reason
    became_ready = latched and not facts.was_ready
    blocking = [f"{point} ({error})" for point, error in facts.storage_failing if point in BLOCKING_POINTS]
    others = [f"{point} ({error})" for point, error in facts.storage_failing if point not in BLOCKING_POINTS]
    if blocking:
        return Readiness(False, False, f"storage failing: {'; '.join(blocking)}: nothing is acknowledged until "
                                       "a write succeeds")
    also = f"; storage failing: {'; '.join(others)}" if others else ""
    if latched and facts.replacing_state:
        return Readiness(False, became_ready, f"installing a snapshot: {reason}{also}")
    if latched and facts.not_current:
        return Readiness(False, became_ready, f"state not current: {facts.not_current}{also}")
    if latched and facts.coordination_silent_s is not None and facts.coordination_silent_s > facts.lease_s:
        return Readiness(False, became_ready,
                         f"coordination stalled: no lease holder heard from for {facts.coordination_silent_s:.1f} s "
                         f"(lease {facts.lease_s:g} s); {facts.role}, epoch {facts.epoch}{also}")
    if latched:
        return Readiness(True, became_ready,
                         f"ready: {facts.role}, epoch {facts.epoch}, applied {facts.applied_index}{also}")
    return Readiness(False, False, reason + also)


def storage_failures(storage: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(point, error) pairs from a storage status (`StorageHealth.to_status()`)."""
    failing = storage.get("failing", {})
    return tuple((point, str(failure.get("error", ""))) for point, failure in sorted(failing.items()))
