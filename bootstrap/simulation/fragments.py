"""The simulated application's fragments: stale after an unreadable entry, repaired from a peer.

Beside the hash chain over everything applied (checker.py), each host's application holds, per
fragment, the outer commit it last took (index and identity). The `unreadable_payload` fault makes
a host's next outer-commit applies fail as the daemon's do when a payload cannot be read back
(log.read EIO): the fragment is then stale and a repair asks a random live peer for its copy, as
the daemon's state keeper does, a network delay later. Whether the copy may be installed, and
whether the host's state is current, is decided by the real `StaleFragments`
(bootstrap/apply_rule.py). Whenever a host says its state is current, every fragment it holds must
be the run's as of its applied index (`FragmentTruth.check`).

A lease holder's snapshot restore is modelled as a verified download as of the snapshot's index
(the download's own floors are the daemon's join.py, tested on their own).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from bootstrap.apply_rule import StaleFragments
from bootstrap.entries import EntryKind, LogEntry
from bootstrap.simulation.checker import entry_identity

Held = tuple[int, bytes]  # (index of the outer commit a fragment last took, its identity)


@dataclass(slots=True)
class FragmentTruth:
    """The committed outer commits per fragment, in index order (from the first apply of each index)."""

    commits: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)

    def learn(self, entry: LogEntry) -> None:
        if entry.index in self.seen or entry.kind is not EntryKind.OUTER_COMMIT or entry.fragment is None:
            return
        self.seen.add(entry.index)
        bisect.insort(self.commits.setdefault(entry.fragment, []), (entry.index, entry_identity(entry)))

    def as_of(self, fragment: int, index: int) -> Held | None:
        """The commit fragment `fragment` holds in the run's state after `index` (None: none yet)."""
        commits = self.commits.get(fragment, [])
        at = bisect.bisect_right(commits, (index, b"\xff" * 64))
        return commits[at - 1] if at else None

    def state_as_of(self, index: int) -> dict[int, Held]:
        return {p: held for p in self.commits if (held := self.as_of(p, index)) is not None}

    def check(self, node_id: str, model: FragmentModel, applied_index: int) -> str | None:
        """A violation when `model` says it is current at `applied_index` but is not the run's state."""
        if not model.current(applied_index):
            return None
        for p in sorted(set(self.commits) | set(model.held)):
            expected, held = self.as_of(p, applied_index), model.held.get(p)
            if held != expected:
                return (f"{node_id} state after {applied_index} differs from other replicas: fragment {p} holds "
                        f"the commit of index {held[0] if held else None}, the run's is index "
                        f"{expected[0] if expected else None} (it reported its state current)")
        return None


@dataclass(slots=True)
class FragmentModel:
    """One host's fragments. `unreadable`: how many next outer-commit applies fail to read back."""

    stale: StaleFragments
    held: dict[int, Held] = field(default_factory=dict)
    unreadable: int = 0
    repairing: set[int] = field(default_factory=set)

    @classmethod
    def new(cls, enforce_floor: bool = True) -> FragmentModel:
        return cls(StaleFragments(enforce_floor=enforce_floor))

    def apply(self, entry: LogEntry) -> int | None:
        """Apply one committed entry; the fragment that now needs a repair, if any."""
        p = entry.fragment
        if entry.kind is not EntryKind.OUTER_COMMIT or p is None:
            return None
        if p in self.stale.floors:
            self.stale.mark(p, entry.index, "a commit arrived while it is stale")
            return p
        if self.unreadable > 0:
            self.unreadable -= 1
            self.stale.mark(p, entry.index, "payload unreadable")
            return p
        self.held[p] = (entry.index, entry_identity(entry))
        return None

    def current(self, applied_index: int) -> bool:
        return self.stale.current(applied_index)[0]

    def serve(self, fragment: int, applied_index: int) -> tuple[int, Held | None] | None:
        """(served index, copy) for a peer's repair, or None: a state that is not current serves nothing."""
        if not self.current(applied_index):
            return None
        return applied_index, self.held.get(fragment)

    def install(self, fragment: int, served_index: int, copy: Held | None) -> bool:
        accepted, _ = self.stale.offer(fragment, served_index)
        if accepted:
            if copy is None:
                self.held.pop(fragment, None)
            else:
                self.held[fragment] = copy
        return accepted

    def restore(self, truth: FragmentTruth, index: int) -> None:
        """A snapshot install: the run's state as of `index`, nothing stale (see the module doc)."""
        self.held = truth.state_as_of(index)
        self.stale = StaleFragments(enforce_floor=self.stale.enforce_floor)
        self.repairing.clear()
