"""The run's evicted members: the EVICTION log entry's payload and the replicated register it builds.

An operator evicts a site for this run (`diloco-node evict`): the lease holder appends an
EVICTION entry naming the node id, the SHA-256 fingerprints of the certificates it has seen that
node use over mutual TLS, and the operator's reason. Every replica applies it into `Evictions`, a
register that only grows (an eviction is never undone within a run), so merging two copies is a
union and a replica that learns the register from a state download and then applies the entry
again ends the same. Every node refuses, with the reason this module words, frames whose sender is
an evicted node id and TLS peers whose certificate is evicted.

A routine leave or a dead voter's removal is not an eviction: those sites may come back.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from wire.messages import NODE_ID_PATTERN

# An operator's reason for an eviction is one part of every refusal sent to the evicted site
# (`EvictionRecord.refusal`), which the transport cuts to the wire's own bound on a reason
# (wire.messages.MAX_REASON_CHARS, 512): 200 characters say why and leave room for the rest of the
# refusal (the node id, the mark and the index), so the operator's words always arrive whole.
MAX_EVICTION_REASON_CHARS = 200
# A site rarely has more than a certificate or two in one run (a renewal); the bound keeps a
# hostile entry from growing every replica's register.
MAX_FINGERPRINTS = 16
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")
# Every refusal of an evicted site contains this; a restarted site recognises it and exits for good.
EVICTED_MARK = " was evicted from this run at index "


class EvictionError(ValueError):
    """An eviction payload or register is malformed; the message names what was wrong."""


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """One evicted site: its node id, the log index that evicted it, the certificates seen, why."""

    node_id: str
    index: int
    fingerprints: tuple[str, ...] = ()
    reason: str = ""

    def refusal(self) -> str:
        """The reason every node gives the evicted site (and its operator's log shows)."""
        why = f": {self.reason}" if self.reason else ""
        return f"node {self.node_id}{EVICTED_MARK}{self.index}{why}"

    def to_plain(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "index": self.index, "fingerprints": list(self.fingerprints),
                "reason": self.reason}


def _checked_node_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not NODE_ID_PATTERN.fullmatch(value):
        raise EvictionError(f"{where}: node_id {value!r} is not a valid node id")
    return value


def _checked_reason(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise EvictionError(f"{where}: reason must be a string, got {type(value).__name__}")
    if len(value) > MAX_EVICTION_REASON_CHARS:
        raise EvictionError(f"{where}: reason of {len(value)} characters exceeds {MAX_EVICTION_REASON_CHARS}")
    return value


def _checked_fingerprints(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise EvictionError(f"{where}: fingerprints must be a list, got {type(value).__name__}")
    if len(value) > MAX_FINGERPRINTS:
        raise EvictionError(f"{where}: {len(value)} fingerprints exceed {MAX_FINGERPRINTS}")
    for fingerprint in value:
        if not isinstance(fingerprint, str) or not _FINGERPRINT.fullmatch(fingerprint):
            raise EvictionError(f"{where}: fingerprint {fingerprint!r} is not 64 lowercase hex digits")
    return tuple(sorted(set(value)))


def encode_payload(node_id: str, fingerprints: Iterable[str], reason: str) -> bytes:
    """The EVICTION entry's payload (msgpack {node_id, fingerprints, reason}); EvictionError if invalid."""
    where = "eviction"
    fields = {"node_id": _checked_node_id(node_id, where),
              "fingerprints": list(_checked_fingerprints(list(fingerprints), where)),
              "reason": _checked_reason(reason, where)}
    return msgpack.packb(fields, use_bin_type=True)


def decode_payload(payload: bytes, index: int) -> EvictionRecord:
    """The record an EVICTION entry at `index` makes; EvictionError naming what is malformed."""
    where = f"eviction entry #{index}"
    try:
        raw = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise EvictionError(f"{where}: payload is not msgpack: {error}") from None
    if not isinstance(raw, dict):
        raise EvictionError(f"{where}: payload must be a map")
    return EvictionRecord(_checked_node_id(raw.get("node_id"), where), index,
                          _checked_fingerprints(raw.get("fingerprints", []), where),
                          _checked_reason(raw.get("reason", ""), where))


def record_from_plain(raw: Any, where: str = "evicted") -> EvictionRecord:
    """Inverse of `EvictionRecord.to_plain` (checkpoints and state downloads)."""
    if not isinstance(raw, Mapping):
        raise EvictionError(f"{where}: expected a map, got {type(raw).__name__}")
    index = raw.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or index < 1:
        raise EvictionError(f"{where}: index {index!r} must be an int >= 1")
    return EvictionRecord(_checked_node_id(raw.get("node_id"), where), index,
                          _checked_fingerprints(raw.get("fingerprints", []), where),
                          _checked_reason(raw.get("reason", ""), where))


class Evictions:
    """The replicated register of evicted sites, by node id and by certificate fingerprint."""

    def __init__(self, records: Iterable[EvictionRecord] = ()) -> None:
        self._by_node: dict[str, EvictionRecord] = {}
        self._by_fingerprint: dict[str, EvictionRecord] = {}
        self.merge(records)

    def __len__(self) -> int:
        return len(self._by_node)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._by_node

    def records(self) -> list[EvictionRecord]:
        """Every record, by node id (a fixed order: registers compare and serialize alike everywhere)."""
        return [self._by_node[n] for n in sorted(self._by_node)]

    def record(self, node_id: str) -> EvictionRecord | None:
        return self._by_node.get(node_id)

    def add(self, record: EvictionRecord) -> bool:
        """Add one record; a node evicted twice keeps its first index and gains the new fingerprints.
        Returns whether anything changed."""
        current = self._by_node.get(record.node_id)
        if current is not None:
            fingerprints = tuple(sorted(set(current.fingerprints) | set(record.fingerprints)))
            first = current if current.index <= record.index else record
            record = EvictionRecord(first.node_id, first.index, fingerprints, first.reason)
            if record == current:
                return False
        self._by_node[record.node_id] = record
        for fingerprint in record.fingerprints:
            self._by_fingerprint[fingerprint] = record
        return True

    def merge(self, records: Iterable[EvictionRecord]) -> bool:
        changed = False
        for record in records:
            changed = self.add(record) or changed
        return changed

    def apply_entry(self, payload: bytes, index: int) -> EvictionRecord:
        """Apply a committed EVICTION entry (EvictionError, nothing changed, if its payload is malformed)."""
        record = decode_payload(payload, index)
        self.add(record)
        return self._by_node[record.node_id]

    def refusal(self, node_id: str | None, fingerprint: str | None = None) -> str | None:
        """Why a peer with this node id (and certificate fingerprint) is refused; None when it is not."""
        record = self._by_node.get(node_id) if node_id is not None else None
        if record is None and fingerprint is not None:
            record = self._by_fingerprint.get(fingerprint)
        return record.refusal() if record is not None else None

    def to_plain(self) -> list[dict[str, Any]]:
        return [r.to_plain() for r in self.records()]

    @classmethod
    def from_plain(cls, raw: Any, where: str = "evicted") -> Evictions:
        if not isinstance(raw, (list, tuple)):
            raise EvictionError(f"{where}: expected a list, got {type(raw).__name__}")
        return cls(record_from_plain(item, f"{where}[{i}]") for i, item in enumerate(raw))
