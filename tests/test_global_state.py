"""GlobalState: Nesterov per fragment, rounds, bounded history, bit-identical replicas, digests,
fragment states out and installed back (all-or-nothing, verified by digest)."""

from __future__ import annotations

import dataclasses
import struct

import blake3
import numpy as np
import pytest

from diloco_node.config.manifest import OuterOptimizer
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import FragmentHistory, GlobalState, GlobalStateError
from diloco_node.sync import outer as outer_module
from diloco_node.sync.outer import nesterov_step

SHAPES = {
    "embed/embedding": (16, 4),
    "blocks/0/w": (4, 4),
    "blocks/0/b": (4,),
    "head/kernel": (4, 16),
}
OUTER = OuterOptimizer(lr=0.7, momentum=0.9, momentum_warmup_rounds=0)  # the constant Nesterov step


def _init(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _state(history_len: int = 4) -> GlobalState:
    return GlobalState(plan_fragments(SHAPES, 3, 6, 1), _init(), OUTER, history_len=history_len)


def _grad(state: GlobalState, p: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 + seed)
    return {n: (0.1 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in state.fragment_params(p).items()}


def test_apply_outer_gradient_is_a_nesterov_step_on_one_fragment() -> None:
    state = _state()
    before = state.fragment_params(1)
    others = {p: state.fragment_digest(p) for p in (0, 2)}
    grad = _grad(state, 1, 0)
    digest = state.apply_outer_gradient(1, grad)
    assert digest == state.fragment_digest(1)
    assert state.rounds() == (0, 1, 0)
    for name, theta in state.fragment_params(1).items():
        expected, _ = nesterov_step(before[name], np.zeros_like(before[name]), grad[name], OUTER.lr, OUTER.momentum)
        assert theta.tobytes() == expected.tobytes()
        assert np.array_equal(state.momentum(1)[name], grad[name])
    assert {p: state.fragment_digest(p) for p in (0, 2)} == others


def test_two_replicas_applying_the_same_gradients_are_bit_identical() -> None:
    a, b = _state(), _state()
    for i in range(10):
        p = i % 3
        grad = _grad(a, p, i)
        assert a.apply_outer_gradient(p, grad) == b.apply_outer_gradient(p, {n: g.copy() for n, g in grad.items()})
    assert a.digest() == b.digest()
    assert all(a.all_params()[n].tobytes() == b.all_params()[n].tobytes() for n in SHAPES)


def test_digest_changes_with_one_bit_round_or_momentum() -> None:
    a, b = _state(), _state()
    assert a.digest() == b.digest()
    frag = b.fragment_state(2)
    name = sorted(frag.params)[0]
    flipped = frag.params[name].copy()
    flipped.view(np.uint32)[0] ^= 1  # one bit of one float
    b.install_fragment(dataclasses.replace(frag, params={**frag.params, name: flipped}))
    assert a.fragment_digest(2) != b.fragment_digest(2) and a.digest() != b.digest()
    c = _state()
    c.install_fragment(dataclasses.replace(c.fragment_state(2), round=7))
    assert c.fragment_digest(2) != a.fragment_digest(2)
    d = _state()
    mom = d.momentum(2)
    d.install_fragment(dataclasses.replace(d.fragment_state(2), momentum={n: m + 1 for n, m in mom.items()}))
    assert d.fragment_digest(2) != a.fragment_digest(2)


def test_fragment_digest_layout_is_the_documented_one() -> None:
    """docs/MERGE.md describes the digest so another implementation can reproduce it (BLAKE3)."""
    state = _state()
    p = 0
    h = blake3.blake3(b"diloco-fragment\0")
    h.update(struct.pack("<qq", p, 0))
    items = [(f"params/{n}", a) for n, a in state.fragment_params(p).items()]
    items += [(f"momentum/{n}", a) for n, a in state.momentum(p).items()]
    for name, arr in sorted(items, key=lambda x: x[0]):
        for field in (name.encode(), b"<f4"):
            h.update(struct.pack("<q", len(field)) + field)
        h.update(struct.pack("<q", arr.ndim) + struct.pack(f"<{arr.ndim}q", *arr.shape))
        raw = arr.astype("<f4").tobytes()
        h.update(struct.pack("<q", len(raw)) + raw)
    assert state.fragment_digest(p) == h.hexdigest()


def test_initial_parameters_are_copied_unless_handed_over() -> None:
    plan = plan_fragments(SHAPES, 3, 6, 1)
    initial = _init()
    copied = GlobalState(plan, initial, OUTER)
    assert not any(np.shares_memory(a, initial[n])
                   for p in range(3) for n, a in copied.fragment_params(p, copies=False).items())
    initial["blocks/0/b"][0] += 1.0  # the caller's arrays are still its own
    adopted = GlobalState(plan, initial, OUTER, adopt_initial=True)
    for p in range(3):
        for name, value in adopted.fragment_params(p, copies=False).items():
            assert np.shares_memory(value, initial[name])  # kept, not copied: no second model
            assert not initial[name].flags.writeable  # and frozen: nobody changes the state in place
    assert adopted.digest() != copied.digest()  # the one changed value is in the adopted state


def test_digests_and_finiteness_are_remembered_per_fragment_until_it_changes(monkeypatch) -> None:
    from diloco_node.sync import global_state as module

    hashed: list[int] = []
    real = module.fragment_state_digest
    monkeypatch.setattr(module, "fragment_state_digest", lambda p, *rest: hashed.append(p) or real(p, *rest))
    state, twin = _state(), _state()
    first = state.digest()
    assert sorted(hashed) == [0, 1, 2]
    assert state.digest() == first and len(hashed) == 3  # nothing changed: nothing hashed again
    hashed.clear()
    state.apply_outer_gradient(1, _grad(state, 1, 0))  # hashes fragment 1 once, for its return value
    after = state.digest()
    assert hashed == [1] and after != first
    twin.apply_outer_gradient(1, _grad(twin, 1, 0))
    assert twin.digest() == after  # the same transition, every fragment hashed from scratch
    hashed.clear()
    state.install_fragment(twin.fragment_state(2))  # a change: hashed once, to check it, and remembered
    assert state.digest() == after and hashed == [2]
    assert state.is_finite()
    monkeypatch.setattr(module.np, "isfinite", lambda a: (_ for _ in ()).throw(AssertionError("rescanned")))
    assert state.is_finite()  # remembered: no fragment changed since the last check


def test_history_keeps_the_newest_versions_for_rebasing() -> None:
    state = _state(history_len=3)
    versions = [state.fragment_params(0)]
    for i in range(4):
        state.apply_outer_gradient(0, _grad(state, 0, i))
        versions.append(state.fragment_params(0))
    history = state.history(0)
    assert history.rounds() == (2, 3, 4) and history.oldest_round == 2 and history.newest_round == 4
    assert history.version(1) is None
    for r in (2, 3, 4):
        assert all(np.array_equal(history.version(r)[n], versions[r][n]) for n in versions[r])
    with pytest.raises(ValueError, match="read-only"):
        history.version(4)[sorted(versions[4])[0]][...] = 0


def test_history_refuses_out_of_order_rounds() -> None:
    history = FragmentHistory(fragment=5, capacity=2)
    history.record(3, {"x": np.zeros(2)})
    with pytest.raises(ValueError, match="fragment 5: round 3 is not newer than 3"):
        history.record(3, {"x": np.zeros(2)})
    with pytest.raises(LookupError, match="history is empty"):
        FragmentHistory(0).newest_round


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda g: {k: v for k, v in list(g.items())[1:]}, "tensor names differ"),
        (lambda g: {**g, "extra": np.zeros(1, np.float32)}, "unexpected \\['extra'\\]"),
        (lambda g: {k: (np.full_like(v, np.nan) if i == 0 else v) for i, (k, v) in enumerate(g.items())}, "non-finite values in"),
        (lambda g: {k: (v[..., :1] if i == 0 else v) for i, (k, v) in enumerate(g.items())}, "has shape"),
        (lambda g: {k: v.astype(np.int32) for k, v in g.items()}, "has dtype int32"),
        (lambda g: {k: np.full_like(v, 3e38) for k, v in g.items()}, "would make .* non-finite; not applied"),
    ],
)
def test_bad_outer_gradients_are_refused_and_change_nothing(mutate, message) -> None:
    state = _state()
    before = state.digest()
    with pytest.raises(GlobalStateError, match=message):
        state.apply_outer_gradient(1, mutate(_grad(state, 1, 0)))
    assert state.digest() == before and state.rounds() == (0, 0, 0) and state.is_finite()


