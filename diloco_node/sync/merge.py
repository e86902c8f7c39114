"""Merge math for one fragment round: contributions in, one outer gradient out (pure numpy).

A learner sends delta = Theta_p(base) - theta_m,p against the global fragment version it last
applied. The syncer rebases it onto its current version (Delta_m = (Theta_now - Theta_base) +
delta), validates it (names, shapes, finite values, counters, norm outliers), weighs it by tokens
(w = c_tokens^2 / c_steps after capping what a learner may claim), and merges: Radial-Directional
Averaging for ordinary tensors, a weighted mean for embedding tables (or, by the manifest, the
plain weighted mean or the support-normalised mean of sparse contributions everywhere). The outer optimizer step that
replicas apply to the result is `outer.nesterov_step`.

No I/O, no clock, no JAX. Every rejection carries a reason naming the learner and what was wrong.
The choices where the papers are silent are written down in docs/MERGE.md.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from diloco_node.sync.contribution_norm import CONTRIBUTION_NORMS, median_nonzero_norm, median_norm_factors
from diloco_node.sync.outer import all_finite, finite_float32

if TYPE_CHECKING:  # only for annotations
    from diloco_node.config.manifest import SyncSpec
    from diloco_node.sync.global_state import FragmentHistory

# A contribution whose learner-side delta norm exceeds this many times the reference (the round's
# median, or the running reference of past rounds) is rejected. Honest learners of one run differ
# by small factors (shard difficulty, a few more steps); 10x catches diverged or corrupted ones.
DEFAULT_NORM_OUTLIER_FACTOR = 10.0
# The round median is a usable reference only with at least this many contributions: with two, one
# outlier drags the median halfway to itself.
MIN_CONTRIBUTIONS_FOR_ROUND_MEDIAN = 3
# Smoothing of the running reference norm (see NormReference): a persistent change of scale is
# followed within a few rounds, a single spike barely moves it.
DEFAULT_NORM_REFERENCE_ALPHA = 0.3
# ... but one round moves it by at most this factor up or down. Without the bound, a lone outlier
# of 100x (rejected) pulled the reference 30% of the way up and the same outlier passed the next
# round; with it, that takes 4 rounds of the same scale. 3x keeps liveness: honest norms growing
# 2.5x per round for as long as they like (e.g. inner learning-rate warm-up) are never rejected.
DEFAULT_NORM_REFERENCE_MAX_STEP = 3.0

MERGE_METHODS = ("rda", "mean", "support_mean")
WEIGHTINGS = ("tokens", "uniform")


@dataclass(frozen=True, slots=True)
class Contribution:
    """One learner's delta for one fragment, relative to the global version `base_round`.

    Counters come from the network and are checked by `merge_contributions` (a bad value is a
    rejection with a reason, not an exception), so only types are enforced here. Numpy integer
    counters are stored as Python ints: int64 arithmetic on a huge claim would wrap silently.
    """

    learner: str
    fragment: int
    base_round: int
    delta: Mapping[str, np.ndarray]
    c_steps: int
    c_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.learner, str) or not self.learner:
            raise TypeError("Contribution.learner must be a non-empty string")
        for attr in ("fragment", "base_round", "c_steps", "c_tokens"):
            value = getattr(self, attr)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"Contribution.{attr} must be an integer, got {type(value).__name__}")
            object.__setattr__(self, attr, int(value))
        if not isinstance(self.delta, Mapping):
            raise TypeError(f"Contribution.delta must be a mapping of name -> array, got {type(self.delta).__name__}")


@dataclass(frozen=True, slots=True)
class ContributionCaps:
    """Upper bounds on what a learner may claim: tokens per inner step and steps per contribution."""

    max_tokens_per_step: int
    max_steps: int

    @classmethod
    def from_sync_spec(cls, sync: "SyncSpec") -> "ContributionCaps":
        return cls(max_tokens_per_step=sync.max_tokens_per_step, max_steps=sync.max_steps_per_contribution)

    def __post_init__(self) -> None:
        if self.max_tokens_per_step < 1 or self.max_steps < 1:
            raise ValueError(f"caps must be >= 1, got max_tokens_per_step={self.max_tokens_per_step}, max_steps={self.max_steps}")


def token_weight(c_tokens: int, c_steps: int, caps: ContributionCaps) -> float:
    """w = tokens * (tokens / steps) ("quantity x quality") after capping the claim.

    Capped as tokens_per_step' = min(c_tokens / c_steps, max_tokens_per_step) and
    steps' = min(c_steps, max_steps), so w = tokens_per_step'^2 * steps' <= max_tokens_per_step^2 *
    max_steps: the weight of an honest learner at the caps. Inflating counters past the caps buys
    nothing. Raises ValueError for counters that cannot give a weight (merge turns that into a
    rejection reason).
    """
    if c_steps <= 0:
        raise ValueError(f"c_steps = {c_steps}: no inner steps since its base")
    if c_tokens < 0:
        raise ValueError(f"c_tokens = {c_tokens} is negative")
    # Compare as exact integers: a claim beyond the float range must be capped, not overflow.
    if _claims_more_tokens_per_step(c_tokens, c_steps, caps):
        tokens_per_step = float(caps.max_tokens_per_step)
    else:
        tokens_per_step = c_tokens / c_steps
    steps = min(c_steps, caps.max_steps)
    return tokens_per_step * tokens_per_step * steps


def _claims_more_tokens_per_step(c_tokens: int, c_steps: int, caps: ContributionCaps) -> bool:
    return int(c_tokens) > caps.max_tokens_per_step * int(c_steps)


def rebase(
    delta: Mapping[str, np.ndarray], base_params: Mapping[str, np.ndarray], current_params: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Outer gradient against the current version: (Theta_now - Theta_base) + delta, float32."""
    out: dict[str, np.ndarray] = {}
    with np.errstate(over="ignore", invalid="ignore"):  # merge_contributions rejects non-finite results
        for name, d in delta.items():
            moved = np.subtract(current_params[name], base_params[name], dtype=np.float32)
            # Added into `moved` itself: the same float32 sums, one fragment-sized temporary fewer.
            out[name] = np.add(moved, d, out=moved, dtype=np.float32)
    return out


