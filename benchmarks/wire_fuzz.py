"""Fuzz the wire frame layer at scale and measure its streaming throughput and memory.

A direct, seeded loop (no hypothesis, so 100k+ examples run in minutes) over the same properties as
tests/test_wire_frames.py, with the same valid messages (`wire.examples`): round trips of every kind, whole-buffer decoding equal
to random-split and byte-at-a-time decoding, damaged frames (flips, cuts, insertions, deletions),
random bytes, and correctly MAC'd frames with arbitrary header maps. Any exception other than
RemoteProtocolError out of the decoder is a bug: it is printed and the exit status is 1.

Then it streams one large contribution (default 256 MiB) through the decoder in 64 KiB reads and
reports MB/s and how much the peak RSS grew (the bounded-memory promise), and feeds damaged streamed
contributions (wire 2.1: chunks cut, flipped, reordered, swapped between tensors or streams) to the
receiver's `ContributionAssembler`: it must refuse them with RemoteProtocolError and nothing else;
and damaged streamed relayed payloads (wire 2.3: chunks cut, flipped, dropped, swapped, repeated, of
another stream, sizes over the bound) to `PayloadAssembler`: refused with RemoteProtocolError, and
every stream it accepts is exactly the declared bytes.

Last, it fuzzes the tensor codecs themselves (`wire.codecs`, every codec, the sparse topk2 and union8
included): valid messages of random shapes, chunk sizes and k must decode to exactly
`quantize_roundtrip`; damaged ones (bits flipped, bytes cut, inserted or deleted, header and body
fields set to hostile values, zstd frames rebuilt around a damaged body) may only raise
RemoteProtocolError, and whatever they decode to is finite float32 of the declared shapes.

    .venv/bin/python benchmarks/wire_fuzz.py --examples 100000 --codec-examples 100000

The hypothesis properties themselves scale with an environment variable:
    WIRE_FUZZ_EXAMPLES=100000 .venv/bin/python -m pytest tests/test_wire_frames.py -k "total or equal or flipped"
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import sys
import time
import traceback
from pathlib import Path

import blake3
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wire.auth import AuthContext, FrameVerifier, compute_mac, derive_frame_key  # noqa: E402
from wire.examples import DecodedStream, ExampleMessages, decode_stream  # noqa: E402
from wire.frames import (  # noqa: E402
    FIXED_HEADER,
    MAGIC,
    NEED_DATA,
    WIRE_MAJOR,
    FrameDecoder,
    FrameEnd,
    PayloadChunk,
    encode_frame,
    encode_frame_head,
)
from wire.messages import MESSAGE_TYPES, FragmentContribution, Message, MessageKind  # noqa: E402

RUN = "run-fuzz"
KEY = derive_frame_key(b"f" * 32)
AUTH = AuthContext(RUN, "site-a", KEY)
NOW = 1_800_000_000.0
STREAMABLE = [kind for kind, cls in MESSAGE_TYPES.items() if cls.STREAMABLE]


class Fuzzer:
    """Seeded damage and garbage around the valid messages of `wire.examples`."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.examples = ExampleMessages(self.rng)
        self.nonce = 0

    def frame(self, message: Message) -> bytes:
        self.nonce += 1
        return encode_frame(message, AUTH, now_unix=NOW, nonce=self.nonce.to_bytes(16, "big"))

    def splits(self, data: bytes) -> list[bytes]:
        points = sorted(self.rng.randrange(len(data) + 1) for _ in range(self.rng.randrange(8)))
        return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]

    def damaged(self, data: bytes) -> bytes:
        out = bytearray(data)
        how = self.rng.randrange(4)
        if how == 0:
            for _ in range(self.rng.randint(1, 4)):
                out[self.rng.randrange(len(out))] ^= self.rng.randint(1, 255)
        elif how == 1:
            del out[self.rng.randrange(len(out) + 1):]
        elif how == 2:
            at = self.rng.randrange(len(out) + 1)
            out[at:at] = self.rng.randbytes(self.rng.randint(1, 40))
        else:
            at = self.rng.randrange(len(out))
            del out[at:at + self.rng.randint(1, 40)]
        return bytes(out)

    def garbage_value(self, depth: int = 0) -> object:
        choice = self.rng.randrange(9 if depth < 2 else 7)
        options = [lambda: None, lambda: True, lambda: self.rng.randrange(-(2**63), 2**64), lambda: float("nan"),
                   self.examples.text, lambda: self.examples.blob(40), lambda: self.rng.uniform(-1e300, 1e300),
                   lambda: [self.garbage_value(depth + 1) for _ in range(self.rng.randrange(4))],
                   lambda: {self.rng.choice((self.examples.text(), self.examples.blob(4))): self.garbage_value(depth + 1)
                            for _ in range(self.rng.randrange(4))}]
        return options[choice]()

    def authenticated_garbage(self) -> bytes:
        base = self.examples.message()
        fields, payload = base.to_wire()
        for key in list(fields):
            roll = self.rng.randrange(6)
            if roll == 4:
                del fields[key]
            elif roll == 5:
                fields[key] = self.garbage_value()
        if self.rng.random() < 0.3:
            payload = self.examples.blob(64)
        self.nonce += 1
        header_map = {"run": RUN, "from": "site-a", "ts": round(NOW * 1000), "nonce": self.nonce.to_bytes(16, "big"),
                      "pd": blake3.blake3(payload).digest(), "m": fields}
        for _ in range(self.rng.randrange(3)):
            header_map[self.rng.choice(["run", "from", "ts", "nonce", "pd", "m"])] = self.garbage_value()
        kind = base.KIND if self.rng.random() < 0.8 else self.rng.randrange(2**16)
        map_bytes = msgpack.packb(header_map, use_bin_type=True)
        fixed = FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, self.rng.randrange(3), kind, 0, len(map_bytes), len(payload))
        return fixed + map_bytes + compute_mac(KEY, fixed + map_bytes) + payload


