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
  "global/", plus metadata {"rounds", "state_digest", "digest_hash", "norm_refs"} and, once a site was evicted,
  "evicted" (`evictions_from_checkpoint`); a checkpoint holds other arrays (the learner's) beside them.
  One written while the state was not current says why (`NOT_CURRENT_KEY`, `checkpoint_not_current`).
- download bytes (`encode_fragment` / `decode_fragment`): what a peer serves for one fragment of a
  state download: a msgpack map of the metadata and the named arrays as [shape, raw <f4 bytes],
  plus "evicted" once a site was evicted (absent reads as none). Format 3: "fragment" and
  "round" come before "arrays", and the arrays come in the digest's order (sorted names), so a
  receiver computes the fragment's state digest while it decodes (`FragmentAssembler`).
- the state digest's layout (`fragment_state_digest`, `digest_start`, `hash_tensor_header`):
  BLAKE3 (wire/digest.py) over the fragment index, its round, then each of `current_arrays` in
  sorted name order, each field length-prefixed (docs/MERGE.md).

Decoding checks structure only (names, integer rounds, byte lengths, the norm reference); whether
the arrays fit a run's plan and are finite is `GlobalState`'s check when it installs them.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from diloco_node.sync.evictions import EvictionError, EvictionRecord, Evictions
from diloco_node.sync.fragments import FragmentPlan
from wire import digest as content_digest

PARAMS = "params"
MOMENTUM = "momentum"
HISTORY = "history"
# Checkpoint array names of the global state start with this; the learner's start with "learner/".
CHECKPOINT_PREFIX = "global/"
# A checkpoint written while the replica was not the run's state at its applied index (a stale
# fragment, a download in progress: only the one written at stop can be) says why under this key.
# Its learner is resumed; its global state is never replayed onto nor exported.
NOT_CURRENT_KEY = "state_not_current"
# Version of the download bytes; a peer serving another version is refused by `decode_fragment`.
# 3 (wire 3.0): arrays in the state digest's order, after "fragment" and "round".
FRAGMENT_BYTES_FORMAT = 3
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


# ---------------------------------------------------------------------------------------------
# The state digest's layout
# ---------------------------------------------------------------------------------------------


def digest_start(p: int, round_: int) -> Any:
    """A fragment digest's hasher after its fixed prefix: a domain label, the index and the round."""
    h = content_digest.hasher(b"diloco-fragment\0")
    h.update(struct.pack("<qq", p, round_))
    return h


def hash_tensor_header(h: Any, name: str, shape: tuple[int, ...]) -> None:
    """A tensor's fields before its raw bytes: name, dtype, shape and byte count, length-prefixed."""
    for field_bytes in (name.encode(), _DTYPE.str.encode()):
        h.update(struct.pack("<q", len(field_bytes)))
        h.update(field_bytes)
    h.update(struct.pack("<q", len(shape)))
    h.update(struct.pack(f"<{len(shape)}q", *shape))
    h.update(struct.pack("<q", math.prod(shape) * _DTYPE.itemsize))


def fragment_state_digest(p: int, round_: int, params: Mapping[str, np.ndarray],
                          momentum: Mapping[str, np.ndarray]) -> str:
    """The fragment's state digest (hex): `digest_start`, then every array of `current_arrays` in
    sorted name order, its header and its raw little-endian float32 bytes (hashed in place)."""
    h = digest_start(p, round_)
    for name, arr in sorted(current_arrays(params, momentum).items(), key=lambda item: item[0]):
        shape = np.shape(arr)  # a 0-d array's own shape (), as `digest_after` and receivers hash it
        data = np.ascontiguousarray(arr, dtype=_DTYPE)  # (at least 1-d: only its bytes are used)
        hash_tensor_header(h, name, shape)
        h.update(data.reshape(-1).view(np.uint8))
    return h.hexdigest()


def fragment_arrays(state: FragmentState) -> dict[str, np.ndarray]:
    """Every array of the fragment by name: current parameters and buffer in the digest's order
    (sorted names), then history versions."""
    named = dict(sorted(current_arrays(state.params, state.momentum).items(), key=lambda item: item[0]))
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
        "digest_hash": content_digest.DIGEST_NAME,
        "norm_refs": {str(f.fragment): f.norm_ref for f in fragments if f.norm_ref is not None},
        "merged": [[f.merged_tokens, f.merged_steps] for f in fragments],
        "commit_wall": [f.commit_wall for f in fragments],
    }
    if evicted:
        meta["evicted"] = evicted.to_plain()
    arrays = {CHECKPOINT_PREFIX + name: array for f in fragments for name, array in fragment_arrays(f).items()}
    return meta, arrays