def _check_weights(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    if len(vectors) == 0:
        raise ValueError("nothing to merge: no vectors")
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    if w.sum() <= 0:
        raise ValueError("weights sum to zero")
    shape = np.shape(vectors[0])
    for v in vectors[1:]:
        if np.shape(v) != shape:
            raise ValueError(f"vectors of different shapes: {shape} and {np.shape(v)}")
    return w


# Elements handled at once by the merge's elementwise work and norms (512 KiB of float64): the
# fragment-sized float64 temporaries of a whole-array expression become chunk-sized ones.
CHUNK_ELEMENTS = 1 << 16
# Values of one tensor the merge folds across every contribution at once: the contribution
# stream's chunk (`wire.contribution_stream.chunk_elements_for`, 4 Mi values for every codec), so
# a streamed contribution's chunk is decoded once, folded and dropped within one block. A block
# holds its float64 accumulator (support_mean: two), one contribution's values and their rebase
# (`MERGE_BLOCK_BYTES`); the merge's only fragment-sized array is its float32 result.
MERGE_BLOCK_ELEMENTS = 1 << 22
# What one block holds at most, in bytes per value: two float64 accumulators (16), the values
# in hand as float32 (4), their rebase's float32 temporary (4), and a streamed chunk that ends
# inside the block, decoded (4) and the joined values (4).
MERGE_BLOCK_BYTES_PER_VALUE = 32


def merge_block_bytes() -> int:
    """The most a merge holds besides its float32 result: one block's temporaries (memory bound)."""
    return MERGE_BLOCK_BYTES_PER_VALUE * MERGE_BLOCK_ELEMENTS + 8 * CHUNK_ELEMENTS


def _norm64(x: np.ndarray) -> float:
    """L2 norm of x in float64, the bits of `sqrt(np.add.reduce(x64 * x64))` on the whole array.

    numpy's own pairwise sum, not a BLAS dot: BLAS picks a kernel (and summation order) per CPU,
    numpy's reduction order is fixed, so norms and the merge are the same bits everywhere. The
    squares are never held whole: `_sum_squares` splits the array exactly where numpy's pairwise
    summation splits it, so the sum is the same bits with one chunk of float64 in memory.
    """
    flat = np.asarray(x).reshape(-1)  # a view of a contiguous array (the merge's always are)
    return math.sqrt(_sum_squares(lambda lo, hi: flat[lo:hi], 0, flat.size))


def _sum_squares(read: Callable[[int, int], np.ndarray], lo: int, hi: int) -> float:
    # numpy's pairwise sum of n > 128 values is pairwise(first n2) + pairwise(rest), n2 = n // 2
    # rounded down to a multiple of 8 (numpy/_core/src/umath/loops_utils.h.src); a reduce over a
    # contiguous float64 slice is one such pairwise sum (tests/test_merge.py checks both against
    # the whole-array expression). So recursing the same way down to chunks gives the same bits.
    # `read(lo, hi)` gives values lo..hi; leaves are read in order, so it may be a stream.
    n = hi - lo
    if n <= CHUNK_ELEMENTS:
        chunk = np.array(read(lo, hi), dtype=np.float64)
        np.multiply(chunk, chunk, out=chunk)
        return float(np.add.reduce(chunk))
    half = n // 2
    half -= half % 8
    return _sum_squares(read, lo, lo + half) + _sum_squares(read, lo + half, hi)


def _chunks(size: int) -> Iterable[slice]:
    step = CHUNK_ELEMENTS  # read at each call: tests shrink it
    return (slice(start, min(start + step, size)) for start in range(0, size, step))


def _add_scaled64(acc: np.ndarray, v: np.ndarray, factor: float) -> None:
    """acc += float64(v) * factor, elementwise (the bits of the whole-array expression), a chunk
    of float64 at a time instead of a float64 copy of v."""
    flat_acc, flat_v = acc.reshape(-1), np.asarray(v).reshape(-1)
    scaled = np.empty(min(flat_acc.size, CHUNK_ELEMENTS), dtype=np.float64)
    for part in _chunks(flat_acc.size):
        v64 = scaled[:part.stop - part.start]
        np.multiply(flat_v[part], factor, out=v64, dtype=np.float64)  # cast to float64, then scaled
        flat_acc[part] += v64


class _Stream:
    """A tensor's values read in order, block after block: `read(lo, hi)` with each `lo` the
    previous `hi`. The values come as pieces (a streamed contribution's decoded chunks, the
    merge's own blocks), and at most one piece is held between two reads."""

    def __init__(self, pieces: Iterator[np.ndarray]) -> None:
        self._pieces = pieces
        self._piece: np.ndarray | None = None
        self._used = 0  # values of the held piece already read
        self._at = 0  # the next value to be read

    def read(self, lo: int, hi: int) -> np.ndarray:
        if lo != self._at:
            raise ValueError(f"read {lo}..{hi} out of order (next is {self._at})")
        parts: list[np.ndarray] = []
        need = hi - lo
        while need > 0:
            if self._piece is None or self._used == self._piece.size:
                # A producer may reuse its buffer for the next piece: what was read of this one is copied.
                parts = [np.array(part) for part in parts]
                self._piece, self._used = next(self._pieces).reshape(-1), 0
                continue
            take = min(need, self._piece.size - self._used)
            parts.append(self._piece[self._used:self._used + take])
            self._used += take
            need -= take
        if self._piece is not None and self._used == self._piece.size:
            self._piece = None  # consumed: dropped now, not at the next read
        self._at = hi
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float32)


