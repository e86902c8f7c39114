"""Frame authentication: the run secret, the derived MAC key, and the checks every received frame passes.

Every frame carries run id, sender, timestamp and nonce in its header map and an HMAC-SHA256 tag
over the fixed header and the header map (which includes the payload's BLAKE3 digest), so a receiver
authenticates a frame before it reads a payload byte. The header map also names the recipient, so
a frame captured on its way to one member is refused by every other. `FrameVerifier` refuses, in
this order: wrong run (409), bad MAC (401), addressed to another node (401), timestamp outside the
skew allowance (401), replayed nonce (401).
`check_epoch` is the epoch fence the coordinator applies to authenticated messages (409).

No I/O except `load_run_secret`, which reads the secret file once at start-up; no clock reads:
`now_unix` is always passed in.
"""

from __future__ import annotations

import heapq
import hmac
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from wire import digest as content_digest
from wire.errors import LocalProtocolError, RemoteProtocolError
from wire.limits import DEFAULT_LIMITS, Limits
from wire.messages import MAX_NODE_ID_CHARS, NODE_ID_PATTERN, MessageKind

MAC_BYTES = 32  # HMAC-SHA256 tag
NONCE_BYTES = 16  # random per frame; 128 bits make accidental reuse impossible in practice
# The run secret is the only thing keeping strangers out of a run: at least 256 bits of it (32 bytes,
# e.g. `head -c 32 /dev/urandom > secret` or 32+ characters of `openssl rand -hex 32`).
MIN_RUN_SECRET_BYTES = 32
# A secret file larger than this is certainly the wrong file (a model checkpoint, a log).
MAX_RUN_SECRET_BYTES = 4096
# HKDF-SHA256 (RFC 5869) labels: a new label gives an unrelated key, so bumping the version of the
# MAC construction can never be confused with the old one.
KDF_SALT = b"diloco-node/wire"
KDF_INFO_FRAME_MAC = b"frame-mac/v1"
# The recipient a frame names when its sender cannot know the receiver's node id: a joiner asks a
# bootstrap address, a download asks whichever peer serves. Only requests that change nothing a
# replay could abuse may be addressed so (a replayed join of a site re-admits that same site).
ANY_MEMBER = ""
ANY_RECIPIENT_KINDS = frozenset({MessageKind.JOIN_REQUEST, MessageKind.SNAPSHOT_REQUEST,
                                 MessageKind.LOG_READ_REQUEST})


class RunSecretError(Exception):
    """The run secret file is unusable; the message says what to fix."""


