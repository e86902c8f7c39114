"""Permanent failures (bad configuration, refused by the run) exit with statuses the systemd unit
does not restart on; transient ones (a crash, a join that ran out of time) with one it does."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from diloco_node.clock import FakeClock
from diloco_node.config.manifest import RunManifest
from diloco_node.config.settings import ConfigError
from diloco_node.daemon.exits import EXIT_CONFIG, EXIT_FAILED, EXIT_REFUSED, EXIT_STORAGE, PERMANENT, exit_status_for
from diloco_node.daemon.join import JoinRefused, negotiate
from diloco_node.transport import PeerRefused, PeerUnreachable
from wire import messages as wire
from wire.limits import CLOCK_SKEW_ALLOWANCE_S

UNIT = Path(__file__).resolve().parent.parent / "examples" / "systemd" / "diloco-node.service"


class _Client:
    def __init__(self, error: Exception) -> None:
        self.error = error

    async def send(self, url, *messages, **kwargs):
        raise self.error


async def _join_error(error: Exception) -> JoinRefused:
    with pytest.raises(JoinRefused) as refused:
        await negotiate(_Client(error), ["http://p1:1"], SimpleNamespace(run=RunManifest()), "j", "http://j:1",
                        wire.Role.LEARNER, deadline_s=20.0, clock=FakeClock(0.0), rng=random.Random(3))
    return refused.value


@pytest.mark.parametrize("error, status", [
    (PeerRefused("http://p1:1", 401, "bad MAC"), EXIT_REFUSED),  # wrong secret
    (PeerRefused("http://p1:1", 409, "another run"), EXIT_REFUSED),
    (PeerRefused("http://p1:1", 503, "still starting"), EXIT_FAILED),  # the deadline passed
    (PeerUnreachable("http://p1:1", "connection refused"), EXIT_FAILED),
])
async def test_a_join_failure_exits_permanent_or_transient(error: Exception, status: int) -> None:
    assert exit_status_for(await _join_error(error)) == status


def test_configuration_errors_and_contradicting_manifests_are_permanent() -> None:
    assert exit_status_for(ConfigError("[node] listen: bad port")) == EXIT_CONFIG
    assert exit_status_for(JoinRefused("run.sync.period: 16 != 8", permanent=True)) == EXIT_REFUSED
    assert exit_status_for(JoinRefused("fragment 1: download failed 20 times")) == EXIT_FAILED
    assert PERMANENT == {EXIT_CONFIG, EXIT_REFUSED, EXIT_STORAGE} and EXIT_FAILED not in PERMANENT


def _unit_values(key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(key + "=")]


def test_the_unit_does_not_restart_on_permanent_failures() -> None:
    (prevent,) = _unit_values("RestartPreventExitStatus")
    assert {int(s) for s in prevent.split()} == PERMANENT
    assert _unit_values("Restart") == ["on-failure"]


def test_the_unit_starts_after_the_clock_is_synchronised() -> None:
    """Frames stamped outside the receiver's clock window are refused: start after time sync."""
    assert CLOCK_SKEW_ALLOWANCE_S == 30.0  # the window the unit's comment cites
    (after,) = _unit_values("After")
    assert "time-sync.target" in after.split()
    assert "CLOCK_SKEW_ALLOWANCE_S" in UNIT.read_text()
