"""The one gate between the HTTP routes and the node's parts: 503 with a reason until they are built.

The listeners answer before the site's parts exist (the model is built, or the state downloaded,
while /status already answers). Every route that needs the parts asks this gate: while starting it
raises a 503 naming the start-up phase, which peers treat as "try later"; once the node opened it,
it returns the complete parts.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from wire.errors import RemoteProtocolError

Parts = TypeVar("Parts")


class StartingGate(Generic[Parts]):
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.phase = "starting"
        self._parts: Parts | None = None

    def starting(self, phase: str) -> None:
        """Name the start-up phase the 503 answers give as the reason."""
        self.phase = phase

    def open(self, parts: Parts) -> None:
        self._parts = parts

    @property
    def is_open(self) -> bool:
        return self._parts is not None

    def parts(self) -> Parts:
        """The parts, or RemoteProtocolError 503 "still starting: <phase>"."""
        if self._parts is None:
            raise RemoteProtocolError(f"{self.node_id} is still starting: {self.phase}", 503)
        return self._parts

    def parts_if_open(self) -> Parts | None:
        """The parts, or None while starting (for checks that simply pass until then)."""
        return self._parts
