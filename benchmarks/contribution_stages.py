"""The syncer's side of a round, stage by stage: CPU-seconds per GB of a contribution's values.

What `benchmarks/dataplane.py` reports as `syncer_stages_cpu_s_per_GB` (and prints alone with
`--stages`), the contribution path's counterpart of `benchmarks/state_transfer.py`'s
`receiver_stages_cpu_s_per_GB`. Each stage is timed alone in this thread (process CPU time), over
`CONTRIBUTIONS` int4 contributions of one fragment of `STAGE_VALUES` fp32 values, the way the lease
holder runs them: ContributionChunk frames read in 64 KiB pieces, each chunk checked and decoded
as it arrives (`ContributionAssembler`: int4 decode and the norm), the merge (every contribution
decoded again, a chunk at a time, and folded), then the commit's codec_down encode and decode.
Every figure is per GB of fp32 values (4 bytes a parameter) handled by that stage, so the stages
add up to the holder's CPU per GB of contributions; a contribution crosses the wire as int4, about
0.14 of those bytes.
"""

from __future__ import annotations

import os
import time

MB = 1_000_000
STAGE_VALUES = 16 * MB  # one synthetic fragment: 64 MB of fp32 values
CONTRIBUTIONS = 2  # learners whose contributions one round merges
RUN_ID = "bench-contributions"
BENCH_SECRET = b"benchmark-secret-not-for-production"  # in-process only


def read_frames(verifier, pieces) -> None:
    """Decode every frame of `pieces` (a stream cut as a socket delivers it): a stage's work."""
    from wire.frames import NEED_DATA, FrameDecoder

    decoder = FrameDecoder(verifier)
    for piece in pieces:
        decoder.receive_data(piece)
        while decoder.next_event(now_unix=time.time()) is not NEED_DATA:
            pass


def hash_pieces(pieces) -> None:
    """BLAKE3 over every piece, as one content hash: a stage's work."""
    from wire import digest as content_digest

    h = content_digest.hasher()
    for piece in pieces:
        h.update(piece)


def syncer_stages(values: int = STAGE_VALUES, contributions: int = CONTRIBUTIONS) -> dict[str, float]:
    """CPU-s per GB of fp32 values of each stage: `frame` (the frame decoder without its payload
    hash: header parse, MAC, the payload's copy), `hash` (BLAKE3 of the payloads), `decode` (the
    assembler: int4 decode, shape and norm of each chunk), `merge_rda` and `merge_mean` (the merge
    of the round's contributions, each decoded again a chunk at a time; per GB of contributions
    merged), `codec_down` (the commit's int4 encode of the merged gradient and its decode back; per
    GB of the fragment)."""
    import numpy as np

    from diloco_node.sync.global_state import FragmentHistory
    from diloco_node.sync.merge import Contribution, ContributionCaps, merge_contributions
    from wire.auth import AuthContext, FrameVerifier, derive_frame_key
    from wire.codecs import decode_named, encode_named
    from wire.contribution_stream import ContributionAssembler, contribution_chunks, open_for
    from wire.frames import encode_frame

    key = derive_frame_key(BENCH_SECRET)
    shapes = {"w": (values,)}
    gb = 4 * values / 1e9
    rng = np.random.default_rng(0)
    current = {"w": rng.standard_normal(values, dtype=np.float32)}
    history = FragmentHistory(fragment=0, capacity=2)
    history.record(0, current)
    heads, chunks = [], []
    for k in range(contributions):
        delta = {"w": (1e-3 * rng.standard_normal(values, dtype=np.float32))}
        head = open_for(shapes, fragment=0, base_index=0, base_round=0, c_steps=8, c_tokens=512, codec="int4",
                        learner_id=f"l{k}", stream=os.urandom(16))
        heads.append(head)
        chunks.append(list(contribution_chunks(head, delta)))
        del delta
    auth = AuthContext(RUN_ID, "learner", key)
    frames = b"".join(encode_frame(chunk, auth, now_unix=time.time(), nonce=os.urandom(16), to="holder")
                      for chunk in chunks[0])
    pieces = [frames[at:at + 65536] for at in range(0, len(frames), 65536)]

    def timed(work, per_gb: float = gb) -> float:
        start = time.process_time()
        work()
        return (time.process_time() - start) / per_gb

    def decode_frames() -> None:
        read_frames(FrameVerifier(RUN_ID, key, node_id="holder"), pieces)

    def hash_all() -> None:
        hash_pieces(chunk.payload for chunk in chunks[0])

    kept = []

    def assemble() -> None:
        for head, parts in zip(heads, chunks):
            assembler = ContributionAssembler(head, shapes)
            for chunk in parts:
                assembler.add(chunk)
            kept.append(assembler.finish())

    hash_cost = timed(hash_all)
    frame_cost = timed(decode_frames) - hash_cost
    decode_cost = timed(assemble, gb * contributions)
    round_ = [Contribution(f"l{k}", 0, 0, delta, 8, 512) for k, delta in enumerate(kept)]
    caps = ContributionCaps(max_tokens_per_step=64, max_steps=64)
    merged = {}

    def merge(embedding_names: list[str]):
        def work() -> None:
            merged["result"] = merge_contributions(round_, current, history, caps=caps, embedding_names=embedding_names)
        return work

    stages = {
        "frame": frame_cost,
        "hash": hash_cost,
        "decode": decode_cost,
        "merge_rda": timed(merge([]), gb * contributions),
        "merge_mean": timed(merge(["w"]), gb * contributions),
        "codec_down": timed(lambda: decode_named(encode_named(merged["result"].outer_gradient, "int4"))),
    }
    return {name: round(max(0.0, value), 3) for name, value in stages.items()}


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="The lease holder's CPU-s per GB of contributions, stage by stage "
                                                 "(what benchmarks/dataplane.py --stages prints).")
    parser.add_argument("--values", type=int, default=STAGE_VALUES, help="fp32 values of the synthetic fragment")
    parser.add_argument("--contributions", type=int, default=CONTRIBUTIONS, help="contributions one round merges")
    args = parser.parse_args()
    if args.values < 1 or args.contributions < 1:
        parser.error("--values and --contributions must be at least 1")
    stages = syncer_stages(args.values, args.contributions)
    print(json.dumps({"syncer_stages_cpu_s_per_GB": stages, "load_avg": os.getloadavg()}))
