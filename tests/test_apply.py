"""The apply rule (sync/apply.py): every branch with exact arrays, counters and reasons."""

import numpy as np
import pytest

from diloco_node.sync import apply as apply_lib
from diloco_node.sync.apply import ApplyRule, Counters, apply_fragment

# One fragment of two tensors: the learner's base (its last applied global round), its local
# fragment after some unsent steps, and the newly committed global fragment.
BASE = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[0.0, 4.0]], np.float32)}
LOCAL = {"a": np.array([1.5, 1.0], np.float32), "b": np.array([[0.5, 4.0]], np.float32)}
MERGED = {"a": np.array([2.0, 2.5], np.float32), "b": np.array([[-1.0, 5.0]], np.float32)}
WORK = Counters(c_steps=3, c_tokens=96)


def _apply(rule, contributors, counters=WORK, learner="me"):
    return apply_fragment(rule, learner, LOCAL, BASE, MERGED, contributors, counters)


def _assert_arrays(got, expected):
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], np.asarray(value, np.float32))


def test_overwrite_takes_the_merged_fragment_and_resets_counters_with_or_without_my_work():
    for contributors, why in ((frozenset({"me", "x"}), "me's contribution is in the merge"),
                              (frozenset({"x"}), "merge lacks me's 3 unsent step(s), discarded")):
        new, counters, reason = _apply(ApplyRule("overwrite"), contributors)
        _assert_arrays(new, MERGED)
        assert counters == Counters(0, 0)
        assert reason == f"overwrite: merged fragment taken ({why})"


def test_rebase_adds_the_global_change_and_keeps_counters_when_the_merge_lacks_my_work():
    new, counters, reason = _apply(ApplyRule("rebase"), frozenset({"x"}))
    # local + (merged - base): a [1.5+1.0, 1.0+0.5], b [[0.5-1.0, 4.0+1.0]]
    _assert_arrays(new, {"a": [2.5, 1.5], "b": [[-0.5, 5.0]]})
    assert counters == WORK
    assert reason == ("rebase: merge lacks me's 3 unsent step(s); global change added to the local "
                      "fragment, counters kept")


def test_rebase_overwrites_when_my_work_is_in_the_merge_or_nothing_is_unsent():
    new, counters, reason = _apply(ApplyRule("rebase"), frozenset({"me"}))
    _assert_arrays(new, MERGED)
    assert (counters, reason) == (Counters(0, 0), "rebase: merged fragment taken (me's contribution is in the merge)")
    new, counters, reason = _apply(ApplyRule("rebase"), frozenset({"x"}), counters=Counters(0, 0))
    _assert_arrays(new, MERGED)
    assert (counters, reason) == (Counters(0, 0), "rebase: merged fragment taken (me has no unsent steps)")


def test_mix_weighs_local_by_alpha_and_resets_counters():
    new, counters, reason = _apply(ApplyRule("mix", mix_alpha=0.25), frozenset({"x"}))
    # 0.25 local + 0.75 merged: a [0.375+1.5, 0.25+1.875], b [[0.125-0.75, 1.0+3.75]]
    _assert_arrays(new, {"a": [1.875, 2.125], "b": [[-0.625, 4.75]]})
    assert counters == Counters(0, 0)
    assert reason == "mix: 0.25 local + 0.75 merged"


@pytest.mark.parametrize("rule", apply_lib.APPLY_RULES)
def test_unknown_contributors_take_the_merged_fragment_under_every_rule(rule):
    new, counters, reason = _apply(ApplyRule(rule), None)
    _assert_arrays(new, MERGED)
    assert counters == Counters(0, 0)
    assert reason == "contributors unknown (downloaded state): merged fragment taken"


def test_choose_step_names_the_fast_path_without_touching_tensors():
    assert apply_lib.choose_step(ApplyRule("rebase"), "me", {"me"}, WORK).action == apply_lib.TAKE_MERGED
    assert apply_lib.choose_step(ApplyRule("rebase"), "me", {"x"}, WORK).action == apply_lib.ADD_GLOBAL_CHANGE
    assert apply_lib.choose_step(ApplyRule("mix"), "me", {"me"}, WORK).action == apply_lib.MIX_WITH_LOCAL


def test_rule_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="apply rule 'keep'"):
        ApplyRule("keep")
    with pytest.raises(ValueError, match="mix_alpha = 1.5"):
        ApplyRule("mix", 1.5)


def test_the_manifest_accepts_exactly_the_rules_apply_implements():
    from diloco_node.config.manifest import APPLY_MODES, ConfigError, SyncSpec

    assert set(APPLY_MODES) == set(apply_lib.APPLY_RULES)
    assert ApplyRule.from_sync_spec(SyncSpec(apply="mix", mix_alpha=0.3)) == ApplyRule("mix", 0.3)
    with pytest.raises(ConfigError, match="sync.apply"):
        SyncSpec(apply="keep")
