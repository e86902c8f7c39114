"""The replicated global model: per fragment its parameters Theta_p, Nesterov buffer and round.

Every replica applies the same committed outer gradients in the same order with the same
elementwise float32 arithmetic (`outer.nesterov_step`, with the lr and momentum the schedule gives
the round: `outer_schedule.py`), so replicas stay bit-identical; the BLAKE3
digests prove it (layout: state_codec.py). A bounded history of past versions per fragment lets the syncer rebase
contributions made against an older round: `FragmentHistory` keeps it in memory (the default,
what the in-process runner and the tests use); the daemon injects a ring on disk
(`daemon/history_ring.py`) through `use_history`, so the history costs no memory per version. `fragment_state`/`install` hand fragments out and take
them in as `state_codec.FragmentState` values: the one form behind checkpoints, state downloads and
the digest's tensor names.

Pure: no I/O, no clock. Invalid input raises `GlobalStateError` before anything is changed.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from diloco_node.config.manifest import OuterOptimizer
from diloco_node.sync.fragments import FragmentPlan
from diloco_node.sync.outer import finite_float32, nesterov_chunks
from diloco_node.sync.outer_schedule import check_schedule, outer_step_values
from diloco_node.sync.state_codec import (
    MOMENTUM,
    PARAMS,
    FragmentState,
    digest_start,
    fragment_state_digest,
    hash_tensor_header,
)
from wire import digest as content_digest

# How many versions of each fragment (current included) are kept for rebasing. A contribution is
# made against the version its learner last applied; with one fragment round per period H and
# overlap tau << H, honest learners are at most a round or two behind. 8 covers learners that
# missed a few merges; kept in memory that is 7 copies of the model beside the current one, which
# is why the daemon keeps them on disk (daemon/history_ring.py).
DEFAULT_HISTORY_LEN = 8
# Rounds are hashed as signed 64-bit integers (see the digest layout in docs/MERGE.md); a larger one
# from a serialized state would get into the state and make every later digest fail.
MAX_ROUND = 2**63 - 1
_DTYPE = np.dtype("<f4")  # the one dtype of the global state, little-endian so digests agree everywhere


class GlobalStateError(ValueError):
    """An outer gradient, installed state or request does not fit the global state; nothing was changed."""


class VersionHistory(Protocol):
    """What the global state and the merge need from one fragment's history of versions.

    `record` is handed the fragment's new current arrays, which the global state never changes
    in place (every step makes new arrays), so a history may keep them by reference.
    """

    fragment: int
    capacity: int

    def record(self, round_: int, params: Mapping[str, np.ndarray]) -> None: ...

    def version(self, round_: int) -> Mapping[str, np.ndarray] | None: ...

    @property
    def newest_round(self) -> int: ...

    @property
    def oldest_round(self) -> int: ...

    def rounds(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...


# (fragment, capacity) -> an empty history for it.
HistoryFactory = Callable[[int, int], VersionHistory]


class FragmentHistory:
    """A bounded ring of one fragment's past parameter versions in memory, by round (newest = current).

    Stored arrays are read-only, so `version` can hand them out without copying; the current
    version is the global state's own arrays (frozen, not copied), so only older versions cost memory.
    """

    def __init__(self, fragment: int, capacity: int = DEFAULT_HISTORY_LEN) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity {capacity} must be >= 1")
        self.fragment = fragment
        self.capacity = capacity
        self._versions: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()

    def record(self, round_: int, params: Mapping[str, np.ndarray]) -> None:
        """Add the version of `round_` (must be newer than every kept one); evicts the oldest."""
        if self._versions and round_ <= self.newest_round:
            raise ValueError(f"fragment {self.fragment}: round {round_} is not newer than {self.newest_round}")
        frozen = {name: _frozen(arr) for name, arr in params.items()}
        self._versions[round_] = frozen
        while len(self._versions) > self.capacity:
            self._versions.popitem(last=False)

    def version(self, round_: int) -> Mapping[str, np.ndarray] | None:
        """The fragment's parameters at `round_` (read-only arrays), or None if evicted/unknown."""
        return self._versions.get(round_)

    @property
    def newest_round(self) -> int:
        if not self._versions:
            raise LookupError(f"fragment {self.fragment}: history is empty")
        return next(reversed(self._versions))

    @property
    def oldest_round(self) -> int:
        if not self._versions:
            raise LookupError(f"fragment {self.fragment}: history is empty")
        return next(iter(self._versions))

    def rounds(self) -> tuple[int, ...]:
        return tuple(self._versions)

    def __len__(self) -> int:
        return len(self._versions)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckedFragment:
    """A fragment state `GlobalState.check_fragment` validated (own float32 copies) and hashed."""

    fragment: int
    round: int
    params: dict[str, np.ndarray]
    momentum: dict[str, np.ndarray]
    history: dict[int, dict[str, np.ndarray]]
    digest: str


