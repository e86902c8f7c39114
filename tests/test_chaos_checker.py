"""The chaos checker catches each planted violation and passes clean histories; metrics on
hand-made histories equal hand-computed values."""

from __future__ import annotations

import pytest

from diloco_node.testbed.chaos.checker import FinalState, check_histories, final_states_from
from diloco_node.testbed.chaos.metrics import (
    commit_gaps,
    commit_times,
    failover_times,
    goodput,
    lease_holder_at,
    measure,
    percentile,
    productive_seconds,
    uptime,
)
from diloco_node.ops.history import HistoryEvent, HistoryWriter, load_histories


def ev(node: str, kind: str, t: float, **fields) -> HistoryEvent:
    return HistoryEvent(t_wall=1.7e9 + t, t_mono=t, node=node, kind=kind, **fields)


def entry(i: int) -> str:
    return f"e{i}"


def state(i: int) -> str:
    return f"s{i}"


def clean_run() -> dict[str, list[HistoryEvent]]:
    """Three nodes; a leads epoch 1 and commits 1..3, is killed; b wins epoch 2 and commits 4;
    a restarts, replays from its checkpoint (index 2) and catches up. Everyone ends at 4."""
    h: dict[str, list[HistoryEvent]] = {"a": [], "b": [], "c": [], "nemesis": []}
    for n in "abc":
        h[n].append(ev(n, "start", 0.0, epoch=0, index=0))
    h["a"].append(ev("a", "lease_acquired", 0.5, epoch=1, index=0))
    for n in "bc":
        h[n].append(ev(n, "vote", 0.4, epoch=1, detail={"for": "a"}))
    for i in (1, 2, 3):
        t = float(i)
        for n in "abc":
            h[n].append(ev(n, "append", t, epoch=1, index=i, entry_digest=entry(i)))
        h["a"].append(ev("a", "commit", t + 0.1, epoch=1, index=i, entry_digest=entry(i)))
        for n in "abc":
            h[n].append(ev(n, "apply", t + 0.2, epoch=1, index=i, entry_digest=entry(i), state_digest=state(i), detail={"finite": True}))
    h["nemesis"].append(ev("nemesis", "fault", 4.0, detail={"action": "kill", "target": "a", "coordinator": True}))
    h["c"].append(ev("c", "vote", 5.9, epoch=2, detail={"for": "b"}))
    h["b"].append(ev("b", "lease_acquired", 6.0, epoch=2, index=3))
    h["b"].append(ev("b", "append", 6.5, epoch=2, index=4, entry_digest=entry(4)))
    h["c"].append(ev("c", "append", 6.5, epoch=2, index=4, entry_digest=entry(4)))
    h["b"].append(ev("b", "commit", 7.0, epoch=2, index=4, entry_digest=entry(4)))
    for n in "bc":
        h[n].append(ev(n, "apply", 7.1, epoch=2, index=4, entry_digest=entry(4), state_digest=state(4)))
    h["nemesis"].append(ev("nemesis", "heal", 8.0, detail={"action": "restart", "target": "a"}))
    h["a"].append(ev("a", "start", 8.5, epoch=1, index=2))
    h["a"].append(ev("a", "apply", 8.6, epoch=1, index=3, entry_digest=entry(3), state_digest=state(3)))
    h["a"].append(ev("a", "append", 8.7, epoch=2, index=4, entry_digest=entry(4)))
    h["a"].append(ev("a", "apply", 8.8, epoch=2, index=4, entry_digest=entry(4), state_digest=state(4)))
    for n in "abc":
        h["nemesis"].append(ev("nemesis", "final", 10.0, index=4, state_digest=state(4), detail={"target": n, "finite": True}))
    return h


def replace(h: dict[str, list[HistoryEvent]], node: str, position: int, event: HistoryEvent) -> None:
    h[node][position] = event


def invariants(h) -> set[str]:
    return {v.invariant for v in check_histories(h)}


def test_clean_history_passes():
    h = clean_run()
    assert check_histories(h) == []
    assert [f.node for f in final_states_from(h)] == ["a", "b", "c"]


def test_two_different_entries_at_one_index():
    h = clean_run()
    # c applies something else at index 2 (same position in its history)
    i = next(k for k, e in enumerate(h["c"]) if e.kind == "apply" and e.index == 2)
    replace(h, "c", i, ev("c", "apply", 2.2, epoch=1, index=2, entry_digest="forged", state_digest=state(2)))
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"one_entry_per_index"}
    assert "index 2: c apply entry forged" in violations[0].message