def checkpoint_not_current(meta: Mapping[str, Any]) -> str:
    """Why a checkpoint's global state was not current when it was written ("" when it was, and for
    checkpoints written before the key existed: those were only written while current, or at stop)."""
    return str(meta.get(NOT_CURRENT_KEY) or "")


def from_checkpoint(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
                    plan: FragmentPlan) -> tuple[list[FragmentState], str | None]:
    """(one FragmentState per fragment of `plan`, the state digest the checkpoint promises).

    A checkpoint written before wire 3.0 ("digest_hash" absent) promises a SHA-256 state digest,
    which no longer names anything: None then (its file's own checksum still guards its bytes,
    and the state's digest is computed afresh when it is installed).

    Arrays without the "global/" prefix belong to others and are skipped; the arrays are copied
    out of the checkpoint's buffer.
    """
    try:
        rounds = [_checked_int(f"checkpoint: rounds[{p}]", r) for p, r in enumerate(meta["rounds"])]
        digest: str | None = str(meta["state_digest"])
        if meta.get("digest_hash") != content_digest.DIGEST_NAME:
            digest = None
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
    """The bytes a peer serves for one fragment of a state download (`fragment_parts`, joined:
    one allocation of exactly the output's size)."""
    return b"".join(fragment_parts(state))


def _fragment_fields(state: FragmentState) -> dict[str, Any]:
    """The download bytes' top-level map, in its wire order; "arrays" holds the arrays themselves."""
    fields: dict[str, Any] = {
        "format": FRAGMENT_BYTES_FORMAT, "fragment": state.fragment, "round": state.round,
        # C-contiguous float32 (no copy when they already are); a 0-d array keeps its shape ()
        "arrays": {name: np.require(np.asarray(a), _DTYPE, "C") for name, a in fragment_arrays(state).items()},
    }
    if state.norm_ref is not None:
        fields["norm_ref"] = state.norm_ref
    fields["merged"] = [state.merged_tokens, state.merged_steps]
    fields["commit_wall"] = state.commit_wall
    if state.evicted:
        fields["evicted"] = [r.to_plain() for r in state.evicted]
    return fields


def fragment_parts(state: FragmentState) -> list[bytes | memoryview]:
    """The download bytes of a fragment as pieces whose concatenation is exactly what
    `msgpack.packb` makes of the map (so peers of any version serve the same bytes and a
    download resumes across them): small msgpack headers and each array's own memory, uncopied.
    A server reads any byte range from them (`PartsReader`) without building the whole."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    fields = _fragment_fields(state)
    parts: list[bytes | memoryview] = [packer.pack_map_header(len(fields))]
    for key, value in fields.items():
        parts.append(packer.pack(key))
        if key != "arrays":
            parts.append(packer.pack(value))
            continue
        parts.append(packer.pack_map_header(len(value)))
        for name, array in value.items():
            raw = memoryview(array.reshape(-1)).cast("B")
            parts.append(packer.pack(name) + packer.pack_array_header(2) + packer.pack(list(array.shape))
                         + _bin_header(raw.nbytes))
            parts.append(raw)
    return parts


def _bin_header(n: int) -> bytes:
    """msgpack's header of a bin of n bytes, in its shortest form (as `packb` writes it)."""
    if n < 1 << 8:
        return b"\xc4" + struct.pack(">B", n)
    if n < 1 << 16:
        return b"\xc5" + struct.pack(">H", n)
    if n < 1 << 32:
        return b"\xc6" + struct.pack(">I", n)
    raise StateCodecError(f"an array of {n} bytes does not fit a msgpack bin")


