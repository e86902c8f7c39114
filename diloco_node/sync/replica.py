"""The node's replica of the global model: applying committed outer steps, digests, fragment bytes.

A commit entry's payload is a small msgpack map: the encoded merged outer gradient (codec_down
bytes, decoded identically everywhere) plus who contributed with which weight, and the syncer's
running reference norm for the fragment after this round (so that a new lease holder keeps
checking norm outliers from its first round instead of starting without a reference). Entry metadata
carries the fragment, its new round and the fragment digest after applying. Every replica
applies entries in log order; an entry whose round is already in the state (a joiner that
downloaded a newer fragment) is skipped; a gap or a digest mismatch marks the fragment as
diverged so the node fetches it from a peer.

No I/O and no clock here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from bootstrap.entries import EntryKind, LogEntry
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.sync.global_state import GlobalState, GlobalStateError
from diloco_node.config.manifest import OuterOptimizer
from wire.codecs import decode_named
from wire.errors import RemoteProtocolError

# A commit payload's msgpack map is a few names and numbers around the delta bytes.
MAX_COMMIT_METADATA_BYTES = 1 << 20
FRAGMENT_BYTES_FORMAT = 1


@dataclass(frozen=True, slots=True)
class CommitPayload:
    delta: bytes  # encoded with the run's codec_down
    contributors: tuple[str, ...]
    weights: tuple[float, ...]
    norm_ref: float | None = None  # the fragment's reference delta norm after this round (optional)

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"delta": self.delta, "contributors": list(self.contributors),
                                  "weights": list(self.weights)}
        if self.norm_ref is not None:
            fields["norm_ref"] = self.norm_ref
        return msgpack.packb(fields, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> CommitPayload:
        if len(data) > MAX_COMMIT_METADATA_BYTES + 1024 * 1024 * 1024:
            raise RemoteProtocolError("commit payload too large", 413)
        try:
            raw = msgpack.unpackb(data, raw=False)
            delta = raw["delta"]
            contributors = tuple(str(c) for c in raw["contributors"])
            weights = tuple(float(w) for w in raw["weights"])
            norm_ref = raw.get("norm_ref")
            norm_ref = None if norm_ref is None else float(norm_ref)
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as error:
            raise RemoteProtocolError(f"commit payload is malformed: {error}", 400) from None
        if not isinstance(delta, bytes) or len(contributors) != len(weights):
            raise RemoteProtocolError("commit payload: delta must be bytes and weights match contributors", 400)
        if norm_ref is not None and not (math.isfinite(norm_ref) and norm_ref >= 0.0):
            # A NaN reference would switch the outlier check off for good on every future holder.
            raise RemoteProtocolError(f"commit payload: norm_ref = {norm_ref!r} must be finite and >= 0", 400)
        return cls(delta, contributors, weights, norm_ref)


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    applied: bool
    fragment: int | None
    reason: str
    diverged: bool = False  # the fragment must be fetched from a peer


class Replica:
    """GlobalState plus the commit-entry rules; `applied_index` is the last log index applied."""

    def __init__(self, plan: FragmentPlan, initial: Mapping[str, np.ndarray], outer: OuterOptimizer) -> None:
        self.plan = plan
        self.state = GlobalState(plan, initial, outer)
        self._scratch = GlobalState(plan, initial, outer)  # for digests of not-yet-committed steps
        self.applied_index = 0
        self.diverged: set[int] = set()
        self.last_reason = "initial state"
        # Per fragment, the reference delta norm carried by the newest applied commit: a node that
        # wins the lease seeds its syncer with these (not part of the digest: merge policy state).
        self.norm_refs: dict[int, float] = {}
        self._bytes_cache: dict[int, tuple[int, bytes, bytes]] = {}  # p -> (round, bytes, sha256)

    # ---- the leader's preview ---------------------------------------------------------------

    def digest_after(self, p: int, outer_gradient: Mapping[str, np.ndarray]) -> str:
        """The digest fragment p will have once this gradient is applied (state untouched)."""
        self._scratch.restore_fragment(self.state.fragment_snapshot(p))
        return self._scratch.apply_outer_gradient(p, outer_gradient)

    # ---- applying committed entries ---------------------------------------------------------

    def apply(self, entry: LogEntry) -> ApplyOutcome:
        outcome = self._apply(entry)
        self.applied_index = entry.index
        self.last_reason = f"#{entry.index}: {outcome.reason}"
        return outcome

    def _apply(self, entry: LogEntry) -> ApplyOutcome:
        if entry.kind is not EntryKind.OUTER_COMMIT:
            return ApplyOutcome(False, None, f"{entry.kind.value}: nothing to apply")
        p, round_ = entry.fragment, entry.round
        if p is None or round_ is None or not 0 <= p < self.plan.num_fragments:
            return ApplyOutcome(False, None, f"commit names no valid fragment ({p}, round {round_}); ignored")
        if p in self.diverged:
            return ApplyOutcome(False, p, f"fragment {p} is being refetched; commit round {round_} not applied", True)
        current = self.state.round(p)
        if round_ <= current:
            return ApplyOutcome(False, p, f"fragment {p} round {round_} already in the state (at {current})")
        if round_ != current + 1:
            self.diverged.add(p)
            return ApplyOutcome(False, p, f"fragment {p}: commit of round {round_} but state is at {current}", True)
        try:
            payload = CommitPayload.decode(entry.payload)
            gradient = decode_named(payload.delta)
            digest = self.state.apply_outer_gradient(p, gradient)
        except (RemoteProtocolError, GlobalStateError, ValueError) as error:
            self.diverged.add(p)
            return ApplyOutcome(False, p, f"fragment {p} round {round_} could not be applied: {error}", True)
        if entry.digest and digest != entry.digest:
            self.diverged.add(p)
            return ApplyOutcome(True, p, f"fragment {p} round {round_}: digest {digest[:12]} != committed "
                                         f"{entry.digest[:12]}; refetching the fragment", True)
        if payload.norm_ref is not None:
            self.norm_refs[p] = payload.norm_ref
        return ApplyOutcome(True, p, f"fragment {p} -> round {round_} from {len(payload.contributors)} "
                                     f"contributor(s), digest {digest[:12]}")

    # ---- fragment bytes for joiners and repair ------------------------------------------------

    def fragment_bytes(self, p: int) -> tuple[int, bytes, bytes]:
        """(round, serialized fragment state, sha256) of fragment p as it is now (cached per round)."""
        round_ = self.state.round(p)
        cached = self._bytes_cache.get(p)
        if cached is not None and cached[0] == round_:
            return cached
        snap = self.state.fragment_snapshot(p)
        data = msgpack.packb({
            "format": FRAGMENT_BYTES_FORMAT, "fragment": p, "round": round_,
            "params": _pack_tensors(snap["params"]), "momentum": _pack_tensors(snap["momentum"]),
        }, use_bin_type=True)
        result = (round_, data, hashlib.sha256(data).digest())
        self._bytes_cache[p] = result
        return result

    def install_fragment_bytes(self, p: int, data: bytes) -> str:
        """Replace fragment p from peer bytes (checked fully before anything changes)."""
        try:
            raw = msgpack.unpackb(data, raw=False)
            if raw.get("format") != FRAGMENT_BYTES_FORMAT or raw.get("fragment") != p:
                raise ValueError(f"not fragment {p} in format {FRAGMENT_BYTES_FORMAT}")
            snap = {"fragment": p, "round": int(raw["round"]),
                    "params": _unpack_tensors(raw["params"]), "momentum": _unpack_tensors(raw["momentum"])}
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as error:
            raise RemoteProtocolError(f"fragment {p} bytes are malformed: {error}", 400) from None
        try:
            digest = self.state.restore_fragment(snap)
        except GlobalStateError as error:
            raise RemoteProtocolError(f"fragment {p} does not fit this run: {error}", 400) from None
        self.diverged.discard(p)
        return digest


def _pack_tensors(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {name: [list(arr.shape), np.ascontiguousarray(arr, dtype="<f4").tobytes()] for name, arr in tensors.items()}


def _unpack_tensors(packed: Mapping[str, Sequence[Any]]) -> dict[str, np.ndarray]:
    out = {}
    for name, (shape, data) in packed.items():
        out[name] = np.frombuffer(data, dtype="<f4").reshape(tuple(int(s) for s in shape)).copy()
    return out