def decode(chunks: list[bytes], *, stream: bool) -> DecodedStream:
    return decode_stream(chunks, FrameVerifier(RUN, KEY), now_unix=NOW, stream_kinds=STREAMABLE if stream else ())


def fuzz(examples: int, seed: int) -> int:
    fuzzer = Fuzzer(seed)
    counts: collections.Counter[str] = collections.Counter()
    bugs = 0
    started = time.perf_counter()
    for i in range(examples):
        mode = ("round-trip", "damaged", "random-bytes", "authenticated-garbage")[i % 4]
        stream = fuzzer.rng.random() < 0.5
        try:
            if mode == "round-trip":
                sent = [fuzzer.examples.message() for _ in range(fuzzer.rng.randint(1, 3))]
                data = b"".join(fuzzer.frame(m) for m in sent)
                whole = decode([data], stream=stream)
                assert whole.status is None and whole.messages() == sent, f"round trip failed: {whole.status}"
            else:
                if mode == "damaged":
                    sent = [fuzzer.examples.message() for _ in range(fuzzer.rng.randint(1, 2))]
                    data = fuzzer.damaged(b"".join(fuzzer.frame(m) for m in sent))
                elif mode == "random-bytes":
                    data = fuzzer.rng.randbytes(fuzzer.rng.randrange(200))
                    if fuzzer.rng.random() < 0.5:  # a plausible fixed header in front
                        data = FIXED_HEADER.pack(MAGIC, WIRE_MAJOR, 0, fuzzer.rng.randrange(20), 0,
                                                 fuzzer.rng.randrange(300), fuzzer.rng.randrange(300)) + data
                else:
                    data = fuzzer.authenticated_garbage()
                whole = decode([data], stream=stream)
                if mode == "damaged":
                    # Caught or harmless: whatever decodes is an undamaged prefix of what was sent.
                    decoded = whole.messages()
                    assert decoded == sent[:len(decoded)], "a damaged stream decoded to different messages"
            split = decode(fuzzer.splits(data), stream=stream)
            assert split == whole, "random split decodes differently from the whole buffer"
            if i % 10 == 0:
                single = decode([data[j:j + 1] for j in range(len(data))], stream=stream)
                assert single == whole, "byte-at-a-time decodes differently from the whole buffer"
                counts["byte-at-a-time checks"] += 1
            counts[f"{mode}: {'ok' if whole.status is None else whole.status}"] += 1
        except Exception:  # noqa: BLE001 - a bug report, not error handling
            bugs += 1
            print(f"BUG in example {i} ({mode}, seed {seed}):", file=sys.stderr)
            traceback.print_exc(limit=6)
            if bugs >= 5:
                break
    elapsed = time.perf_counter() - started
    print(f"fuzzed {i + 1} examples in {elapsed:.1f} s ({(i + 1) / elapsed:,.0f}/s), seed {seed}, bugs: {bugs}, "
          f"peak RSS {max_rss_mb():.0f} MiB")
    for key in sorted(counts):
        print(f"  {key:<36} {counts[key]:>8}")
    return bugs