class PartsReader:
    """Byte ranges of a fragment's download bytes, read from its parts (`fragment_parts`) without
    joining them: what a server holds for a fragment is its parts (the state's own arrays), and a
    chunk it serves is views of them (`views`), never a copy."""

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts]
        self._starts: list[int] = []
        total = 0
        for part in self._parts:
            self._starts.append(total)
            total += part.nbytes
        self.total = total

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length) clipped to the end (b"" past it): one copy of the range."""
        return b"".join(self.views(offset, length))

    def views(self, offset: int, length: int) -> list[memoryview]:
        """The range `read` returns as views of the parts it lies in, in order, copying nothing
        (a server hashes and writes them where they are: wire.messages `PayloadParts`)."""
        start, stop = max(0, min(offset, self.total)), max(0, min(offset + max(0, length), self.total))
        pieces: list[memoryview] = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        at = start
        while at < stop:
            part, part_start = self._parts[i], self._starts[i]
            take = min(stop, part_start + part.nbytes) - at
            pieces.append(part[at - part_start:at - part_start + take])
            at += take
            i += 1
        return pieces


def decode_fragment(data: bytes | bytearray | memoryview) -> FragmentState:
    """Inverse of `encode_fragment` for a peer's bytes; StateCodecError on any structural problem."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise StateCodecError(f"fragment bytes are not msgpack: {error}") from None
    if not isinstance(raw, dict) or raw.get("format") != FRAGMENT_BYTES_FORMAT:
        raise StateCodecError(f"fragment bytes are not a map in format {FRAGMENT_BYTES_FORMAT}")
    fragment = _checked_int("fragment bytes: 'fragment'", raw.get("fragment"))
    packed = raw.get("arrays")
    if not isinstance(packed, dict):
        raise StateCodecError(f"fragment {fragment} bytes: 'arrays' must be a map")
    return _state_from_raw(raw, {name: _unpacked_array(fragment, name, item) for name, item in packed.items()})