class GlobalState:
    """Theta_p, Nesterov buffer and round for every fragment of a plan; digests over exact bytes."""

    def __init__(
        self,
        plan: FragmentPlan,
        initial_params: Mapping[str, np.ndarray],
        outer: OuterOptimizer,
        history_len: int = DEFAULT_HISTORY_LEN,
        history_factory: HistoryFactory | None = None,
        *,
        adopt_initial: bool = False,
    ) -> None:
        """`adopt_initial`: the caller hands over `initial_params` (float32 arrays nobody else
        writes): they are kept and frozen, not copied, so founding a state costs one model, not two.
        `outer` gives each step's lr and momentum by the round it produces (`sync/outer_schedule.py`);
        ConfigError if its schedule needs a horizon it does not know."""
        check_schedule(outer)
        self.plan = plan
        self.outer = outer
        self.history_len = history_len
        self._history_factory: HistoryFactory = history_factory or FragmentHistory
        params = _validated_tensors(plan, initial_params, "initial parameters", copy=not adopt_initial)
        self._params: list[dict[str, np.ndarray]] = []
        self._momentum: list[dict[str, np.ndarray]] = []
        self._rounds: list[int] = []
        self._histories: list[VersionHistory] = []
        self._reset_memos()
        for fragment in plan.fragments:
            p_params = {n: _freeze_own(params[n]) for n in fragment.names}
            self._params.append(p_params)
            self._momentum.append({n: _freeze_own(np.zeros_like(a)) for n, a in p_params.items()})
            self._rounds.append(0)
            history = self._history_factory(fragment.index, history_len)
            history.record(0, p_params)
            self._histories.append(history)

    def _reset_memos(self) -> None:
        """Per fragment: a version that every change of its arrays or round bumps, and the digest
        and finiteness last computed with the version they saw. The arrays are read-only and only
        ever replaced, so a memo of the current version is the value recomputing would give; at
        1B parameters recomputing costs seconds a pass, and the status page and every apply's
        history line ask for the whole state's digest."""
        self._versions: list[int] = [0] * self.plan.num_fragments
        self._digest_memo: list[tuple[int, str] | None] = [None] * self.plan.num_fragments
        self._finite_memo: list[tuple[int, bool] | None] = [None] * self.plan.num_fragments

    def _changed(self, p: int) -> None:
        self._versions[p] += 1

    def use_history(self, factory: HistoryFactory) -> None:
        """Keep every fragment's history in histories made by `factory` from now on (e.g. on disk).

        The versions kept so far move over, oldest first, so nothing a stale contribution may
        need is lost.
        """
        rings = []
        for p, old in enumerate(self._histories):
            ring = factory(p, self.history_len)
            for r in old.rounds():
                version = old.version(r)
                assert version is not None
                ring.record(r, version)
            rings.append(ring)
        self._history_factory = factory
        self._histories = rings

    # --- reading -----------------------------------------------------------------------------

    @property
    def num_fragments(self) -> int:
        return self.plan.num_fragments

    def _shapes(self, p: int) -> dict[str, tuple[int, ...]]:
        return {n: a.shape for n, a in self._params[p].items()}

    def _check_index(self, p: int) -> None:
        if not 0 <= p < self.plan.num_fragments:
            raise GlobalStateError(f"fragment {p} out of range 0..{self.plan.num_fragments - 1}")

    def fragment_params(self, p: int, *, copies: bool = True) -> dict[str, np.ndarray]:
        """Fragment p's current parameters: copies, or (`copies=False`) the state's own read-only
        arrays, which a step replaces and never changes (what the learner keeps as its base)."""
        self._check_index(p)
        if not copies:
            return dict(self._params[p])
        return {n: a.copy() for n, a in self._params[p].items()}

    def momentum(self, p: int) -> dict[str, np.ndarray]:
        """Copies of fragment p's Nesterov buffer."""
        self._check_index(p)
        return {n: a.copy() for n, a in self._momentum[p].items()}

    def all_params(self, *, copies: bool = True) -> dict[str, np.ndarray]:
        """The whole global model as one flat dict (e.g. to evaluate it): copies, or (`copies=False`)
        the state's own read-only arrays, which a step replaces and never changes."""
        return {n: a.copy() if copies else a for params in self._params for n, a in params.items()}

    def round(self, p: int) -> int:
        self._check_index(p)
        return self._rounds[p]

    def rounds(self) -> tuple[int, ...]:
        return tuple(self._rounds)

    def history(self, p: int) -> VersionHistory:
        self._check_index(p)
        return self._histories[p]

    def is_finite(self) -> bool:
        return all(self._fragment_finite(p) for p in range(self.num_fragments))

    def _fragment_finite(self, p: int) -> bool:
        version = self._versions[p]
        memo = self._finite_memo[p]
        if memo is not None and memo[0] == version:
            return memo[1]
        finite = all(bool(np.all(np.isfinite(a))) for group in (self._params[p], self._momentum[p])
                     for a in group.values())
        if self._versions[p] == version:  # not replaced meanwhile (another thread may step it)
            self._finite_memo[p] = (version, finite)
        return finite

    # --- the one transition ------------------------------------------------------------------

    def step_values(self, p: int) -> tuple[float, float]:
        """(lr, momentum) of fragment p's next outer step: the schedule's at the round it will produce."""
        self._check_index(p)
        return outer_step_values(self.outer, self._rounds[p] + 1)

    def apply_outer_gradient(self, p: int, outer_gradient: Mapping[str, np.ndarray]) -> str:
        """One Nesterov step on fragment p, with the schedule's lr and momentum at the round it
        produces (`step_values`); its round += 1. Returns the fragment's new digest.

        Refuses (GlobalStateError, state untouched) a gradient with wrong names, shapes or
        non-finite values, and a step whose result would not be finite.
        """
        self._check_index(p)
        new_params, new_momentum = self._stepped(p, self._params[p], self._momentum[p], outer_gradient,
                                                 self._rounds[p] + 1)
        self._params[p] = new_params
        self._momentum[p] = new_momentum
        self._rounds[p] += 1
        self._changed(p)
        self._histories[p].record(self._rounds[p], new_params)
        return self.fragment_digest(p)

    def digest_after(self, p: int, outer_gradient: Mapping[str, np.ndarray]) -> str:
        """The digest fragment p would have after `apply_outer_gradient` (state untouched).

        Streamed: the step is computed a chunk at a time and hashed as it goes (the lease holder's
        preview costs no copy of the fragment). Raises like the step itself.
        """
        self._check_index(p)
        # One read of each: an apply on another thread replaces these, never changes them.
        params, momentum, round_ = self._params[p], self._momentum[p], self._rounds[p]
        grads = self._checked_gradient(p, outer_gradient)
        lr, mu = outer_step_values(self.outer, round_ + 1)
        h = digest_start(p, round_ + 1)
        # The digest's order: every "momentum/<name>" tensor, then every "params/<name>" one, each
        # in name order. The first pass also checks both results of every tensor, in the order
        # `_stepped` does, so a step that would not be finite is refused with the same reason.
        for name in sorted(grads):
            hash_tensor_header(h, f"{MOMENTUM}/{name}", params[name].shape)
            for _, theta, buf in nesterov_chunks(params[name], momentum[name], grads[name], lr, mu):
                if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(buf))):
                    raise GlobalStateError(f"outer step on fragment {p} would make {name} non-finite; not applied")
                h.update(np.ascontiguousarray(buf, dtype=_DTYPE).view(np.uint8))
        for name in sorted(grads):
            hash_tensor_header(h, f"{PARAMS}/{name}", params[name].shape)
            for _, theta, _ in nesterov_chunks(params[name], momentum[name], grads[name], lr, mu):
                h.update(np.ascontiguousarray(theta, dtype=_DTYPE).view(np.uint8))
        return h.hexdigest()

    def _checked_gradient(self, p: int, outer_gradient: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Only read by the step: checked, not copied (a copy of the fragment less at every apply).
        return _validated_fragment_tensors(self._shapes(p), outer_gradient, f"outer gradient for fragment {p}",
                                           copy=False)

    def _stepped(self, p: int, params: Mapping[str, np.ndarray], momentum: Mapping[str, np.ndarray],
                 outer_gradient: Mapping[str, np.ndarray], round_: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """New (params, momentum) of fragment p after the Nesterov step that produces `round_`;
        GlobalStateError if invalid.

        Written chunk by chunk into the new arrays: the step's temporaries are one chunk's."""
        grads = self._checked_gradient(p, outer_gradient)
        lr, mu = outer_step_values(self.outer, round_)
        new_params: dict[str, np.ndarray] = {}
        new_momentum: dict[str, np.ndarray] = {}
        for name in sorted(grads):
            shape = params[name].shape
            theta_out, buf_out = np.empty(shape, dtype=_DTYPE), np.empty(shape, dtype=_DTYPE)
            flat_theta, flat_buf = theta_out.reshape(-1), buf_out.reshape(-1)
            for part, theta, buf in nesterov_chunks(params[name], momentum[name], grads[name], lr, mu):
                if not (np.all(np.isfinite(theta)) and np.all(np.isfinite(buf))):
                    raise GlobalStateError(f"outer step on fragment {p} would make {name} non-finite; not applied")
                flat_theta[part] = theta
                flat_buf[part] = buf
            new_params[name] = _freeze_own(theta_out)
            new_momentum[name] = _freeze_own(buf_out)
        return new_params, new_momentum

    # --- digests -----------------------------------------------------------------------------

    def fragment_digest(self, p: int) -> str:
        """BLAKE3 over the fragment index, its round, then each tensor in sorted name order.

        Tensors are "params/<name>" and "momentum/<name>"; each contributes its name, dtype,
        shape and raw little-endian float32 bytes, every field length-prefixed (exact layout in
        docs/MERGE.md) so different splits of the same bytes cannot collide.
        """
        self._check_index(p)
        version = self._versions[p]
        memo = self._digest_memo[p]
        if memo is not None and memo[0] == version:
            return memo[1]
        digest = fragment_state_digest(p, self._rounds[p], self._params[p], self._momentum[p])
        if self._versions[p] == version:  # not replaced meanwhile (another thread may step it)
            self._digest_memo[p] = (version, digest)
        return digest

    def digest(self) -> str:
        """BLAKE3 over the number of fragments and every fragment digest in index order."""
        h = content_digest.hasher(b"diloco-global-state\0")
        h.update(struct.pack("<q", self.num_fragments))
        for p in range(self.num_fragments):
            h.update(bytes.fromhex(self.fragment_digest(p)))
        return h.hexdigest()

    # --- serialization (names and forms: state_codec.py) -----------------------------------

    def fragment_state(self, p: int, include_history: bool = False, *, copies: bool = True) -> FragmentState:
        """Fragment p as a `FragmentState` (without the norm reference: the replica's).

        History (older versions for rebasing) is optional: a syncer's state wants it, a joiner does
        not need it (contributions against evicted rounds are rejected by reason). `copies=False`
        hands out the state's own read-only arrays (a step makes new ones, so they stay as of
        now): what a checkpoint or a serialization wants, without a copy of the model.
        """
        self._check_index(p)
        history: dict[int, dict[str, np.ndarray]] = {}
        if include_history:
            ring = self._histories[p]
            history = {r: {n: a.copy() for n, a in ring.version(r).items()}  # type: ignore[union-attr]
                       for r in ring.rounds() if r != self._rounds[p]}
        if not copies:
            return FragmentState(p, self._rounds[p], dict(self._params[p]), dict(self._momentum[p]), history)
        return FragmentState(p, self._rounds[p], self.fragment_params(p), self.momentum(p), history)

    def fragment_states(self, include_history: bool = False) -> list[FragmentState]:
        """`fragment_state` of every fragment, in index order."""
        return [self.fragment_state(p, include_history) for p in range(self.num_fragments)]

    def install_fragment(self, state: FragmentState, expected_digest: str | None = None) -> str:
        """Replace one fragment; checks everything (and the digest if given) before changing
        anything. Returns the fragment digest."""
        return self.install_checked(self.check_fragment(state, expected_digest))

    def check_fragment(self, state: FragmentState, expected_digest: str | None = None, *,
                       adopt: bool = False, digest: str | None = None) -> CheckedFragment:
        """`install_fragment`'s checks and digest, changing nothing: the slow half (copies, a
        finiteness scan and a hash of the fragment), safe to run in a worker thread. `adopt`:
        the caller hands over `state`'s arrays (just decoded, nobody else's): kept, not copied.
        `digest`: the state digest this node computed of these very arrays while it decoded them
        (state_codec `FragmentAssembler.state_digest`), so they are not hashed a second time."""
        p, round_, params, momentum, history = self._validated_state(state, copy=not adopt)
        if digest is None:
            digest = fragment_state_digest(p, round_, params, momentum)
        if expected_digest is not None and digest != expected_digest:
            raise GlobalStateError(f"fragment {p} state digest {digest[:12]} != expected {expected_digest[:12]}")
        return CheckedFragment(p, round_, params, momentum, history, digest)

    def install_checked(self, checked: CheckedFragment) -> str:
        """Install what `check_fragment` checked (the quick half); returns the fragment digest."""
        self._install(checked.fragment, checked.round, checked.params, checked.momentum, checked.history)
        self._digest_memo[checked.fragment] = (self._versions[checked.fragment], checked.digest)
        return checked.digest

    def install(self, states: Sequence[FragmentState], expected_digest: str | None = None) -> str:
        """Replace the whole state, one `FragmentState` per fragment; all-or-nothing. Returns digest()."""
        if len(states) != self.num_fragments:
            raise GlobalStateError(f"state: expected {self.num_fragments} fragments, got {len(states)}")
        parsed = [self._validated_state(s) for s in states]
        if sorted(item[0] for item in parsed) != list(range(self.num_fragments)):
            raise GlobalStateError("state: fragment indexes must be 0..P-1, each once")
        if expected_digest is not None:
            trial = self._copy_with(parsed)
            if trial.digest() != expected_digest:
                raise GlobalStateError(f"state digest {trial.digest()[:12]} != expected {expected_digest[:12]}")
        for item in parsed:
            self._install(*item)
        return self.digest()

    def _copy_with(self, parsed: list[tuple]) -> GlobalState:
        clone = GlobalState.__new__(GlobalState)
        clone.plan, clone.outer, clone.history_len = self.plan, self.outer, self.history_len
        clone._history_factory = self._history_factory
        clone._params = list(self._params)
        clone._momentum = list(self._momentum)
        clone._rounds = list(self._rounds)
        clone._histories = list(self._histories)
        clone._reset_memos()
        for p, round_, params, momentum, _ in parsed:
            clone._params[p], clone._momentum[p], clone._rounds[p] = params, momentum, round_
        return clone

    def _validated_state(self, state: Any, copy: bool = True) -> tuple:
        """(p, round, params, momentum, history) as own float32 copies (`copy=False`: the state's
        own float32 arrays, for a caller that hands them over), or GlobalStateError."""
        if not isinstance(state, FragmentState):
            raise GlobalStateError(f"expected a FragmentState, got {type(state).__name__}")
        p = state.fragment
        if not isinstance(p, (int, np.integer)) or isinstance(p, bool):
            raise GlobalStateError("fragment state: 'fragment' must be an integer")
        p = int(p)
        self._check_index(p)
        round_ = state.round
        if not isinstance(round_, (int, np.integer)) or isinstance(round_, bool) or not 0 <= round_ <= MAX_ROUND:
            raise GlobalStateError(f"fragment {p} state: 'round' must be an integer in [0, {MAX_ROUND}]")
        round_ = int(round_)
        params = _validated_fragment_tensors(self._shapes(p), state.params, f"fragment {p} state params", copy)
        momentum = _validated_fragment_tensors(self._shapes(p), state.momentum, f"fragment {p} state momentum", copy)
        if not isinstance(state.history, Mapping):
            raise GlobalStateError(f"fragment {p} state: 'history' must be a mapping of round -> params")
        history: dict[int, dict[str, np.ndarray]] = {}
        for r, version in state.history.items():
            if not isinstance(r, (int, np.integer)) or isinstance(r, bool) or not 0 <= int(r) < round_:
                raise GlobalStateError(f"fragment {p} state: history round {r!r} must be in [0, {round_})")
            history[int(r)] = _validated_fragment_tensors(self._shapes(p), version, f"fragment {p} history round {r}")
        return p, round_, params, momentum, history

    def _install(self, p: int, round_: int, params: dict, momentum: dict, history: dict) -> None:
        params = {n: _freeze_own(a) for n, a in params.items()}
        momentum = {n: _freeze_own(a) for n, a in momentum.items()}
        self._params[p] = params
        self._momentum[p] = momentum
        self._rounds[p] = round_
        self._changed(p)
        ring = self._history_factory(p, self.history_len)
        for r in sorted(history):  # the ring keeps the newest history_len versions
            ring.record(r, history[r])
        ring.record(round_, params)
        self._histories[p] = ring


def _frozen(arr: Any) -> np.ndarray:
    """A read-only float32 array with `arr`'s values: `arr` itself when it already is one, else a
    frozen copy (a caller's writable array is never frozen under its feet)."""
    if isinstance(arr, np.ndarray) and arr.dtype == _DTYPE and not arr.flags.writeable:
        return arr
    copy = np.array(arr, dtype=_DTYPE, copy=True)
    copy.setflags(write=False)
    return copy


def _freeze_own(arr: np.ndarray) -> np.ndarray:
    """Freeze an array this module just made (nobody else holds it): no copy. The current
    versions are shared with the history, so nobody may change them in place."""
    arr.setflags(write=False)
    return arr


def _validated_tensors(plan: FragmentPlan, tensors: Any, what: str, copy: bool = True) -> dict[str, np.ndarray]:
    """Exactly the plan's tensors, finite, as float32: own copies, or (`copy=False`, for arrays the
    caller hands over) the caller's own float32 arrays; GlobalStateError otherwise."""
    if not isinstance(tensors, Mapping):
        raise GlobalStateError(f"{what}: expected a mapping of name -> array")
    expected = set(plan.names)
    _check_names(set(tensors), expected, what)
    return {n: _validated_array(tensors[n], n, None, what, copy) for n in sorted(expected)}


def _validated_fragment_tensors(shapes: Mapping[str, tuple[int, ...]], tensors: Any, what: str,
                                copy: bool = True) -> dict[str, np.ndarray]:
    """Exactly the fragment's tensors with the given shapes, finite, as float32: own copies, or
    (`copy=False`, for input that is only read) possibly the caller's arrays."""
    if not isinstance(tensors, Mapping):
        raise GlobalStateError(f"{what}: expected a mapping of name -> array")
    _check_names(set(tensors), set(shapes), what)
    return {n: _validated_array(tensors[n], n, shapes[n], what, copy) for n in sorted(shapes)}


def _check_names(got: set, expected: set, what: str) -> None:
    if got != expected:
        missing = sorted(expected - got)[:3]
        extra = sorted(str(n) for n in got - expected)[:3]
        raise GlobalStateError(f"{what}: tensor names differ (missing {missing}, unexpected {extra})")


def _validated_array(value: Any, name: str, shape: tuple | None, what: str, copy: bool = True) -> np.ndarray:
    arr, why = finite_float32(value, name, shape)
    if arr is None:
        raise GlobalStateError(f"{what}: {why}")
    return np.array(arr, dtype=_DTYPE, copy=True) if copy else np.asarray(arr, dtype=_DTYPE)