class _BlockBuffer:
    """One float64 block, reused for every block of a tensor: a fresh 32 MiB accumulator per
    block would be fresh pages from the kernel each time, their first touch costing more than
    the arithmetic done in them."""

    def __init__(self, size: int) -> None:
        self._buffer = np.empty(min(size, MERGE_BLOCK_ELEMENTS), dtype=np.float64)

    def zeros(self, n: int) -> np.ndarray:
        block = self._buffer[:n]
        block.fill(0.0)
        return block


def _array_pieces(value: np.ndarray) -> Iterator[np.ndarray]:
    yield np.asarray(value).reshape(-1)


# One vector's values, a fresh stream each time it is read: the merge reads each contribution
# once per pass (RDA: its norm, its direction, the result), decoding it again rather than keep it.
VectorSource = Callable[[], _Stream]


def _blocks(size: int) -> Iterable[tuple[int, int]]:
    return ((lo, min(lo + MERGE_BLOCK_ELEMENTS, size)) for lo in range(0, size, MERGE_BLOCK_ELEMENTS))


def _array_source(v: np.ndarray) -> VectorSource:
    return lambda: _Stream(_array_pieces(v))


def rda(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-Directional Averaging of one tensor's outer gradients.

    (sum w|v| / sum w) * unit(sum w unit(v) / sum w), unit(0) = 0. Norms and sums in float64,
    result float32 in the input shape. One contribution with positive weight is returned as is
    (RDA of a single vector is that vector; returning it exactly avoids a float round trip).
    """
    w = _check_weights(vectors, weights)
    return _rda_fold([_array_source(v) for v in vectors], w, np.shape(vectors[0]))


def _copy_of(source: VectorSource, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, dtype=np.float32)
    flat, stream = out.reshape(-1), source()
    for lo, hi in _blocks(flat.size):
        flat[lo:hi] = stream.read(lo, hi)
    return out


def _rda_fold(sources: Sequence[VectorSource], w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """RDA with every vector read as a stream, three times (its norm; the direction and its norm;
    the result), so besides the float32 result only one block is in memory. Same operations, same
    order per value, same bits as the whole-array expressions."""
    positive = [i for i in range(len(w)) if w[i] > 0]
    if len(positive) == 1:
        return _copy_of(sources[positive[0]], shape)
    size = math.prod(shape)
    total = float(w.sum())
    radius = 0.0
    factors: list[tuple[int, float]] = []  # (vector, w / |v|) of the vectors with a direction
    for i in positive:
        n = math.sqrt(_sum_squares(sources[i]().read, 0, size))
        radius += w[i] * n
        if n > 0.0:
            factors.append((i, w[i] / n))
    radius /= total

    def direction() -> _Stream:
        streams = [(sources[i](), factor) for i, factor in factors]

        def pieces() -> Iterator[np.ndarray]:
            blocks = _BlockBuffer(size)
            for lo, hi in _blocks(size):
                acc = blocks.zeros(hi - lo)
                for stream, factor in streams:
                    _add_scaled64(acc, stream.read(lo, hi), factor)  # the bits of (w / n) * v
                acc /= total
                yield acc
        return _Stream(pieces())

    d_norm = math.sqrt(_sum_squares(direction().read, 0, size))
    if d_norm == 0.0:  # all zero, or directions cancel exactly: no direction to go
        return np.zeros(shape, dtype=np.float32)
    scale = radius / d_norm
    out = np.empty(shape, dtype=np.float32)
    flat, stream = out.reshape(-1), direction()
    for lo, hi in _blocks(size):
        block = stream.read(lo, hi)
        for part in _chunks(hi - lo):
            chunk = block[part]
            chunk *= scale  # the bits of (radius / d_norm) * direction
            flat[lo + part.start:lo + part.stop] = chunk
        del block, chunk
    return out


def weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """sum w v / sum w, accumulated in float64, returned float32."""
    w = _check_weights(vectors, weights)
    return _mean_fold([_array_source(v) for v in vectors], w, np.shape(vectors[0]))


def _mean_fold(sources: Sequence[VectorSource], w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The weighted mean, block by block across every vector: each vector read once, one float64
    block accumulator, the float32 result."""
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    total = float(w.sum())
    streams = [(sources[i](), w[i]) for i in range(len(w)) if w[i] > 0]
    blocks = _BlockBuffer(flat.size)
    for lo, hi in _blocks(flat.size):
        acc = blocks.zeros(hi - lo)
        for stream, wi in streams:
            _add_scaled64(acc, stream.read(lo, hi), wi)
        acc /= total
        flat[lo:hi] = acc
    return out


def support_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Per coordinate, the weighted mean over the contributions that sent it (nonzero there):
    sum w v / sum of w over those with v != 0, 0 where none did. For sparse contributions (top-k
    uplinks) a coordinate chosen by one learner keeps that learner's value instead of being shrunk
    by the learners that did not choose it; dense contributions give the weighted mean."""
    w = _check_weights(vectors, weights)
    return _support_mean_fold([_array_source(v) for v in vectors], w, np.shape(vectors[0]))


def _support_mean_fold(sources: Sequence[VectorSource], w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    out = np.empty(shape, dtype=np.float32)
    flat = out.reshape(-1)
    streams = [(sources[i](), w[i]) for i in range(len(w)) if w[i] > 0]
    acc_blocks, support_blocks = _BlockBuffer(flat.size), _BlockBuffer(flat.size)
    for lo, hi in _blocks(flat.size):
        acc, support = acc_blocks.zeros(hi - lo), support_blocks.zeros(hi - lo)
        for stream, wi in streams:
            v = stream.read(lo, hi)
            _add_scaled64(acc, v, wi)
            np.add(support, wi, out=support, where=v != 0)  # the bits of support += where(v != 0, w, 0)
            del v
        np.divide(acc, support, out=acc, where=support > 0)
        flat[lo:hi] = acc
    return out


@dataclass(frozen=True, slots=True)
class MergeResult:
    """The outcome of one round's merge, with a reason for every decision."""

    outer_gradient: dict[str, np.ndarray] | None  # None when nothing acceptable
    accepted: tuple[tuple[str, float], ...]  # (learner, weight), sorted by learner
    rejected: tuple[tuple[str, str], ...]  # (learner, reason)
    reason: str
    capped: tuple[tuple[str, str], ...] = ()  # (learner, what was capped): accepted at reduced weight
    # Round median of the learner-side delta norms of well-formed contributions (None if none):
    # feed it to NormReference.update so later rounds with 1-2 contributions have a reference.
    round_median_norm: float | None = None
    delta_norms: tuple[tuple[str, float], ...] = ()  # (learner, |delta|) of well-formed contributions


class NormReference:
    """A running reference for delta norms (EMA of round medians), one value per fragment.

    Kept by the syncer and passed to `merge_contributions`; `snapshot`/`restore` let a new syncer
    after failover or a restart carry it on. Updated from the median of every well-formed
    contribution of a round, accepted or not, so a genuine change of scale is followed within a few
    rounds instead of rejecting everyone forever (a liveness choice; see docs/MERGE.md). One
    update changes the reference by at most `max_step` times, so a rejected outlier cannot drag
    it far enough to pass on its next try.
    """

    def __init__(self, alpha: float = DEFAULT_NORM_REFERENCE_ALPHA,
                 max_step: float = DEFAULT_NORM_REFERENCE_MAX_STEP) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha = {alpha} must be in (0, 1]")
        if not (math.isfinite(max_step) and max_step > 1.0):
            raise ValueError(f"max_step = {max_step} must be a finite number > 1")
        self.alpha = alpha
        self.max_step = max_step
        self._values: dict[int, float] = {}

    def get(self, fragment: int) -> float | None:
        return self._values.get(fragment)

    def advanced(self, old: float | None, round_median_norm: float | None) -> float | None:
        """The reference after a round with this median, from `old` (None: none yet). Pure: the
        syncer computes it with the merge and stores it only when the round is adopted."""
        if round_median_norm is None or not math.isfinite(round_median_norm):
            return old
        if old is None:
            return round_median_norm
        new = old + self.alpha * (round_median_norm - old)
        if old > 0.0:  # a zero reference (all-zero deltas so far) has no scale to bound
            new = min(max(new, old / self.max_step), old * self.max_step)
        return new

    def update(self, fragment: int, round_median_norm: float | None) -> float | None:
        new = self.advanced(self._values.get(fragment), round_median_norm)
        if new is not None:
            self._values[fragment] = new
        return new

    def set(self, fragment: int, value: float) -> None:
        """Store a value `advanced` computed (finite and >= 0, as `restore` requires)."""
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"reference norm of fragment {fragment} = {value!r} must be finite and >= 0")
        self._values[fragment] = float(value)

    def snapshot(self) -> dict[int, float]:
        return dict(self._values)

    def restore(self, values: Mapping[int, float]) -> None:
        """Replace every value (all or nothing). A NaN, infinite or negative value is refused: it
        would switch the outlier check off for good (NaN never leaves an EMA)."""
        restored = {int(k): float(v) for k, v in values.items()}
        for fragment, value in sorted(restored.items()):
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"reference norm of fragment {fragment} = {value!r} must be finite and >= 0")
        self._values = restored


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _tokens_per_step_text(c_tokens: int, c_steps: int) -> str:
    try:
        return _fmt(c_tokens / c_steps)
    except OverflowError:  # a claim beyond the float range (Python ints are unbounded)
        return f"> {_fmt(sys.float_info.max)}"