def _state_from_raw(raw: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> FragmentState:
    """A FragmentState from a decoded top-level map whose "arrays" are already `arrays`."""
    if raw.get("format") != FRAGMENT_BYTES_FORMAT:
        raise StateCodecError(f"fragment bytes are not a map in format {FRAGMENT_BYTES_FORMAT}")
    fragment = _checked_int("fragment bytes: 'fragment'", raw.get("fragment"))
    round_ = _checked_int(f"fragment {fragment} bytes: 'round'", raw.get("round"))
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


# ---------------------------------------------------------------------------------------------
# Download bytes, decoded as they arrive
# ---------------------------------------------------------------------------------------------

# Outside the arrays a fragment's download bytes hold a few names and numbers: any one string,
# bin or container larger than these is malformed (and is never allocated).
MAX_METADATA_ITEM_BYTES = 1 << 20
MAX_METADATA_ITEMS = 1 << 16
MAX_METADATA_DEPTH = 16


class FragmentAssembler:
    """Decodes one fragment's download bytes as they arrive, in order, straight into arrays of
    the shapes `shapes` allows ({array name: shape}, e.g. "params/<tensor>"): the bytes are never
    held whole, so receiving a fragment costs its arrays and one chunk, not twice the fragment.
    As each array's bytes are copied in, they are hashed into the fragment's state digest
    (`state_digest()`, the same as `fragment_state_digest` of the decoded arrays): the bytes are
    hashed where they already are, once, and the installer need not hash the arrays again.
    `finish()` is `decode_fragment`'s result for the same bytes, or StateCodecError; an array
    name or shape `shapes` does not allow, arrays out of the digest's order, or arrays before
    "fragment" and "round" are refused before anything is allocated for them."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._shapes = dict(shapes)
        self._state_hash: Any = None  # started once "fragment" and "round" are known
        self.received = 0
        self._pending = bytearray()  # bytes of a header or metadata item, not yet complete
        self._target: np.ndarray | None = None  # uint8 view of the array being filled
        self._filled = 0
        self._result: dict[str, Any] | None = None
        self._arrays: dict[str, np.ndarray] = {}
        self._parser = self._parse()
        self._want: int | np.ndarray | None = next(self._parser)

    def state_digest(self) -> str:
        """The state digest (hex) of the arrays fed so far; whole once `finish` has succeeded."""
        if self._state_hash is None:
            raise StateCodecError("fragment bytes: no arrays yet")
        return self._state_hash.hexdigest()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        want, filled = self._want, self._filled
        n = data.nbytes if type(data) is memoryview else len(data)
        if type(want) is np.ndarray and n < want.size - filled:  # the usual piece: inside one array
            self._state_hash.update(data)  # hashed where the bytes are, as they are copied
            want[filled:filled + n] = np.frombuffer(data, np.uint8)
            self._filled = filled + n
            self.received += n
            return
        view = memoryview(data).cast("B")
        self.received += view.nbytes
        at = 0
        while at < view.nbytes:
            if self._want is None:
                raise StateCodecError(f"fragment bytes: {view.nbytes - at} bytes after the end")
            if isinstance(self._want, np.ndarray):  # an array's raw bytes: copied into it directly
                take = min(view.nbytes - at, self._want.size - self._filled)
                piece = view[at:at + take]
                self._state_hash.update(piece)  # hashed where the bytes are, as they are copied
                self._want[self._filled:self._filled + take] = np.frombuffer(piece, np.uint8)
                self._filled += take
                at += take
                if self._filled == self._want.size:
                    self._advance(None)
                continue
            take = min(view.nbytes - at, self._want - len(self._pending))
            self._pending += view[at:at + take]
            at += take
            if len(self._pending) == self._want:
                item, self._pending = bytes(self._pending), bytearray()
                self._advance(item)

    def finish(self) -> FragmentState:
        """The decoded fragment, once every byte has been fed."""
        if self._result is None:
            raise StateCodecError(f"fragment bytes end early (after {self.received} bytes)")
        return _state_from_raw(self._result, self._arrays)

    def _advance(self, item: bytes | None) -> None:
        try:
            self._want = self._parser.send(item)
            if isinstance(self._want, np.ndarray):
                self._filled = 0
        except StopIteration:
            self._want = None

    # The parser: a generator that yields how many bytes it needs next (an int) or an array to
    # fill with raw bytes, and is sent those bytes (or None once the array is full).

    def _parse(self) -> Any:
        head = yield 1
        n = yield from self._map_length(head[0])
        raw: dict[str, Any] = {}
        for _ in range(n):
            key = yield from self._value(0)
            if not isinstance(key, str) or key in raw:
                raise StateCodecError(f"fragment bytes: key {key!r} is not a new string")
            if key == "arrays":
                self._start_digest(raw)
                raw[key] = yield from self._arrays_map()
            else:
                raw[key] = yield from self._value(0)
        if raw.get("format") != FRAGMENT_BYTES_FORMAT:
            raise StateCodecError(f"fragment bytes are not a map in format {FRAGMENT_BYTES_FORMAT}")
        if "arrays" not in raw:
            raise StateCodecError("fragment bytes: no 'arrays'")
        self._result = raw

    def _start_digest(self, raw: Mapping[str, Any]) -> None:
        """The state digest starts with the fragment and round: format 3 sends them first."""
        for key in ("fragment", "round"):
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
                raise StateCodecError(f"fragment bytes: {key!r} must be an integer in [0, 2^63) before 'arrays'")
        self._state_hash = digest_start(raw["fragment"], raw["round"])

    def _arrays_map(self) -> Any:
        head = yield 1
        n = yield from self._map_length(head[0])
        last = ""
        for _ in range(n):
            name = yield from self._value(0)
            if not isinstance(name, str) or name in self._arrays:
                raise StateCodecError(f"fragment bytes: array name {name!r} is not a new string")
            if name <= last:
                raise StateCodecError(f"fragment bytes: array {name!r} after {last!r}, not in the digest's order")
            last = name
            if (yield 1) != b"\x92":
                raise StateCodecError(f"fragment bytes: array {name!r} is not [shape, bytes]")
            shape = yield from self._value(0)
            expected = self._shapes.get(name)
            if expected is None:
                raise StateCodecError(f"fragment bytes: array {name!r} is not one of this fragment's")
            if not isinstance(shape, list) or tuple(shape) != tuple(expected):
                raise StateCodecError(f"fragment bytes: {name}: shape {shape!r}, this run's is {list(expected)}")
            kind = (yield 1)[0]
            size = yield from self._bin_length(kind)
            if size is None or size != math.prod(expected) * _DTYPE.itemsize:
                raise StateCodecError(f"fragment bytes: {name}: not {math.prod(expected) * _DTYPE.itemsize} raw bytes")
            array = np.empty(expected, _DTYPE)
            hash_tensor_header(self._state_hash, name, tuple(expected))
            if size:
                yield array.reshape(-1).view(np.uint8)
            self._arrays[name] = array
        return None

    def _map_length(self, kind: int) -> Any:
        if 0x80 <= kind <= 0x8F:
            return kind & 0x0F
        if kind in (0xDE, 0xDF):
            return (yield from self._uint(2 if kind == 0xDE else 4))
        raise StateCodecError(f"fragment bytes: a map expected, got type byte 0x{kind:02x}")

    def _bin_length(self, kind: int) -> Any:
        if kind in (0xC4, 0xC5, 0xC6):
            return (yield from self._uint({0xC4: 1, 0xC5: 2, 0xC6: 4}[kind]))
        return None

    def _uint(self, width: int) -> Any:
        return int.from_bytes((yield width), "big")

    def _value(self, depth: int) -> Any:
        """One msgpack value outside the arrays (names, numbers, small lists and maps)."""
        if depth > MAX_METADATA_DEPTH:
            raise StateCodecError("fragment bytes: metadata nested too deep")
        kind = (yield 1)[0]
        if kind <= 0x7F:
            return kind
        if kind >= 0xE0:
            return kind - 0x100
        if 0xA0 <= kind <= 0xBF or kind in (0xD9, 0xDA, 0xDB):
            n = kind & 0x1F if kind <= 0xBF else (yield from self._uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[kind]))
            return (yield from self._small(n)).decode("utf-8", errors="strict") if n else ""
        if 0x90 <= kind <= 0x9F or kind in (0xDC, 0xDD):
            n = kind & 0x0F if kind <= 0x9F else (yield from self._uint(2 if kind == 0xDC else 4))
            self._check_items(n)
            out = []
            for _ in range(n):
                out.append((yield from self._value(depth + 1)))
            return out
        if 0x80 <= kind <= 0x8F or kind in (0xDE, 0xDF):
            n = yield from self._map_length(kind)
            self._check_items(n)
            mapping = {}
            for _ in range(n):
                key = yield from self._value(depth + 1)
                try:
                    mapping[key] = yield from self._value(depth + 1)
                except TypeError:
                    raise StateCodecError(f"fragment bytes: unhashable map key {key!r}") from None
            return mapping
        fixed = {0xC0: None, 0xC2: False, 0xC3: True}
        if kind in fixed:
            return fixed[kind]
        if kind in (0xC4, 0xC5, 0xC6):
            n = yield from self._bin_length(kind)
            return (yield from self._small(n)) if n else b""
        formats = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
                   0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
        if kind in formats:
            fmt = formats[kind]
            return struct.unpack(fmt, (yield struct.calcsize(fmt)))[0]
        raise StateCodecError(f"fragment bytes: unsupported msgpack type byte 0x{kind:02x}")

    def _small(self, n: int) -> Any:
        if n > MAX_METADATA_ITEM_BYTES:
            raise StateCodecError(f"fragment bytes: a metadata item of {n} bytes")
        return (yield n)

    @staticmethod
    def _check_items(n: int) -> None:
        if n > MAX_METADATA_ITEMS:
            raise StateCodecError(f"fragment bytes: a metadata container of {n} items")


def fragment_shapes(tensor_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{array name: shape} a fragment's download bytes may hold, from its tensors' shapes."""
    return {name: tuple(shape) for name, shape in
            current_arrays(tensor_shapes, tensor_shapes).items()}  # type: ignore[arg-type]
