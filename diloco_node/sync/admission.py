"""Which contributions the lease holder's syncer takes in, and how much work each may claim.

Every contribution passes here before it counts toward a round, in the daemon and in the runner
alike (`Syncer.admit`, `Syncer.add`):

- members only: the sender must be a learner member of the run that has not left;
- the lease: only the lease holder takes contributions (the caller says why it is not one);
- in flight: at most `max_in_flight` contributions of one learner are being received at a time
  (a learner sends one fragment per slot, so a second one while its first is still arriving is a
  flood); the caller's own learner is not limited (it cannot flood its own node);
- the fragment must exist in the run's plan;
- the steps cap: a steps claim for fragment p may exceed the period H only by what the time since
  the learner's previous admitted contribution for p (or since the lease was gained) allows at the
  syncer's step-time estimate, times `STEPS_TIME_SLACK`; a larger claim is cut to that, its tokens
  with it (the merge weights then cap per-step tokens and whole claims by the manifest's caps).

Every refusal has a kind (what /status counts) and a human reason. Pure: no I/O, no clock (the
caller passes `now`), no threads; one caller (an event loop, or the runner's event queue).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

# A learner's steps claim for fragment p may exceed the period H by what the time since its previous
# admitted contribution for p allows at the syncer's step-time estimate, times this slack (a learner
# a little faster than the estimate, or whose previous round was dropped, is not cut).
STEPS_TIME_SLACK = 2.0
# Contributions being received per learner: one fragment per slot.
MAX_IN_FLIGHT_PER_LEARNER = 1
LEARNER_ROLE = "learner"

# The refusal kinds, in the order /status lists them.
NOT_MEMBER = "not_member"
NOT_LEARNER = "not_learner"
LEFT = "left"
NOT_LEASE_HOLDER = "not_lease_holder"
IN_FLIGHT = "in_flight"
UNKNOWN_FRAGMENT = "unknown_fragment"
MALFORMED = "malformed"  # the caller found the contribution's bytes bad (shapes, chunks, decoding)
REFUSAL_KINDS = (NOT_MEMBER, NOT_LEARNER, LEFT, NOT_LEASE_HOLDER, IN_FLIGHT, UNKNOWN_FRAGMENT, MALFORMED)


@dataclass(frozen=True, slots=True)
class Member:
    """What admission needs to know of a member: its role ("learner", "witness") and whether it left."""

    role: str
    left: bool = False


@dataclass(frozen=True, slots=True)
class Refused:
    kind: str  # one of REFUSAL_KINDS
    reason: str


@dataclass(eq=False, slots=True)
class Admitted:
    """A contribution being received: it holds one of its learner's in-flight places until
    `Admission.release` (or `Syncer.add`) gives it back."""

    learner: str
    fragment: int
    released: bool = False


@dataclass(slots=True)
class AdmissionCounts:
    """Refusals by kind and capped claims since the syncer was made, and the last reason of either."""

    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_KINDS, 0))
    capped: int = 0
    last_reason: str = ""


def steps_allowed(period: int, step_s: float | None, since: float | None, now: float) -> int | None:
    """The most inner steps a claim may hold: H plus what `now - since` allows at `step_s` per step
    (times the slack); None (no cap) while the step time or the start of the window is unknown."""
    if not step_s or step_s <= 0.0 or since is None:
        return None
    return period + math.ceil(STEPS_TIME_SLACK * max(0.0, now - since) / step_s)


class Admission:
    """The admission rules of one syncer: who may contribute, how many at a time, how much work."""

    def __init__(self, num_fragments: int, period: int, max_in_flight: int = MAX_IN_FLIGHT_PER_LEARNER) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight = {max_in_flight} must be >= 1")
        self.num_fragments = num_fragments
        self.period = period
        self.max_in_flight = max_in_flight
        self.counts = AdmissionCounts()
        self._in_flight: dict[str, int] = {}  # learner -> contributions being received
        self._admitted_at: dict[tuple[str, int], float] = {}  # (learner, p) -> last admitted whole
        self._lease_since: float | None = None  # when the lease was gained (None: not known)

    def refuse(self, kind: str, reason: str) -> Refused:
        """Count a refusal (also one the caller found, e.g. a malformed stream) and return it."""
        if kind not in self.counts.refused:
            raise ValueError(f"refusal kind {kind!r}: must be one of {', '.join(REFUSAL_KINDS)}")
        self.counts.refused[kind] += 1
        self.counts.last_reason = reason
        return Refused(kind, reason)

    def admit(self, learner: str, fragment: int, *, member: Member | None, not_holder: str = "",
              local: bool = False) -> Admitted | Refused:
        """May `learner` send a contribution to `fragment` now? `member`: its membership record (None:
        not a member); `not_holder`: why this node does not hold the lease ("" when it does); `local`:
        the contribution is this node's own learner's (no in-flight limit)."""
        if member is None:
            return self.refuse(NOT_MEMBER, f"contribution refused: {learner} is not a member of this run")
        if member.role != LEARNER_ROLE:
            return self.refuse(NOT_LEARNER, f"contribution refused: {learner} is a {member.role}, not a learner")
        if member.left:
            return self.refuse(LEFT, f"contribution refused: {learner} has left the run")
        if not_holder:
            return self.refuse(NOT_LEASE_HOLDER, not_holder)
        if not local and self._in_flight.get(learner, 0) >= self.max_in_flight:
            return self.refuse(IN_FLIGHT, f"a contribution from {learner} is already being received")
        if not 0 <= fragment < self.num_fragments:
            return self.refuse(UNKNOWN_FRAGMENT, f"fragment {fragment} does not exist in this run")
        self._in_flight[learner] = self._in_flight.get(learner, 0) + 1
        return Admitted(learner, fragment)

    def release(self, ticket: Admitted) -> None:
        """The contribution arrived whole or was dropped: its in-flight place is free (idempotent)."""
        if ticket.released:
            return
        ticket.released = True
        left = self._in_flight.get(ticket.learner, 0) - 1
        if left > 0:
            self._in_flight[ticket.learner] = left
        else:
            self._in_flight.pop(ticket.learner, None)

    def in_flight(self) -> Mapping[str, int]:
        return dict(self._in_flight)

    def cap_claim(self, learner: str, fragment: int, c_steps: int, c_tokens: int, now: float,
                  step_s: float | None, tokens_per_step: int) -> tuple[int, int, str]:
        """A whole contribution is taken in: its claim (steps, tokens) after the steps cap, and why
        it was cut ("" when it was not). The admission time starts the learner's next window."""
        since = self._admitted_at.get((learner, fragment), self._lease_since)
        self._admitted_at[(learner, fragment)] = now
        allowed = steps_allowed(self.period, step_s, since, now)
        if allowed is None or c_steps <= allowed:
            return c_steps, c_tokens, ""
        why = (f"{learner} claims {c_steps} steps for fragment {fragment}; {allowed} are possible since its "
               f"previous contribution: capped")
        self.counts.capped += 1
        self.counts.last_reason = why
        return allowed, min(c_tokens, allowed * tokens_per_step), why

    def lease_gained(self, now: float) -> None:
        """Windows restart at the lease: what learners did for the previous holder is not ours to time."""
        self._lease_since = now
        self._admitted_at.clear()
