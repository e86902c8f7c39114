"""Storage and clock faults in the chaos engine: schedules that draw them keep every constraint,
the failpoints a full or failing disk arms, files damaged at rest, and the stand-in's checkpoint
catching the damage."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from diloco_node.ops.debug_routes import DEBUG_ENV_VAR
from diloco_node.storage import failpoints
from diloco_node.testbed.chaos import standin
from diloco_node.testbed.chaos.harness import ChaosConfig, DaemonLauncher, corrupt_file, storage_fault_spec
from diloco_node.testbed.chaos.schedule import (
    CORRUPTIONS,
    CRASH_POINTS,
    DEFAULT_WEIGHTS,
    STORAGE_ACTIONS,
    STORAGE_FAULT_WEIGHTS,
    Fault,
    Schedule,
    ScheduleError,
    ScheduleSpec,
    check_schedule,
    generate,
)

SOAK = ScheduleSpec(nodes=("n1", "n2", "n3"), joiners=("n4",), duration_s=300, lease_s=3.0, faults=20,
                    degrade_s=(3.0, 10.0), weights={**DEFAULT_WEIGHTS, **STORAGE_FAULT_WEIGHTS})


def test_schedules_with_storage_faults_keep_the_constraints_and_draw_every_kind():
    drawn = set()
    for seed in range(25):
        schedule = generate(seed, SOAK)
        assert check_schedule(schedule, SOAK) == []
        grid = [i * 0.1 for i in range(int(SOAK.duration_s / 0.1))]
        # a full or failing disk, a crash at a fsync and a corruption each count as the node down
        assert max(sum(1 + len(f.side) for f in schedule.faults if f.is_outage and f.at_s <= t < f.end_s)
                   for t in grid) <= 1
        assert Schedule.from_dict(json.loads(schedule.to_json())) == schedule
        drawn |= {f.action for f in schedule.faults}
        assert {f.action for f in schedule.faults} >= STORAGE_ACTIONS | {"clock_jump"}  # each at least once
        for f in schedule.faults:
            assert (f.how in CRASH_POINTS) if f.action == "crash_at_fsync" else True
            assert (f.how in CORRUPTIONS) if f.action == "corrupt" else True
            assert (abs(f.param) == 3600.0) if f.action == "clock_jump" else True
    assert drawn >= STORAGE_ACTIONS | {"clock_jump"}
    assert all(Fault(0, a, "n1", 1, how=_how(a)).is_outage for a in STORAGE_ACTIONS)


def _how(action: str) -> str:
    return {"crash_at_fsync": CRASH_POINTS[0], "corrupt": CORRUPTIONS[0]}.get(action, "")


def test_corruptions_can_be_narrowed_and_a_bad_one_is_refused():
    spec = ScheduleSpec(**{**{f: getattr(SOAK, f) for f in ("nodes", "joiners", "duration_s", "lease_s", "faults",
                                                            "degrade_s", "weights")}, "corruptions": ("checkpoint:flip",)})
    hows = {f.how for seed in range(10) for f in generate(seed, spec).faults if f.action == "corrupt"}
    assert hows == {"checkpoint:flip"}
    with pytest.raises(ScheduleError, match="corruptions"):
        ScheduleSpec(nodes=("n1", "n2", "n3"), duration_s=100, lease_s=3, faults=4, corruptions=("disk:melt",))


def test_storage_faults_are_drawn_only_when_asked_for():
    plain = ChaosConfig(workdir=".", duration_s=300, faults=20).schedule_spec()
    assert set(plain.weights) == set(DEFAULT_WEIGHTS)
    with_storage = ChaosConfig(workdir=".", duration_s=300, faults=20, storage_faults=True).schedule_spec()
    assert set(with_storage.weights) == set(DEFAULT_WEIGHTS) | set(STORAGE_FAULT_WEIGHTS)


@pytest.mark.parametrize("fault, error", [
    (dict(action="crash_at_fsync", how="log.append=eio"), "expected one of"),
    (dict(action="corrupt", how="identity:flip"), "expected one of"),
    (dict(action="kill", how="checkpoint:flip"), "only crash_at_fsync and corrupt have a how"),
    (dict(action="clock_jump"), "needs param"),
])
def test_malformed_storage_faults_are_refused_by_name(fault, error):
    with pytest.raises(ScheduleError, match=error):
        Fault(1.0, target="n1", duration_s=1.0, **fault)


def test_a_full_disk_fails_every_write_and_a_failing_one_reads_too_but_the_history_is_spared():
    full = failpoints.parse(storage_fault_spec("disk_full"))
    failing = failpoints.parse(storage_fault_spec("io_error"))
    writes = {p for p in failpoints.POINTS if not p.endswith(".read")} - {"history.write"}
    assert set(full) == writes and {a.action for a in full.values()} == {"enospc"}
    assert set(failing) == set(failpoints.POINTS) - {"history.write"} and {a.action for a in failing.values()} == {"eio"}
    with pytest.raises(ValueError, match="no failpoint spec"):
        storage_fault_spec("kill")


def test_daemons_are_started_with_failpoints_allowed_and_none_armed():
    env = DaemonLauncher().env()
    assert env[DEBUG_ENV_VAR] == "1" and failpoints.ENV_VAR not in env


def test_files_are_damaged_at_rest_by_a_bit_flip_or_a_truncation(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(64))
    assert corrupt_file(path, "flip", random.Random(1)).startswith("f.bin: flipped a bit at byte ")
    data = path.read_bytes()
    assert len(data) == 64 and sum(bin(b).count("1") for b in data[32:]) == 1 and data[:32] == bytes(32)
    assert corrupt_file(path, "truncate", random.Random(1)) == "f.bin: truncated from 64 to 56 bytes"
    assert corrupt_file(tmp_path / "none", "flip", random.Random(1)) == "skipped: no file to flip"


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_the_standins_checkpoint_detects_damage(tmp_path, how):
    path = tmp_path / "checkpoint.json"
    standin._write_checkpoint(path, {"applied": 7, "digest": "abc", "epoch": 3})
    assert standin._read_checkpoint(path) == {"applied": 7, "digest": "abc", "epoch": 3}
    for seed in range(20):  # a flip in the JSON syntax or in the CRC digits alike
        standin._write_checkpoint(path, {"applied": 7, "digest": "abc", "epoch": 3})
        corrupt_file(path, how, random.Random(seed))
        with pytest.raises(ValueError):
            standin._read_checkpoint(path)
    assert standin._read_checkpoint(tmp_path / "absent.json") is None


async def test_a_node_still_starting_is_armed_once_it_answers_and_not_after_the_heal(tmp_path, monkeypatch):
    import time

    from diloco_node.testbed.chaos import harness
    from diloco_node.testbed.chaos.harness import ModeRun

    monkeypatch.setattr(harness, "ARM_RETRY_S", 0.01)

    answers = iter(["skipped: connection refused", "skipped: connection refused", "ok"])

    async def arm() -> str:
        return next(answers)

    run = ModeRun(ChaosConfig(workdir=tmp_path), Schedule(1, 60, ()), "decoupled", DaemonLauncher())
    run.t0 = time.monotonic()
    assert run._arm(0, Fault(0.0, "disk_full", "n1", 5.0), arm) == "arming"
    while not run.arming[0].done():
        await asyncio.sleep(0.05)
    assert await run._armed(0) == "ok"

    async def never() -> str:
        return "skipped: connection refused"

    run._arm(1, Fault(0.0, "disk_full", "n1", 5.0), never)
    assert await run._armed(1) == "not armed before the heal" and await run._armed(2) == "never tried"


def test_the_chaos_command_draws_storage_faults_and_only_the_corruptions_asked_for(capsys):
    """`diloco-node chaos --storage-faults --corruptions` reaches the schedule as the benchmark's do."""
    from diloco_node import cli

    argv = ["chaos", "--schedule-only", "--seed", "3", "--duration", "600", "--faults", "24"]
    assert cli.main([*argv, "--storage-faults", "--corruptions", "log:truncate"]) == 0
    faults = json.loads(capsys.readouterr().out)["faults"]
    assert {f["action"] for f in faults} & set(STORAGE_ACTIONS)
    assert {f["how"] for f in faults if f["action"] == "corrupt"} == {"log:truncate"}
    assert cli.main(argv) == 0  # without the flag: no storage fault drawn
    assert not {f["action"] for f in json.loads(capsys.readouterr().out)["faults"]} & set(STORAGE_ACTIONS)
    assert cli.main([*argv, "--storage-faults", "--corruptions", "log:bogus"]) == 2
    assert "log:bogus" in capsys.readouterr().err