def load_run_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the run secret from `path`.

    The file's bytes are the secret, minus one trailing newline (so `echo`/`openssl rand -hex`
    output works). Refused with RunSecretError: missing, not a regular file, empty, shorter than
    MIN_RUN_SECRET_BYTES, longer than MAX_RUN_SECRET_BYTES, or readable/writable by "other"
    (world-readable is an error, not a warning: a daemon that starts anyway would leak the run's
    only credential silently; fix with `chmod 600`). Group-readable is allowed so that a service
    group can share the file.
    """
    secret_path = Path(path)
    try:
        info = secret_path.stat()
    except FileNotFoundError:
        raise RunSecretError(f"run secret file {secret_path} does not exist "
                             f"(create it with: head -c 32 /dev/urandom > {secret_path}; chmod 600 {secret_path})") from None
    except OSError as error:
        raise RunSecretError(f"run secret file {secret_path} cannot be read: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise RunSecretError(f"run secret {secret_path} is not a regular file")
    if info.st_mode & (stat.S_IROTH | stat.S_IWOTH):
        raise RunSecretError(f"run secret file {secret_path} is accessible by other users "
                             f"(mode {stat.S_IMODE(info.st_mode):o}); run: chmod 600 {secret_path}")
    if info.st_size > MAX_RUN_SECRET_BYTES:
        raise RunSecretError(f"run secret file {secret_path} is {info.st_size} bytes, more than "
                             f"{MAX_RUN_SECRET_BYTES}: is this the right file?")
    try:
        secret = secret_path.read_bytes()
    except OSError as error:
        raise RunSecretError(f"run secret file {secret_path} cannot be read: {error.strerror}") from None
    if secret.endswith(b"\r\n"):
        secret = secret[:-2]
    elif secret.endswith(b"\n"):
        secret = secret[:-1]
    if not secret:
        raise RunSecretError(f"run secret file {secret_path} is empty")
    if len(secret) < MIN_RUN_SECRET_BYTES:
        raise RunSecretError(f"run secret in {secret_path} is {len(secret)} bytes; at least "
                             f"{MIN_RUN_SECRET_BYTES} are required")
    return secret


@dataclass(frozen=True, slots=True)
class FrameKey:
    """The HMAC key derived from the run secret (never printed)."""

    material: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if type(self.material) is not bytes or len(self.material) != MAC_BYTES:
            raise LocalProtocolError(f"FrameKey must be {MAC_BYTES} bytes")


def hkdf_sha256(input_key: bytes, *, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869): extract with `salt`, then expand with `info` to `length` bytes."""
    if not 0 < length <= 255 * 32:
        raise LocalProtocolError(f"HKDF-SHA256 output length must be in (0, 8160], got {length}")
    pseudo_random_key = hmac.digest(salt, input_key, "sha256")
    output, block = b"", b""
    for counter in range(1, -(-length // 32) + 1):
        block = hmac.digest(pseudo_random_key, block + info + bytes([counter]), "sha256")
        output += block
    return output[:length]


def derive_frame_key(run_secret: bytes) -> FrameKey:
    """The frame MAC key: HKDF-SHA256 of the run secret with this module's salt and info labels."""
    if type(run_secret) is not bytes or len(run_secret) < MIN_RUN_SECRET_BYTES:
        raise LocalProtocolError(f"run secret must be at least {MIN_RUN_SECRET_BYTES} bytes")
    return FrameKey(hkdf_sha256(run_secret, salt=KDF_SALT, info=KDF_INFO_FRAME_MAC, length=MAC_BYTES))


def compute_mac(key: FrameKey, signed_bytes: bytes) -> bytes:
    """The tag a frame carries: HMAC-SHA256(key, fixed header || header map)."""
    return hmac.digest(key.material, signed_bytes, "sha256")


def check_run_id(value: object, *, what: str = "run id") -> str:
    """Run ids follow the node-id rules (short printable ASCII); raise LocalProtocolError otherwise."""
    if type(value) is not str or not value or len(value) > MAX_NODE_ID_CHARS or not NODE_ID_PATTERN.fullmatch(value):
        raise LocalProtocolError(f"{what} {value!r} must be 1-{MAX_NODE_ID_CHARS} characters matching "
                                 f"{NODE_ID_PATTERN.pattern}")
    return value


@dataclass(frozen=True, slots=True)
class AuthContext:
    """Who we are when we send: the run, our node id, and the MAC key."""

    run_id: str
    sender: str
    key: FrameKey

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        check_run_id(self.sender, what="sender")
        if not isinstance(self.key, FrameKey):
            raise LocalProtocolError("AuthContext.key must be a FrameKey (see derive_frame_key)")


class ReplayCache:
    """Nonces seen recently, per sender, with bounded memory.

    A nonce is remembered until its frame's timestamp leaves the acceptance window; after that the
    timestamp check alone refuses a replay. Frames older than `horizon` (the newest expiry cut-off
    ever applied) are refused outright, so a receiver clock stepping back cannot revive forgotten
    nonces. When `max_nonces` is reached the oldest nonce is evicted and its sender's floor rises to
    its timestamp: anything that old from that sender is refused from then on, so eviction never
    opens a replay hole; it can only refuse an honest frame that is older than everything retained.
    """

    def __init__(self, *, max_nonces: int, window_s: float) -> None:
        self._max_nonces = max_nonces
        self._window_ms = int(window_s * 1000)
        self._seen: dict[str, dict[bytes, int]] = {}
        self._by_age: list[tuple[int, str, bytes]] = []
        self._floor_ms: dict[str, int] = {}
        self._horizon_ms: int | None = None

    def __len__(self) -> int:
        return len(self._by_age)

    def check_and_remember(self, sender: str, nonce: bytes, sent_at_ms: int, now_ms: int) -> None:
        """Refuse (401) a nonce seen before from `sender`, else remember it."""
        self._expire(now_ms)
        if self._horizon_ms is not None and sent_at_ms < self._horizon_ms:
            raise RemoteProtocolError(f"frame from {sender!r} is older than the replay window", 401)
        floor = self._floor_ms.get(sender)
        if floor is not None and sent_at_ms <= floor:
            raise RemoteProtocolError(f"frame from {sender!r} is older than its oldest remembered nonce "
                                      "(replay cache full)", 401)
        nonces = self._seen.setdefault(sender, {})
        if nonce in nonces:
            raise RemoteProtocolError(f"replayed frame from {sender!r} (nonce {nonce.hex()} already seen)", 401)
        nonces[nonce] = sent_at_ms
        heapq.heappush(self._by_age, (sent_at_ms, sender, nonce))
        while len(self._by_age) > self._max_nonces:
            evicted_ms, evicted_sender, _ = self._pop_oldest()
            self._floor_ms[evicted_sender] = max(self._floor_ms.get(evicted_sender, evicted_ms), evicted_ms)

    def _expire(self, now_ms: int) -> None:
        cutoff = now_ms - self._window_ms
        if self._horizon_ms is None or cutoff > self._horizon_ms:
            self._horizon_ms = cutoff
        while self._by_age and self._by_age[0][0] < self._horizon_ms:
            self._pop_oldest()
        if self._floor_ms:
            horizon = self._horizon_ms
            self._floor_ms = {sender: ms for sender, ms in self._floor_ms.items() if ms >= horizon}

    def _pop_oldest(self) -> tuple[int, str, bytes]:
        sent_at_ms, sender, nonce = heapq.heappop(self._by_age)
        nonces = self._seen[sender]
        del nonces[nonce]
        if not nonces:
            del self._seen[sender]
        return sent_at_ms, sender, nonce


class FrameVerifier:
    """Node-wide checks on received frame headers. Share one instance across all connections,
    since the replay cache must see every frame the node receives."""

    def __init__(self, run_id: str, key: FrameKey, limits: Limits = DEFAULT_LIMITS, *,
                 node_id: str | None = None) -> None:
        """`node_id`: ours; frames must then be addressed to it (or to ANY_MEMBER, for the kinds in
        ANY_RECIPIENT_KINDS). None accepts any recipient (tools that only inspect frames)."""
        self.run_id = check_run_id(run_id)
        self.node_id = check_run_id(node_id, what="node id") if node_id is not None else None
        if not isinstance(key, FrameKey):
            raise LocalProtocolError("FrameVerifier key must be a FrameKey (see derive_frame_key)")
        self._key = key
        self._skew_ms = int(limits.clock_skew_allowance_s * 1000)
        self.replay_cache = ReplayCache(max_nonces=limits.replay_cache_max_nonces,
                                        window_s=limits.clock_skew_allowance_s)

    def verify(self, *, run_id: str, sender: str, sent_at_ms: int, nonce: bytes, signed_bytes: bytes,
               mac: bytes, now_unix: float, recipient: str = ANY_MEMBER,
               kind: MessageKind | None = None) -> None:
        """Raise RemoteProtocolError unless the frame is for our run, authentic, for us, fresh and new."""
        if run_id != self.run_id:
            raise RemoteProtocolError(f"frame is for run {run_id!r}, this node is in run {self.run_id!r}", 409)
        if not hmac.compare_digest(compute_mac(self._key, signed_bytes), mac):
            raise RemoteProtocolError(f"bad MAC on frame from {sender!r} (tampered, or a different run secret)", 401)
        if self.node_id is not None:
            if recipient == ANY_MEMBER:
                if kind not in ANY_RECIPIENT_KINDS:
                    name = kind.name if kind is not None else "this"
                    raise RemoteProtocolError(f"{name} frame from {sender!r} names no recipient", 401)
            elif recipient != self.node_id:
                raise RemoteProtocolError(f"frame from {sender!r} is addressed to {recipient!r}, not to "
                                          f"{self.node_id!r} (misdirected or replayed)", 401)
        now_ms = round(now_unix * 1000)
        if sent_at_ms < now_ms - self._skew_ms:
            raise RemoteProtocolError(f"stale frame from {sender!r}: sent {(now_ms - sent_at_ms) / 1000:.3f} s ago, "
                                      f"allowance {self._skew_ms / 1000:g} s", 401)
        if sent_at_ms > now_ms + self._skew_ms:
            raise RemoteProtocolError(f"frame from {sender!r} is {(sent_at_ms - now_ms) / 1000:.3f} s in the future, "
                                      f"allowance {self._skew_ms / 1000:g} s (check its clock)", 401)
        self.replay_cache.check_and_remember(sender, nonce, sent_at_ms, now_ms)


def check_epoch(msg_epoch: int, known_epoch: int) -> str:
    """The epoch fence: refuse (409) anything stamped with an epoch older than the newest we know.

    Returns the reason the message passes, for logs and /status.
    """
    if msg_epoch < known_epoch:
        raise RemoteProtocolError(f"stale epoch {msg_epoch}: this node has seen epoch {known_epoch}", 409)
    if msg_epoch == known_epoch:
        return f"epoch {msg_epoch} is current"
    return f"epoch {msg_epoch} is newer than known {known_epoch}: adopt it"


def payload_digest(payload: bytes) -> bytes:
    """BLAKE3 of a payload (wire/digest.py), as carried in the header map's `pd` field."""
    return content_digest.digest(payload)