def test_committed_index_missing_after_failover():
    h = clean_run()
    i = next(k for k, e in enumerate(h["b"]) if e.kind == "lease_acquired")
    replace(h, "b", i, ev("b", "lease_acquired", 6.0, epoch=2, index=2))  # b never got index 3
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"committed_index_lost"}
    assert "b took the lease for epoch 2 with log up to index 2, but index 3 was committed by a" in violations[0].message


def test_a_node_ending_below_the_committed_index_lost_it():
    h = clean_run()
    finals = final_states_from(h)
    finals[2] = FinalState("c", 3, state(3), t_mono=10.0)
    found = {v.invariant: v.message for v in check_histories(h, finals)}
    assert "committed_index_lost" in found
    assert found["committed_index_lost"].startswith("c ended at index 3, but index 4 was committed")
    assert found["not_converged"] == "after healing the live nodes never reached one index: c@3, a@4, b@4"
    assert "digest_divergence" not in found  # c's state is the right one for index 3


def test_a_node_ending_with_its_state_not_current_is_behind_not_divergent():
    h = clean_run()
    finals = final_states_from(h)
    finals[2] = FinalState("c", 3, "", t_mono=10.0)  # /status named no digest: state not current
    found = {v.invariant: v.message for v in check_histories(h, finals)}
    assert found["committed_index_lost"].startswith("c ended at index 3, but index 4 was committed")
    assert "not_converged" in found
    assert "digest_divergence" not in found


def test_epoch_going_down_on_a_node():
    h = clean_run()
    h["b"].append(ev("b", "vote", 9.0, epoch=1, detail={"for": "a"}))
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"epoch_regressed"}
    assert violations[0].message.startswith("b vote at epoch 1 after")


def test_live_sites_on_different_digests_at_the_same_index():
    h = clean_run()
    h["nemesis"][-1] = ev("nemesis", "final", 10.0, index=4, state_digest="other", detail={"target": "c"})
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"digest_divergence"}
    assert any("after healing c and a are both at index 4 but on states other and s4" in v.message for v in violations)


def test_replicas_applying_one_entry_to_different_states():
    h = clean_run()
    i = next(k for k, e in enumerate(h["c"]) if e.kind == "apply" and e.index == 1)
    replace(h, "c", i, ev("c", "apply", 1.2, epoch=1, index=1, entry_digest=entry(1), state_digest="drift"))
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"digest_divergence"}
    assert "after applying the same entry e1" in violations[0].message


def test_every_divergent_index_is_reported_against_the_digest_most_nodes_had():
    """The issue's shape: one node applies two indices onto a state it did not hold; it is named at
    each of them, with the entry and both digests, even where it was the first to report."""
    h = clean_run()
    for index in (2, 3):
        i = next(k for k, e in enumerate(h["a"]) if e.kind == "apply" and e.index == index)
        replace(h, "a", i, ev("a", "apply", h["a"][i].t_mono, epoch=1, index=index, entry_digest=entry(index),
                             state_digest=f"stale{index}"))
    divergent = [v for v in check_histories(h) if v.invariant == "digest_divergence"]
    messages = sorted(v.message for v in divergent if "after applying" in v.message)
    assert len(messages) == 2, messages
    assert messages[0].startswith("index 2: a has state stale2 but ") and "had s2 after applying the same entry e2" in messages[0]
    assert messages[1].startswith("index 3: a has state stale3 but ") and "had s3 after applying the same entry e3" in messages[1]


def test_non_finite_parameters_flag():
    h = clean_run()
    i = next(k for k, e in enumerate(h["b"]) if e.kind == "apply" and e.index == 4)
    replace(h, "b", i, ev("b", "apply", 7.1, epoch=2, index=4, entry_digest=entry(4), state_digest=state(4), detail={"finite": False}))
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"non_finite"}
    assert "b reports non-finite global parameters after applying index 4" in violations[0].message


def test_two_leaders_in_one_epoch():
    h = clean_run()
    h["c"].append(ev("c", "lease_acquired", 6.2, epoch=2, index=3))
    assert invariants(h) == {"two_leaders"}


def test_apply_gap_within_a_lifetime_but_replay_after_restart_is_fine():
    h = clean_run()
    i = next(k for k, e in enumerate(h["c"]) if e.kind == "apply" and e.index == 2)
    del h["c"][i]  # c jumps 1 -> 3
    violations = check_histories(h)
    assert {v.invariant for v in violations} == {"apply_gap"}
    assert "c applied index 3 right after 1 (a gap" in violations[0].message


