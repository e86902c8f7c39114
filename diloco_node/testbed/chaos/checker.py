"""The invariant checker: safety properties over every node's history after a chaos run.

Pure: it takes parsed histories (`diloco_node.ops.history`) and returns violations, each with the
invariant's name and a human-readable message naming nodes, indexes, epochs and times. It reads
no file and no clock. The properties (docs/CHAOS.md has the reasoning):

- one_entry_per_index: every commit/apply event for an index names the same entry digest (an event
  that names none, its payload unreadable on a failing disk, is not compared);
- committed_index_lost: a new lease holder's log reaches every index committed before it won,
  and every node's final state reaches every index ever committed;
- epoch_regressed: a node's current epoch never goes down, across restarts too;
- two_leaders: no two nodes acquire the lease in the same epoch;
- apply_gap: within one process lifetime a node applies index i+1 right after i (a snapshot
  install may jump); after a restart it may replay from any earlier index;
- digest_divergence: every apply of an index yields the same state digest on every node, and
  live nodes that end at the same index end on the same digest;
- non_finite: no apply or final state reports non-finite global parameters;
- not_converged: after healing, all live nodes reached one index (the harness waits for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from diloco_node.ops.history import NEMESIS_KINDS, UNREADABLE_ENTRY, HistoryEvent

INVARIANTS = (
    "one_entry_per_index",
    "committed_index_lost",
    "epoch_regressed",
    "two_leaders",
    "apply_gap",
    "digest_divergence",
    "non_finite",
    "not_converged",
)


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    message: str
    t_mono: float | None = None

    def __post_init__(self) -> None:
        if self.invariant not in INVARIANTS:
            raise ValueError(f"unknown invariant {self.invariant!r}")

    def __str__(self) -> str:
        at = f"t={self.t_mono:.3f} " if self.t_mono is not None else ""
        return f"{self.invariant}: {at}{self.message}"

    def to_dict(self) -> dict[str, object]:
        return {"invariant": self.invariant, "message": self.message, "t_mono": self.t_mono}


@dataclass(frozen=True, slots=True)
class FinalState:
    """What a live node reported once the run had healed and settled."""

    node: str
    index: int
    state_digest: str
    finite: bool = True
    t_mono: float | None = None  # when the node was asked (None: after everything)


def final_states_from(histories: Mapping[str, Sequence[HistoryEvent]]) -> list[FinalState]:
    """The harness writes one `final` event per live node (detail.target) into its own history."""
    finals = []
    for events in histories.values():
        for e in events:
            if e.kind == "final":
                target = e.detail.get("target")
                if not isinstance(target, str) or e.index is None or e.state_digest is None:
                    raise ValueError(f"final event at t={e.t_mono:.3f} needs detail.target, index and state_digest")
                # probed_at: when the harness asked the node, which is what commits are compared to
                probed_at = e.detail.get("probed_at", e.t_mono)
                finals.append(FinalState(target, e.index, e.state_digest, bool(e.detail.get("finite", True)), float(probed_at)))
    return finals


def node_histories(histories: Mapping[str, Sequence[HistoryEvent]]) -> dict[str, list[HistoryEvent]]:
    """The nodes' own histories, without the harness's (nemesis) events."""
    return {
        node: [e for e in events if e.kind not in NEMESIS_KINDS]
        for node, events in histories.items()
        if any(e.kind not in NEMESIS_KINDS for e in events)
    }


def check_histories(
    histories: Mapping[str, Sequence[HistoryEvent]],
    final_states: Sequence[FinalState] | None = None,
) -> list[Violation]:
    """Every violation found, in a stable order (by invariant, then time). Each node's events must
    be in the order it wrote them (`load_histories` sorts by t_mono, which is that order).
    `final_states` defaults to the `final` events found in `histories`."""
    finals = list(final_states) if final_states is not None else final_states_from(histories)
    nodes = node_histories(histories)
    out: list[Violation] = []
    out += _one_entry_per_index(nodes)
    out += _committed_index_lost(nodes, finals)
    out += _epochs_monotone(nodes)
    out += _two_leaders(nodes)
    out += _apply_order(nodes)
    out += _digests_agree(nodes, finals)
    out += _finite(nodes, finals)
    return out


def _all_events(nodes: Mapping[str, Sequence[HistoryEvent]]) -> list[HistoryEvent]:
    return sorted((e for events in nodes.values() for e in events), key=lambda e: e.t_mono)


def _one_entry_per_index(nodes: Mapping[str, Sequence[HistoryEvent]]) -> list[Violation]:
    first: dict[int, HistoryEvent] = {}
    out = []
    for e in _all_events(nodes):
        if e.kind not in ("commit", "apply") or e.entry_digest == UNREADABLE_ENTRY:
            continue  # the node could not read the entry's payload back then (a failing disk)
        assert e.index is not None
        known = first.setdefault(e.index, e)
        if known.entry_digest != e.entry_digest:
            out.append(Violation(
                "one_entry_per_index",
                f"index {e.index}: {e.node} {e.kind} entry {e.entry_digest} (epoch {e.epoch}) but {known.node} "
                f"{known.kind} entry {known.entry_digest} (epoch {known.epoch}) at t={known.t_mono:.3f}",
                e.t_mono,
            ))
    return out


def _committed_index_lost(nodes: Mapping[str, Sequence[HistoryEvent]], finals: Sequence[FinalState]) -> list[Violation]:
    out = []
    highest: HistoryEvent | None = None  # the highest committed index seen so far, in time order
    for e in _all_events(nodes):
        if e.kind == "commit":
            assert e.index is not None
            if highest is None or e.index > (highest.index or 0):
                highest = e
        elif e.kind == "lease_acquired" and e.index is not None and highest is not None:
            # Raft's election restriction: a committed entry is on a majority, and a winner
            # needs a majority whose logs are not ahead of its own.
            if e.index < (highest.index or 0):
                out.append(Violation(
                    "committed_index_lost",
                    f"{e.node} took the lease for epoch {e.epoch} with log up to index {e.index}, "
                    f"but index {highest.index} was committed by {highest.node} at t={highest.t_mono:.3f}",
                    e.t_mono,
                ))
    commits = [e for e in _all_events(nodes) if e.kind == "commit"]
    for f in finals:
        # Only what was committed before the node was asked counts: a live cluster keeps going.
        before = [e for e in commits if f.t_mono is None or e.t_mono <= f.t_mono]
        top = max(before, key=lambda e: e.index or 0, default=None)
        if top is not None and f.index < (top.index or 0):
            out.append(Violation(
                "committed_index_lost",
                f"{f.node} ended at index {f.index}, but index {top.index} was committed "
                f"by {top.node} at t={top.t_mono:.3f}",
                f.t_mono,
            ))
    return out


def _epochs_monotone(nodes: Mapping[str, Sequence[HistoryEvent]]) -> list[Violation]:
    out = []
    for node, events in sorted(nodes.items()):
        last: HistoryEvent | None = None
        for e in events:
            if e.epoch is None:
                continue
            if last is not None and e.epoch < (last.epoch or 0):
                out.append(Violation(
                    "epoch_regressed",
                    f"{node} {e.kind} at epoch {e.epoch} after {last.kind} at epoch {last.epoch} (t={last.t_mono:.3f})",
                    e.t_mono,
                ))
            if last is None or e.epoch >= (last.epoch or 0):
                last = e
    return out


def _two_leaders(nodes: Mapping[str, Sequence[HistoryEvent]]) -> list[Violation]:
    holder: dict[int, HistoryEvent] = {}
    out = []
    for e in _all_events(nodes):
        if e.kind != "lease_acquired":
            continue
        assert e.epoch is not None
        known = holder.setdefault(e.epoch, e)
        if known.node != e.node:
            out.append(Violation(
                "two_leaders",
                f"{e.node} and {known.node} both acquired the lease for epoch {e.epoch} "
                f"(t={known.t_mono:.3f} and t={e.t_mono:.3f})",
                e.t_mono,
            ))
    return out


def _apply_order(nodes: Mapping[str, Sequence[HistoryEvent]]) -> list[Violation]:
    out = []
    for node, events in sorted(nodes.items()):
        last: int | None = None  # last applied index in this process lifetime
        for e in events:
            if e.kind == "start":
                last = None  # a restarted node replays from its checkpoint
            elif e.kind == "apply":
                assert e.index is not None
                if last is not None and e.index != last + 1 and not e.detail.get("snapshot"):
                    what = "a gap" if e.index > last + 1 else "a repeat"
                    out.append(Violation(
                        "apply_gap",
                        f"{node} applied index {e.index} right after {last} ({what} within one process lifetime)",
                        e.t_mono,
                    ))
                last = e.index
    return out


def _digests_agree(nodes: Mapping[str, Sequence[HistoryEvent]], finals: Sequence[FinalState]) -> list[Violation]:
    out = []
    first: dict[int, HistoryEvent] = {}
    # Per (index, entry): the applies, so that each divergent one is named against the digest most
    # nodes reported (the first reporter may be the odd one out), every divergent index on its own.
    applies: dict[tuple[int, str | None], list[HistoryEvent]] = {}
    for e in _all_events(nodes):
        if e.kind != "apply":
            continue
        assert e.index is not None
        first.setdefault(e.index, e)
        applies.setdefault((e.index, e.entry_digest), []).append(e)
    for (index, entry), events in sorted(applies.items(), key=lambda item: item[0][0]):
        counts: dict[str | None, int] = {}
        for e in events:
            counts[e.state_digest] = counts.get(e.state_digest, 0) + 1
        if len(counts) < 2:
            continue
        reference = max(counts, key=lambda d: counts[d])  # ties: the first reported (dicts keep order)
        holders = sorted({e.node for e in events if e.state_digest == reference})
        for e in events:
            if e.state_digest != reference:
                out.append(Violation(
                    "digest_divergence",
                    f"index {index}: {e.node} has state {e.state_digest} but {', '.join(holders)} had "
                    f"{reference} after applying the same entry {entry}",
                    e.t_mono,
                ))
    by_index: dict[int, FinalState] = {}
    for f in finals:
        reference = by_index.setdefault(f.index, f)
        if f.state_digest != reference.state_digest:
            out.append(Violation(
                "digest_divergence",
                f"after healing {f.node} and {reference.node} are both at index {f.index} but on "
                f"states {f.state_digest} and {reference.state_digest}",
                f.t_mono,
            ))
    if len(by_index) > 1:
        where = ", ".join(f"{f.node}@{f.index}" for f in sorted(finals, key=lambda f: (f.index, f.node)))
        out.append(Violation("not_converged", f"after healing the live nodes never reached one index: {where}",
                             max((f.t_mono for f in finals if f.t_mono is not None), default=None)))
    for f in finals:
        applied = first.get(f.index)
        # An empty digest is a node that said its state is not current (its /status names no
        # state_digest until a stale fragment is repaired): it holds no claim to compare, and
        # not_converged / committed_index_lost already report a node left behind.
        if applied is not None and f.state_digest and applied.state_digest != f.state_digest:
            out.append(Violation(
                "digest_divergence",
                f"{f.node} ended at index {f.index} with state {f.state_digest}, but applying index {f.index} "
                f"gave {applied.state_digest} on {applied.node}",
                f.t_mono,
            ))
    return out


def _finite(nodes: Mapping[str, Sequence[HistoryEvent]], finals: Sequence[FinalState]) -> list[Violation]:
    out = []
    for e in _all_events(nodes):
        if e.kind == "apply" and e.detail.get("finite") is False:
            out.append(Violation("non_finite", f"{e.node} reports non-finite global parameters after applying index {e.index}", e.t_mono))
    for f in finals:
        if not f.finite:
            out.append(Violation("non_finite", f"{f.node} reports non-finite global parameters at the end (index {f.index})", f.t_mono))
    return out
