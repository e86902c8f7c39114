"""The one serialization of the replicated global state (sync/state_codec.py): named arrays, the
download bytes a peer serves, and checkpoint entries, each round-tripped through the replica."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgpack
import numpy as np
import pytest

from diloco_node.config.manifest import OuterOptimizer
from diloco_node.ops.checkpoint import CheckpointStore, read_checkpoint_file
from diloco_node.sync.fragments import plan_fragments
from diloco_node.sync.global_state import GlobalStateError
from diloco_node.sync import replica as replica_module
from diloco_node.sync.replica import Replica
from diloco_node.sync.state_codec import (
    FRAGMENT_BYTES_FORMAT,
    FragmentAssembler,
    FragmentState,
    StateCodecError,
    decode_fragment,
    encode_fragment,
    fragment_arrays,
    fragment_shapes,
    from_checkpoint,
    from_fragment_arrays,
    params_from_checkpoint,
    to_checkpoint,
)
from wire.errors import RemoteProtocolError

SHAPES = {"embed/embedding": (16, 4), "blocks/0/w": (4, 4), "blocks/0/b": (4,), "head/kernel": (4, 16)}
PLAN = plan_fragments(SHAPES, 3, 6, 1)
OUTER = OuterOptimizer(lr=0.7, momentum=0.9)


def _replica(steps: int = 0) -> Replica:
    """A replica whose fragments took `steps` outer steps in turn, with a norm reference on fragment 1."""
    rng = np.random.default_rng(0)
    replica = Replica(PLAN, {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}, OUTER)
    for i in range(steps):
        p = i % PLAN.num_fragments
        grad = {n: (0.1 * rng.standard_normal(a.shape)).astype(np.float32)
                for n, a in replica.state.fragment_params(p).items()}
        replica.state.apply_outer_gradient(p, grad)
    replica.norm_refs[1] = 0.25
    return replica


def _same(a: FragmentState, b: FragmentState) -> bool:
    left, right = fragment_arrays(a), fragment_arrays(b)
    return ((a.fragment, a.round, a.norm_ref) == (b.fragment, b.round, b.norm_ref) and left.keys() == right.keys()
            and all(left[n].tobytes() == right[n].tobytes() and left[n].shape == right[n].shape for n in left))


def test_named_arrays_round_trip_with_history_and_tensor_names_holding_slashes() -> None:
    source = _replica(steps=7)
    state = dataclasses.replace(source.state.fragment_state(2, include_history=True), norm_ref=1.5)
    named = fragment_arrays(state)
    assert "params/blocks/0/w" in named and "momentum/blocks/0/b" in named and "history/1/blocks/0/w" in named
    assert _same(from_fragment_arrays(2, state.round, named, 1.5), state)


@pytest.mark.parametrize("name", ["weights/x", "history/x/blocks/0/w", "history/3", "params/"])
def test_an_array_name_of_no_known_kind_is_refused(name: str) -> None:
    with pytest.raises(StateCodecError, match="array"):
        from_fragment_arrays(0, 1, {name: np.zeros(1, np.float32)})


def test_download_bytes_carry_the_fragment_and_its_norm_reference() -> None:
    source, joiner = _replica(steps=5), _replica()
    joiner.norm_refs[0] = 9.0  # a reference the source does not have: replaced by none
    for p in range(PLAN.num_fragments):
        round_, data, _ = source.fragment_bytes(p)
        assert round_ == source.state.round(p)
        assert joiner.install_fragment_bytes(p, data) == source.state.fragment_digest(p)
    assert joiner.state.digest() == source.state.digest()
    assert joiner.norm_refs == {1: 0.25}
    assert _same(decode_fragment(source.fragment_bytes(1)[1]), source.fragment_state(1))


def test_download_bytes_follow_an_install_of_the_same_round() -> None:
    """What is served follows what a repair just installed (same round, other bytes)."""
    served, other = _replica(), _replica(steps=3)
    stale = served.fragment_bytes(0)[1]
    served.install_fragment_bytes(0, other.fragment_bytes(0)[1])
    assert served.fragment_bytes(0)[1] != stale


def test_fragment_bytes_name_the_state_digest_and_hold_arrays_in_its_order() -> None:
    """Wire 3.0: the digest beside the bytes is the fragment's state digest (no digest of the
    download bytes), and the arrays come sorted by name, after "fragment" and "round", so a
    receiver hashes them into that digest as it decodes them."""
    source = _replica(steps=3)
    round_, data, digest = source.fragment_bytes(1)
    assert digest == bytes.fromhex(source.state.fragment_digest(1))
    fields = msgpack.unpackb(data, raw=False)
    keys = list(fields)
    assert keys.index("fragment") < keys.index("arrays") and keys.index("round") < keys.index("arrays")
    assert list(fields["arrays"]) == sorted(fields["arrays"])
    assembler = FragmentAssembler(fragment_shapes({n: a.shape for n, a in source.state.fragment_params(1, copies=False).items()}))
    for at in range(0, len(data), 7):  # odd chunk sizes: headers and arrays split anywhere
        assembler.feed(data[at:at + 7])
    state = assembler.finish()
    assert assembler.state_digest() == source.state.fragment_digest(1) and state.round == round_


def test_the_assembler_refuses_arrays_out_of_the_digest_order_or_before_the_round() -> None:
    state = _replica(steps=1).fragment_state(1)
    shapes = fragment_shapes({n: a.shape for n, a in state.params.items()})
    arrays = {n: [list(a.shape), np.ascontiguousarray(a, np.float32).tobytes()]
              for n, a in fragment_arrays(state).items()}
    reordered = {"format": FRAGMENT_BYTES_FORMAT, "fragment": 1, "round": state.round,
                 "arrays": dict(reversed(list(arrays.items())))}
    early = {"format": FRAGMENT_BYTES_FORMAT, "fragment": 1, "arrays": arrays, "round": state.round}
    for fields, why in ((reordered, "digest's order"), (early, "before 'arrays'")):
        assembler = FragmentAssembler(shapes)
        with pytest.raises(StateCodecError, match=why):
            assembler.feed(msgpack.packb(fields, use_bin_type=True))


def test_fragment_bytes_are_the_arrays_own_bytes_in_order() -> None:
    state = _replica(steps=1).fragment_state(1)
    fields = msgpack.unpackb(encode_fragment(state), raw=False)
    for name, (shape, data) in fields["arrays"].items():
        assert data == np.ascontiguousarray(fragment_arrays(state)[name], dtype=np.float32).tobytes()
        assert tuple(shape) == fragment_arrays(state)[name].shape


def _packed(**changes: object) -> bytes:
    fields = msgpack.unpackb(encode_fragment(_replica().fragment_state(1)), raw=False)
    fields.update(changes)
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize(("data", "message"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb([1, 2]), f"not a map in format {FRAGMENT_BYTES_FORMAT}"),
    (_packed(format=1), f"not a map in format {FRAGMENT_BYTES_FORMAT}"),
    (_packed(round="3"), "'round' must be an integer"),
    (_packed(arrays=[]), "'arrays' must be a map"),
    (_packed(arrays={"params/blocks/0/w": [[4, 4], b"\x00" * 60]}), "60 bytes do not hold shape \\[4, 4\\]"),
    (_packed(arrays={"params/blocks/0/w": [[-4, -4], b"\x00" * 64]}), "do not hold shape"),
    (_packed(arrays={"params/blocks/0/w": b"x"}), "is not \\[shape, bytes\\]"),
    (_packed(norm_ref=float("nan")), "norm_ref = nan must be finite and >= 0"),
    (_packed(norm_ref="big"), "norm_ref must be a number"),
])
def test_malformed_download_bytes_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(StateCodecError, match=message):
        decode_fragment(data)


def test_a_peers_bytes_that_do_not_fit_change_nothing() -> None:
    replica = _replica()
    before = replica.state.digest()
    with pytest.raises(RemoteProtocolError, match="fragment 0 bytes are malformed"):
        replica.install_fragment_bytes(0, b"\x01\x02")
    with pytest.raises(RemoteProtocolError, match="fragment 1 bytes hold fragment 0"):
        replica.install_fragment_bytes(1, replica.fragment_bytes(0)[1])
    wrong_shape = dataclasses.replace(replica.fragment_state(1), params={n: np.zeros(3, np.float32) for n in
                                                                          replica.state.fragment_params(1)})
    with pytest.raises(RemoteProtocolError, match="fragment 1 does not fit this run: .* has shape"):
        replica.install_fragment_bytes(1, encode_fragment(wrong_shape))
    assert replica.state.digest() == before and replica.norm_refs == {1: 0.25}


def test_checkpoint_entries_round_trip_through_a_checkpoint_file(tmp_path: Path) -> None:
    source = _replica(steps=4)
    meta, arrays = source.checkpoint_entries()
    assert meta["rounds"] == list(source.state.rounds()) and meta["norm_refs"] == {"1": 0.25}
    learner = {"learner/params/x": np.ones(2, np.float32)}  # other arrays beside the global state's
    with CheckpointStore(tmp_path) as store:
        path = store.save({"applied_index": 7, **meta}, {**arrays, **learner})
    loaded = read_checkpoint_file(path)
    target = _replica()
    target.norm_refs = {0: 3.0}
    assert target.restore_checkpoint(loaded.meta, loaded.arrays) == source.state.digest()
    assert target.norm_refs == {1: 0.25}
    assert target.fragment_bytes(2) == source.fragment_bytes(2)
    assert params_from_checkpoint(loaded.arrays).keys() == set(SHAPES)


def test_a_checkpoint_that_does_not_match_its_digest_or_plan_is_refused() -> None:
    source, target = _replica(steps=2), _replica()
    meta, arrays = source.checkpoint_entries()
    before = target.state.digest()
    with pytest.raises(GlobalStateError, match="state digest .* != expected"):
        target.restore_checkpoint({**meta, "state_digest": "0" * 64}, arrays)
    with pytest.raises(StateCodecError, match="2 fragment rounds, the plan has 3"):
        target.restore_checkpoint({**meta, "rounds": meta["rounds"][:2]}, arrays)
    with pytest.raises(StateCodecError, match="global state metadata is malformed"):
        target.restore_checkpoint({"rounds": meta["rounds"]}, arrays)
    with pytest.raises(StateCodecError, match="'global/params/other'.*is not in the fragment plan"):
        target.restore_checkpoint(meta, {**arrays, "global/params/other": np.zeros(1, np.float32)})
    assert target.state.digest() == before


def test_checkpoint_keeps_history_when_the_states_carry_it() -> None:
    source = _replica(steps=6)
    states = source.state.fragment_states(include_history=True)
    meta, arrays = to_checkpoint(states, source.state.digest())
    back, digest = from_checkpoint(meta, arrays, PLAN)
    assert digest == source.state.digest()
    assert all(_same(a, b) for a, b in zip(back, states, strict=True))


def test_a_checkpoint_from_before_blake3_loads_without_its_sha256_state_digest() -> None:
    """A checkpoint written before wire 3.0 promises a SHA-256 state digest: it still restores (its
    file checksum guards its bytes), to the state's BLAKE3 digest."""
    source = _replica(steps=4)
    meta, arrays = source.checkpoint_entries()
    assert meta["digest_hash"] == "blake3"
    old = {k: v for k, v in meta.items() if k != "digest_hash"}
    old["state_digest"] = "ab" * 32  # what a SHA-256 layout gave: checked no more
    assert from_checkpoint(old, arrays, PLAN)[1] is None
    assert _replica().restore_checkpoint(old, arrays) == source.state.digest()
    with pytest.raises(GlobalStateError, match="state digest"):
        _replica().restore_checkpoint({**meta, "state_digest": "ab" * 32}, arrays)


