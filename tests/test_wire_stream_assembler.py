"""The receiver both streams share (wire/stream_assembler.py): a streamed contribution (wire 2.1)
and a streamed relayed payload (wire 2.3) obey the same rules, checked here on each of them the
same way: the stream id, nothing after the last chunk, dead after the first refusal, a short stream
refused at its end, and the body bound the transport reads going down chunk by chunk."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
import pytest

from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for
from wire.errors import RemoteProtocolError
from wire.limits import Limits
from wire.messages import PayloadChunk, PayloadOpen
from wire.payload_stream import PayloadAssembler, chunk_spans
from wire.stream_assembler import StreamAssembler

STREAM = b"s" * 16
OTHER_STREAM = b"o" * 16


@dataclasses.dataclass
class Stream:
    """One stream as its receiver sees it: a fresh receiver, the chunks in order, and its end."""

    open_receiver: Callable[[], StreamAssembler[Any, Any]]
    chunks: list[Any]
    finish: Callable[[StreamAssembler[Any, Any]], object]


def _contribution() -> Stream:
    rng = np.random.default_rng(0)
    delta = {"a": rng.normal(size=(40,)).astype(np.float32), "b": rng.normal(size=(24,)).astype(np.float32)}
    shapes = {name: values.shape for name, values in delta.items()}
    limits = Limits(max_chunk_elements=16)  # several chunks per tensor
    head = open_for(shapes, fragment=0, base_index=1, base_round=0, c_steps=4, c_tokens=64, codec="fp32",
                    learner_id="site-a", stream=STREAM, limits=limits)
    return Stream(lambda: ContributionAssembler(head, shapes, limits), list(contribution_chunks(head, delta)),
                  lambda receiver: receiver.finish())


def _payload() -> Stream:
    payload = bytes(range(256)) * 10
    head = PayloadOpen(STREAM, blake3.blake3(payload).digest(), len(payload), 1024, "a", {"b": "a"})
    chunks = [PayloadChunk(STREAM, offset, payload[offset:offset + length])
              for offset, length in chunk_spans(len(payload), 1024)]
    return Stream(lambda: PayloadAssembler(head, max_size=len(payload)), chunks,
                  lambda receiver: receiver.finish(blake3.blake3(payload).digest()))


STREAMS = {"contribution": (_contribution, "streamed contribution refused: "),
           "payload": (_payload, "streamed payload refused: ")}


@pytest.fixture(params=sorted(STREAMS))
def stream(request: pytest.FixtureRequest) -> tuple[Stream, str]:
    make, prefix = STREAMS[request.param]
    return make(), prefix


def test_a_whole_stream_passes_and_the_body_bound_goes_down_to_nothing(stream: tuple[Stream, str]) -> None:
    made, _ = stream
    receiver = made.open_receiver()
    assert len(made.chunks) >= 3 and receiver.chunks_left == len(made.chunks)
    bounds = [receiver.max_remaining_bytes]
    for chunk in made.chunks:
        assert not receiver.complete
        receiver.add(chunk)
        bounds.append(receiver.max_remaining_bytes)
    assert receiver.complete and receiver.chunks_left == 0 and bounds[-1] == 0
    assert bounds == sorted(bounds, reverse=True) and len(set(bounds)) == len(bounds)  # each chunk takes its share
    made.finish(receiver)


def test_a_chunk_of_another_stream_is_refused_and_the_receiver_is_dead_after(stream: tuple[Stream, str]) -> None:
    made, prefix = stream
    receiver = made.open_receiver()
    receiver.add(made.chunks[0])
    stranger = dataclasses.replace(made.chunks[1], stream=OTHER_STREAM)
    with pytest.raises(RemoteProtocolError) as refused:
        receiver.add(stranger)
    assert str(refused.value) == prefix + "a chunk of another stream (its stream id differs from the open's)"
    assert refused.value.status_hint == 400
    # The right chunk, and the end, are refused with the first refusal from now on.
    for late in (lambda: receiver.add(made.chunks[1]), lambda: made.finish(receiver)):
        with pytest.raises(RemoteProtocolError, match="the stream already failed: .*a chunk of another stream") as dead:
            late()
        assert str(dead.value).startswith(prefix)


def test_a_chunk_after_the_last_one_is_refused(stream: tuple[Stream, str]) -> None:
    made, prefix = stream
    receiver = made.open_receiver()
    for chunk in made.chunks:
        receiver.add(chunk)
    with pytest.raises(RemoteProtocolError, match="a chunk after the last one") as refused:
        receiver.add(made.chunks[-1])
    assert str(refused.value).startswith(prefix)


def test_a_stream_that_ends_short_is_refused_at_its_end_and_stays_refused(stream: tuple[Stream, str]) -> None:
    made, prefix = stream
    receiver = made.open_receiver()
    for chunk in made.chunks[:-1]:
        receiver.add(chunk)
    assert receiver.chunks_left == 1 and not receiver.complete
    with pytest.raises(RemoteProtocolError, match="the stream ended") as refused:
        made.finish(receiver)
    assert str(refused.value).startswith(prefix)
    with pytest.raises(RemoteProtocolError, match="the stream already failed: short"):
        receiver.add(made.chunks[-1])
