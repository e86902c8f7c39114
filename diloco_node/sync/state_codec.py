"""The one naming and serialization of the replicated global state, fragment by fragment.

A fragment's replicated state is its round, its parameters Theta_p, its Nesterov buffer, optionally
older parameter versions (kept for rebasing), the reference delta norm carried by the newest
commit (merge policy state) and the tokens and steps merged so far (what ends a run): the last
two are replicated, but not part of the digest. `FragmentState` holds these
in memory; this module gives them their names and their serialized forms:

- named arrays (`fragment_arrays` / `from_fragment_arrays`): "params/<tensor>",
  "momentum/<tensor>" and "history/<round>/<tensor>". The fragment digest hashes the first two
  names (`current_arrays`), so the digest layout and every serialized form name tensors alike.
- checkpoint entries (`to_checkpoint` / `from_checkpoint`): the named arrays of every fragment under
  "global/", plus metadata {"rounds", "state_digest", "norm_refs"} and, once a site was evicted,
  "evicted" (`evictions_from_checkpoint`); a checkpoint holds other arrays (the learner's) beside them.
- download bytes (`encode_fragment` / `decode_fragment`): what a peer serves for one fragment of a
  state download: a msgpack map of the metadata and the named arrays as [shape, raw <f4 bytes],
  plus "evicted" once a site was evicted (absent reads as none: older peers interoperate).

Decoding checks structure only (names, integer rounds, byte lengths, the norm reference); whether
the arrays fit a run's plan and are finite is `GlobalState`'s check when it installs them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from diloco_node.sync.evictions import EvictionError, EvictionRecord, Evictions
from diloco_node.sync.fragments import FragmentPlan

PARAMS = "params"
MOMENTUM = "momentum"
HISTORY = "history"
# Checkpoint array names of the global state start with this; the learner's start with "learner/".
CHECKPOINT_PREFIX = "global/"
# Version of the download bytes; a peer serving another version is refused by `decode_fragment`.
FRAGMENT_BYTES_FORMAT = 2
_DTYPE = np.dtype("<f4")  # the one dtype of the global state on every wire and disk


class StateCodecError(ValueError):
    """Serialized global state is malformed (structure, not content); nothing was installed."""


@dataclass(frozen=True, slots=True)
class FragmentState:
    """One fragment's replicated state, as it is serialized and installed."""

    fragment: int
    round: int
    params: Mapping[str, np.ndarray]
    momentum: Mapping[str, np.ndarray]
    # Older parameter versions by round (each older than `round`); empty in downloads, which do
    # not need them (contributions against an evicted round are refused with a reason).
    history: Mapping[int, Mapping[str, np.ndarray]] = field(default_factory=dict)
    norm_ref: float | None = None  # the fragment's reference delta norm after its newest commit
    # Tokens and inner steps merged into this fragment since the run began (what `[run.stop]`
    # counts): replicated like the norm reference, and like it not part of the digest.
    merged_tokens: int = 0
    merged_steps: int = 0
    commit_wall: float = 0.0  # the newest commit's planning time (unix seconds; [run.stop] wall_s)
    # The run's evicted sites (sync/evictions.py): run-wide, not the fragment's, but carried by
    # every fragment's download bytes so a joiner learns them whichever fragment it fetches.
    evicted: tuple[EvictionRecord, ...] = ()


# ---------------------------------------------------------------------------------------------
# Named arrays
# ---------------------------------------------------------------------------------------------