# ---- download bytes as parts (served) and decoded as they arrive (received) ----------------


def _fragment_with_everything() -> FragmentState:
    """A fragment with a 0-d array, an empty one, a large one (bin32), a norm reference, totals,
    a wall time and an eviction: every kind of field the download bytes carry."""
    from diloco_node.sync.evictions import Evictions

    rng = np.random.default_rng(3)
    params = {"a/w": rng.standard_normal((3, 5)).astype(np.float32), "b": np.array(1.5, np.float32),
              "c": rng.standard_normal(70_000).astype(np.float32), "e": np.zeros((0, 4), np.float32)}
    evicted = Evictions.from_plain([{"node_id": "s9", "index": 4, "reason": "test"}], "test").records()
    return FragmentState(3, 7, params, {n: a * 2 for n, a in params.items()}, norm_ref=0.5,
                         merged_tokens=10**12, merged_steps=5, commit_wall=1.7e9, evicted=tuple(evicted))


def _packb_of(state: FragmentState) -> bytes:
    """What encode_fragment wrote before it was built from parts: msgpack.packb of the map."""
    arrays = {n: [list(a.shape), np.ascontiguousarray(a, np.float32).tobytes()]
              for n, a in fragment_arrays(state).items()}
    fields = {"format": FRAGMENT_BYTES_FORMAT, "fragment": state.fragment, "round": state.round, "arrays": arrays,
              "norm_ref": state.norm_ref, "merged": [state.merged_tokens, state.merged_steps],
              "commit_wall": state.commit_wall, "evicted": [r.to_plain() for r in state.evicted]}
    return msgpack.packb(fields, use_bin_type=True)