def test_constructor_refuses_missing_tensors_and_bad_fragment_index() -> None:
    init = _init()
    del init["head/kernel"]
    with pytest.raises(GlobalStateError, match="initial parameters: tensor names differ \\(missing \\['head/kernel'\\]"):
        GlobalState(plan_fragments(SHAPES, 3, 6, 1), init, OUTER)
    with pytest.raises(GlobalStateError, match="fragment 3 out of range 0..2"):
        _state().round(3)


def test_fragment_states_install_round_trip_with_history() -> None:
    source = _state()
    for i in range(5):
        source.apply_outer_gradient(i % 3, _grad(source, i % 3, i))
    states = source.fragment_states(include_history=True)
    assert [s.round for s in states] == [2, 2, 1]
    target = _state()
    assert target.install(states, expected_digest=source.digest()) == source.digest()
    assert target.rounds() == source.rounds()
    assert target.history(0).rounds() == source.history(0).rounds() == (0, 1, 2)
    # both continue identically, including the Nesterov buffer
    grad = _grad(source, 0, 99)
    assert source.apply_outer_gradient(0, grad) == target.apply_outer_gradient(0, grad)


def test_states_without_history_keep_only_the_current_version() -> None:
    source = _state()
    source.apply_outer_gradient(0, _grad(source, 0, 1))
    target = _state()
    target.install(source.fragment_states())
    assert target.history(0).rounds() == (1,)
    assert target.digest() == source.digest()


