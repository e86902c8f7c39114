"""Wall clock jumps (NTP stepping an hour either way, a drifting oscillator) change no lease,
timeout or quorum decision: the daemon decides on monotonic time. What deliberately uses wall
time ([run.stop] wall_s, history timestamps) behaves as docs/CHAOS.md says."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from bootstrap.coordinator_node import CoordinatorNode, PersistentState
from bootstrap.entries import EntryKind
from diloco_node import clock as clock_module
from diloco_node.clock import FakeClock, SystemClock, set_wall_skew, wall_skew
from diloco_node.daemon.coordination import CoordinationIO
from diloco_node.daemon.peers import AddressBook
from diloco_node.daemon.tasks import TaskSet
from diloco_node.ops.history import HistoryEvent
from diloco_node.sync.replica import StopSpec
from diloco_node.testbed.chaos.checker import check_histories
from diloco_node.testbed.chaos.metrics import measure

from conftest import NoDisk
from test_run_stop import _commit, _replica

ROOT = Path(__file__).resolve().parents[1]


def test_the_fake_clock_steps_and_drifts_its_wall_time_alone():
    clock = FakeClock(100.0)
    clock.jump_wall(3600.0)
    assert (clock.monotonic(), clock.wall()) == (100.0, 3700.0)
    clock.drift_wall(0.01)
    clock.advance(100.0)
    assert clock.monotonic() == 200.0 and clock.wall() == pytest.approx(3801.0)
    clock.jump_wall(-7200.0)
    assert clock.wall() == pytest.approx(200.0 - 3600.0 + 1.0)


def test_the_system_clock_wall_skew_moves_wall_time_only_and_is_bounded():
    system = SystemClock()
    try:
        assert wall_skew() == {"offset_s": 0.0, "drift_rate": 0.0}
        assert set_wall_skew(-3600.0, 0.001) == {"offset_s": -3600.0, "drift_rate": 0.001}
        assert system.wall() == pytest.approx(time.time() - 3600.0, abs=1.0)
        assert system.monotonic() == pytest.approx(time.monotonic(), abs=1.0)  # untouched
        with pytest.raises(ValueError, match="offset must be within"):
            set_wall_skew(1e9)
        with pytest.raises(ValueError, match="drift rate must be within"):
            set_wall_skew(0.0, 0.5)
    finally:
        set_wall_skew(0.0)
    assert system.wall() == pytest.approx(time.time(), abs=1.0)


class _Silent:
    """A peer client whose peers never answer (a holder that must step down, candidates that time out)."""

    async def send(self, url, message, *, peer, deadline_s):
        return []


async def _decisions(voters: list[str], jumps: dict[int, tuple[str, float]]) -> tuple[list[tuple], list[float]]:
    """The coordination I/O's core over 30 s of ticks (proposing now and then), with the wall clock
    moved at given ticks: every decision it takes (role, epoch, election deadline, pre-vote round,
    lease, vote, commit) after each tick, and the wall times."""
    clock = FakeClock(0.0)
    core = CoordinatorNode("a", PersistentState.founding(voters), now=0.0, rng=random.Random(3))
    tasks = TaskSet()
    io = CoordinationIO(core=core, persistent=core.persistent, store=NoDisk(), history=NoDisk(), client=_Silent(),
                        addresses=AddressBook({"b": "https://b.example:7070", "c": "https://c.example:7070"}),
                        clock=clock, tasks=tasks, on_apply=lambda entry: None, on_restore_snapshot=lambda s: None,
                        after_step=lambda: None, remember_member=lambda *a: None, report_error=lambda m: None)
    trace, walls = [], []
    try:
        for tick in range(300):
            if tick in jumps:
                how, amount = jumps[tick]
                clock.jump_wall(amount) if how == "jump" else clock.drift_wall(amount)
            io.dispatch(core.tick(clock.monotonic()))
            if tick % 20 == 0 and core.is_lease_holder(clock.monotonic()):
                io.dispatch(core.propose(clock.monotonic(), EntryKind.OUTER_COMMIT, b"x", fragment=0, round=tick)[2])
            election = core.election
            trace.append((tick, core.role.value, core.epoch, election.state.voted_for, election.election_deadline,
                          election.pre_votes, election.won_at, election.lease_until, election.last_step_down_reason,
                          core.log.commit_index, core.log.last_index))
            walls.append(clock.wall())
            clock.advance(0.1)
    finally:
        await tasks.close()
    return trace, walls


JUMPS = {50: ("jump", 3600.0), 120: ("jump", -7200.0), 200: ("drift", 0.05)}


async def test_wall_clock_jumps_and_drift_change_no_lease_or_commit_decision():
    """One voter: it waits out the start-up lease, wins, renews its lease and commits."""
    steady, steady_walls = await _decisions(["a"], {})
    jumped, jumped_walls = await _decisions(["a"], JUMPS)
    assert jumped_walls[60] - steady_walls[60] == pytest.approx(3600.0)  # the jumps did happen
    assert jumped_walls[-1] - steady_walls[-1] == pytest.approx(-3600.0 + 0.05 * 9.9)
    assert steady[-1][1] == "leader" and steady[-1][9] >= 10  # there were decisions to move
    assert jumped == steady


async def test_wall_clock_jumps_and_drift_change_no_election_timeout():
    """Three voters, the others silent: it times out, opens pre-vote rounds, never wins."""
    steady, _ = await _decisions(["a", "b", "c"], {})
    jumped, _ = await _decisions(["a", "b", "c"], JUMPS)
    assert len({t[4] for t in steady}) >= 3  # several election deadlines passed and were re-armed
    assert jumped == steady


def test_only_the_documented_daemon_parts_read_wall_time():
    """Lease, timeouts and quorum run on `clock.monotonic()`; wall time is read where it is
    stamped for other hosts or humans (docs/CHAOS.md, "Clocks")."""
    readers = sorted(path.name for path in (ROOT / "diloco_node" / "daemon").rglob("*.py")
                     if re.search(r"\.wall\b", path.read_text()))
    assert readers == ["history_hooks.py", "identity.py", "lost_entries.py", "rounds.py"]


def test_run_stop_wall_s_follows_the_lease_holders_wall_clock_and_never_runs_back():
    founded = 1_000_000.0
    replica = _replica(StopSpec(wall_s=600.0), founded)
    assert replica.apply(_commit(replica, 1, 0, 1, 1, wall=founded + 30)).applied
    # The holder's clock stepped back an hour: its next commit is planned "before" the first,
    # and the elapsed wall time the run goes by does not go back with it.
    assert replica.apply(_commit(replica, 2, 1, 1, 1, wall=founded + 40 - 3600)).applied
    assert replica.completion() is None and max(replica.commit_wall) == founded + 30
    # It stepped forward an hour: the run is complete at that commit, as documented.
    assert replica.apply(_commit(replica, 3, 0, 1, 1, wall=founded + 50 + 3600)).applied
    assert replica.completion() == f"a commit {50 + 3600} s after the run was founded (stop.wall_s = 600)"


def _history(node: str, wall_offset: float) -> list[HistoryEvent]:
    def event(t: float, kind: str, **fields) -> HistoryEvent:
        base = dict(epoch=1, index=None, entry_digest=None, state_digest=None, fragment=None, round=None, detail={})
        return HistoryEvent(t_wall=1.7e9 + t + wall_offset, t_mono=t, node=node, kind=kind, **(base | fields))

    return [event(0.0, "start", index=0), event(1.0, "lease_acquired", index=0) if node == "n1" else event(1.0, "vote"),
            event(2.0, "commit", index=1, entry_digest="e1", detail={"contributors": ["n1", "n2"]}),
            event(2.1, "apply", index=1, entry_digest="e1", state_digest="s1", detail={"finite": True}),
            event(3.0, "step", detail={"steps": 10, "tokens": 100, "productive_s": 1.0})]


def test_the_checker_and_metrics_never_read_history_wall_times():
    steady = {"n1": _history("n1", 0.0), "n2": _history("n2", 0.0)}
    jumped = {"n1": _history("n1", 3600.0), "n2": _history("n2", -3600.0)}
    assert check_histories(jumped) == check_histories(steady) == []
    windows = {"n1": (0.0, 4.0), "n2": (0.0, 4.0)}
    assert measure(jumped, windows, 0.0, 4.0, 1.0) == measure(steady, windows, 0.0, 4.0, 1.0)


def test_the_clock_module_keeps_one_skew_for_the_process():
    assert clock_module._wall_skew.describe() == wall_skew()
