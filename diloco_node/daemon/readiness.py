"""Is this node ready, and why (not): one pure function of what the node knows, with the reason.

`/readyz`, `/status` and systemd's READY=1 and STATUS= lines all come from `readiness()`. A node is
ready once its replica is one committed global state caught up with what the lease holder told
it, and (for a learner) its training step is compiled. Once ready it stays ready while it catches
up from the log (its state is always one committed state); during a snapshot install it is not
one state, so it says not ready until the downloaded state has been replayed. A ready node also
says not ready while its coordination is stalled: it holds no lease and has heard from no lease
holder for longer than the lease (it cannot commit, nor learn of commits), with how long.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    if latched and facts.replacing_state:
        return Readiness(False, became_ready, f"installing a snapshot: {reason}")
    if latched and facts.coordination_silent_s is not None and facts.coordination_silent_s > facts.lease_s:
        return Readiness(False, became_ready,
                         f"coordination stalled: no lease holder heard from for {facts.coordination_silent_s:.1f} s "
                         f"(lease {facts.lease_s:g} s); {facts.role}, epoch {facts.epoch}")
    if latched:
        return Readiness(True, became_ready, f"ready: {facts.role}, epoch {facts.epoch}, applied {facts.applied_index}")
    return Readiness(False, False, reason)