@runtime_checkable
class PrevalidatedDelta(Protocol):
    """A delta whose tensors were checked when it arrived (a streamed contribution, kept encoded:
    wire.contribution_stream.EncodedDelta): its `shapes`, and `tensor_norms` measured then. Its
    values are finite float32 by construction, so the merge reads each tensor once, when merging."""

    shapes: Mapping[str, tuple[int, ...]]
    tensor_norms: Mapping[str, float]

    def decoded_chunks(self, name: str) -> Iterator[np.ndarray]:
        """Tensor `name`'s values in order, a decoded chunk (1-D float32) at a time."""
        ...


def _names_problem(c: Contribution, current: Mapping[str, np.ndarray]) -> str | None:
    names = set(c.delta)
    expected = set(current)
    if names == expected:
        return None
    missing = sorted(expected - names)
    extra = sorted(str(n) for n in names - expected)  # a peer's names need not even be strings
    parts = []
    if missing:
        parts.append("missing " + ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else ""))
    if extra:
        parts.append("unexpected " + ", ".join(extra[:3]) + (" ..." if len(extra) > 3 else ""))
    return "tensor names do not match the fragment: " + "; ".join(parts)


def _delta_norm(c: Contribution, current: Mapping[str, np.ndarray]) -> tuple[float | None, str | None]:
    """The delta's fragment-wide L2 norm (float64), or a reason naming what is wrong with it.

    Tensor by tensor: a plain mapping's tensors are checked (floating, exact shape, finite within
    float32) one at a time and dropped again; a prevalidated delta brings its shapes and norms.
    """
    why = _names_problem(c, current)
    if why is not None:
        return None, why
    norms = []
    if isinstance(c.delta, PrevalidatedDelta):
        for name in sorted(current):
            shape = tuple(np.shape(current[name]))
            if tuple(c.delta.shapes[name]) != shape:
                return None, f"{name} has shape {tuple(c.delta.shapes[name])}, expected {shape}"
            norms.append(float(c.delta.tensor_norms[name]))
    else:
        for name in sorted(current):
            arr, why = finite_float32(c.delta[name], name, np.shape(current[name]))
            if arr is None:
                return None, why
            norms.append(_norm64(arr))
    return math.sqrt(sum(n ** 2 for n in norms)), None