def current_arrays(params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{"params/<tensor>": ..., "momentum/<tensor>": ...}: the arrays a fragment digest covers."""
    named = {f"{PARAMS}/{n}": a for n, a in params.items()}
    named.update({f"{MOMENTUM}/{n}": a for n, a in momentum.items()})
    return named


def fragment_arrays(state: FragmentState) -> dict[str, np.ndarray]:
    """Every array of the fragment by name: current parameters and buffer, then history versions."""
    named = current_arrays(state.params, state.momentum)
    for round_, version in state.history.items():
        named.update({f"{HISTORY}/{round_}/{n}": a for n, a in version.items()})
    return named


def from_fragment_arrays(fragment: int, round_: int, arrays: Mapping[str, np.ndarray],
                         norm_ref: float | None = None) -> FragmentState:
    """Inverse of `fragment_arrays`; StateCodecError for a name of no known kind."""
    params: dict[str, np.ndarray] = {}
    momentum: dict[str, np.ndarray] = {}
    history: dict[int, dict[str, np.ndarray]] = {}
    for name, array in arrays.items():
        kind, _, rest = name.partition("/")
        if kind == PARAMS and rest:
            params[rest] = array
        elif kind == MOMENTUM and rest:
            momentum[rest] = array
        elif kind == HISTORY:
            round_text, _, tensor = rest.partition("/")
            if not round_text.isdigit() or not tensor:
                raise StateCodecError(f"fragment {fragment}: array {name!r} is not history/<round>/<tensor>")
            history.setdefault(int(round_text), {})[tensor] = array
        else:
            raise StateCodecError(f"fragment {fragment}: array {name!r} is not params/, momentum/ or history/")
    return FragmentState(fragment, round_, params, momentum, history, _checked_norm_ref(fragment, norm_ref))


def _tensor_of(name: str) -> str:
    """The tensor an array name is about ("history/3/blocks/0/w" -> "blocks/0/w")."""
    kind, _, rest = name.partition("/")
    return rest.partition("/")[2] if kind == HISTORY else rest


def _checked_norm_ref(fragment: int, norm_ref: Any) -> float | None:
    if norm_ref is None:
        return None
    if isinstance(norm_ref, bool) or not isinstance(norm_ref, (int, float)):
        raise StateCodecError(f"fragment {fragment}: norm_ref must be a number, got {type(norm_ref).__name__}")
    # A NaN reference would switch the outlier check off for good on every future lease holder.
    if not (math.isfinite(norm_ref) and norm_ref >= 0.0):
        raise StateCodecError(f"fragment {fragment}: norm_ref = {norm_ref!r} must be finite and >= 0")
    return float(norm_ref)


def _checked_merged(what: str, value: Any) -> tuple[int, int]:
    """(tokens, steps) merged so far: two non-negative integers."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise StateCodecError(f"{what} must be [tokens, steps]")
    tokens, steps = (_checked_int(what, v) for v in value)
    if tokens < 0 or steps < 0:
        raise StateCodecError(f"{what} = {list(value)} must not be negative")
    return tokens, steps


def _checked_wall(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise StateCodecError(f"{what} = {value!r} must be a finite non-negative unix time")
    return float(value)


def _checked_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise StateCodecError(f"{what} must be an integer, got {type(value).__name__}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# Checkpoint entries
# ---------------------------------------------------------------------------------------------


def to_checkpoint(fragments: Sequence[FragmentState], state_digest: str,
                  evicted: Evictions | None = None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, arrays) of the whole global state for a checkpoint; fragments in index order."""
    meta: dict[str, Any] = {
        "rounds": [f.round for f in fragments],
        "state_digest": state_digest,
        "norm_refs": {str(f.fragment): f.norm_ref for f in fragments if f.norm_ref is not None},
        "merged": [[f.merged_tokens, f.merged_steps] for f in fragments],
        "commit_wall": [f.commit_wall for f in fragments],
    }
    if evicted:
        meta["evicted"] = evicted.to_plain()
    arrays = {CHECKPOINT_PREFIX + name: array for f in fragments for name, array in fragment_arrays(f).items()}
    return meta, arrays


def from_checkpoint(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                    plan: FragmentPlan) -> tuple[list[FragmentState], str]:
    """(one FragmentState per fragment of `plan`, the state digest the checkpoint promises).

    Arrays without the "global/" prefix belong to others and are skipped; the arrays are copied
    out of the checkpoint's buffer.
    """
    try:
        rounds = [_checked_int(f"checkpoint: rounds[{p}]", r) for p, r in enumerate(meta["rounds"])]
        digest = str(meta["state_digest"])
        norm_refs = {int(p): v for p, v in meta.get("norm_refs", {}).items()}
        merged = [_checked_merged(f"checkpoint: merged[{p}]", m) for p, m in enumerate(meta.get("merged", []))]
        walls = [_checked_wall(f"checkpoint: commit_wall[{p}]", w) for p, w in enumerate(meta.get("commit_wall", []))]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise StateCodecError(f"checkpoint: global state metadata is malformed: {error!r}") from None
    if len(rounds) != plan.num_fragments:
        raise StateCodecError(f"checkpoint: {len(rounds)} fragment rounds, the plan has {plan.num_fragments}")
    per_fragment: list[dict[str, np.ndarray]] = [{} for _ in range(plan.num_fragments)]
    for name, array in arrays.items():
        if not name.startswith(CHECKPOINT_PREFIX):
            continue
        local = name[len(CHECKPOINT_PREFIX):]
        try:
            p = plan.fragment_of(_tensor_of(local))
        except KeyError as error:
            raise StateCodecError(f"checkpoint: array {name!r}: {error.args[0]}") from None
        per_fragment[p][local] = np.array(array, dtype=_DTYPE)
    if merged and len(merged) != plan.num_fragments:
        raise StateCodecError(f"checkpoint: {len(merged)} merged totals, the plan has {plan.num_fragments}")
    states = [from_fragment_arrays(p, rounds[p], per_fragment[p], norm_refs.get(p)) for p in range(plan.num_fragments)]
    if merged:  # checkpoints written before the totals existed start them at zero
        states = [dataclasses.replace(s, merged_tokens=m[0], merged_steps=m[1]) for s, m in zip(states, merged)]
    if len(walls) == len(states):
        states = [dataclasses.replace(s, commit_wall=w) for s, w in zip(states, walls)]
    return states, digest


def evictions_from_checkpoint(meta: Mapping[str, Any]) -> Evictions:
    """The evicted sites a checkpoint records (none in checkpoints written before evictions existed)."""
    try:
        return Evictions.from_plain(meta.get("evicted", []), "checkpoint: evicted")
    except EvictionError as error:
        raise StateCodecError(str(error)) from None


def params_from_checkpoint(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global model's current parameters from a checkpoint's arrays (e.g. to evaluate it)."""
    prefix = f"{CHECKPOINT_PREFIX}{PARAMS}/"
    return {name[len(prefix):]: np.asarray(a) for name, a in arrays.items() if name.startswith(prefix)}


# ---------------------------------------------------------------------------------------------
# Download bytes
# ---------------------------------------------------------------------------------------------


def encode_fragment(state: FragmentState) -> bytes:
    """The bytes a peer serves for one fragment of a state download."""
    fields: dict[str, Any] = {
        "format": FRAGMENT_BYTES_FORMAT, "fragment": state.fragment, "round": state.round,
        # Each array's own memory, packed straight into the one output buffer (the same bytes as
        # `tobytes()`, without a second copy of the fragment: 2 GB for a 1B model's embedding).
        "arrays": {name: [list(a.shape), memoryview(np.ascontiguousarray(a, dtype=_DTYPE)).cast("B")]
                   for name, a in fragment_arrays(state).items()},
    }
    if state.norm_ref is not None:
        fields["norm_ref"] = state.norm_ref
    fields["merged"] = [state.merged_tokens, state.merged_steps]
    fields["commit_wall"] = state.commit_wall
    if state.evicted:
        fields["evicted"] = [r.to_plain() for r in state.evicted]
    return msgpack.packb(fields, use_bin_type=True)


def decode_fragment(data: bytes) -> FragmentState:
    """Inverse of `encode_fragment` for a peer's bytes; StateCodecError on any structural problem."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise StateCodecError(f"fragment bytes are not msgpack: {error}") from None
    if not isinstance(raw, dict) or raw.get("format") != FRAGMENT_BYTES_FORMAT:
        raise StateCodecError(f"fragment bytes are not a map in format {FRAGMENT_BYTES_FORMAT}")
    fragment = _checked_int("fragment bytes: 'fragment'", raw.get("fragment"))
    round_ = _checked_int(f"fragment {fragment} bytes: 'round'", raw.get("round"))
    packed = raw.get("arrays")
    if not isinstance(packed, dict):
        raise StateCodecError(f"fragment {fragment} bytes: 'arrays' must be a map")
    arrays = {name: _unpacked_array(fragment, name, item) for name, item in packed.items()}
    state = from_fragment_arrays(fragment, round_, arrays, raw.get("norm_ref"))
    tokens, steps = _checked_merged(f"fragment {fragment} bytes: 'merged'", raw.get("merged", [0, 0]))
    wall = _checked_wall(f"fragment {fragment} bytes: 'commit_wall'", raw.get("commit_wall", 0.0))
    try:
        evicted = tuple(Evictions.from_plain(raw.get("evicted", []), f"fragment {fragment} bytes: evicted").records())
    except EvictionError as error:
        raise StateCodecError(str(error)) from None
    return dataclasses.replace(state, merged_tokens=tokens, merged_steps=steps, commit_wall=wall, evicted=evicted)


def _unpacked_array(fragment: int, name: Any, item: Any) -> np.ndarray:
    if not isinstance(name, str) or not isinstance(item, list) or len(item) != 2:
        raise StateCodecError(f"fragment {fragment} bytes: array {name!r} is not [shape, bytes]")
    shape, data = item
    if not isinstance(shape, list) or not isinstance(data, bytes):
        raise StateCodecError(f"fragment {fragment} bytes: array {name!r} is not [shape, bytes]")
    dims = tuple(_checked_int(f"fragment {fragment} bytes: {name} shape", d) for d in shape)
    if any(d < 0 for d in dims) or math.prod(dims) * _DTYPE.itemsize != len(data):
        raise StateCodecError(f"fragment {fragment} bytes: {name}: {len(data)} bytes do not hold shape {list(dims)}")
    return np.frombuffer(data, dtype=_DTYPE).reshape(dims).copy()
