"""Fragment plans: every tensor exactly once, embeddings apart, balanced, deterministic, offsets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_node.sync.fragments import FragmentPlan, Fragment, is_embedding, plan_fragments

TINY_MODEL = {
    "embed/embedding": (256, 64),
    "pos_embed/embedding": (128, 64),
    "blocks/0/attn/qkv/kernel": (64, 192),
    "blocks/0/attn/out/kernel": (64, 64),
    "blocks/0/mlp/up/kernel": (64, 256),
    "blocks/0/mlp/down/kernel": (256, 64),
    "blocks/0/norm1/scale": (64,),
    "final_norm/scale": (64,),
}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("embed/embedding", True),
        ("pos_embed/embedding", True),
        ("tok_embed/table", True),
        ("unembed/kernel", False),
        ("blocks/0/embed_proj/kernel", False),
        ("blocks/0/mlp/up/kernel", False),
        ("head/kernel", False),
    ],
)
def test_is_embedding_looks_at_the_first_path_component(name: str, expected: bool) -> None:
    assert is_embedding(name) is expected


def test_embeddings_get_fragment_zero_and_the_rest_is_balanced() -> None:
    plan = plan_fragments(TINY_MODEL, num_fragments=3, period=6, overlap=1)
    assert plan.fragments[0].names == ("embed/embedding", "pos_embed/embedding")
    assert plan.fragments[0].is_embedding
    assert not any(f.is_embedding for f in plan.fragments[1:])
    loads = [f.num_elements for f in plan.fragments[1:]]
    assert max(loads) - min(loads) <= 64 * 256
    assert plan.fragments[1].nbytes == 4 * plan.fragments[1].num_elements
    assert plan.fragment_of("final_norm/scale") in (1, 2)
    assert plan.embedding_names == ("embed/embedding", "pos_embed/embedding")


def test_single_fragment_holds_everything() -> None:
    plan = plan_fragments(TINY_MODEL, num_fragments=1, period=4, overlap=0)
    assert plan.fragments[0].names == tuple(sorted(TINY_MODEL))
    assert not plan.fragments[0].is_embedding  # mixed: merge still knows embeddings by name
    assert plan.due(0) == [0] and plan.due(4) == [0] and plan.due(3) == []


def test_offsets_are_distinct_and_spread_evenly() -> None:
    plan = plan_fragments(TINY_MODEL, num_fragments=4, period=8, overlap=2)
    assert [plan.offset(p) for p in range(4)] == [0, 2, 4, 6]
    assert [plan.due(s) for s in range(10)] == [[0], [], [1], [], [2], [], [3], [], [0], []]
    with pytest.raises(IndexError, match="fragment 4 out of range"):
        plan.offset(4)


def test_p_equal_h_syncs_one_fragment_every_step() -> None:
    plan = plan_fragments(TINY_MODEL, num_fragments=4, period=4, overlap=1)
    assert [plan.due(s) for s in range(8)] == [[0], [1], [2], [3], [0], [1], [2], [3]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_fragments=0, period=4, overlap=0), "must be >= 1"),
        (dict(num_fragments=8, period=8, overlap=0), "cannot split 6 non-embedding tensor"),
        (dict(num_fragments=4, period=3, overlap=0), "each fragment needs its own offset"),
        (dict(num_fragments=2, period=4, overlap=4), r"overlap tau = 4 must be in \[0, period H = 4\)"),
    ],
)
def test_impossible_plans_are_refused_with_a_clear_error(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_fragments(TINY_MODEL, **kwargs)


def test_empty_model_and_unknown_tensor_errors() -> None:
    with pytest.raises(ValueError, match="no tensors"):
        plan_fragments({}, 1, 1, 0)
    plan = plan_fragments(TINY_MODEL, 2, 4, 0)
    with pytest.raises(KeyError, match="'nope' is not in the fragment plan"):
        plan.fragment_of("nope")


def test_hand_built_plan_with_a_tensor_twice_is_refused() -> None:
    a = Fragment(0, ("x",), 1, 4, False)
    b = Fragment(1, ("x", "y"), 2, 8, False)
    with pytest.raises(ValueError, match="'x' is in fragments 0 and 1"):
        FragmentPlan((a, b), period=2, overlap=0)


shape_strategy = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
model_strategy = st.dictionaries(
    st.sampled_from(["embed", "pos_embed", "blocks", "mlp", "head", "norm"]).flatmap(
        lambda top: st.text("abcdefgh", min_size=1, max_size=4).map(lambda leaf: f"{top}/{leaf}")
    ),
    shape_strategy,
    min_size=1,
    max_size=14,
)


@settings(max_examples=150, deadline=None)
@given(shapes=model_strategy, num_fragments=st.integers(1, 6), seed=st.randoms(use_true_random=False))
def test_plans_cover_every_tensor_once_balanced_within_the_largest_tensor(shapes, num_fragments, seed) -> None:
    try:
        plan = plan_fragments(shapes, num_fragments, period=num_fragments + 3, overlap=1)
    except ValueError as exc:
        assert "cannot split" in str(exc)
        return
    listed = [n for f in plan.fragments for n in f.names]
    assert sorted(listed) == sorted(shapes) and len(listed) == len(set(listed))
    assert len(plan.fragments) == num_fragments
    for f in plan.fragments:
        assert all(plan.fragment_of(n) == f.index for n in f.names)
    sizes = {n: _count(s) for n, s in shapes.items()}
    packed = [f for f in plan.fragments if not f.is_embedding] if num_fragments > 1 else []
    if num_fragments > 1:
        embedding_fragments = [f for f in plan.fragments if f.is_embedding]
        assert all(all(is_embedding(n) for n in f.names) for f in embedding_fragments)
        assert all(not is_embedding(n) for f in packed for n in f.names)
    if len(packed) >= 2:
        loads = [f.num_elements for f in packed]
        largest = max(sizes[n] for f in packed for n in f.names)
        assert max(loads) - min(loads) <= largest
    # deterministic whatever the insertion order of the mapping
    items = list(shapes.items())
    seed.shuffle(items)
    assert plan_fragments(dict(items), num_fragments, num_fragments + 3, 1) == plan


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Fragment(-1, ("x",), 1, 4, False), "fragment index -1 must be >= 0"),
        (lambda: Fragment(0, (), 0, 0, False), "fragment 0 has no tensors"),
        (lambda: Fragment(0, ("x", "x"), 2, 8, False), "fragment 0 lists a tensor twice"),
        (lambda: FragmentPlan((), period=2, overlap=0), "at least one fragment"),
        (lambda: FragmentPlan((Fragment(1, ("x",), 1, 4, False),), period=2, overlap=0), "indexed 0..P-1 in order"),
        (lambda: plan_fragments({"": (2,)}, 1, 1, 0), "tensor names must be non-empty"),
        (lambda: plan_fragments({"w": (2, -3)}, 1, 1, 0), "'w' has a negative dimension in shape \\(2, -3\\)"),
    ],
)
def test_malformed_fragments_and_shapes_are_refused(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_fragments_too_big_for_a_commit_are_refused_before_training():
    from diloco_node.sync.fragments import wire_fit_problems
    from wire.limits import MAX_LOG_APPEND_BYTES

    limits = dict(max_log_append_bytes=MAX_LOG_APPEND_BYTES)
    # ~1.2B parameters (shapes only: nothing is allocated) in 8 tensors.
    shapes = {f"blocks.{i}.mlp.kernel": (12288, 12288) for i in range(8)}
    coarse = plan_fragments(shapes, 2, 32, 1)
    problems = wire_fit_problems(coarse, shapes, "int4", "fp32", **limits)
    text = "; ".join(problems)
    assert "its commit (fp32, 603,979,776 parameters) can reach 2,305 MiB, over the 256 MiB wire limit" in text
    assert "raise run.sync.fragments" in text
    # contributions are streamed in chunks: no fragment is too big for them, whatever the codec
    assert "contribution" not in text
    fine = plan_fragments(shapes, 8, 32, 1)  # one 151M-parameter tensor per fragment
    assert wire_fit_problems(fine, shapes, "int4", "int4", **limits) == []
    assert wire_fit_problems(fine, shapes, "fp32", "int4", **limits) == []
    assert any("commit (fp32" in p for p in wire_fit_problems(fine, shapes, "int4", "fp32", **limits))