def _delta_pieces(c: Contribution, name: str) -> Iterator[np.ndarray]:
    """One tensor of an already validated delta, as float32 pieces in order: a streamed
    contribution's decoded chunks, or a plain array a block at a time."""
    if isinstance(c.delta, PrevalidatedDelta):
        yield from c.delta.decoded_chunks(name)
        return
    flat = np.asarray(c.delta[name]).reshape(-1)
    for lo, hi in _blocks(flat.size):
        with np.errstate(over="ignore"):  # _delta_norm accepted it: finite within float32
            yield np.asarray(flat[lo:hi], dtype=np.float32)


def _outer_source(c: Contribution, name: str, current: Mapping[str, np.ndarray],
                  base: Mapping[str, np.ndarray] | None, factor: float = 1.0) -> VectorSource:
    """Contribution c's outer gradient for one tensor, as a stream of blocks: its delta, rebased
    block by block when its base is older (the bits of `rebase`, which is elementwise), times
    `factor` (float32) unless that is 1 (sync.contribution_norm; 1 leaves the bits as they are)."""
    size = math.prod(np.shape(current[name]))
    scale = np.float32(factor) if factor != 1.0 else None

    def blocks() -> Iterator[np.ndarray]:
        delta = _Stream(_delta_pieces(c, name))
        if base is None:
            for lo, hi in _blocks(size):
                # A scaled copy, never in place: the values may be the contribution's own array.
                # No name keeps a block once yielded (two blocks held at once would double the peak).
                yield delta.read(lo, hi) if scale is None else np.multiply(delta.read(lo, hi), scale, dtype=np.float32)
            return
        now, then = np.asarray(current[name]).reshape(-1), np.asarray(base[name]).reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):  # non-finite rebases are rejected by name
            for lo, hi in _blocks(size):
                moved = np.subtract(now[lo:hi], then[lo:hi], dtype=np.float32)
                np.add(moved, delta.read(lo, hi), out=moved, dtype=np.float32)
                if scale is not None:
                    moved *= scale  # the rebase's own temporary
                yield moved
                del moved

    return lambda: _Stream(blocks())


