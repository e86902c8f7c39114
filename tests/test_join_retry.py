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


async def test_a_peer_of_another_wire_major_version_ends_the_join_at_once_naming_both() -> None:
    """The handshake's first frame is refused by a node of another major with 426 and both versions."""
    import time

    from wire.auth import AuthContext, FrameVerifier, derive_frame_key
    from wire.errors import RemoteProtocolError
    from wire.frames import FIXED_HEADER, decode_frame, encode_frame

    key = derive_frame_key(b"s" * 32)
    now = time.time()
    frame = bytearray(encode_frame(wire.JoinRequest("j", "http://j:1", wire.Role.LEARNER, bytes(32)),
                                   AuthContext("run", "j", key), now_unix=now, nonce=bytes(16)))
    frame[4:6] = bytes([2, 3])  # what a 2.3 node sends (its MAC does not matter: refused before)
    with pytest.raises(RemoteProtocolError, match=r"wire version 2\.3 is not supported: this node speaks wire 3\.0") as why:
        decode_frame(bytes(frame), FrameVerifier("run", key), now_unix=now)
    assert why.value.status_hint == 426 and FIXED_HEADER.size == 24
    client = _Client(PeerRefused("http://p1:1", 426, str(why.value)))
    pauses, error = await _join(client, deadline_s=60.0)
    assert pauses == [] and client.calls == 1 and "2.3" in str(error) and "3.0" in str(error)


def test_backoff_doubles_and_is_jittered() -> None:
    rng = random.Random(1)
    draws = [join_backoff_s(attempt, rng) for attempt in (1, 2, 3, 10)]
    assert 0.25 <= draws[0] <= 0.75 and 0.5 <= draws[1] <= 1.5 and 1.0 <= draws[2] <= 3.0
    assert JOIN_RETRY_MAX_S * 0.5 <= draws[3] <= JOIN_RETRY_MAX_S * 1.5
