"""A replica site's peak resident memory, from the model's size and the named limits on every buffer
a fragment passes through: what a site's `MemoryMax=` is computed from (docs/SCALE.md, "Memory bound").

The bound is a sum of terms, each a named limit of the code that holds those bytes:
- the runtime (Python, numpy, JAX imported, aiohttp; measured: `RUNTIME_BYTES`);
- the replicated state: parameters and Nesterov momentum, fp32 (`STATE_BYTES_PER_PARAM`);
- the fragment being worked on, the larger of: the lease holder's commit of the largest
  fragment (`COMMIT_COPIES` fp32 copies of it, the merge's float32 result and codec_down's encoder,
  plus one block of the merge, `merge.merge_block_bytes()`), and an apply or a synthetic learner's
  delta (`APPLY_COPIES` fp32 copies; docs/DAEMON.md "Memory"); a snapshot install of a running site (its state resident) holds
  instead up to `join.DOWNLOAD_PEERS` downloaded fragments beside it, decoded straight into their
  arrays (a fresh joiner's state is untouched zero pages, which the downloaded arrays replace);
- state download chunks being received: `join.DOWNLOAD_PEERS` x `join.CHUNKS_IN_FLIGHT` requests of
  `join.SNAPSHOT_CHUNK_BYTES`, each held `RECEIVE_COPIES` times on its way in (socket reader, frame
  decoder, the payload);
- chunks being served: at most `server.MAX_CONCURRENT_STREAMS` requests are answered at once (a
  request's stream slot is held until its reply is written, so a slow reader holds one), each
  with at most `state_transfer.SERVED_CHUNK_BYTES` of fragment bytes plus the one slice the
  socket may have copied (`server.STREAMED_REPLY_MIN_BYTES`); the served fragment itself is read
  from the state's arrays, never serialized whole. A reply is written from views of those arrays
  while the reader keeps up; a slow one gets the rest from one copy of at most a chunk (counted
  here), so it keeps a replaced state version alive for at most `server.REPLY_VIEWS_S` plus one
  slice's wait for the socket (bounded by the read timeout), not for its whole reply.
The bound covers a replica (a witness, the lease holder, a synthetic learner); a training learner
adds its own training state (docs/OPERATIONS.md, "Memory").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from diloco_node.daemon import join, state_transfer
from diloco_node.sync import merge
from diloco_node.transport import server
from wire.limits import MiB

# Measured: a 1B witness after start-up, less its state (727-783 MiB over four runs, docs/SCALE.md).
RUNTIME_BYTES = 800 * MiB
STATE_BYTES_PER_PARAM = 8  # parameters and the Nesterov buffer, fp32
FP32_BYTES = 4
# fp32 copies of the fragment the lease holder commits (sync/syncer.py `plan_commit`): the merge's
# float32 result (1; it folds every contribution block by block, sync/merge.py), then codec_down's
# encoder beside it, its float32 work copy (1) and the codes, scales and compressed bytes (int4:
# under 0.5); the result goes before the bytes are decoded back. tests/test_memory_bound.py measures it.
COMMIT_COPIES = 2.5
# fp32 copies of the fragment a replica applies (the decoded outer gradient, the new parameters and
# momentum, chunk temporaries: 3.3 measured, docs/DAEMON.md) or a synthetic learner's delta; rounded up.
APPLY_COPIES = 4
# A chunk on its way in: the socket reader's buffer, the frame decoder's, the payload handed on.
RECEIVE_COPIES = 3


@dataclass(frozen=True, slots=True)
class MemoryBound:
    """The bound's terms, in bytes; `total` is their sum."""

    runtime: int
    state: int
    fragment_in_flight: int
    receiving: int
    serving: int

    @property
    def total(self) -> int:
        return self.runtime + self.state + self.fragment_in_flight + self.receiving + self.serving


def memory_bound(params: int, largest_fragment_params: int, *, installing: bool = False) -> MemoryBound:
    """The terms of a replica's peak resident memory for `params` parameters whose largest fragment
    has `largest_fragment_params`; `installing`: the site may replace its state from peers while
    the state is resident (a restart after the log was compacted past it)."""
    if params <= 0 or not 0 < largest_fragment_params <= params:
        raise ValueError(f"params = {params}, largest_fragment_params = {largest_fragment_params}: "
                         "need 0 < largest fragment <= params")
    fragment_bytes = FP32_BYTES * largest_fragment_params
    working = max(math.ceil(COMMIT_COPIES * fragment_bytes) + merge.merge_block_bytes(), APPLY_COPIES * fragment_bytes)
    if installing:
        working = max(working, join.DOWNLOAD_PEERS * STATE_BYTES_PER_PARAM * largest_fragment_params)
    return MemoryBound(
        runtime=RUNTIME_BYTES,
        state=STATE_BYTES_PER_PARAM * params,
        fragment_in_flight=working,
        receiving=join.DOWNLOAD_PEERS * join.CHUNKS_IN_FLIGHT * join.SNAPSHOT_CHUNK_BYTES * RECEIVE_COPIES,
        serving=server.MAX_CONCURRENT_STREAMS * (state_transfer.SERVED_CHUNK_BYTES + server.STREAMED_REPLY_MIN_BYTES),
    )


def memory_bound_bytes(params: int, largest_fragment_params: int, *, installing: bool = False) -> int:
    """`memory_bound(...).total`: a replica site's `MemoryMax=` in bytes."""
    return memory_bound(params, largest_fragment_params, installing=installing).total


def issue_target_bytes(params: int) -> int:
    """The data plane's stated target: 1.25 x (parameters + momentum) + 256 MiB."""
    return int(1.25 * STATE_BYTES_PER_PARAM * params) + 256 * MiB
