"""What every receiver of a streamed body shares: one open, then the chunks of that stream in order,
each checked before it is kept, and a receiver that is dead after its first refusal.

Sans-IO and pure. `StreamAssembler` is the base of the two streams the wire has:
`contribution_stream.ContributionAssembler` (wire 2.1, a contribution tensor by tensor) and
`payload_stream.PayloadAssembler` (wire 2.3, a relayed log entry's payload byte range by byte
range). Each says what its chunks are (where the next one starts, how large it may be, what it
holds) and what a whole stream gives; this class does the rest, the same way for both:

- a chunk of another stream (its stream id differs from the open's) is refused, and so is a chunk
  after the last one, before the subclass looks at it;
- the first refusal kills the receiver: every later chunk, and `finish`, is refused with it;
- every refusal is a `RemoteProtocolError` that names the stream's kind ("streamed contribution
  refused: ...", "streamed payload refused: ..."), 400 unless a size was at fault (413);
- `max_remaining_bytes` and `chunks_left` are what the transport bounds the rest of the body with
  (`diloco_node.transport.server.SequenceConsumer`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, Protocol, TypeVar

from wire.errors import RemoteProtocolError


class StreamPart(Protocol):
    """An open or a chunk: every frame of a stream carries its stream id."""

    @property
    def stream(self) -> bytes: ...


OpenT = TypeVar("OpenT", bound=StreamPart)
ChunkT = TypeVar("ChunkT", bound=StreamPart)


class StreamAssembler(ABC, Generic[OpenT, ChunkT]):
    """Checks one stream's chunks in arrival order against its open; dead after its first refusal.

    A subclass names its stream (`KIND`), checks its open in `__init__` (raising `refused(...)`)
    before calling this one's, and implements `complete`, `max_remaining_bytes`, `chunks_left`,
    `_whole` and `_take`; its `finish` starts with `_check_alive()` and refuses with `_fail`.
    """

    # What a refusal names, e.g. "streamed contribution".
    KIND: ClassVar[str]

    def __init__(self, head: OpenT) -> None:
        self.head = head
        self._failed: str | None = None

    @classmethod
    def refused(cls, why: str, status: int = 400) -> RemoteProtocolError:
        """A refusal of this kind of stream (also for its open, before the assembler exists)."""
        return RemoteProtocolError(f"{cls.KIND} refused: {why}", status)

    @property
    @abstractmethod
    def complete(self) -> bool:
        """Every chunk the open announced has come."""

    @property
    @abstractmethod
    def max_remaining_bytes(self) -> int:
        """Most payload bytes the chunks still due can carry."""

    @property
    @abstractmethod
    def chunks_left(self) -> int:
        """Chunks still due."""

    @abstractmethod
    def _whole(self) -> str:
        """What a complete stream held, for the refusal of a chunk after the last one."""

    @abstractmethod
    def _take(self, chunk: ChunkT) -> None:
        """Check and keep (or count) the next chunk of this stream; raise `refused(...)` if it is not."""

    def add(self, chunk: ChunkT) -> None:
        """Check one chunk and keep it; the first refusal is the stream's last word."""
        self._check_alive()
        try:
            if chunk.stream != self.head.stream:
                raise self.refused("a chunk of another stream (its stream id differs from the open's)")
            if self.complete:
                raise self.refused(f"a chunk after the last one ({self._whole()})")
            self._take(chunk)
        except RemoteProtocolError as error:
            self._failed = str(error)
            raise

    def _check_alive(self) -> None:
        if self._failed is not None:
            raise self.refused(f"the stream already failed: {self._failed}")

    def _fail(self, state: str, why: str, status: int = 400) -> RemoteProtocolError:
        """Kill the receiver (`state` is what a later call is told) and return the refusal to raise."""
        self._failed = state
        return self.refused(why, status)
