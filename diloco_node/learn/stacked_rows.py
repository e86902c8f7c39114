"""Compiled device programs that read or write ONE learner's row of a stacked parameter stack.

`StackedLearners` keeps M learners' parameters stacked on the device (leading axis M). The runner
needs, at a fragment boundary, one learner's fragment (to apply a merge rule that reads it), one
learner's outer delta against its base (what the codec encodes), or to write one learner's merged
fragment back. Each is one jitted program over the fragment's stacked leaves that moves only that
learner's row: the learner index is a traced argument, so a fragment's program compiles once for
every learner, and the write donates the stacked buffers it replaces.

The arithmetic is the host's, in float32: `delta_rows` computes `base - row` elementwise, which
XLA rounds exactly as numpy does (one IEEE subtraction per element, nothing to fuse), so the
bytes handed to the codec are the same bit for bit (tests/test_stacked_rows.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _take(stacked: Sequence[jax.Array], index: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.dynamic_index_in_dim(leaf, index, axis=0, keepdims=False) for leaf in stacked)


@jax.jit
def take_rows(stacked: tuple[jax.Array, ...], index: jax.Array) -> tuple[jax.Array, ...]:
    """Row `index` of every stacked leaf (float32 on the device)."""
    return tuple(row.astype(jnp.float32) for row in _take(stacked, index))


@jax.jit
def delta_rows(stacked: tuple[jax.Array, ...], index: jax.Array,
               base: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """`base - row` per leaf: the outer delta of learner `index` against the global fragment it
    last applied, in float32."""
    return tuple(b.astype(jnp.float32) - row.astype(jnp.float32) for b, row in zip(base, _take(stacked, index)))


def _set_rows(stacked: tuple[jax.Array, ...], index: jax.Array,
              values: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.dynamic_update_index_in_dim(leaf, value.astype(leaf.dtype), index, axis=0)
                 for leaf, value in zip(stacked, values))


# The write replaces the stack's buffers: donating them lets XLA update the row in place.
set_rows = jax.jit(_set_rows, donate_argnums=(0,))


def to_host(rows: Sequence[jax.Array]) -> list[np.ndarray]:
    """Host float32 copies of device rows: every copy is started before the first is waited on."""
    for row in rows:
        row.copy_to_host_async()
    # Copies the caller owns (writable): the device buffers may be views on a CPU backend.
    return [np.array(row, dtype=np.float32) for row in rows]


def nbytes(rows: Sequence[np.ndarray]) -> int:
    return sum(int(np.asarray(r).nbytes) for r in rows)