def test_checker_reads_what_the_writer_wrote(tmp_path):
    """The full path: histories on disk -> load -> check, with a planted divergence."""
    h = clean_run()
    h["nemesis"][-1] = ev("nemesis", "final", 10.0, index=4, state_digest="other", detail={"target": "c"})
    paths = []
    for node, events in h.items():
        path = tmp_path / node / "history.jsonl"
        now = [0.0]  # the writer's clocks read each synthetic event's own time
        w = HistoryWriter(path, node, fsync="never", wall_clock=lambda now=now: 1.7e9 + now[0],
                          mono_clock=lambda now=now: now[0])
        for e in events:
            now[0] = e.t_mono
            w.record(e.kind, epoch=e.epoch, index=e.index, entry_digest=e.entry_digest, state_digest=e.state_digest,
                     fragment=e.fragment, round=e.round, detail=e.detail)
        w.close()
        assert load_histories([path])[node] == events
        paths.append(path)
    loaded = load_histories(paths)
    assert invariants(loaded) == {"digest_divergence"}


# ---------------------------------------------------------------------------------------------
# metrics on a hand-made run (numbers worked out in the comments)


def metrics_run() -> dict[str, list[HistoryEvent]]:
    """Learners a and b over [0, 10]. b is killed at 4.5 (it was coordinator), restarts at 6.
    Commits: 1@2 [a,b], 2@4 [a,b], 3@5 [a], 4@8 [a,b], 5@9.5 [a,b]."""
    h: dict[str, list[HistoryEvent]] = {"a": [], "b": [], "c": [], "nemesis": []}
    h["a"].append(ev("a", "start", 0.0))
    h["b"].append(ev("b", "start", 0.0))
    h["a"].append(ev("a", "lease_acquired", 0.5, epoch=1, index=0))
    h["a"].append(ev("a", "lease_lost", 3.1, epoch=1))
    h["b"].append(ev("b", "lease_acquired", 3.0, epoch=2, index=0))
    for t in range(1, 11):  # a: ten steps of 1 s, all merged or pending at the end: 10 s
        h["a"].append(ev("a", "step", float(t), detail={"steps": 4, "tokens": 512, "productive_s": 1.0}))
    for t in (1.0, 2.0, 3.0, 4.2, 7.0, 8.0, 9.0, 10.0):  # 4.2 is lost to the kill: 7 s productive
        h["b"].append(ev("b", "step", t, detail={"steps": 4, "tokens": 512, "productive_s": 1.0}))
    h["b"].append(ev("b", "start", 6.0))
    h["a"].append(ev("a", "lease_acquired", 7.0, epoch=3, index=3))
    for index, t, who in ((1, 2.0, ["a", "b"]), (2, 4.0, ["a", "b"]), (3, 5.0, ["a"]), (4, 8.0, ["a", "b"]), (5, 9.5, ["a", "b"])):
        h["a"].append(ev("a", "commit", t, epoch=3, index=index, entry_digest=entry(index), detail={"contributors": who}))
        h["b"].append(ev("b", "commit", t + 0.05, epoch=3, index=index, entry_digest=entry(index)))
    for t in (6.0, 7.0, 8.0, 9.0, 10.0):  # c joins at 5: five steps, never crashed: 5 s
        h["c"].append(ev("c", "step", t, detail={"steps": 1, "tokens": 128, "productive_s": 1.0}))
    h["nemesis"].append(ev("nemesis", "fault", 4.5, detail={"action": "kill", "target": "b", "coordinator": True}))
    h["nemesis"].append(ev("nemesis", "fault", 5.5, detail={"action": "stop", "target": "a", "coordinator": True}))
    h["nemesis"].append(ev("nemesis", "fault", 6.5, detail={"action": "kill", "target": "c", "coordinator": False}))
    for node in h:
        h[node].sort(key=lambda e: e.t_mono)
    return h


def test_commit_times_take_the_first_event_per_index():
    commits = commit_times(metrics_run())
    assert [(c.index, c.t_mono) for c in commits] == [(1, 2.0), (2, 4.0), (3, 5.0), (4, 8.0), (5, 9.5)]
    assert commits[2].contributors == frozenset({"a"})


def test_productive_seconds_discount_work_lost_to_a_crash():
    h = metrics_run()
    commits = commit_times(h)
    assert productive_seconds(h["a"], "a", commits, 0, 10) == (10.0, 0.0)
    assert productive_seconds(h["b"], "b", commits, 0, 10) == (7.0, 1.0)