def _report(what: str, bugs: int, counts: collections.Counter[str]) -> int:
    """Print a fuzz loop's outcome counts under one line; returns its bugs."""
    print(f"{what}, bugs: {bugs}")
    for key in sorted(counts):
        print(f"  {key:<36} {counts[key]:>8}")
    return bugs


def max_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def stream_big(size_mb: int, read_kib: int = 64) -> None:
    """Stream one size_mb contribution through the decoder; report MB/s and peak-RSS growth."""
    block = random.Random(1).randbytes(1 << 20)
    size = size_mb << 20
    digest = blake3.blake3()
    for _ in range(size_mb):
        digest.update(block)
    head_message = FragmentContribution(fragment=0, base_index=1, base_round=1, c_steps=24, c_tokens=1 << 20,
                                        codec="int4-zstd", learner_id="site-a", payload=b"")
    head = encode_frame_head(head_message, AUTH, now_unix=NOW, nonce=b"\x01" * 16, payload_length=size,
                             payload_digest=digest.digest())
    decoder = FrameDecoder(FrameVerifier(RUN, KEY), stream_kinds=[MessageKind.FRAGMENT_CONTRIBUTION])
    rss_before = max_rss_mb()
    started = time.perf_counter()
    received, end = 0, None
    read = read_kib << 10
    decoder.receive_data(head)
    pending = [block[j:j + read] for j in range(0, len(block), read)]
    for _ in range(size_mb):
        for piece in pending:
            decoder.receive_data(piece)
            while (event := decoder.next_event(now_unix=NOW)) is not NEED_DATA:
                if isinstance(event, PayloadChunk):
                    received += len(event.data)
                elif isinstance(event, FrameEnd):
                    end = event
    elapsed = time.perf_counter() - started
    assert isinstance(end, FrameEnd) and received == size, (end, received)
    print(f"streamed a {size_mb} MiB contribution in {read_kib} KiB reads: {size_mb / elapsed:,.0f} MiB/s "
          f"({elapsed:.2f} s, BLAKE3 included); peak RSS grew {max_rss_mb() - rss_before:.1f} MiB "
          f"(from {rss_before:.0f} MiB)")