def test_install_is_all_or_nothing_and_checks_the_digest() -> None:
    source, target = _state(), _state()
    source.apply_outer_gradient(2, _grad(source, 2, 0))
    before = target.digest()
    with pytest.raises(GlobalStateError, match="state digest .* != expected"):
        target.install(source.fragment_states(), expected_digest="0" * 64)
    assert target.digest() == before
    broken = source.fragment_states()
    broken[2] = dataclasses.replace(broken[2], params={n: np.full_like(a, np.inf) for n, a in broken[2].params.items()})
    with pytest.raises(GlobalStateError, match="fragment 2 state params: non-finite values"):
        target.install(broken)
    assert target.digest() == before
    frag = source.fragment_state(2)
    with pytest.raises(GlobalStateError, match="fragment 2 state digest"):
        target.install_fragment(frag, expected_digest="ab" * 32)
    assert target.install_fragment(frag, expected_digest=source.fragment_digest(2)) == source.fragment_digest(2)
    assert target.digest() == source.digest()


def test_fragment_state_arrays_are_copies() -> None:
    state = _state()
    for arr in state.fragment_state(0, include_history=True).params.values():
        arr[...] = 0
    assert state.digest() == _state().digest()


@pytest.mark.parametrize("bad_round", [2**63, 10**30])
def test_a_round_the_digest_cannot_encode_is_refused_and_changes_nothing(bad_round) -> None:
    # the digest packs the round as int64: a larger one must not get into the state
    source, target = _state(), _state()
    before = target.digest()
    states = source.fragment_states()
    states[1] = dataclasses.replace(states[1], round=bad_round)
    with pytest.raises(GlobalStateError, match=f"fragment 1 state: 'round' must be an integer in \\[0, {2**63 - 1}\\]"):
        target.install(states)
    with pytest.raises(GlobalStateError, match="'round' must be an integer in"):
        target.install_fragment(states[1])
    assert target.digest() == before


@pytest.mark.parametrize(
    ("value", "message"),
    [([[1.0], [1.0, 2.0]], "is not a numeric array"), (np.full((4, 4), 1e300), "has values beyond the float32 range")],
    ids=["ragged", "float64 overflow"],
)
def test_malformed_arrays_are_a_global_state_error(value, message) -> None:
    state = _state()
    grad = _grad(state, 2, 0)  # fragment 2 holds blocks/0/w and blocks/0/b
    with np.errstate(all="raise"):
        with pytest.raises(GlobalStateError, match=f"blocks/0/w {message}"):
            state.apply_outer_gradient(2, {**grad, "blocks/0/w": value})
    assert state.rounds() == (0, 0, 0)


def _states_with(change):
    states = _state().fragment_states(include_history=True)
    change(states)
    return states


