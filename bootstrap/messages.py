"""Messages between coordination state machines, and the actions they ask their host to perform.

Every message is a frozen, slotted dataclass whose fields are spelled out, so the wire layer can
map each to a frame field by field. A message that exists is valid; a peer's out-of-range value
raises `RemoteProtocolError` when the wire layer constructs it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bootstrap.entries import LogEntry, Snapshot
from wire.errors import RemoteProtocolError


def _check_epoch(epoch: int) -> None:
    if not isinstance(epoch, int) or epoch < 0:
        raise RemoteProtocolError(f"epoch must be an int >= 0, got {epoch!r}", 400)


def _check_id(name: str, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise RemoteProtocolError(f"{name} must be a non-empty string, got {value!r}", 400)


def _check_index(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 0:
        raise RemoteProtocolError(f"{name} must be an int >= 0, got {value!r}", 400)


# ---------------------------------------------------------------- election and replication


@dataclass(frozen=True, slots=True)
class VoteRequest:
    epoch: int
    candidate_id: str
    last_log_epoch: int
    last_log_index: int
    pre_vote: bool = False  # "would you vote for me?": answered without changing any state

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        _check_id("candidate_id", self.candidate_id)
        _check_epoch(self.last_log_epoch)
        _check_index("last_log_index", self.last_log_index)


@dataclass(frozen=True, slots=True)
class VoteResponse:
    epoch: int
    voter_id: str
    granted: bool
    reason: str
    pre_vote: bool = False

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        _check_id("voter_id", self.voter_id)


@dataclass(frozen=True, slots=True)
class AppendEntries:
    """Replication and lease renewal in one: an empty `entries` is a heartbeat.

    `sent_at` is the leader's own monotonic time at sending; followers echo it untouched so the
    leader can date each renewal on its own clock (never compared with another node's clock).
    """

    epoch: int
    leader_id: str
    prev_index: int
    prev_epoch: int
    entries: tuple[LogEntry, ...]
    leader_commit: int
    sent_at: float

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        _check_id("leader_id", self.leader_id)
        _check_index("prev_index", self.prev_index)
        _check_epoch(self.prev_epoch)
        _check_index("leader_commit", self.leader_commit)
        if not isinstance(self.entries, tuple):
            raise RemoteProtocolError("entries must be a tuple", 400)
        for offset, entry in enumerate(self.entries):
            if entry.index != self.prev_index + 1 + offset:
                raise RemoteProtocolError(
                    f"entry {offset} has index {entry.index}, expected {self.prev_index + 1 + offset}", 400
                )
            if entry.epoch > self.epoch:
                raise RemoteProtocolError(f"entry {entry.index} is stamped with a future epoch {entry.epoch}", 400)


@dataclass(frozen=True, slots=True)
class AppendResponse:
    """`match_index` is the last index known to match on success, else a hint for backing off."""

    epoch: int
    follower_id: str
    success: bool
    match_index: int
    sent_at: float
    reason: str

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        _check_id("follower_id", self.follower_id)
        _check_index("match_index", self.match_index)


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    """The whole snapshot in one message (the daemon streams fragment state separately)."""

    epoch: int
    leader_id: str
    snapshot: Snapshot
    sent_at: float

    def __post_init__(self) -> None:
        _check_epoch(self.epoch)
        _check_id("leader_id", self.leader_id)


# ---------------------------------------------------------------- membership (SWIM-shaped)


class MemberState(str, enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


class MemberRole(str, enum.Enum):
    LEARNER = "learner"  # trains, votes, keeps a replica
    WITNESS = "witness"  # votes and keeps a replica, never trains


# Same incarnation: the more severe state wins, so a suspicion is not undone by stale "alive".
STATE_PRECEDENCE = {MemberState.ALIVE: 0, MemberState.SUSPECT: 1, MemberState.DEAD: 2, MemberState.LEFT: 3}


@dataclass(frozen=True, slots=True)
class MemberRecord:
    node_id: str
    address: str
    role: MemberRole
    incarnation: int
    state: MemberState

    def __post_init__(self) -> None:
        _check_id("node_id", self.node_id)
        if not isinstance(self.address, str):
            raise RemoteProtocolError("address must be a string", 400)
        if not isinstance(self.role, MemberRole):
            raise RemoteProtocolError(f"unknown member role {self.role!r}", 400)
        if not isinstance(self.state, MemberState):
            raise RemoteProtocolError(f"unknown member state {self.state!r}", 400)
        _check_index("incarnation", self.incarnation)

    def supersedes(self, other: MemberRecord) -> bool:
        """SWIM's ordering: a higher incarnation wins; at equal ones the more severe state does."""
        if self.incarnation != other.incarnation:
            return self.incarnation > other.incarnation
        return STATE_PRECEDENCE[self.state] > STATE_PRECEDENCE[other.state]


@dataclass(frozen=True, slots=True)
class JoinRequest:
    member: MemberRecord


@dataclass(frozen=True, slots=True)
class JoinReply:
    accepted: bool
    reason: str
    members: tuple[MemberRecord, ...]


@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    sender_id: str
    updates: tuple[MemberRecord, ...]
    on_behalf_of: str = ""  # set when this ping is an indirect probe for another member


@dataclass(frozen=True, slots=True)
class PingAck:
    seq: int
    sender_id: str
    target_id: str  # the member whose liveness this proves
    updates: tuple[MemberRecord, ...]
    on_behalf_of: str = ""


@dataclass(frozen=True, slots=True)
class PingRequest:
    """Ask a helper to probe `target_id` for us (SWIM indirect probe)."""

    seq: int
    sender_id: str
    target_id: str
    updates: tuple[MemberRecord, ...]


Message = (
    VoteRequest
    | VoteResponse
    | AppendEntries
    | AppendResponse
    | InstallSnapshot
    | JoinRequest
    | JoinReply
    | Ping
    | PingAck
    | PingRequest
)


# ---------------------------------------------------------------- actions for the host


@dataclass(frozen=True, slots=True)
class Send:
    to: str
    message: Message


@dataclass(frozen=True, slots=True)
class ApplyEntry:
    """Apply this committed entry now. Emitted strictly in index order, once per index."""

    entry: LogEntry


@dataclass(frozen=True, slots=True)
class RestoreSnapshot:
    """Replace the application state with this snapshot (a lagging node catching up)."""

    snapshot: Snapshot


Action = Send | ApplyEntry | RestoreSnapshot