def fuzz_streams(examples: int, seed: int) -> int:
    """Damaged chunk sequences into ContributionAssembler: only RemoteProtocolError may come out."""
    import numpy as np

    from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for
    from wire.errors import RemoteProtocolError
    from wire.limits import Limits
    from wire.messages import ContributionChunk

    rng = random.Random(seed)
    limits = Limits(max_chunk_elements=256)
    counts: collections.Counter[str] = collections.Counter()
    bugs = 0
    for i in range(examples):
        shapes = {f"t{j}": tuple(rng.randint(0, 40) for _ in range(rng.randint(0, 3))) for j in range(rng.randint(1, 4))}
        codec = rng.choice(("int4", "int8", "fp32", "bf16", "e3m0"))
        delta = {n: np.random.default_rng(i).standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        head = open_for(shapes, fragment=0, base_index=0, base_round=0, c_steps=1, c_tokens=1, codec=codec,
                        learner_id="site-a", stream=bytes(16), limits=limits)
        chunks = list(contribution_chunks(head, delta))
        damage = rng.choice(("none", "flip", "cut", "drop", "swap", "stream", "extend"))
        k = rng.randrange(len(chunks))
        c = chunks[k]
        if damage == "flip" and c.payload:
            payload = bytearray(c.payload)
            payload[rng.randrange(len(payload))] ^= 1 << rng.randrange(8)
            chunks[k] = ContributionChunk(c.stream, c.tensor, c.offset, bytes(payload))
        elif damage == "cut":
            chunks[k] = ContributionChunk(c.stream, c.tensor, c.offset, c.payload[:rng.randrange(len(c.payload) + 1)])
        elif damage == "drop":
            del chunks[k]
        elif damage == "swap" and len(chunks) > 1:
            j = rng.randrange(len(chunks))
            chunks[k], chunks[j] = chunks[j], chunks[k]
        elif damage == "stream":
            chunks[k] = ContributionChunk(bytes([1]) * 16, c.tensor, c.offset, c.payload)
        elif damage == "extend":
            chunks.append(c)
        try:
            assembler = ContributionAssembler(head, shapes, limits)
            for chunk in chunks:
                assembler.add(chunk)
            got = assembler.finish()
            for name in shapes:
                assert got[name].shape == tuple(shapes[name]) and np.all(np.isfinite(got[name]))
            counts[f"{damage}: accepted"] += 1
        except RemoteProtocolError as error:
            counts[f"{damage}: {error.status_hint}"] += 1
        except Exception:  # noqa: BLE001 - a bug report, not error handling
            bugs += 1
            print(f"BUG in stream example {i} ({damage}, seed {seed}):", file=sys.stderr)
            traceback.print_exc(limit=6)
            if bugs >= 5:
                break
    return _report(f"fuzzed {examples} streamed contributions", bugs, counts)


def fuzz_payload_streams(examples: int, seed: int) -> int:
    """Damaged relayed payload streams into PayloadAssembler: only RemoteProtocolError may come out,
    and whatever it accepts is byte for byte the payload the open declared."""
    from wire.errors import RemoteProtocolError
    from wire.messages import PayloadChunk, PayloadOpen
    from wire.payload_stream import PayloadAssembler, chunk_spans

    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    bugs = 0
    for i in range(examples):
        payload = rng.randbytes(rng.randint(1, 3000))
        chunk_bytes = rng.randint(1, 700)
        bound = len(payload) + rng.choice((0, 0, 1, 1000))
        head = PayloadOpen(bytes(16), blake3.blake3(payload).digest(), len(payload), chunk_bytes, "", {})
        chunks = [PayloadChunk(head.stream, offset, payload[offset:offset + length])
                  for offset, length in chunk_spans(len(payload), chunk_bytes)]
        damage = rng.choice(("none", "flip", "cut", "drop", "swap", "stream", "extend", "oversize"))
        k = rng.randrange(len(chunks))
        c = chunks[k]
        if damage == "flip":
            data = bytearray(c.payload)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            chunks[k] = PayloadChunk(c.stream, c.offset, bytes(data))
        elif damage == "cut" and len(c.payload) > 1:
            chunks[k] = PayloadChunk(c.stream, c.offset, c.payload[:rng.randrange(1, len(c.payload))])
        elif damage == "drop":
            del chunks[k]
        elif damage == "swap" and len(chunks) > 1:
            j = rng.randrange(len(chunks))
            chunks[k], chunks[j] = chunks[j], chunks[k]
        elif damage == "stream":
            chunks[k] = PayloadChunk(bytes([1]) * 16, c.offset, c.payload)
        elif damage == "extend":
            chunks.append(c)
        elif damage == "oversize":
            bound = len(payload) - 1
        try:
            assembler = PayloadAssembler(head, bound)
            kept = blake3.blake3()
            parts = []
            for chunk in chunks:
                assembler.add(chunk)
                kept.update(chunk.payload)
                parts.append(chunk.payload)
            assembler.finish(kept.digest())
            assert b"".join(parts) == payload, "an accepted stream is not the declared payload"
            counts[f"{damage}: accepted"] += 1
        except RemoteProtocolError as error:
            counts[f"{damage}: {error.status_hint}"] += 1
        except Exception:  # noqa: BLE001 - a bug report, not error handling
            bugs += 1
            print(f"BUG in payload stream example {i} ({damage}, seed {seed}):", file=sys.stderr)
            traceback.print_exc(limit=6)
            if bugs >= 5:
                break
    return _report(f"fuzzed {examples} streamed relayed payloads", bugs, counts)


def fuzz_streamed_replies(examples: int, seed: int) -> int:
    """Damaged snapshot-chunk replies through the joiner's path (`StreamedReply.read`, then `feed`
    handing the payload over piece by piece, unjoined): only RemoteProtocolError may come out, and
    what an accepted reply handed over is byte for byte the payload that was sent."""
    from diloco_node.transport.client import StreamedReply
    from wire.errors import RemoteProtocolError
    from wire.messages import SnapshotChunk

    fuzzer = Fuzzer(seed + 1)
    rng = fuzzer.rng
    counts: collections.Counter[str] = collections.Counter()
    bugs = 0
    for i in range(examples):
        payload = rng.randbytes(rng.randint(1, 20_000))
        sent = SnapshotChunk(fragment=rng.randrange(4), commit_index=rng.randrange(1, 100), offset=0,
                             total=len(payload), digest=rng.randbytes(32), payload=payload)
        frame = fuzzer.frame(sent)
        damage = rng.choice(("none", "none", "damaged", "trailing", "another-frame"))
        if damage == "damaged":
            frame = fuzzer.damaged(frame)
        elif damage == "trailing":
            frame += rng.randbytes(rng.randint(1, 100))
        elif damage == "another-frame":
            frame += fuzzer.frame(sent)
        handed: list[bytes] = []
        try:
            decoder = FrameDecoder(FrameVerifier(RUN, KEY), stream_kinds=(MessageKind.SNAPSHOT_CHUNK,))
            reply = StreamedReply.read(fuzzer.splits(frame), decoder, MessageKind.SNAPSHOT_CHUNK, NOW)
            reply.feed(lambda piece: handed.append(bytes(piece)))
            assert b"".join(handed) == payload, "an accepted reply handed over bytes that were not sent"
            assert reply.head == sent.without_payload(), "an accepted reply's head is not the one sent"
            counts[f"{damage}: accepted"] += 1
        except RemoteProtocolError as error:
            assert damage != "none", f"an undamaged reply was refused: {error}"
            counts[f"{damage}: {error.status_hint}"] += 1
        except Exception:  # noqa: BLE001 - a bug report, not error handling
            bugs += 1
            print(f"BUG in streamed reply example {i} ({damage}, seed {seed}):", file=sys.stderr)
            traceback.print_exc(limit=6)
            if bugs >= 5:
                break
    return _report(f"fuzzed {examples} streamed snapshot-chunk replies", bugs, counts)


def _codec_messages(rng: random.Random, pool: int) -> list[tuple[bytes, dict]]:
    """Valid codec messages of random shapes, codecs, chunk sizes and k, with what each decodes to."""
    import numpy as np

    from wire.codecs import CODECS, encode_named, quantize_roundtrip

    out = []
    for _ in range(pool):
        codec = rng.choice(sorted(CODECS))
        sparse = CODECS[codec].segmented
        block = rng.choice((64, 128, 256)) if sparse else None
        top_k = rng.randint(1, block) if codec == "topk2" and rng.random() < 0.5 else None
        tensors = {}
        for j in range(rng.randint(1, 3)):
            side = 600 if sparse else 40  # sparse chunks are 64..256 values: several per tensor
            shape = rng.choice(((), (rng.randint(0, side),), (rng.randint(0, 5), rng.randint(0, side // 4))))
            values = np.random.default_rng(rng.randrange(2**32)).standard_normal(shape).astype(np.float32)
            if rng.random() < 0.5:  # sparse contributions: mostly zeros
                values[np.random.default_rng(j).random(shape) < rng.random()] = 0.0
            tensors[f"t{j}"] = values
        zstd = rng.choice((1, None))
        message = encode_named(tensors, codec, zstd_level=zstd, block_size=block, top_k=top_k)
        expected = {name: quantize_roundtrip(value, codec, block_size=block, top_k=top_k)
                    for name, value in tensors.items()}
        out.append((message, expected))
    return out


def _damage_codec_message(rng: random.Random, message: bytes) -> bytes:
    """Damage a codec message: bytes, header fields, or its body under a freshly made zstd frame."""
    import zstandard

    from wire.codecs.container import FLAG_ZSTD, FLAGS_OFFSET

    how = rng.randrange(6)
    out = bytearray(message)
    if how == 0:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    elif how == 1:
        del out[rng.randrange(len(out)):]
    elif how == 2:
        at = rng.randrange(len(out) + 1)
        out[at:at] = rng.randbytes(rng.randint(1, 16))
    elif how == 3:
        at = rng.randrange(len(out))
        del out[at:at + rng.randint(1, 16)]
    elif how == 4:  # a hostile u32 anywhere: block size, count, k, a chunk's count
        at = rng.randrange(max(1, len(out) - 3))
        out[at:at + 4] = rng.choice((0, 1, 63, 64, 65, 4096, 2**16, 2**31, 2**32 - 1)).to_bytes(4, "little")
    else:  # damage inside the compressed body, then compress it again: a well-formed zstd frame
        from wire.codecs.container import _parse  # the header's own parser finds where the payload starts

        _, _, _, payload, compressed = _parse(bytes(message), 1 << 20, 1 << 20)
        body = bytearray(zstandard.ZstdDecompressor().decompress(bytes(payload)) if compressed else bytes(payload))
        if body:
            for _ in range(rng.randint(1, 3)):
                body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
        if rng.random() < 0.3:
            body = body[:rng.randrange(len(body) + 1)] if rng.random() < 0.5 else body + rng.randbytes(rng.randint(1, 8))
        header = bytearray(message[:len(message) - len(payload)])
        header[FLAGS_OFFSET] = FLAG_ZSTD
        out = header + zstandard.ZstdCompressor(level=1, write_content_size=True).compress(bytes(body))
    return bytes(out)


def fuzz_codecs(examples: int, seed: int) -> int:
    """Valid and damaged codec messages into decode_named: only RemoteProtocolError may come out."""
    import numpy as np

    from wire.codecs import CODECS_BY_ID, decode_named
    from wire.errors import RemoteProtocolError

    rng = random.Random(seed)
    counts: collections.Counter[str] = collections.Counter()
    bugs = 0
    started = time.perf_counter()
    messages: list[tuple[bytes, dict]] = []
    for i in range(examples):
        if i % 50 == 0:  # a fresh pool now and then: encoding costs more than decoding
            messages = _codec_messages(rng, 25)
        message, expected = rng.choice(messages)
        codec = CODECS_BY_ID[message[5]].name
        intact = rng.random() < 0.1
        try:
            data = message if intact else _damage_codec_message(rng, message)
            decoded = decode_named(data, max_elements=1 << 12)
            for value in decoded.values():
                assert value.dtype == np.float32 and np.isfinite(value).all(), "a decoded tensor is not finite float32"
            if intact:
                assert list(decoded) == list(expected) and all(
                    decoded[n].tobytes() == expected[n].tobytes() for n in expected), "a valid message decoded wrongly"
            counts[f"{codec} {'intact' if intact else 'damaged'}: accepted"] += 1
        except RemoteProtocolError as error:
            counts[f"{codec} {'intact' if intact else 'damaged'}: {error.status_hint}"] += 1
        except Exception:  # noqa: BLE001 - a bug report, not error handling
            bugs += 1
            print(f"BUG in codec example {i} (codec id {codec}, seed {seed}):", file=sys.stderr)
            traceback.print_exc(limit=6)
            if bugs >= 5:
                break
    elapsed = time.perf_counter() - started
    print(f"fuzzed {i + 1 if examples else 0} codec messages in {elapsed:.1f} s, bugs: {bugs}")
    for key in sorted(counts):
        print(f"  {key:<36} {counts[key]:>8}")
    return bugs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=100_000, help="fuzz examples (default 100000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream-mb", type=int, default=256, help="size of the streamed payload, 0 to skip")
    parser.add_argument("--stream-examples", type=int, default=2_000,
                        help="damaged streamed contributions, relayed payloads and snapshot-chunk replies (default 2000)")
    parser.add_argument("--codec-examples", type=int, default=100_000,
                        help="valid and damaged tensor codec messages (default 100000)")
    args = parser.parse_args()
    if args.stream_mb:
        stream_big(args.stream_mb)  # first, so the RSS growth is not hidden by the fuzz loop's peak
    bugs = fuzz(args.examples, args.seed)
    bugs += fuzz_streams(args.stream_examples, args.seed)
    bugs += fuzz_payload_streams(args.stream_examples, args.seed)
    bugs += fuzz_streamed_replies(args.stream_examples, args.seed)
    bugs += fuzz_codecs(args.codec_examples, args.seed)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