class _Supervisor:
    """Records what the harness asks of the processes (a running-log corruption kills nothing)."""

    def __init__(self, alive: bool) -> None:
        self.calls: list[str] = []
        self._alive = alive

    def kill(self, node: str) -> None:
        self.calls.append(f"kill {node}")

    def restart(self, node: str) -> None:
        self.calls.append(f"restart {node}")

    def alive(self, node: str) -> bool:
        return self._alive

    def returncode(self, node: str) -> int:
        return 75


class _Nemesis:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def record(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))


@pytest.mark.parametrize("alive_at_heal", [True, False])
async def test_a_running_nodes_log_is_damaged_without_a_kill_and_restarted_only_if_it_exited(tmp_path, alive_at_heal):
    import time
    from pathlib import Path

    from diloco_node.testbed.chaos.harness import ModeRun, NodeSlot

    fault = Fault(0.0, "corrupt", "n1", 5.0, how="log:flip-running")
    assert "while it runs" in fault.describe() and "SIGKILL" not in fault.describe()
    data = tmp_path / "n1"
    (data / "coordination").mkdir(parents=True)
    log_bin = data / "coordination" / "log.bin"
    log_bin.write_bytes(bytes(256))
    run = ModeRun(ChaosConfig(workdir=tmp_path), Schedule(1, 60, (fault,)), "decoupled", DaemonLauncher())
    run.t0 = time.monotonic()
    run.slots["n1"] = NodeSlot("n1", "learner", 1, "127.0.0.1:1", "127.0.0.11", data, Path(tmp_path / "n1.log"), True)
    sup, nemesis = _Supervisor(alive=True), _Nemesis()
    await run._inject(sup, nemesis, 0, fault)
    assert sup.calls == [] and sum(bin(b).count("1") for b in log_bin.read_bytes()) == 1
    assert nemesis.events[-1][1]["note"].startswith("log.bin: flipped a bit at byte ")
    sup._alive = alive_at_heal
    await run._heal(sup, nemesis, 0, fault)
    heal = nemesis.events[-1][1]
    if alive_at_heal:
        assert sup.calls == [] and heal["note"] == "running"
    else:  # it exited on the damage it found: restarted, as systemd would, and the exit recorded
        assert sup.calls == ["restart n1"] and heal["exit_code"] == 75