def test_download_bytes_from_parts_are_msgpacks_bytes_so_peers_of_any_version_serve_the_same() -> None:
    state = _fragment_with_everything()
    assert encode_fragment(state) == _packb_of(state)
    replica_state = _replica(steps=3).fragment_state(1)
    assert encode_fragment(replica_state) == msgpack.packb(msgpack.unpackb(encode_fragment(replica_state)),
                                                           use_bin_type=True)


def test_a_parts_reader_serves_any_range_without_joining_the_parts() -> None:
    from diloco_node.sync.state_codec import PartsReader, fragment_parts

    state = _fragment_with_everything()
    data = encode_fragment(state)
    reader = PartsReader(fragment_parts(state))
    assert reader.total == len(data)
    for offset, length in [(0, 1), (0, len(data)), (7, 1000), (100, 300_000), (len(data) - 3, 10), (len(data) + 5, 3)]:
        assert reader.read(offset, length) == data[offset:offset + length]


@pytest.mark.parametrize("piece", [1, 7, 4096, 1 << 30])
def test_an_assembler_decodes_bytes_fed_in_any_pieces_as_decode_fragment_does(piece: int) -> None:
    from diloco_node.sync.state_codec import fragment_state_digest
    from diloco_node.sync.state_codec import FragmentAssembler, fragment_shapes

    state = _fragment_with_everything()
    data = encode_fragment(state)
    assembler = FragmentAssembler(fragment_shapes({n: a.shape for n, a in state.params.items()}))
    for start in range(0, len(data), piece):
        assembler.feed(data[start:start + piece])
    got, expected = assembler.finish(), decode_fragment(data)
    assert assembler.received == len(data)
    assert assembler.state_digest() == fragment_state_digest(state.fragment, state.round, state.params, state.momentum)
    assert _same(got, expected) and got == dataclasses.replace(expected, params=got.params, momentum=got.momentum)


