"""The learner's apply rule (sync/apply.py): every branch, with exact arrays."""

from __future__ import annotations

import numpy as np
import pytest

from diloco_node.config.manifest import SyncSpec
from diloco_node.sync.apply import ApplyRule, FragmentCounters, SentFragment, apply_merge

BASE = {"w": np.array([1.0, 2.0], np.float32)}
MERGED = {"w": np.array([1.5, 1.0], np.float32)}  # the run moved by (+0.5, -1.0) since BASE
LOCAL = {"w": np.array([0.75, 2.5], np.float32)}  # this learner's unsent drift: (-0.25, +0.5)
COUNTERS = FragmentCounters(c_steps=7, c_tokens=700)


KEEP = ApplyRule(keep_unmerged=True)


def test_a_merge_with_our_contribution_overwrites_and_resets_the_counters() -> None:
    new, counters = apply_merge(LOCAL, BASE, MERGED, {"me", "b"}, COUNTERS, learner="me", rule=KEEP)
    np.testing.assert_array_equal(new["w"], MERGED["w"])
    assert counters == FragmentCounters(0, 0)


def test_keep_unmerged_takes_a_merge_without_our_unsent_work_on_top_of_it_and_keeps_the_counters() -> None:
    new, counters = apply_merge(LOCAL, BASE, MERGED, {"b"}, COUNTERS, learner="me", rule=KEEP)
    np.testing.assert_array_equal(new["w"], np.array([1.25, 1.5], np.float32))  # merged + our drift
    assert counters == COUNTERS


def test_by_default_a_merge_without_us_overwrites_our_unsent_work() -> None:
    new, counters = apply_merge(LOCAL, BASE, MERGED, {"b"}, COUNTERS, learner="me", rule=ApplyRule())
    np.testing.assert_array_equal(new["w"], MERGED["w"])
    assert counters == FragmentCounters(0, 0)


def test_nothing_unsent_means_nothing_to_keep() -> None:
    new, counters = apply_merge(BASE, BASE, MERGED, set(), FragmentCounters(0, 0), learner="me", rule=KEEP)
    np.testing.assert_array_equal(new["w"], MERGED["w"])
    assert counters == FragmentCounters(0, 0)


def test_mix_blends_local_and_merged_when_our_work_is_in() -> None:
    rule = ApplyRule(mode="mix", mix_alpha=0.25)
    new, counters = apply_merge(LOCAL, BASE, MERGED, {"me"}, COUNTERS, learner="me", rule=rule)
    np.testing.assert_allclose(new["w"], 0.25 * LOCAL["w"] + 0.75 * MERGED["w"], rtol=0, atol=1e-7)
    assert new["w"].dtype == np.float32 and counters == FragmentCounters(0, 0)


def test_the_rule_comes_from_the_run_manifest() -> None:
    assert ApplyRule.from_sync_spec(SyncSpec()) == ApplyRule("overwrite", 0.5, False)
    assert ApplyRule.from_sync_spec(SyncSpec(apply="mix", mix_alpha=0.3, keep_unmerged=True)) == \
        ApplyRule("mix", 0.3, True)


EAGER = ApplyRule(mode="eager")
# What this learner sent 2 steps ago: LOCAL has moved by (-0.25, +0.5) since, over 2 steps and 200 tokens.
SENT = SentFragment({"w": np.array([1.0, 2.0], np.float32)}, FragmentCounters(c_steps=5, c_tokens=500))


def test_eager_takes_the_progress_made_while_the_round_was_in_flight_on_top_of_the_merge() -> None:
    new, counters = apply_merge(LOCAL, BASE, MERGED, {"me", "b"}, COUNTERS, learner="me", rule=EAGER, sent=SENT)
    np.testing.assert_array_equal(new["w"], np.array([1.25, 1.5], np.float32))  # merged + (local - sent)
    assert new["w"].dtype == np.float32
    assert counters == FragmentCounters(2, 200)  # only the steps since the send: the next contribution's


def test_eager_overwrites_a_merge_without_our_contribution_or_with_no_send_pending() -> None:
    for contributors, sent in (({"b"}, SENT), ({"me"}, None)):
        new, counters = apply_merge(LOCAL, BASE, MERGED, contributors, COUNTERS, learner="me", rule=EAGER, sent=sent)
        np.testing.assert_array_equal(new["w"], MERGED["w"])
        assert counters == FragmentCounters(0, 0)


def test_a_learner_that_does_not_keep_its_fragment_as_sent_refuses_eager_before_training() -> None:
    sync = SyncSpec(apply="eager")
    with pytest.raises(ValueError, match="eager"):
        ApplyRule.from_sync_spec(sync)
    assert ApplyRule.from_sync_spec(sync, keeps_sent=True) == ApplyRule("eager", 0.5, False)
