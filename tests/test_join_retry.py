"""A joiner asks bootstrap peers that are starting (503) or unreachable again, with backoff and
jitter, until its deadline; refusals that asking again cannot change end the join at once."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from diloco_node.clock import FakeClock
from diloco_node.config.manifest import RunManifest
from diloco_node.daemon.join import JOIN_RETRY_MAX_S, JoinRefused, join_backoff_s, negotiate
from diloco_node.transport import PeerRefused, PeerUnreachable
from wire import messages as wire


class _Client:
    def __init__(self, error: Exception) -> None:
        self.error, self.calls = error, 0

    async def send(self, url, *messages, **kwargs):
        self.calls += 1
        raise self.error


async def _join(client: _Client, deadline_s: float) -> tuple[list[float], Exception]:
    pauses: list[float] = []

    class Clock(FakeClock):
        async def sleep(self, seconds: float) -> None:
            pauses.append(seconds)
            await super().sleep(seconds)

    with pytest.raises(JoinRefused) as refused:
        await negotiate(client, ["http://p1:1", "http://p2:1"], SimpleNamespace(run=RunManifest()), "j",
                        "http://j:1", wire.Role.LEARNER, deadline_s=deadline_s, clock=Clock(0.0), rng=random.Random(7))
    return pauses, refused.value


async def test_a_starting_peer_is_asked_again_with_backoff_until_the_deadline() -> None:
    client = _Client(PeerRefused("http://p1:1", 503, "p1 is still starting"))
    pauses, error = await _join(client, deadline_s=60.0)
    assert len(pauses) >= 4 and sum(pauses) <= 60.0
    assert pauses[1] > pauses[0] and max(pauses) <= JOIN_RETRY_MAX_S * 1.5  # doubling, capped, jittered
    assert client.calls == 2 * (len(pauses) + 1)  # every round asks every bootstrap peer
    assert "within 60 s" in str(error) and "503" in str(error)


async def test_an_unreachable_peer_is_retried_too_but_a_wrong_secret_ends_at_once() -> None:
    pauses, _ = await _join(_Client(PeerUnreachable("http://p1:1", "connection refused")), deadline_s=5.0)
    assert pauses
    client = _Client(PeerRefused("http://p1:1", 401, "bad MAC"))
    pauses, error = await _join(client, deadline_s=60.0)
    assert pauses == [] and client.calls == 1 and "401" in str(error)


def test_backoff_doubles_and_is_jittered() -> None:
    rng = random.Random(1)
    draws = [join_backoff_s(attempt, rng) for attempt in (1, 2, 3, 10)]
    assert 0.25 <= draws[0] <= 0.75 and 0.5 <= draws[1] <= 1.5 and 1.0 <= draws[2] <= 3.0
    assert JOIN_RETRY_MAX_S * 0.5 <= draws[3] <= JOIN_RETRY_MAX_S * 1.5
