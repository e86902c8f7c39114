"""The node's replica of the global model: applying committed outer steps, digests, and the
replicated state (global state plus norm references) in and out through `state_codec`.

A commit entry's payload is a small msgpack map: the encoded merged outer gradient (codec_down
bytes, decoded identically everywhere) plus who contributed with which weight, and the syncer's
running reference norm for the fragment after this round (so that a new lease holder keeps
checking norm outliers from its first round instead of starting without a reference). Entry metadata
carries the fragment, its new round and the fragment digest after applying. Every replica
applies entries in log order; an entry whose round is already in the state (a joiner that
downloaded a newer fragment) is skipped; a gap or a digest mismatch marks the fragment as
diverged so the node fetches it from a peer. An EVICTION entry adds its site to `evictions`
(sync/evictions.py), which checkpoints and every fragment's download bytes carry.

No I/O and no clock here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from bootstrap.entries import EntryKind, LogEntry, PayloadUnavailable
from diloco_node.config.manifest import OuterOptimizer, StopSpec
from diloco_node.sync.evictions import EvictionError, Evictions
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.sync.global_state import CheckedFragment, GlobalState, GlobalStateError
from diloco_node.sync.state_codec import (
    FragmentState,
    StateCodecError,
    decode_fragment,
    encode_fragment,
    fragment_state_digest,
    evictions_from_checkpoint,
    from_checkpoint,
    to_checkpoint,
)
from wire.codecs import decode_named
from wire.errors import RemoteProtocolError

# A commit payload's msgpack map is a few names and numbers around the delta bytes.
MAX_COMMIT_METADATA_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class CommitPayload:
    delta: bytes  # encoded with the run's codec_down
    contributors: tuple[str, ...]
    weights: tuple[float, ...]
    norm_ref: float | None = None  # the fragment's reference delta norm after this round (optional)
    tokens: int = 0  # tokens of the accepted contributions this round merged (what [run.stop] counts)
    steps: int = 0  # their inner steps
    wall: float = 0.0  # the lease holder's unix time when it planned the commit ([run.stop] wall_s)

    def encode(self) -> bytes:
        fields: dict[str, Any] = {"delta": self.delta, "contributors": list(self.contributors),
                                  "weights": list(self.weights), "tokens": self.tokens, "steps": self.steps,
                                  "wall": self.wall}
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
            tokens, steps = raw.get("tokens", 0), raw.get("steps", 0)
            wall = float(raw.get("wall", 0.0))
        except (ValueError, KeyError, TypeError, AttributeError, msgpack.UnpackException) as error:
            raise RemoteProtocolError(f"commit payload is malformed: {error}", 400) from None
        if not isinstance(delta, bytes) or len(contributors) != len(weights):
            raise RemoteProtocolError("commit payload: delta must be bytes and weights match contributors", 400)
        if norm_ref is not None and not (math.isfinite(norm_ref) and norm_ref >= 0.0):
            # A NaN reference would switch the outlier check off for good on every future holder.
            raise RemoteProtocolError(f"commit payload: norm_ref = {norm_ref!r} must be finite and >= 0", 400)
        for name, value in (("tokens", tokens), ("steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise RemoteProtocolError(f"commit payload: {name} = {value!r} must be a non-negative integer", 400)
        if not (math.isfinite(wall) and wall >= 0.0):
            raise RemoteProtocolError(f"commit payload: wall = {wall!r} must be a finite unix time", 400)
        return cls(delta, contributors, weights, norm_ref, tokens, steps, wall)


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    applied: bool
    fragment: int | None
    reason: str
    diverged: bool = False  # the fragment must be fetched from a peer
    contributors: tuple[str, ...] = ()  # whose contributions the applied commit merged


class Replica:
    """GlobalState plus the commit-entry rules; `applied_index` is the last log index applied."""

    def __init__(self, plan: FragmentPlan, initial: Mapping[str, np.ndarray], outer: OuterOptimizer,
                 stop: StopSpec | None = None, founded_at: float = 0.0, *, adopt_initial: bool = False) -> None:
        self.plan = plan
        self.stop = stop or StopSpec()
        self.founded_at = founded_at
        self.state = GlobalState(plan, initial, outer, adopt_initial=adopt_initial)
        self.applied_index = 0
        self.completed_at_index: int | None = None  # the commit that completed the run, when applied here
        self.diverged: set[int] = set()
        self.last_reason = "initial state"
        # Per fragment, the reference delta norm carried by the newest applied commit: a node that
        # wins the lease seeds its syncer with these (not part of the digest: merge policy state).
        self.norm_refs: dict[int, float] = {}
        # Per fragment, (tokens, inner steps) merged since the run began: the run is complete once
        # every fragment has merged what [run.stop] asks, and from then on no commit is applied, so
        # every replica ends at the same index with the same state.
        self.merged: list[tuple[int, int]] = [(0, 0)] * plan.num_fragments
        self.commit_wall: list[float] = [0.0] * plan.num_fragments  # newest commit's planning time
        self.evictions = Evictions()  # sites removed from this run for good (never undone)

    # ---- the leader's preview ---------------------------------------------------------------

    def digest_after(self, p: int, outer_gradient: Mapping[str, np.ndarray]) -> str:
        """The digest fragment p will have once this gradient is applied (state untouched)."""
        return self.state.digest_after(p, outer_gradient)

    # ---- applying committed entries ---------------------------------------------------------

    def apply(self, entry: LogEntry) -> ApplyOutcome:
        was_complete = self.completion() is not None
        outcome = self._apply(entry)
        if not was_complete and self.completion() is not None:
            # The completing commit: later entries (a membership change, a new holder's no-op)
            # are applied past it, and a site that catches up in one batch must name this one.
            self.completed_at_index = entry.index
        self.applied_index = entry.index
        self.last_reason = f"#{entry.index}: {outcome.reason}"
        return outcome

    @property
    def merged_totals(self) -> tuple[int, int]:
        """(tokens, inner steps) every fragment has merged at least."""
        return min(t for t, _ in self.merged), min(s for _, s in self.merged)

    def completion(self) -> str | None:
        """Why the run is complete (its [run.stop] limit reached), or None while it goes on."""
        newest = max(self.commit_wall)
        elapsed = newest - self.founded_at if self.founded_at and newest else 0.0
        return self.stop.reached(*self.merged_totals, elapsed)

    def _apply(self, entry: LogEntry) -> ApplyOutcome:
        if entry.kind is EntryKind.EVICTION:
            try:
                record = self.evictions.apply_entry(entry.payload_bytes(), entry.index)
            except EvictionError as error:  # the lease holder checked it: only a bug gets here
                return ApplyOutcome(False, None, f"{error}; ignored")
            return ApplyOutcome(True, None, record.refusal())
        if entry.kind is not EntryKind.OUTER_COMMIT:
            return ApplyOutcome(False, None, f"{entry.kind.value}: nothing to apply")
        complete = self.completion()
        if complete is not None:
            return ApplyOutcome(False, entry.fragment, f"the run is complete ({complete}); commit not applied")
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
            payload = CommitPayload.decode(entry.payload_bytes())
            # bounded by the fragment's own size (not a fixed cap: a 7B model's fragments pass 2^28 values)
            gradient = decode_named(payload.delta, max_elements=self.plan.fragments[p].num_elements)
            digest = self.state.apply_outer_gradient(p, gradient)
        except (RemoteProtocolError, GlobalStateError, ValueError, PayloadUnavailable) as error:
            # PayloadUnavailable: the entry's bytes are no longer on this node's disk; the
            # fragment is fetched from a peer like after any other entry that cannot be applied.
            self.diverged.add(p)
            return ApplyOutcome(False, p, f"fragment {p} round {round_} could not be applied: {error}", True)
        if entry.digest and digest != entry.digest:
            self.diverged.add(p)
            return ApplyOutcome(True, p, f"fragment {p} round {round_}: digest {digest[:12]} != committed "
                                         f"{entry.digest[:12]}; refetching the fragment", True)
        if payload.norm_ref is not None:
            self.norm_refs[p] = payload.norm_ref
        tokens, steps = self.merged[p]
        self.merged[p] = (tokens + payload.tokens, steps + payload.steps)
        self.commit_wall[p] = max(self.commit_wall[p], payload.wall)
        return ApplyOutcome(True, p, f"fragment {p} -> round {round_} from {len(payload.contributors)} "
                                     f"contributor(s), digest {digest[:12]}", contributors=payload.contributors)

    # ---- the replicated state out and in (names and forms: state_codec.py) -----------------

    def fragment_state(self, p: int, *, copies: bool = True) -> FragmentState:
        """Fragment p's replicated state: the global state's part plus the norm reference and totals
        (`copies=False`: the state's own read-only arrays, see `GlobalState.fragment_state`)."""
        tokens, steps = self.merged[p]
        return dataclasses.replace(self.state.fragment_state(p, copies=copies), norm_ref=self.norm_refs.get(p),
                                   merged_tokens=tokens, merged_steps=steps, commit_wall=self.commit_wall[p],
                                   evicted=tuple(self.evictions.records()))

    def install_states(self, states: Sequence[FragmentState], expected_digest: str | None = None) -> str:
        """Replace the whole replicated state (all-or-nothing, GlobalStateError); returns its digest."""
        digest = self.state.install(states, expected_digest)
        self.norm_refs = {s.fragment: s.norm_ref for s in states if s.norm_ref is not None}
        ordered = sorted(states, key=lambda s: s.fragment)
        self.merged = [(s.merged_tokens, s.merged_steps) for s in ordered]
        self.commit_wall = [s.commit_wall for s in ordered]
        for state in states:  # the register only grows: what we applied ourselves stays
            self.evictions.merge(state.evicted)
        return digest

    def fragment_bytes(self, p: int) -> tuple[int, bytes, bytes]:
        """(round, download bytes, state digest) of fragment p as it is now, serialized whole: what
        a test or a tool hands to `install_fragment_bytes`. Serving peers reads the state's own
        arrays a chunk at a time instead (daemon/state_transfer.py `ServedFragments`)."""
        state = self.fragment_state(p, copies=False)
        digest = fragment_state_digest(p, state.round, state.params, state.momentum)
        return state.round, encode_fragment(state), bytes.fromhex(digest)

    def install_fragment_bytes(self, p: int, data: bytes) -> str:
        """Replace fragment p from a peer's download bytes (checked fully before anything changes)."""
        return self.install_checked_bytes(self.check_fragment_bytes(p, data))

    def check_fragment_bytes(self, p: int, data: bytes | bytearray) -> tuple[FragmentState, CheckedFragment]:
        """Decode and check a peer's download bytes for fragment p, changing nothing: the slow
        half of `install_fragment_bytes` (seconds for a large fragment), for a worker thread."""
        try:
            state = decode_fragment(data)
        except StateCodecError as error:
            raise RemoteProtocolError(f"fragment {p} bytes are malformed: {error}", 400) from None
        if state.fragment != p:
            raise RemoteProtocolError(f"fragment {p} bytes hold fragment {state.fragment}", 400)
        try:
            return state, self.state.check_fragment(state, adopt=True)  # decoded just now: ours
        except GlobalStateError as error:
            raise RemoteProtocolError(f"fragment {p} does not fit this run: {error}", 400) from None

    def install_checked_bytes(self, checked: tuple[FragmentState, CheckedFragment]) -> str:
        """Install what `check_fragment_bytes` checked (on the thread that applies commits)."""
        state, fragment = checked
        p = fragment.fragment
        digest = self.state.install_checked(fragment)
        if state.norm_ref is None:
            self.norm_refs.pop(p, None)
        else:
            self.norm_refs[p] = state.norm_ref
        self.merged[p] = (state.merged_tokens, state.merged_steps)
        self.commit_wall[p] = state.commit_wall
        self.evictions.merge(state.evicted)
        self.diverged.discard(p)
        return digest

    def checkpoint_entries(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(metadata, arrays) of the replicated state for a checkpoint (the caller adds its own)."""
        # The state's own arrays, not copies: they are never changed in place, so a checkpoint
        # written on the disk thread while commits are applied still holds this one state.
        return to_checkpoint([self.fragment_state(p, copies=False) for p in range(self.plan.num_fragments)],
                             self.state.digest(), self.evictions)

    def restore_checkpoint(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> str:
        """Replace the replicated state from a checkpoint's metadata and arrays, verified against
        the digest it promises (one written before wire 3.0 promises none that still names anything:
        state_codec `from_checkpoint`); StateCodecError or GlobalStateError (nothing changed) otherwise."""
        states, digest = from_checkpoint(meta, arrays, self.plan)
        evicted = evictions_from_checkpoint(meta)
        installed = self.install_states(states, expected_digest=digest)
        self.evictions.merge(evicted.records())
        return installed
