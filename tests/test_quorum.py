"""Quorum and adaptive grace window: table-driven decisions AND reasons, grace formula, EMA."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco_node.sync.quorum import DEFAULT_MIN_ROUND_INTERVAL_FACTOR, Ema, QuorumPolicy, RoundDecision, TimingEstimates, decide_round, grace_window
from diloco_node.config.manifest import SyncSpec

K1 = QuorumPolicy(min_quorum=1, grace_gamma=0.5, grace_cap_s=5.0, overlap_steps=2)
K3 = QuorumPolicy(min_quorum=3, grace_gamma=0.5, grace_cap_s=5.0, overlap_steps=2)
# slack = tau*step - (quorum + sync) = 2*1.0 - (0.1 + 0.22) = 1.68; grace = 0.5 * 1.68 = 0.84 s
KNOWN = TimingEstimates(step_s=1.0, quorum_s=0.1, sync_s=0.22)
UNKNOWN = TimingEstimates(step_s=None, quorum_s=None, sync_s=None)

# (case, now, opened_at, arrivals, live, policy, estimates, merge_now, wake_at, reason)
CASES = [
    ("nobody yet", 10.0, 9.0, {}, 4, K1, KNOWN, False, None,
     "waiting: 0 of 1 needed contributions"),
    ("quorum reached, grace running", 10.0, 9.0, {"a": 9.5}, 4, K1, KNOWN, False, 10.34,
     "quorum 1/1 reached at t=9.50 (1 of 4 arrived); waiting grace 0.84 s for 3 more live learners (until t=10.34)"),
    ("grace expired", 10.34, 9.0, {"a": 9.5}, 4, K1, KNOWN, True, None,
     "merging: grace window of 0.84 s expired with 1 of 4"),
    ("grace expired with two", 11.0, 9.0, {"a": 9.5, "b": 10.1}, 4, K1, KNOWN, True, None,
     "merging: grace window of 0.84 s expired with 2 of 4"),
    ("one missing learner left", 10.0, 9.0, {"a": 9.5, "b": 9.6, "c": 9.7}, 4, K1, KNOWN, False, 10.34,
     "quorum 1/1 reached at t=9.50 (3 of 4 arrived); waiting grace 0.84 s for 1 more live learner (until t=10.34)"),
    ("everybody arrived", 9.9, 9.0, {"a": 9.5, "b": 9.6, "c": 9.7, "d": 9.9}, 4, K1, KNOWN, True, None,
     "merging: all 4 live learners arrived"),
    ("single learner run", 9.6, 9.0, {"a": 9.5}, 1, K1, KNOWN, True, None,
     "merging: all 1 live learner arrived"),
    ("a contributor died after sending", 9.6, 9.0, {"a": 9.5, "b": 9.55}, 1, K1, KNOWN, True, None,
     "merging: all 1 live learners arrived (2 contributions)"),
    ("all contributors died", 9.6, 9.0, {"a": 9.5}, 0, K1, KNOWN, True, None,
     "merging: no live learners left to wait for (1 contribution)"),
    ("estimates unknown: merge at quorum", 9.6, 9.0, {"a": 9.5}, 4, K1, UNKNOWN, True, None,
     "merging: quorum 1/1 reached with 1 of 4; no grace window until step/quorum/sync time is measured"),
    ("only sync unknown", 9.6, 9.0, {"a": 9.5}, 4, K1, TimingEstimates(1.0, 0.1, None), True, None,
     "merging: quorum 1/1 reached with 1 of 4; no grace window until sync time is measured"),
    ("no slack", 9.6, 9.0, {"a": 9.5}, 4, K1, TimingEstimates(0.1, 0.5, 0.5), True, None,
     "merging: quorum 1/1 reached with 1 of 4; no grace window: no slack (tau*step 0.20 s <= quorum+sync 1.00 s)"),
    ("K=3, two arrived", 10.0, 9.0, {"a": 9.5, "b": 9.8}, 4, K3, KNOWN, False, None,
     "waiting: 2 of 3 needed contributions"),
    ("K=3 reached by the third, grace from then", 10.0, 9.0, {"a": 9.5, "b": 9.8, "c": 9.9}, 4, K3, KNOWN, False, 10.74,
     "quorum 3/3 reached at t=9.90 (3 of 4 arrived); waiting grace 0.84 s for 1 more live learner (until t=10.74)"),
    ("K > live learners: cannot reach quorum", 10.0, 9.0, {"a": 9.5}, 2, K3, KNOWN, False, None,
     "waiting: 1 of 3 needed contributions; only 2 live learners, quorum K = 3 cannot be reached until more learners are live"),
    ("K > live learners even though all live arrived", 10.0, 9.0, {"a": 9.5, "b": 9.6}, 2, K3, KNOWN, False, None,
     "waiting: 2 of 3 needed contributions; only 2 live learners, quorum K = 3 cannot be reached until more learners are live"),
    ("no live learners at all", 10.0, 9.0, {}, 0, K1, KNOWN, False, None,
     "waiting: 0 of 1 needed contributions; only 0 live learners, quorum K = 1 cannot be reached until more learners are live"),
    ("early arrival: grace counts from the round's opening", 9.5, 9.0, {"a": 8.0}, 4, K1, KNOWN, False, 9.84,
     "quorum 1/1 reached at t=9.00 (1 of 4 arrived); waiting grace 0.84 s for 3 more live learners (until t=9.84)"),
]


@pytest.mark.parametrize(
    ("case", "now", "opened_at", "arrivals", "live", "policy", "estimates", "merge_now", "wake_at", "reason"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_decide_round(case, now, opened_at, arrivals, live, policy, estimates, merge_now, wake_at, reason) -> None:
    decision = decide_round(now, opened_at, arrivals, live, policy, estimates)
    assert decision.reason == reason
    assert decision.merge_now is merge_now
    assert decision.have == len(arrivals) and decision.need == policy.min_quorum
    if wake_at is None:
        assert decision.wake_at is None
    else:
        assert decision.wake_at == pytest.approx(wake_at)


# Rate limit: rho 0.5, H 32, step 0.25 s -> at most one round per 4.0 s; a held contribution
# counts toward quorum at the next expected round, last merge + 32 x 0.25 = +8 s.
# grace = 0.5 * (2 * 0.25 - (0.05 + 0.05)) = 0.2 s. The fragment last merged at t=100.
KR = QuorumPolicy(min_quorum=1, grace_gamma=0.5, grace_cap_s=5.0, overlap_steps=2, period_steps=32,
                  min_round_interval_factor=0.5)
FAST = TimingEstimates(step_s=0.25, quorum_s=0.05, sync_s=0.05)
HELD = "this fragment merged 3.1 s ago; at most one round per 0.5 x 32 x 0.25 s = 4.0 s, "

# (case, now, opened_at, arrivals, live, policy, last_merge_at, merge_now, wake_at, held_s, reason)
HOLD_CASES = [
    ("a straggler's lone early contribution is held", 103.1, 103.0, {"s": 103.0}, 4, KR, 100.0, False, 108.0, 5.0,
     "holding: " + HELD + "1 early contribution held for the next on-time ones (until t=108.00 at the latest)"),
    ("two early contributions are held together", 103.1, 101.0, {"s": 101.0, "t": 103.0}, 4, KR, 100.0, False, 108.0,
     7.0, "holding: " + HELD + "2 early contributions held for the next on-time ones (until t=108.00 at the latest)"),
    ("the next on-time contribution counts at once; grace for the rest", 107.9, 103.0, {"s": 103.0, "a": 107.9}, 4,
     KR, 100.0, False, 108.1, 4.9,
     "quorum 1/1 reached at t=107.90 (2 of 4 arrived); waiting grace 0.20 s for 2 more live learners (until t=108.10)"),
    ("held and on-time merge together when all live arrived", 107.9, 103.0,
     {"s": 103.0, "a": 107.9, "b": 107.9, "c": 107.9}, 4, KR, 100.0, True, None, 0.0,
     "merging: all 4 live learners arrived, including 1 early contribution"),
    ("nobody on time by the next expected round: grace from then", 108.0, 103.0, {"s": 103.0}, 4, KR, 100.0, False,
     108.2, 5.0,
     "quorum 1/1 reached at t=108.00 (1 of 4 arrived); waiting grace 0.20 s for 3 more live learners (until t=108.20)"),
    ("then the held contribution merges alone (liveness)", 108.2, 103.0, {"s": 103.0}, 4, KR, 100.0, True, None, 5.0,
     "merging: grace window of 0.20 s expired with 1 of 4 (early contributions held 5.00 s)"),
    ("an arrival after the interval is on time", 104.5, 104.5, {"s": 104.5}, 4, KR, 100.0, False, 104.7, 0.0,
     "quorum 1/1 reached at t=104.50 (1 of 4 arrived); waiting grace 0.20 s for 3 more live learners (until t=104.70)"),
    ("the only live learner is never held", 103.1, 103.0, {"s": 103.0}, 1, KR, 100.0, True, None, 0.0,
     "merging: all 1 live learner arrived, including 1 early contribution"),
    ("no last merge known: no limit", 103.2, 103.0, {"s": 103.0}, 4, KR, None, True, None, 0.0,
     "merging: grace window of 0.20 s expired with 1 of 4"),
    ("rho = 0 disables the limit", 103.2, 103.0, {"s": 103.0}, 4,
     QuorumPolicy(1, 0.5, 5.0, 2, period_steps=32, min_round_interval_factor=0.0), 100.0, True, None, 0.0,
     "merging: grace window of 0.20 s expired with 1 of 4"),
    ("H = 0 (the default) disables the limit", 103.2, 103.0, {"s": 103.0}, 4, QuorumPolicy(1, 0.5, 5.0, 2), 100.0,
     True, None, 0.0, "merging: grace window of 0.20 s expired with 1 of 4"),
]


@pytest.mark.parametrize(
    ("case", "now", "opened_at", "arrivals", "live", "policy", "last_merge_at", "merge_now", "wake_at", "held_s",
     "reason"),
    HOLD_CASES,
    ids=[c[0] for c in HOLD_CASES],
)
def test_rate_limit(case, now, opened_at, arrivals, live, policy, last_merge_at, merge_now, wake_at, held_s,
                    reason) -> None:
    decision = decide_round(now, opened_at, arrivals, live, policy, FAST, last_merge_at=last_merge_at)
    assert decision.reason == reason
    assert decision.merge_now is merge_now
    assert decision.held_s == pytest.approx(held_s)
    if wake_at is None:
        assert decision.wake_at is None
    else:
        assert decision.wake_at == pytest.approx(wake_at)


def test_rate_limit_interval_formula() -> None:
    assert KR.min_round_interval(0.25) == pytest.approx(4.0)
    assert KR.min_round_interval(None) == 0.0
    assert QuorumPolicy(1, 0.5, 5.0, 2).min_round_interval(0.25) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 20), min_size=1, max_size=8),
    live=st.integers(1, 8), last=st.floats(-10, 20), now=st.floats(0, 40),
)
def test_held_rounds_always_merge_by_waking(arrivals, live, last, now) -> None:
    now = max(now, max(arrivals.values()))
    d = decide_round(now, 0.0, arrivals, live, KR, FAST, last_merge_at=last)
    for _ in range(3):  # hold -> grace -> merge at most
        if d.merge_now:
            break
        assert d.wake_at is not None and d.wake_at > now
        now = d.wake_at
        d = decide_round(now, 0.0, arrivals, live, KR, FAST, last_merge_at=last)
    assert d.merge_now
    # the limit never pushes quorum past the next expected round (last merge + H x step = +8 s)
    assert d.quorum_at is not None and d.quorum_at <= max(max(arrivals.values()), last + 8.0) + 1e-9


def test_quorum_time_is_reported_for_the_quorum_estimate() -> None:
    decision = decide_round(10.0, 9.0, {"a": 9.7, "b": 9.2, "c": 9.9}, 5, K3, KNOWN)
    assert decision.quorum_at == 9.9
    assert decide_round(10.0, 9.0, {"a": 9.7}, 5, K3, KNOWN).quorum_at is None


@pytest.mark.parametrize(
    ("policy", "estimates", "expected"),
    [
        (K1, KNOWN, 0.84),
        (K1, UNKNOWN, 0.0),
        (K1, TimingEstimates(None, 0.1, 0.2), 0.0),
        (K1, TimingEstimates(100.0, 0.1, 0.2), 5.0),  # capped
        (QuorumPolicy(1, 0.5, 5.0, 0), KNOWN, 0.0),  # tau = 0: no overlap, no slack
        (QuorumPolicy(1, 0.0, 5.0, 2), KNOWN, 0.0),  # gamma = 0 disables the window
        (QuorumPolicy(1, 0.9, 0.5, 2), KNOWN, 0.5),
    ],
)
def test_grace_window_formula(policy, estimates, expected) -> None:
    assert grace_window(policy, estimates) == pytest.approx(expected)


@settings(max_examples=200, deadline=None)
@given(
    step=st.floats(0, 100), quorum=st.floats(0, 100), sync=st.floats(0, 100),
    gamma=st.floats(0, 0.99), cap=st.floats(0, 30), tau=st.integers(0, 8),
)
def test_grace_is_within_zero_and_cap_and_never_exceeds_the_slack(step, quorum, sync, gamma, cap, tau) -> None:
    g = grace_window(QuorumPolicy(1, gamma, cap, tau), TimingEstimates(step, quorum, sync))
    assert 0.0 <= g <= cap
    assert g <= max(0.0, tau * step - (quorum + sync)) + 1e-9


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.dictionaries(st.sampled_from("abcdefgh"), st.floats(0, 20), max_size=8),
    live=st.integers(0, 8), k=st.integers(1, 8), now=st.floats(0, 40),
)
def test_decisions_are_consistent(arrivals, live, k, now) -> None:
    policy = QuorumPolicy(k, 0.5, 5.0, 2)
    d = decide_round(now, 0.0, arrivals, live, policy, KNOWN)
    assert isinstance(d, RoundDecision) and d.reason
    if len(arrivals) < k:
        assert not d.merge_now and d.wake_at is None
    if d.merge_now:
        assert len(arrivals) >= k and d.wake_at is None
    if d.wake_at is not None:
        assert d.wake_at > now and not d.merge_now
        # waking at the deadline with nothing new merges
        assert decide_round(d.wake_at, 0.0, arrivals, live, policy, KNOWN).merge_now


def test_policy_from_the_run_manifest() -> None:
    sync = SyncSpec(min_quorum=2, grace_gamma=0.3, grace_cap_s=1.5, overlap=3, fragments=2, period=8)
    assert QuorumPolicy.from_sync_spec(sync) == QuorumPolicy(2, 0.3, 1.5, 3, period_steps=8)
    assert QuorumPolicy.from_sync_spec(sync).min_round_interval_factor == DEFAULT_MIN_ROUND_INTERVAL_FACTOR


def test_ema() -> None:
    ema = Ema(alpha=0.5)
    assert ema.value is None
    assert ema.update(2.0) == 2.0
    assert ema.update(4.0) == 3.0
    assert ema.value == 3.0
    with pytest.raises(ValueError, match="not finite"):
        ema.update(math.inf)
    with pytest.raises(ValueError, match="alpha = 0"):
        Ema(alpha=0)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: QuorumPolicy(0, 0.5, 1.0, 2), "min_quorum K = 0 must be >= 1"),
        (lambda: QuorumPolicy(1, 1.0, 1.0, 2), "grace_gamma = 1.0 must be in \\[0, 1\\)"),
        (lambda: QuorumPolicy(1, 0.5, -1.0, 2), "grace_cap_s = -1.0"),
        (lambda: QuorumPolicy(1, 0.5, 1.0, -1), "overlap_steps tau = -1"),
        (lambda: QuorumPolicy(1, 0.5, 1.0, 2, period_steps=-1), "period_steps H = -1"),
        (lambda: QuorumPolicy(1, 0.5, 1.0, 2, min_round_interval_factor=1.5), "rho = 1.5 must be in \\[0, 1\\]"),
        (lambda: decide_round(1.0, 0.0, {}, 1, K1, KNOWN, last_merge_at=math.nan), "last_merge_at = nan"),
        (lambda: TimingEstimates(-1.0, None, None), "step_s = -1.0"),
        (lambda: TimingEstimates(None, math.nan, None), "quorum_s = nan"),
        (lambda: decide_round(math.nan, 0.0, {}, 1, K1, KNOWN), "must be finite"),
        (lambda: decide_round(1.0, 0.0, {}, -1, K1, KNOWN), "live_learners = -1"),
        # a NaN arrival would otherwise vanish from max() and merge at once; inf would wait forever
        (lambda: decide_round(10.0, 9.0, {"a": math.nan}, 4, K1, KNOWN), "arrival time of a = nan must be finite"),
        (lambda: decide_round(10.0, 9.0, {"a": 9.5, "b": math.inf}, 4, K1, KNOWN), "arrival time of b = inf"),
    ],
)
def test_bad_parameters_are_refused(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()