def _outer_norm(c: Contribution, current: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]) -> float:
    """The fragment-wide L2 norm of c's outer gradient rebased from `base` (one more read of it)."""
    total = 0.0
    for name in sorted(current):
        total += _sum_squares(_outer_source(c, name, current, base)().read, 0, int(np.size(current[name])))
    return math.sqrt(total)


def _finite_source(source: VectorSource, size: int) -> bool:
    stream = source()
    return all(all_finite(stream.read(lo, hi)) for lo, hi in _blocks(size))


def merge_contributions(
    contributions: Sequence[Contribution],
    current: Mapping[str, np.ndarray],
    history: "FragmentHistory",
    *,
    method: str = "rda",
    weighting: str = "tokens",
    caps: ContributionCaps,
    embedding_names: Collection[str],
    norm_outlier_factor: float = DEFAULT_NORM_OUTLIER_FACTOR,
    reference_norm: float | None = None,
    contribution_norm: str = "none",
) -> MergeResult:
    """Rebase, validate, weigh and merge one fragment round's contributions.

    `current` is the syncer's current fragment (version `history.newest_round`), `history` holds
    older versions for rebasing. Contributions are processed in learner-name order so the result
    does not depend on arrival order; a second contribution from the same learner is rejected.
    Norm outliers are judged on the learner-side delta (before rebasing: the rebase term is the
    syncer's own, trusted data) against factor x the round median (when >= 3 contributions) and
    factor x `reference_norm` (the running reference, when known). `contribution_norm` "median"
    rescales each accepted outer gradient (rebased ones after rebasing) to the median norm of the
    accepted ones before merging (sync/contribution_norm.py).
    """
    if method not in MERGE_METHODS:
        raise ValueError(f"merge method {method!r}: must be one of {', '.join(MERGE_METHODS)}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting {weighting!r}: must be one of {', '.join(WEIGHTINGS)}")
    if contribution_norm not in CONTRIBUTION_NORMS:
        raise ValueError(f"contribution_norm {contribution_norm!r}: must be one of {', '.join(CONTRIBUTION_NORMS)}")
    if not norm_outlier_factor > 1.0:
        raise ValueError(f"norm_outlier_factor = {norm_outlier_factor} must be > 1")
    current_round = history.newest_round
    fragment = history.fragment

    rejected: list[tuple[str, str]] = []
    capped: list[tuple[str, str]] = []

    def reject(learner: str, why: str) -> None:
        rejected.append((learner, f"rejected learner {learner}: {why}"))

    # 1. per-contribution checks that need no other contribution
    candidates: list[tuple[Contribution, float, float]] = []  # (c, weight, |delta|)
    seen: set[str] = set()
    for c in sorted(contributions, key=lambda c: c.learner):  # stable: same-learner order kept
        if c.learner in seen:
            reject(c.learner, "duplicate contribution in this round")
            continue
        seen.add(c.learner)
        if c.fragment != fragment:
            reject(c.learner, f"contribution for fragment {c.fragment} in a round of fragment {fragment}")
            continue
        if c.base_round > current_round:
            reject(c.learner, f"base round {c.base_round} is ahead of the current round {current_round}")
            continue
        if c.base_round < 0:
            reject(c.learner, f"base round {c.base_round} is negative")
            continue
        try:
            weight = token_weight(c.c_tokens, c.c_steps, caps) if weighting == "tokens" else _uniform_weight(c)
        except ValueError as exc:
            reject(c.learner, str(exc))
            continue
        if weight <= 0.0:
            reject(c.learner, f"weight 0 (c_tokens = {c.c_tokens})")
            continue
        notes = []
        if c.c_steps > caps.max_steps:
            notes.append(f"c_steps {c.c_steps} capped at {caps.max_steps}")
        if _claims_more_tokens_per_step(c.c_tokens, c.c_steps, caps):
            notes.append(f"tokens/step {_tokens_per_step_text(c.c_tokens, c.c_steps)} capped at {caps.max_tokens_per_step}")
        if notes and weighting == "tokens":
            capped.append((c.learner, "; ".join(notes)))
        norm, why = _delta_norm(c, current)
        if norm is None:
            reject(c.learner, why or "invalid delta")
            continue
        candidates.append((c, weight, norm))

    # 2. norm outliers against the round median and the running reference
    norms = [n for _, _, n in candidates]
    round_median = float(np.median(norms)) if norms else None
    limits: list[tuple[float, str]] = []
    # A zero reference (e.g. most learners sent all-zero deltas) cannot define "too large".
    if round_median is not None and round_median > 0 and len(norms) >= MIN_CONTRIBUTIONS_FOR_ROUND_MEDIAN:
        limits.append((round_median, "the round median"))
    if reference_norm is not None and math.isfinite(reference_norm) and reference_norm > 0:
        # A change of scale the round itself shows is not an outlier: when at least 3 contributions
        # came and even the lower of their middle norms is past the limit, most of the round moved
        # together (an inner warm-up, Muon's first rounds), and the round median alone judges it.
        # The lower middle, not the median: two of four colluding outliers cannot lift it.
        lower_middle = sorted(norms)[(len(norms) - 1) // 2] if norms else 0.0
        scale_changed = (len(norms) >= MIN_CONTRIBUTIONS_FOR_ROUND_MEDIAN
                         and lower_middle > norm_outlier_factor * reference_norm)
        if not scale_changed:
            limits.append((reference_norm, "the running reference"))
    survivors: list[tuple[Contribution, float, float]] = []  # (c, weight, |delta|)
    for c, weight, n in candidates:
        over = [(ref, label) for ref, label in limits if n > norm_outlier_factor * ref]
        if over:
            ref, label = over[0]
            reject(c.learner, f"norm {_fmt(n)} is {n / ref:.1f}x {label} {_fmt(ref)} (limit {norm_outlier_factor:g}x)")
            continue
        survivors.append((c, weight, n))

    # 3. stale contributions: their base must still be in the history, and the rebased values finite.
    # Checked tensor by tensor before merging (the accepted set decides the weights); the merge
    # below rebases each tensor again rather than keeping K rebased fragments in memory.
    accepted_items: list[tuple[Contribution, Mapping[str, np.ndarray] | None, float]] = []  # (c, base, weight)
    outer_norms: list[float] = []  # |outer gradient| of each accepted item: its delta's, or its rebase's
    rebased_count = 0
    for c, weight, n in survivors:
        if c.base_round == current_round:
            accepted_items.append((c, None, weight))
            outer_norms.append(n)
            continue
        base = history.version(c.base_round)
        if base is None:
            reject(c.learner, f"base round {c.base_round} has been evicted (history keeps rounds "
                              f"{history.oldest_round}..{current_round})")
            continue
        if not all(_finite_source(_outer_source(c, name, current, base), int(np.size(current[name])))
                   for name in sorted(current)):
            reject(c.learner, f"non-finite values after rebasing from round {c.base_round}")
            continue
        accepted_items.append((c, base, weight))
        outer_norms.append(_outer_norm(c, current, base) if contribution_norm == "median" else n)
        rebased_count += 1

    delta_norms = tuple((c.learner, n) for c, _, n in candidates)
    rejected_sorted = tuple(sorted(rejected))
    total = len(contributions)
    if not accepted_items:
        if total == 0:
            reason = f"nothing to merge for fragment {fragment}: no contributions"
        else:
            reason = f"nothing to merge for fragment {fragment}: all {total} contribution(s) rejected"
        return MergeResult(None, (), rejected_sorted, reason, (), round_median, delta_norms)

    # 4. merge tensor by tensor, block by block across every contribution, each contribution's
    # values decoded (and rebased) a chunk at a time as they are folded in: besides the float32
    # result, one block's temporaries (`merge_block_bytes`)
    weights = np.asarray([w for _, _, w in accepted_items], dtype=np.float64)  # each finite and > 0 (step 1)
    factors = median_norm_factors(outer_norms) if contribution_norm == "median" else [1.0] * len(accepted_items)
    embeddings = set(embedding_names)
    outer: dict[str, np.ndarray] = {}
    for name in sorted(current):
        shape = tuple(np.shape(current[name]))
        sources = [_outer_source(c, name, current, base, f) for (c, base, _), f in zip(accepted_items, factors)]
        if method == "rda" and name not in embeddings:
            outer[name] = _rda_fold(sources, weights, shape)
        elif method == "support_mean":
            outer[name] = _support_mean_fold(sources, weights, shape)
        else:
            outer[name] = _mean_fold(sources, weights, shape)
    accepted = tuple((c.learner, w) for c, _, w in accepted_items)
    how = f"{method}, {'token-weighted' if weighting == 'tokens' else 'uniform weights'}"
    if contribution_norm == "median":
        how += f", each scaled to the median norm {_fmt(median_nonzero_norm(outer_norms))}"
    reason = (f"merged {len(accepted)} of {total} contribution(s) for fragment {fragment} at round {current_round} "
              f"({how}): " + ", ".join(f"{learner} w={_fmt(w)}" for learner, w in accepted))
    if rebased_count:
        reason += f"; {rebased_count} rebased from older rounds"
    if rejected_sorted:
        reason += "; rejected " + ", ".join(learner for learner, _ in rejected_sorted)
    accepted_names = {learner for learner, _ in accepted}
    capped_accepted = tuple(item for item in capped if item[0] in accepted_names)
    if capped_accepted:
        reason += "; capped " + ", ".join(learner for learner, _ in capped_accepted)
    return MergeResult(outer, accepted, rejected_sorted, reason, capped_accepted, round_median, delta_norms)


def _uniform_weight(c: Contribution) -> float:
    if c.c_steps <= 0:
        raise ValueError(f"c_steps = {c.c_steps}: no inner steps since its base")
    return 1.0