@pytest.mark.parametrize(("data", "message"), [
    (b"\xc1", "a map expected"),
    (_packed(format=1), f"not a map in format {FRAGMENT_BYTES_FORMAT}"),
    (_packed(arrays={"params/blocks/0/w": [[4, 4], b"\x00" * 60]}), "not 64 raw bytes"),
    (_packed(arrays={"params/blocks/0/w": [[8, 2], b"\x00" * 64]}), "shape \\[8, 2\\], this run's is \\[4, 4\\]"),
    (_packed(arrays={"params/other": [[4, 4], b"\x00" * 64]}), "'params/other' is not one of this fragment's"),
    (_packed(arrays={"params/blocks/0/w": b"x"}), "is not \\[shape, bytes\\]"),
    (_packed(norm_ref=float("nan")), "norm_ref = nan must be finite and >= 0"),
    (_packed(round="3"), "'round' must be an integer"),
    (_packed(note="x" * (2 << 20)), "a metadata item of"),
    (_packed()[:-1], "end early"),
    (_packed() + b"\x00", "after the end"),
])
def test_an_assembler_refuses_malformed_bytes_before_allocating_for_them(data: bytes, message: str) -> None:
    from diloco_node.sync.state_codec import FragmentAssembler, fragment_shapes

    # fragment 1's arrays, and "blocks/0/w" (of another fragment) for the cases that change it
    shapes = fragment_shapes({**{n: a.shape for n, a in _replica().state.fragment_params(1).items()},
                              "blocks/0/w": (4, 4)})
    assembler = FragmentAssembler(shapes)
    with pytest.raises(StateCodecError, match=message):
        assembler.feed(data)
        assembler.finish()
