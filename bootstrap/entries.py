"""The replicated log's data: entries, voting configurations and snapshots, valid by construction.

Also the one piece of quorum arithmetic every other module relies on (`ClusterConfig.is_majority`
and `majorities_can_be_disjoint`), so "majority" means the same thing everywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from wire.errors import LocalProtocolError


class EntryKind(str, enum.Enum):
    """What a log entry records. The log itself treats all of them as opaque except MEMBERSHIP."""

    OUTER_COMMIT = "outer_commit"  # a merged outer gradient for one fragment round (opaque bytes)
    MEMBERSHIP = "membership"  # the new voting configuration, effective as soon as it is appended
    NOOP = "noop"  # appended by every new lease holder so it can commit entries of older epochs
    EVICTION = "eviction"  # an operator removed a site for this run (opaque bytes, like OUTER_COMMIT)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The set of voting members. Learners and witnesses both vote; catching-up joiners do not.

    An empty configuration means "not yet known" (a node that is still joining): it can never
    form a majority, so such a node never campaigns.
    """

    voters: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not isinstance(self.voters, frozenset):
            raise LocalProtocolError(f"voters must be a frozenset, got {type(self.voters).__name__}")
        for voter in self.voters:
            if not isinstance(voter, str) or not voter:
                raise LocalProtocolError(f"voter ids must be non-empty strings, got {voter!r}")

    @classmethod
    def of(cls, voters: Iterable[str]) -> ClusterConfig:
        return cls(frozenset(voters))

    @property
    def quorum(self) -> int:
        """Votes needed for a majority (an empty configuration needs an impossible 1)."""
        return len(self.voters) // 2 + 1

    def is_majority(self, nodes: Iterable[str]) -> bool:
        return len(self.voters.intersection(nodes)) >= self.quorum

    def sorted_voters(self) -> list[str]:
        """Voters in a fixed order: set iteration order depends on PYTHONHASHSEED, replays must not."""
        return sorted(self.voters)

    def describe(self) -> str:
        return "{" + ",".join(self.sorted_voters()) + "}"


def majorities_can_be_disjoint(a: ClusterConfig, b: ClusterConfig) -> bool:
    """True when some majority of `a` and some majority of `b` share no member.

    Best case for disjointness: each majority takes members the other config lacks first, and
    only then shares from the intersection. Possible iff the shared members they still need fit.
    """
    if not a.voters or not b.voters:
        return False  # an empty config has no majority at all
    shared = len(a.voters & b.voters)
    need_a = max(0, a.quorum - len(a.voters - b.voters))
    need_b = max(0, b.quorum - len(b.voters - a.voters))
    return need_a + need_b <= shared


class PayloadUnavailable(LookupError):
    """A stored payload can no longer be read (its entry was truncated or compacted away, or the
    stored record is damaged). The storage layer's errors for that derive from this."""


class StoredPayload:
    """An entry's payload bytes kept outside memory (the daemon's log file): `read()` fetches them.

    This module does no I/O: the reader is a callable the storage layer supplies. Memory holds an
    entry's metadata and this reference; the bytes (a merged fragment delta, megabytes) are read
    when an entry is sent, applied or rewritten. `read` raises `PayloadUnavailable` (or the
    storage's subclass of it) when the bytes are gone.

    `pieces` (optional) reads the same bytes a piece at a time, so a writer can copy them without
    holding them whole; without it, `pieces` yields `read()` once. `transient`: the bytes are not
    in the log file yet (a relayed payload in its spool file): the log store writes them from here
    and then keeps its own reference instead.
    """

    __slots__ = ("size", "_read", "_pieces", "transient")

    def __init__(self, size: int, read: Callable[[], bytes], *,
                 pieces: Callable[[int], Iterator[bytes]] | None = None, transient: bool = False) -> None:
        if not isinstance(size, int) or size < 0:
            raise LocalProtocolError(f"stored payload size must be an int >= 0, got {size!r}")
        self.size = size
        self._read = read
        self._pieces = pieces
        self.transient = transient

    def read(self) -> bytes:
        data = self._read()
        if len(data) != self.size:
            raise LocalProtocolError(f"stored payload: read {len(data)} bytes, expected {self.size}")
        return data

    def pieces(self, piece_bytes: int) -> Iterator[bytes]:
        """The bytes in order, at most `piece_bytes` at a time (checked to add up to `size`)."""
        if self._pieces is None:
            yield self.read()
            return
        total = 0
        for piece in self._pieces(piece_bytes):
            total += len(piece)
            if total > self.size:
                break
            yield piece
        if total != self.size:
            raise LocalProtocolError(f"stored payload: read {total} bytes, expected {self.size}")

    def __repr__(self) -> str:
        return f"StoredPayload({self.size} bytes{', transient' if self.transient else ''})"


@dataclass(frozen=True, slots=True)
class LogEntry:
    """One replicated entry: opaque payload bytes plus the metadata the daemon and the log need.

    `payload` is the bytes themselves or a `StoredPayload` (bytes that live in the log file);
    read it with `payload_bytes()`. `digest` is the daemon's digest of the fragment state after
    applying (opaque here); `config` is set exactly for MEMBERSHIP entries.
    """

    epoch: int
    index: int
    kind: EntryKind
    payload: bytes | StoredPayload = b""
    fragment: int | None = None
    round: int | None = None
    digest: str = ""
    config: ClusterConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or self.epoch < 1:
            raise LocalProtocolError(f"entry epoch must be an int >= 1, got {self.epoch!r}")
        if not isinstance(self.index, int) or self.index < 1:
            raise LocalProtocolError(f"entry index must be an int >= 1, got {self.index!r}")
        if not isinstance(self.kind, EntryKind):
            raise LocalProtocolError(f"entry kind must be an EntryKind, got {self.kind!r}")
        if not isinstance(self.payload, (bytes, StoredPayload)):
            raise LocalProtocolError(f"entry payload must be bytes or a StoredPayload, "
                                     f"got {type(self.payload).__name__}")
        if (self.kind is EntryKind.MEMBERSHIP) != (self.config is not None):
            raise LocalProtocolError("a config is carried by, and only by, membership entries")
        for name in ("fragment", "round"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise LocalProtocolError(f"entry {name} must be None or an int >= 0, got {value!r}")

    def payload_bytes(self) -> bytes:
        """The payload's bytes (read from storage when they are stored there)."""
        return self.payload if isinstance(self.payload, bytes) else self.payload.read()

    @property
    def payload_size(self) -> int:
        return len(self.payload) if isinstance(self.payload, bytes) else self.payload.size

    def describe(self) -> str:
        extra = f" {self.config.describe()}" if self.config is not None else ""
        return f"#{self.index}@e{self.epoch} {self.kind.value}{extra}"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The applied state through `last_index`: what compaction keeps and a lagging node installs.

    `state` is the application's serialized state (opaque); `config` is the voting configuration
    in effect at `last_index`. Index 0 is the empty initial snapshot of a brand-new cluster.
    """

    last_index: int
    last_epoch: int
    config: ClusterConfig
    state: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.last_index, int) or self.last_index < 0:
            raise LocalProtocolError(f"snapshot index must be an int >= 0, got {self.last_index!r}")
        if not isinstance(self.last_epoch, int) or self.last_epoch < 0:
            raise LocalProtocolError(f"snapshot epoch must be an int >= 0, got {self.last_epoch!r}")
        if not isinstance(self.config, ClusterConfig):
            raise LocalProtocolError("snapshot config must be a ClusterConfig")
        if not isinstance(self.state, bytes):
            raise LocalProtocolError("snapshot state must be bytes")
