"""Mapping between coordination messages (`bootstrap.messages`) and wire messages (`wire.messages`).

The coordination core speaks Raft/SWIM-shaped messages; the wire carries the kinds `wire.messages`
defines. Most map field by field. Where the two sets differ, this module decides, and the
choices are documented in docs/DAEMON.md:

- `AppendEntries.sent_at` (the leader's own clock) is not on the wire: every LogAppend is a
  request whose LogAck comes back in the same HTTP response, so the sender restores `sent_at`
  from the request it made (`append_response_from_wire`).
- SWIM probes ride on Heartbeat/HeartbeatAck (seq and sender only). Piggybacked gossip and
  indirect probes are not carried; members learn each other from join requests and from the
  membership lists join replies carry. A member that answers a probe (or probes us, or asks to
  join) while we hold it suspect, dead or unknown is marked alive again under a locally raised
  incarnation (`revived_record`): with no gossip, incarnations are local bookkeeping only.
- A graceful leave (a Ping announcing our own LEFT record) travels as a wire Leave.
- Pre-votes travel as VoteRequest/VoteReply with `pre_vote` set (part of wire 1.0; see
  docs/WIRE.md, versioning).
- InstallSnapshot: the daemon's snapshot carries no state (the global state is downloaded
  fragment by fragment, join.py), only (last_index, last_epoch, voters), so it travels as a
  LogAppend holding one entry of kind "snapshot" at `last_index`; a replica that receives it
  restores the coordination snapshot and downloads the global state with that index as the floor.
  A build that predates it refuses the unknown entry kind (400).

Everything here is pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from bootstrap import messages as coord
from bootstrap.entries import ClusterConfig, EntryKind, LogEntry, Snapshot
from wire import messages as wire
from wire.errors import LocalProtocolError, RemoteProtocolError

# Log entry kinds on the wire are short lowercase names (wire.messages.NAME_PATTERN).
_KIND_TO_WIRE = {EntryKind.OUTER_COMMIT: "commit", EntryKind.MEMBERSHIP: "membership", EntryKind.NOOP: "noop",
                 EntryKind.EVICTION: "eviction"}
_KIND_FROM_WIRE = {name: kind for kind, name in _KIND_TO_WIRE.items()}
# The wire kind of the log entry that stands for an InstallSnapshot (see the module docstring).
SNAPSHOT_ENTRY_KIND = "snapshot"


def entry_to_wire(entry: LogEntry) -> wire.LogEntry:
    metadata: dict[str, Any] = {"fragment": entry.fragment, "round": entry.round, "digest": entry.digest}
    if entry.config is not None:
        metadata["voters"] = entry.config.sorted_voters()
    return wire.LogEntry(index=entry.index, epoch=entry.epoch, kind=_KIND_TO_WIRE[entry.kind],
                         metadata=metadata, payload=entry.payload_bytes())


def relayed_entry_to_wire(entry: LogEntry, digest: bytes, size: int) -> wire.LogEntry:
    """An entry whose payload travels down the relay tree: named by its BLAKE3 digest and size (wire 2.2)."""
    described = entry_to_wire(replace(entry, payload=b""))
    return replace(described, payload_digest=digest, payload_size=size)


def entry_from_wire(entry: wire.LogEntry) -> LogEntry:
    """A peer's entry as a coordination entry; anything malformed is the peer's error (400)."""
    if entry.relayed:  # its bytes must have been filled in (relays.RelayIO.complete) before this
        raise RemoteProtocolError(f"log entry {entry.index}: relayed payload not received", 400)
    kind = _KIND_FROM_WIRE.get(entry.kind)
    if kind is None:
        raise RemoteProtocolError(f"log entry {entry.index}: unknown kind {entry.kind!r}", 400)
    meta = entry.metadata
    try:
        config = None
        if kind is EntryKind.MEMBERSHIP:
            voters = meta.get("voters")
            if not isinstance(voters, (list, tuple)):
                raise LocalProtocolError("membership entry without a voter list")
            config = ClusterConfig.of(voters)
        digest = meta.get("digest", "")
        return LogEntry(epoch=entry.epoch, index=entry.index, kind=kind, payload=entry.payload,
                        fragment=meta.get("fragment"), round=meta.get("round"),
                        digest=digest if isinstance(digest, str) else "", config=config)
    except LocalProtocolError as error:
        raise RemoteProtocolError(f"log entry {entry.index}: {error}", 400) from None


def to_wire(message: coord.Message, *, epoch: int, commit_index: int, last_index: int) -> wire.Message | None:
    """The wire form of an outgoing coordination message, or None when it is not carried."""
    if isinstance(message, coord.VoteRequest):
        return wire.VoteRequest(message.epoch, message.candidate_id, message.last_log_epoch, message.last_log_index,
                                pre_vote=message.pre_vote)
    if isinstance(message, coord.VoteResponse):
        # A reason longer than the wire allows is cut, not refused: it is for people.
        return wire.VoteReply(message.epoch, message.voter_id, message.granted, message.reason[:wire.MAX_REASON_CHARS],
                              pre_vote=message.pre_vote)
    if isinstance(message, coord.AppendEntries):
        return wire.LogAppend(message.epoch, message.leader_id, message.prev_index, message.prev_epoch,
                              tuple(entry_to_wire(e) for e in message.entries), message.leader_commit)
    if isinstance(message, coord.AppendResponse):
        return wire.LogAck(message.epoch, message.follower_id, message.match_index, message.success)
    if isinstance(message, coord.Ping):
        own = [r for r in message.updates if r.node_id == message.sender_id and r.state is coord.MemberState.LEFT]
        if own:
            return wire.Leave(message.sender_id, "leaving the run")
        return wire.Heartbeat(epoch, message.sender_id, message.seq, commit_index)
    if isinstance(message, coord.PingAck):
        return wire.HeartbeatAck(epoch, message.sender_id, message.seq, last_index)
    if isinstance(message, coord.InstallSnapshot):
        return snapshot_to_wire(message, commit_index)
    return None  # PingRequest, JoinRequest/JoinReply (see module docstring)


def append_from_wire(message: wire.LogAppend) -> coord.AppendEntries | coord.InstallSnapshot:
    """A LogAppend as the coordination message it stands for: entries, or a snapshot install."""
    install = snapshot_from_wire(message)
    if install is not None:
        return install
    try:
        return coord.AppendEntries(message.epoch, message.leader, message.prev_index, message.prev_epoch,
                                   tuple(entry_from_wire(e) for e in message.entries), message.leader_commit,
                                   sent_at=0.0)
    except LocalProtocolError as error:
        raise RemoteProtocolError(f"LogAppend: {error}", 400) from None


def snapshot_to_wire(message: coord.InstallSnapshot, leader_commit: int) -> wire.LogAppend:
    """The wire form of an InstallSnapshot: a LogAppend whose single entry is the snapshot point."""
    snapshot = message.snapshot
    if snapshot.last_index < 1:
        raise LocalProtocolError("the initial snapshot (index 0) is never sent")
    marker = wire.LogEntry(index=snapshot.last_index, epoch=snapshot.last_epoch, kind=SNAPSHOT_ENTRY_KIND,
                           metadata={"voters": snapshot.config.sorted_voters()}, payload=b"")
    return wire.LogAppend(message.epoch, message.leader_id, snapshot.last_index - 1, 0, (marker,),
                          max(leader_commit, snapshot.last_index))


def snapshot_from_wire(message: wire.LogAppend) -> coord.InstallSnapshot | None:
    """The InstallSnapshot a LogAppend stands for, or None when it is an ordinary append."""
    if not any(entry.kind == SNAPSHOT_ENTRY_KIND for entry in message.entries):
        return None
    if len(message.entries) != 1:
        raise RemoteProtocolError("LogAppend: a snapshot entry must travel alone", 400)
    marker = message.entries[0]
    voters = marker.metadata.get("voters")
    if not isinstance(voters, (list, tuple)) or not all(isinstance(v, str) for v in voters):
        raise RemoteProtocolError("LogAppend: the snapshot entry carries no voter list", 400)
    try:
        snapshot = Snapshot(marker.index, marker.epoch, ClusterConfig.of(voters))
        return coord.InstallSnapshot(message.epoch, message.leader, snapshot, sent_at=0.0)
    except LocalProtocolError as error:
        raise RemoteProtocolError(f"LogAppend: snapshot entry: {error}", 400) from None


def append_response_from_wire(message: wire.LogAck, sent_at: float) -> coord.AppendResponse:
    """`sent_at` is the time we stamped on the AppendEntries this ack answers."""
    return coord.AppendResponse(message.epoch, message.follower, message.success, message.index, sent_at,
                                "acknowledged over the wire")


def vote_request_from_wire(message: wire.VoteRequest) -> coord.VoteRequest:
    return coord.VoteRequest(message.epoch, message.candidate, message.last_log_epoch, message.last_log_index,
                             pre_vote=message.pre_vote)


def vote_response_from_wire(message: wire.VoteReply) -> coord.VoteResponse:
    return coord.VoteResponse(message.epoch, message.voter, message.granted, message.reason,
                              pre_vote=message.pre_vote)


def revived_record(current: coord.MemberRecord | None, node_id: str, address: str,
                   role: coord.MemberRole) -> coord.MemberRecord | None:
    """The record that makes `node_id` alive again in our view, or None if it already is."""
    if current is not None and current.state is coord.MemberState.ALIVE and current.address == address:
        return None
    incarnation = 1 if current is None else current.incarnation + 1
    return coord.MemberRecord(node_id, address, role, incarnation, coord.MemberState.ALIVE)


def left_record(current: coord.MemberRecord | None) -> coord.MemberRecord | None:
    if current is None or current.state is coord.MemberState.LEFT:
        return None
    return coord.MemberRecord(current.node_id, current.address, current.role, current.incarnation,
                              coord.MemberState.LEFT)


def role_to_wire(role: coord.MemberRole) -> wire.Role:
    return wire.Role.WITNESS if role is coord.MemberRole.WITNESS else wire.Role.LEARNER


def role_from_wire(role: wire.Role) -> coord.MemberRole:
    return coord.MemberRole.WITNESS if role is wire.Role.WITNESS else coord.MemberRole.LEARNER


class AddressBook:
    """Node id -> advertised URL of every member we have heard of (persisted with the replica), and
    the operator URLs members advertise for browsers (`status_url`; learned again at every start)."""

    def __init__(self, entries: Mapping[str, str] | None = None) -> None:
        self._urls: dict[str, str] = dict(entries or {})
        self._roles: dict[str, str] = {}
        self._status_urls: dict[str, str] = {}

    def learn_status_url(self, node_id: str, url: str) -> None:
        """A member's advertised operator URL ("" says nothing: an older member, or none set)."""
        if url:
            self._status_urls[node_id] = url

    def status_url(self, node_id: str) -> str:
        return self._status_urls.get(node_id, "")

    def learn(self, node_id: str, url: str, role: str | None = None) -> bool:
        """Record an address; True when it is new or changed."""
        if role is not None:
            self._roles[node_id] = role
        if not url or self._urls.get(node_id) == url:
            return False
        self._urls[node_id] = url
        return True

    def url(self, node_id: str) -> str | None:
        return self._urls.get(node_id)

    def role(self, node_id: str) -> str | None:
        return self._roles.get(node_id)

    def items(self) -> list[tuple[str, str]]:
        return sorted(self._urls.items())

    def to_dict(self) -> dict[str, str]:
        return dict(self._urls)
