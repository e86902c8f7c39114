"""Per-round diagnostics of a sparse uplink (sim/sparse_diagnostics.py), on hand-made numbers."""

import numpy as np
import pytest

from diloco_node.sim.sparse_diagnostics import SparseDiagnostics


def test_a_round_reports_remainder_coverage_cosine_and_the_merged_norm_against_the_dense_mean():
    d = SparseDiagnostics()
    delta_a = {"w": np.array([3.0, 4.0, 0.0, 0.0], np.float32)}
    delta_b = {"w": np.array([0.0, 0.0, 3.0, 4.0], np.float32)}
    sent_a = {"w": np.array([0.0, 4.0, 0.0, 0.0], np.float32)}  # the larger value only
    sent_b = {"w": np.array([0.0, 0.0, 0.0, 4.0], np.float32)}
    d.sent("a", 0, 0, delta_a, sent_a, {"w": delta_a["w"] - sent_a["w"]})
    d.sent("b", 0, 0, delta_b, sent_b, {"w": delta_b["w"] - sent_b["w"]})
    merged = {"w": (sent_a["w"] + sent_b["w"]) / 2}
    d.merged(0, 1, 5.0, ("a", "b"), merged)
    (row,) = d.rows
    assert row["remainder_over_delta"] == pytest.approx(3 / 5)
    assert row["cosine_sent_delta"] == pytest.approx(4 / 5)
    assert row["sent_ever"] == 0.5
    # dense mean (1.5, 2, 1.5, 2): norm 5 / sqrt(2); merged (0, 2, 0, 2): norm 2 sqrt(2)
    assert row["merged_over_dense"] == pytest.approx(2 * np.sqrt(2) / (5 / np.sqrt(2)), rel=1e-4)
    assert (row["contributors"], row["rebased"]) == (2, 0)


def test_a_contribution_sent_against_an_older_round_counts_as_rebased_and_coverage_only_grows():
    d = SparseDiagnostics()
    delta = {"w": np.ones(4, np.float32)}
    d.sent("a", 0, 0, delta, {"w": np.array([1, 0, 0, 0], np.float32)}, {})
    d.merged(0, 1, 1.0, ("a",), delta)
    d.sent("a", 0, 0, delta, {"w": np.array([0, 1, 0, 0], np.float32)}, {})  # still against round 0
    d.merged(0, 2, 2.0, ("a",), delta)
    assert [r["rebased"] for r in d.rows] == [0, 1]
    assert [r["sent_ever"] for r in d.rows] == [0.25, 0.5]
    assert d.rows[0]["remainder_over_delta"] == 0.0  # no error feedback: nothing kept
