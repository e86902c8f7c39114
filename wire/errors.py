"""Protocol errors shared by every sans-IO component.

Modelled on h11: a peer's garbage raises `RemoteProtocolError`, our own misuse raises
`LocalProtocolError`. Both carry the HTTP status an I/O edge should answer with, so the
transport never has to guess. Any other exception escaping a decoder is a bug.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of both error kinds; `status_hint` is the HTTP status to answer with."""

    def __init__(self, message: str, status_hint: int = 400) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError, not ProtocolError")
        super().__init__(message)
        self.status_hint = status_hint


class LocalProtocolError(ProtocolError):
    """We tried to do something the protocol forbids (a bug or misuse on our side)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something invalid: malformed, unauthenticated, too large, or stale.

    Status hints: 400 malformed, 401 bad or replayed MAC, 409 wrong run or stale epoch,
    413 too large, 426 unsupported wire version, 429 too many concurrent streams.
    """
