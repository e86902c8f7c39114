"""Resource limits of the wire layer: every bound a peer's bytes can hit, named, with its reason.

The module constants are the defaults; a `Limits` instance overrides any of them for one node or
one test (`Limits(max_header_map_bytes=4096)`). The frame decoder enforces the size limits before
it buffers anything; the transport enforces the stream and deadline limits it is handed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from wire.messages import MessageKind

KiB = 1024
MiB = 1024 * KiB

# The msgpack header map holds scalar fields, auth fields and log-entry metadata (contributors,
# weights, digests). Log reads page by entry count, so 256 KiB is generous; msgpack.unpackb takes
# no buffer limit of its own, so this bound is what keeps parsing cheap.
MAX_HEADER_MAP_BYTES = 256 * KiB

# Largest single-frame contribution (FragmentContribution, wire 2.0), still accepted from older
# senders: an int4 delta of a ~500M-parameter fragment. Current senders stream a contribution as
# ContributionOpen + ContributionChunks, which no whole-fragment cap limits (below).
MAX_CONTRIBUTION_BYTES = 256 * MiB
# Values per chunk of a streamed contribution. The receiver buffers, checks and decodes one chunk at
# a time (and measures its norm in float64), so this is what a contribution's transfer costs in
# memory whatever the fragment's size: 2^22 values are 16 MiB decoded, ~80 MiB with the decode and
# norm temporaries. The largest tensor of a 70B model (a 128k x 8192 embedding, 2^30 values) is 256
# chunks of a few hundred bytes of framing each; no tensor is too large for the wire.
MAX_CHUNK_ELEMENTS = 1 << 22
# One ContributionChunk's encoded payload: a chunk of MAX_CHUNK_ELEMENTS values in the largest codec
# (fp32, 4 bytes a value) plus its codec header. 16 MiB at 4 Mbit/s is ~35 s, inside the deadline.
MAX_CONTRIBUTION_CHUNK_BYTES = 16 * MiB + 4 * KiB
# A log append carries merged outer gradients (same size class as a contribution); the replica
# needs each whole entry to apply it, so it is buffered and this bounds memory per stream.
MAX_LOG_APPEND_BYTES = 256 * MiB
# A relayed log entry's payload (a commit) streams as PayloadOpen + PayloadChunks (wire 2.3): the
# receiver buffers one chunk, spools it to disk and hashes it, so a chunk, not the payload, is what
# a transfer costs in memory. 16 MiB at 4 Mbit/s is ~35 s, inside the deadline.
MAX_PAYLOAD_STREAM_CHUNK_BYTES = 16 * MiB
# The most a PayloadOpen may declare whatever the run: what one log.bin record can hold (its length
# is a u32; daemon/coordination_store.py) less room for the entry's own fields. The receiver's own bound
# is tighter: the largest commit the run's model shapes and codec_down can produce
# (wire/payload_stream.py, `commit_size_bound`); this ceiling only caps it. (An fp32 commit of a
# 7B model at P = 24 is ~1.1 GiB: a 288M-parameter fragment; int8 ~280 MiB, int4 ~140 MiB.)
MAX_RELAYED_PAYLOAD_BYTES = 4096 * MiB - 16 * MiB
# A log read reply is the catch-up version of log append: same size class.
MAX_LOG_READ_REPLY_BYTES = 256 * MiB
# Snapshots are fetched in resumable chunks; a chunk is kept small so a broken link loses little.
MAX_SNAPSHOT_CHUNK_BYTES = 64 * MiB
# The run manifest (model config, fragment layout, codec list) is a small document.
MAX_MANIFEST_BYTES = 1 * MiB
# Every other kind carries no payload at all: any payload byte is refused.
NO_PAYLOAD = 0

DEFAULT_MAX_PAYLOAD_BYTES: Mapping[int, int] = MappingProxyType({
    MessageKind.FRAGMENT_CONTRIBUTION: MAX_CONTRIBUTION_BYTES,
    MessageKind.CONTRIBUTION_CHUNK: MAX_CONTRIBUTION_CHUNK_BYTES,
    MessageKind.LOG_APPEND: MAX_LOG_APPEND_BYTES,
    MessageKind.PAYLOAD_PUSH: MAX_LOG_APPEND_BYTES,  # one relayed log entry's bytes in one frame (wire 2.2)
    MessageKind.PAYLOAD_CHUNK: MAX_PAYLOAD_STREAM_CHUNK_BYTES,  # one chunk of a streamed one (wire 2.3)
    MessageKind.LOG_READ_REPLY: MAX_LOG_READ_REPLY_BYTES,
    MessageKind.SNAPSHOT_CHUNK: MAX_SNAPSHOT_CHUNK_BYTES,
    MessageKind.MEMBERSHIP: MAX_MANIFEST_BYTES,
})

# Codecs (wire.codecs) decompress; a 2 KB zstd frame can declare 64 MiB, so the decompressed size of
# one payload is bounded separately. fp32 of a 256 MB int4 delta is ~8x larger: 2 GiB would be an
# unreasonable allocation, so fragments must be sized to stay under 1 GiB decoded.
MAX_DECOMPRESSED_BYTES = 1024 * MiB

# One peer may hold a few streams at once (a contribution, a log append, a snapshot fetch); more
# than this is a flood, answered with 429 by the transport.
MAX_CONCURRENT_STREAMS_PER_PEER = 4

# A stream that delivers no byte for this long is stalled (or a slowloris): drop it. Long enough for
# a congested WAN link to recover from a burst of loss.
READ_TIMEOUT_S = 30.0
# Whole-message deadline: 256 MiB at ~4 Mbit/s, the slowest inter-site link we plan for, takes ~540 s.
MESSAGE_TIMEOUT_S = 600.0
# A stream must deliver its first authenticated frame header (fixed header, header map, MAC) within
# this long of being admitted, or lose its slot (408). A member's header is a few hundred bytes (at
# most 256 KiB: 0.5 s at 4 Mbit/s) and arrives within a round trip; without this bound a stranger
# sending a well-formed prefix one byte per second held a slot for the whole message deadline.
AUTH_DEADLINE_S = 5.0
# Once authenticated, a stream must keep at least this rate, measured over the time the receiver
# spends waiting for its bytes (time our own handlers take does not count against the sender).
# 1/16 of the slowest planned link (4 Mbit/s); a stalled or trickling sender is cut (408).
MIN_TRANSFER_BYTES_PER_S = 32 * KiB
# ... after this much waiting: short bursts of loss on a WAN link must not cut a healthy stream.
MIN_TRANSFER_WINDOW_S = 10.0

# Nonces remembered for replay protection across all senders. Each costs ~150 bytes, so 2^18 is
# ~40 MB worst case; at 100 frames/s from each of 30 peers it covers a 60 s window. When full, the
# oldest nonce is forgotten and its sender's "too old" floor rises past it, so replay safety holds
# and only an honest sender's very old in-flight frames are refused (see wire.auth.ReplayCache).
REPLAY_CACHE_MAX_NONCES = 2**18

# How far a frame's timestamp may be from the receiver's wall clock. This is the one place where
# wall clocks of different nodes are compared, and only loosely: NTP keeps sites within well under a
# second, 30 s tolerates a badly synced site, and replayed frames older than this are refused by
# time alone (which is what lets the replay cache forget them).
CLOCK_SKEW_ALLOWANCE_S = 30.0

# Largest PayloadChunk event the streaming decoder emits, so one event never pins a huge buffer.
MAX_PAYLOAD_CHUNK_BYTES = 1 * MiB


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-instance limits; every field defaults to the module constant of the same meaning."""

    max_header_map_bytes: int = MAX_HEADER_MAP_BYTES
    max_payload_bytes: Mapping[int, int] = field(default_factory=lambda: DEFAULT_MAX_PAYLOAD_BYTES)
    max_decompressed_bytes: int = MAX_DECOMPRESSED_BYTES
    max_concurrent_streams_per_peer: int = MAX_CONCURRENT_STREAMS_PER_PEER
    read_timeout_s: float = READ_TIMEOUT_S
    message_timeout_s: float = MESSAGE_TIMEOUT_S
    auth_deadline_s: float = AUTH_DEADLINE_S
    min_transfer_bytes_per_s: int = MIN_TRANSFER_BYTES_PER_S
    min_transfer_window_s: float = MIN_TRANSFER_WINDOW_S
    replay_cache_max_nonces: int = REPLAY_CACHE_MAX_NONCES
    clock_skew_allowance_s: float = CLOCK_SKEW_ALLOWANCE_S
    max_payload_chunk_bytes: int = MAX_PAYLOAD_CHUNK_BYTES
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        for name in ("max_header_map_bytes", "max_decompressed_bytes", "max_concurrent_streams_per_peer",
                     "replay_cache_max_nonces", "max_payload_chunk_bytes", "min_transfer_bytes_per_s",
                     "max_chunk_elements"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        for name in ("read_timeout_s", "message_timeout_s", "clock_skew_allowance_s", "auth_deadline_s",
                     "min_transfer_window_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
                raise ValueError(f"Limits.{name} must be a positive finite number of seconds, got {value!r}")
        payload_limits = {int(kind): limit for kind, limit in self.max_payload_bytes.items()}
        for kind, limit in payload_limits.items():
            if type(limit) is not int or limit < 0:
                raise ValueError(f"Limits.max_payload_bytes[{kind}] must be a non-negative int, got {limit!r}")
        object.__setattr__(self, "max_payload_bytes", MappingProxyType(payload_limits))

    def max_payload(self, kind: int) -> int:
        """Largest payload accepted for message kind `kind` (0 for kinds without a payload)."""
        return self.max_payload_bytes.get(int(kind), NO_PAYLOAD)

    def with_max_payload(self, kind: int, limit: int) -> Limits:
        """A copy with one kind's payload limit replaced."""
        return replace(self, max_payload_bytes={**self.max_payload_bytes, int(kind): limit})


DEFAULT_LIMITS = Limits()