def _replace_first(**changes):
    def change(states):
        states[0] = dataclasses.replace(states[0], **changes)
    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: s.pop(), "state: expected 3 fragments, got 2"),
        (lambda s: s.__setitem__(2, s[1]), "fragment indexes must be 0..P-1, each once"),
        (lambda s: s.__setitem__(0, {"fragment": 0}), "expected a FragmentState, got dict"),
        (_replace_first(fragment="0"), "'fragment' must be an integer"),
        (_replace_first(fragment=3), "fragment 3 out of range"),
        (_replace_first(round=-1), "fragment 0 state: 'round' must be an integer in"),
        (_replace_first(params=None), "fragment 0 state params: expected a mapping"),
        (_replace_first(history=[1]), "'history' must be a mapping of round -> params"),
        (_replace_first(history={True: {}}), "history round True must be in"),
        (lambda s: s.__setitem__(0, dataclasses.replace(s[0], history={0: s[0].params})),
         "history round 0 must be in \\[0, 0\\)"),  # a history round must be older than the current one
    ],
)
def test_malformed_states_are_refused_and_change_nothing(change, message) -> None:
    target = _state()
    target.apply_outer_gradient(0, _grad(target, 0, 0))
    before = target.digest()
    with pytest.raises(GlobalStateError, match=message):
        target.install(_states_with(change))
    assert target.digest() == before and target.rounds() == (1, 0, 0)


def test_shared_views_are_read_only_and_stay_as_of_when_taken() -> None:
    """`copies=False` hands out the state's own arrays (a learner's base, a checkpoint): nobody can
    change them, and a later step makes new arrays instead of changing them."""
    state = _state()
    params = state.fragment_params(1, copies=False)
    frozen = state.fragment_state(1, copies=False)
    before = {n: a.copy() for n, a in params.items()}
    for arr in (*params.values(), *frozen.momentum.values()):
        with pytest.raises(ValueError, match="read-only"):
            arr[...] = 0
    state.apply_outer_gradient(1, _grad(state, 1, 0))
    assert all(np.array_equal(params[n], before[n]) for n in before)
    assert not all(np.array_equal(state.fragment_params(1)[n], before[n]) for n in before)


def test_digest_after_previews_the_step_without_changing_the_state() -> None:
    state = _state()
    grad = _grad(state, 2, 5)
    digest_before = state.fragment_digest(2)
    preview = state.digest_after(2, grad)
    assert state.fragment_digest(2) == digest_before and state.round(2) == 0
    assert state.apply_outer_gradient(2, grad) == preview


def test_streamed_step_and_preview_are_the_whole_array_bits(monkeypatch) -> None:
    # Tensors of several chunks (and a ragged last one): the step written chunk by chunk and the
    # preview hashed chunk by chunk give the bits and digest of the whole-array Nesterov step.
    monkeypatch.setattr(outer_module, "STEP_CHUNK_ELEMENTS", 1000)
    shapes = {"embed/embedding": (37, 101), "blocks/0/w": (2500,), "blocks/0/b": (3,)}
    rng = np.random.default_rng(3)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    state = GlobalState(plan_fragments(shapes, 1, 2, 0), init, OUTER)
    mu, eta = np.float32(OUTER.momentum), np.float32(OUTER.lr)
    params, buf = dict(init), {n: np.zeros(s, np.float32) for n, s in shapes.items()}
    for round_ in range(1, 4):
        grad = {n: (0.1 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}
        preview = state.digest_after(0, grad)
        for n in shapes:  # the whole-array expressions
            buf[n] = mu * buf[n] + grad[n]
            params[n] = params[n] - eta * (grad[n] + mu * buf[n])
        expected = GlobalState(plan_fragments(shapes, 1, 2, 0), params, OUTER)
        expected._momentum[0] = buf  # the same arrays the step should produce
        expected._rounds[0] = round_
        assert state.apply_outer_gradient(0, grad) == preview == expected.fragment_digest(0)
        for n in shapes:
            assert state.fragment_params(0)[n].tobytes() == params[n].tobytes()
            assert state.momentum(0)[n].tobytes() == buf[n].tobytes()


def test_preview_refuses_a_step_that_would_not_be_finite_like_the_step() -> None:
    state = _state()
    grad = _grad(state, 0, 1)
    name = sorted(grad)[-1]
    grad[name] = np.full_like(grad[name], np.finfo(np.float32).max)
    with pytest.raises(GlobalStateError, match=f"would make {name} non-finite") as preview_error:
        state.digest_after(0, grad)
    with pytest.raises(GlobalStateError) as step_error:
        state.apply_outer_gradient(0, grad)
    assert str(preview_error.value) == str(step_error.value)
    assert state.round(0) == 0