def test_goodput_equals_the_hand_computed_value():
    h = metrics_run()
    assert goodput(h, {"a": (0, 10), "b": (0, 10)}, 0, 10) == pytest.approx(17 / 20)
    # c joined at 5: owed 5 s, all productive -> (10 + 7 + 5) / (10 + 10 + 5)
    assert goodput(h, {"a": (0, 10), "b": (0, 10), "c": (5, 10)}, 0, 10) == pytest.approx(22 / 25)


def test_gaps_and_uptime_equal_the_hand_computed_values():
    commits = commit_times(metrics_run())
    assert commit_gaps(commits, 0, 10) == pytest.approx([2.0, 2.0, 1.0, 3.0, 1.5, 0.5])
    # allowing 2 s between commits, only the 3 s gap stalls, by 1 s: 1 - 1/10
    assert uptime(commits, 0, 10, stall_after_s=2.0) == pytest.approx(0.9)
    assert uptime(commits, 0, 10, stall_after_s=0.0) == pytest.approx(0.0)
    assert uptime(commits, 0, 10, stall_after_s=1.0) == pytest.approx(1 - (1 + 1 + 2 + 0.5) / 10)


def test_failover_is_coordinator_death_to_next_commit():
    failovers, unrecovered = failover_times(metrics_run())
    assert failovers == pytest.approx([0.5, 2.5])  # 4.5 -> 5.0 and 5.5 -> 8.0; c's kill is not a failover
    assert unrecovered == 0
    failovers, unrecovered = failover_times(metrics_run(), t1=7.0)
    assert (failovers, unrecovered) == (pytest.approx([0.5]), 1)
    assert percentile([0.5, 2.5], 50) == pytest.approx(1.5)
    assert percentile([0.5, 2.5], 99) == pytest.approx(2.48)
    assert percentile([], 50) is None


def test_lease_holder_from_histories():
    h = metrics_run()
    assert lease_holder_at(h, 0.1) is None
    assert lease_holder_at(h, 1.0) == "a"
    assert lease_holder_at(h, 3.5) == "b"
    assert lease_holder_at(h, 6.5) is None  # b restarted at 6 and has not won again
    assert lease_holder_at(h, 7.5) == "a"


def test_measure_report_shape():
    report = measure(metrics_run(), {"a": (0, 10), "b": (0, 10)}, 0, 10, stall_after_s=2.0).to_report()
    assert report["goodput"] == 0.85 and report["uptime"] == 0.9 and report["max_commit_gap_s"] == 3.0
    assert report["failover_s"] == {"p50": 1.5, "p99": 2.48, "all": [0.5, 2.5], "unrecovered": 0}
    assert report["commits"] == 5 and report["lost_learner_s"] == 1.0


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="t1 > t0"):
        commit_gaps([], 5, 5)
    with pytest.raises(ValueError, match="no learner"):
        goodput(metrics_run(), {"a": (20, 30)}, 0, 10)


def test_a_commit_after_the_final_probe_is_not_a_loss():
    h = clean_run()
    h["b"].append(ev("b", "commit", 10.5, epoch=2, index=5, entry_digest=entry(5)))  # after finals (t=10)
    assert check_histories(h) == []
    h["b"][-1] = ev("b", "commit", 9.5, epoch=2, index=5, entry_digest=entry(5))  # before: a loss
    assert invariants(h) == {"committed_index_lost"}


def test_stale_leader_step_down_after_sigcont():
    from diloco_node.testbed.chaos.metrics import step_down_times

    h = {"a": [ev("a", "lease_acquired", 1.0, epoch=1, index=0), ev("a", "lease_lost", 9.3, epoch=2)],
         "b": [ev("b", "lease_acquired", 6.0, epoch=2, index=4)],
         "nemesis": [ev("nemesis", "fault", 5.0, detail={"action": "stop", "target": "a", "coordinator": True, "fault": 0}),
                     ev("nemesis", "heal", 9.0, detail={"action": "stop", "target": "a", "fault": 0})]}
    times, never = step_down_times(h)
    assert times == pytest.approx([0.3]) and never == 0
    h["a"].pop()  # a never noticed it was superseded
    assert step_down_times(h) == ([], 1)
    h["b"][0] = ev("b", "lease_acquired", 9.5, epoch=2, index=4)  # elected only after SIGCONT: not stale
    assert step_down_times(h) == ([], 0)
