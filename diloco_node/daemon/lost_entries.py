"""The vote barrier's way out: what a node that lost log entries says about it, and the
operator's explicit acceptance of the loss.

A node whose log.bin was found damaged at rest does not stand, and votes only for a candidate at
least as up to date as its vote floor (or not at all when no floor is known), until it holds again
every entry it may have acknowledged (coordination.py). When it is the lone voter
(the other voters are fewer than a majority, so no lease holder can ever be elected without its
vote) nobody can: the run stays without a lease holder. `/status` (`storage.vote_barrier_help`)
and the log then say so, and what the operator can do (docs/OPERATIONS.md, "A voter that lost log
entries"): restore a copy of the log, or accept the loss with `diloco-node accept-loss`, which
names who accepts and which entries, is recorded durably in `coordination/loss-accepted.json`
(every acceptance, never overwritten) and only then lifts the barrier. Nothing lifts it silently.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from diloco_node.daemon.coordination_records import read_record, write_record
from diloco_node.storage.records import RecordError

log = logging.getLogger("diloco_node.daemon")

LOSS_FILE = "loss-accepted.json"
_LOSS_KEY = "accepted"
# The durable step the record belongs to: a part of the node's voting state, as its vote is.
LOSS_POINT = "election.write"
# An operator's name and reason are shown on /status and kept forever: bounded.
MAX_TEXT_CHARS = 500


class _Store(Protocol):
    directory: Path
    damaged_after: int | None
    damage_reason: str
    mark: Any
    floor: Any

    @property
    def durable_last_index(self) -> int: ...


class _Coordination(Protocol):
    node_id: str
    store: _Store
    vote_barrier: str | None
    clock: Any  # the node's Clock: `wall()` stamps the record
    core: Any  # the CoordinatorNode: its log's end, its election's floor


def is_lone_voter(node_id: str, voters: list[str] | tuple[str, ...] | frozenset[str]) -> bool:
    """Whether the other voters are fewer than a majority: no lease holder without this node's vote."""
    voters = set(voters)
    return node_id in voters and len(voters - {node_id}) < len(voters) // 2 + 1


def barrier_help(node_id: str, voters: Any, damaged_after: int | None, barrier: str | None) -> dict[str, Any] | None:
    """What /status says beside `vote_barrier`: whether anyone else can end it, and what to do."""
    if barrier is None:
        return None
    lone = is_lone_voter(node_id, voters)
    if lone:
        todo = (f"no lease holder can be elected without this node's vote, so no one can give back the entries "
                f"after {damaged_after}: stop the node and restore log.bin from a copy that holds them, or run "
                f"`diloco-node accept-loss --lost-after {damaged_after} --by NAME --reason TEXT` against this "
                "node's operator listener to accept their loss (docs/OPERATIONS.md, \"A voter that lost log entries\")")
    else:
        todo = ("wait: the barrier lifts once a lease holder elected by the other voters has committed an entry "
                "of its own past the damage and this node holds it; if none is elected, bring the other voters "
                "back first")
    return {"lone_voter": lone, "lost_after": damaged_after, "what_to_do": todo}


def read_acceptances(directory: Path) -> list[dict[str, Any]]:
    """Every loss accepted on this node, oldest first ([] when none; a damaged record raises RecordError)."""
    path = Path(directory) / LOSS_FILE
    if not path.exists():
        return []
    accepted = read_record("election.read", path, _LOSS_KEY).get(_LOSS_KEY)
    if not isinstance(accepted, list):
        raise RecordError(f"{path}: {_LOSS_KEY} is not a list")
    return accepted


def accept_loss(coordination: _Coordination, *, by: str, reason: str, lost_after: Any) -> tuple[int, dict[str, Any]]:
    """`POST /accept-loss`: lift the vote barrier because an operator accepts losing the entries
    after `lost_after` (it must be the index the node reports: the operator accepts THIS loss).
    The acceptance is written (fsynced) before the barrier lifts; the log's high-water mark is
    lowered to what log.bin holds, and the vote floor to its last entry, so a restart does not find
    the same loss again.
    Returns (HTTP status, JSON body); a refusal changes nothing."""
    store, node_id = coordination.store, coordination.node_id
    if coordination.vote_barrier is None or store.damaged_after is None:
        return 409, {"error": f"{node_id} has no vote barrier: no loss to accept"}
    if not isinstance(by, str) or not by.strip() or not isinstance(reason, str) or not reason.strip():
        return 400, {"error": "say who accepts the loss (--by NAME) and why (--reason TEXT)"}
    if len(by) > MAX_TEXT_CHARS or len(reason) > MAX_TEXT_CHARS:
        return 400, {"error": f"--by and --reason are at most {MAX_TEXT_CHARS} characters"}
    if type(lost_after) is not int or lost_after != store.damaged_after:
        return 409, {"error": f"{node_id} lost the entries after {store.damaged_after}, not after {lost_after!r}: "
                              f"accept exactly that loss (--lost-after {store.damaged_after})",
                     "lost_after": store.damaged_after}
    replog = coordination.core.log
    if replog.applied_index > replog.last_index:
        # Lost while running, after its replica applied them: voting now would let it lead a log
        # that counts new entries at those indexes as committed and applied. A restart puts the
        # replica back inside the log (an older checkpoint), then the loss can be accepted.
        return 409, {"error": f"{node_id} applied entries through {replog.applied_index} that its log lost while "
                              "running: restart it first (it resumes from a checkpoint inside its log), then "
                              "accept the loss", "lost_after": store.damaged_after}
    last_log = replog.last_log
    record = {"node_id": node_id, "by": by.strip(), "reason": reason.strip(), "lost_after": lost_after,
              "fsynced_through": store.mark.index, "vote_floor": store.floor.value and list(store.floor.value),
              "damage": store.damage_reason,
              "at_unix": round(coordination.clock.wall(), 3)}
    try:
        accepted = read_acceptances(store.directory)
        write_record(LOSS_POINT, store.directory / LOSS_FILE, {_LOSS_KEY: [*accepted, record]})
        if store.mark.index > store.durable_last_index:
            store.mark.write(store.durable_last_index)
        if store.floor.value != last_log:  # down to the log it has: the loss is accepted
            store.floor.write(last_log)
    except (OSError, RecordError) as error:
        return 503, {"error": f"{node_id} cannot record the acceptance ({error}); the barrier stays"}
    log.warning("%s: %s accepted the loss of the entries after %d (%s); it votes again: %s", node_id, record["by"],
                lost_after, record["reason"], store.damage_reason)
    coordination.vote_barrier = None
    coordination.core.election.vote_floor = None
    store.damaged_after = None
    return 200, {"message": f"{node_id} votes again: the loss of the entries after {lost_after} accepted by "
                            f"{record['by']}, recorded in {LOSS_FILE}", "record": record}
