"""Whether a replica's state is the run's state at its applied index: stale fragments and their repair.

The rule: a replica applies index i only onto the state after i - 1. When it cannot apply a
committed entry to a fragment (the payload cannot be read back, the digest disagrees, a round is
missing), that fragment is *stale* from that index on (every fragment, when entries before i never
reached the state at all: `gap`): the replica says its state is not current,
and the only way back is a copy of the fragment from a peer that has applied at least that index
(its *floor*; every later entry the replica could not apply to the fragment raises it). A copy served
as of an older index is refused: installing it would silently drop the entries between (the
replica would go on applying later indices onto a fragment that never saw them). A copy served as
of a newer index than the replica has applied is taken, but the state is current again only once
the replica has applied that index too (until then the fragment is ahead of the rest).

Sans-IO: the daemon's state keeper (diloco_node/daemon/state_transfer.py) and the coordination
simulation (bootstrap/simulation/) both decide through `StaleFragments`; neither the daemon's
download nor the simulation's model of it decides on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class StaleFragments:
    """Per fragment, the floor a repair copy must reach; and the index the state is current from."""

    floors: dict[int, int] = field(default_factory=dict)  # fragment -> index a copy must be served at
    reasons: dict[int, str] = field(default_factory=dict)
    current_from: int = 0  # applied index from which the state is one state (a copy ahead of us)
    # Only the simulation's broken variant sets this False: a copy is taken from any peer, however far behind.
    enforce_floor: bool = True

    def mark(self, fragment: int, index: int, reason: str) -> None:
        """Entry `index` could not be applied to `fragment`: it is stale until a copy served as of
        `index` or later is installed."""
        self.floors[fragment] = max(self.floors.get(fragment, 0), index)
        self.reasons[fragment] = f"fragment {fragment} stale since index {self.floors[fragment]}: {reason}"

    def gap(self, applied_index: int, index: int, fragments: int) -> str:
        """Entry `index` arrives at a state as of `applied_index`: when it does not follow, the entries
        between never reached the state, and which fragments they changed is not known, so every
        fragment is stale from `index` (a copy must include it). The reason, or "" when it follows."""
        if index <= applied_index + 1:
            return ""
        reason = f"entries {applied_index + 1}..{index - 1} never reached the state (applied {applied_index})"
        for p in range(fragments):
            self.mark(p, index, reason)
        return reason

    def floor(self, fragment: int) -> int:
        """The lowest log index a peer's copy of `fragment` may be served at (0: not stale)."""
        return self.floors.get(fragment, 0) if self.enforce_floor else 0

    def offer(self, fragment: int, served_index: int) -> tuple[bool, str]:
        """A peer served `fragment` as of its applied index `served_index`: may it be installed?
        On yes the fragment is no longer stale (the caller installs it now)."""
        floor = self.floors.get(fragment)
        if floor is None:
            return True, f"fragment {fragment} was not stale"
        if served_index < floor and self.enforce_floor:
            return False, (f"fragment {fragment} served as of index {served_index}, behind index {floor} "
                           "it must include: refused, asked again")
        del self.floors[fragment]
        self.reasons.pop(fragment, None)
        self.current_from = max(self.current_from, served_index) if self.enforce_floor else self.current_from
        return True, f"fragment {fragment} repaired as of index {served_index}"

    def current(self, applied_index: int) -> tuple[bool, str]:
        """(whether the state is the run's state as of `applied_index`, why not)."""
        if self.floors:
            return False, "; ".join(self.reasons[p] for p in sorted(self.floors))
        if applied_index < self.current_from:
            return False, (f"a repaired fragment is as of index {self.current_from}, ahead of applied "
                           f"index {applied_index}")
        return True, ""
