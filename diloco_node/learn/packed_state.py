"""The learner's state as a few large device buffers: which leaves share a flat buffer, and the
compiled programs that read and write single tensors in them.

Why: a jitted call costs host CPU for every array passed in and out (about 2 µs each in C++, on
jax 0.10 with XLA:CPU, measured), so a step over a model's leaves costs more dispatch the more
tensors the model has: the llama preset "1m" passes 116 parameter and optimizer arrays, "10m" 224
(thread CPU per dispatch 0.8 and 1.4 ms). Packed, both pass three (0.30 and 0.51 ms), whatever the
depth. The step slices its leaves out of the buffers inside the trace and concatenates the new
ones back: the same arithmetic on the same values (AdamW: bit for bit equal after 40 steps; Muon:
equal to float rounding, the fused matrix products differ by ~1e-6).

What is packed: the fully replicated leaves (every device holds all of them, so slicing and
concatenating them is local), one buffer per dtype. A leaf split over devices (`fsdp`) stays a
leaf of its own. Nothing is packed when the state is larger than `PACK_MAX_BYTES`: XLA keeps the
concatenated state beside the new leaves during the step (measured on XLA:CPU at llama 10m: 71 ->
145 MB of temporaries, one more copy of the state), and a model that large steps long enough for
its dispatch not to matter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Pack a state (parameters or optimizer state) of at most this many bytes: the step then holds one
# more copy of it in temporaries (see above). 2 GiB packs llama 100m's AdamW state (1.2 GB: 4 bytes
# per parameter and 8 of moments), not 1b's (15 GB, where the dispatch is ~1% of a step).
PACK_MAX_BYTES = 2 << 30


@dataclass(frozen=True)
class Packing:
    """Where each leaf of a list lives: in packed buffer `slot[i][0]` at element offset `slot[i][1]`
    (`slot[i][1] == -1`: buffer `slot[i][0]` is the leaf itself). Buffers: the packed ones first,
    then the loose leaves in their order. Hashable: the compiled programs are cached by it."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    slot: tuple[tuple[int, int], ...]
    buffer_shapes: tuple[tuple[int, ...], ...]
    buffer_dtypes: tuple[str, ...]
    # Per buffer and per leaf: the layout on the devices (None: one device, no shardings given).
    buffer_shardings: tuple[Any, ...] | None
    leaf_shardings: tuple[Any, ...] | None

    @property
    def num_buffers(self) -> int:
        return len(self.buffer_shapes)

    def leaves(self, buffers: Sequence[Any]) -> list[Any]:
        """The leaves, sliced out of the buffers (traceable; outside a trace use `unpack`)."""
        out = []
        for shape, (b, offset) in zip(self.shapes, self.slot):
            if offset < 0:
                out.append(buffers[b])
            else:
                out.append(jax.lax.slice(buffers[b], (offset,), (offset + math.prod(shape),)).reshape(shape))
        return out

    def buffers(self, leaves: Sequence[Any]) -> list[Any]:
        """The buffers made of the leaves (traceable; outside a trace use `pack`)."""
        parts: list[list[Any]] = [[] for _ in range(self.num_buffers)]
        for leaf, (b, offset) in zip(leaves, self.slot):
            parts[b].append(leaf if offset < 0 else jnp.ravel(leaf))
        return [jnp.concatenate(part) if b < self.num_packed else part[0] for b, part in enumerate(parts)]

    @property
    def num_packed(self) -> int:
        """How many buffers are packed (the first ones); the rest are loose leaves."""
        return len(self.buffer_shapes) - sum(offset < 0 for _, offset in self.slot)

    def pack(self, leaves: Sequence[Any]) -> list[jax.Array]:
        """The buffers of these leaves (new arrays; the leaves are left as they are)."""
        return list(_pack_program(self)(list(leaves)))

    def unpack(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
        """Copies of every leaf (new arrays; the buffers are left as they are)."""
        return list(_unpack_program(self)(list(buffers)))

    def read(self, buffers: Sequence[jax.Array], indices: Sequence[int]) -> list[jax.Array]:
        """Leaves `indices` as device arrays: a packed one sliced out by one compiled program (a new
        array), a loose one as it is (the next step donates it: read it before, or copy it)."""
        packed = tuple(i for i in indices if self.slot[i][1] >= 0)
        sliced = dict(zip(packed, _read_program(self, packed)(list(buffers)))) if packed else {}
        return [sliced[i] if i in sliced else buffers[self.slot[i][0]] for i in indices]

    def write(self, buffers: Sequence[jax.Array], values: dict[int, jax.Array]) -> list[jax.Array]:
        """The buffers with leaves `values` (device arrays, each with its leaf's layout) written in:
        one compiled program that donates the buffers it writes and copies the values into them
        (the values stay the caller's: the step never donates them)."""
        indices = tuple(sorted(values))
        touched = sorted({self.slot[i][0] for i in indices})
        new = _write_program(self, indices)([buffers[b] for b in touched], [values[i] for i in indices])
        out = list(buffers)
        for b, array in zip(touched, new):
            out[b] = array
        return out


def make_packing(shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any], shardings: Sequence[Any] | None,
                 replicated: Any = None, max_bytes: int = PACK_MAX_BYTES) -> Packing:
    """The packing of leaves of these shapes, dtypes and shardings (None: one device). `replicated`:
    the packed buffers' sharding on a mesh. Nothing is packed above `max_bytes` in all."""
    dtypes = [str(np.dtype(d)) for d in dtypes]
    total = sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))
    packable = [total <= max_bytes and (shardings is None or shardings[i].is_fully_replicated)
                for i in range(len(shapes))]
    group_of: dict[str, int] = {}
    sizes: list[int] = []
    group_dtypes: list[str] = []
    placed: list[tuple[int, int] | None] = []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        if not packable[i]:
            placed.append(None)
            continue
        g = group_of.setdefault(dtype, len(sizes))
        if g == len(sizes):
            sizes.append(0)
            group_dtypes.append(dtype)
        placed.append((g, sizes[g]))
        sizes[g] += math.prod(shape)
    slot, buffer_shapes, buffer_dtypes = [], [(n,) for n in sizes], list(group_dtypes)
    buffer_shardings = None if shardings is None else [replicated] * len(sizes)
    for i, where in enumerate(placed):
        if where is None:
            slot.append((len(buffer_shapes), -1))
            buffer_shapes.append(tuple(shapes[i]))
            buffer_dtypes.append(dtypes[i])
            if buffer_shardings is not None:
                buffer_shardings.append(shardings[i])
        else:
            slot.append(where)
    return Packing(tuple(tuple(s) for s in shapes), tuple(dtypes), tuple(slot), tuple(buffer_shapes),
                   tuple(buffer_dtypes), None if buffer_shardings is None else tuple(buffer_shardings),
                   None if shardings is None else tuple(shardings))


def packing_of(tree: Any, shardings: Any = None, replicated: Any = None, max_bytes: int = PACK_MAX_BYTES) -> Packing:
    """The packing of a tree's leaves (arrays or shape structs), with a tree of their shardings."""
    leaves = jax.tree.leaves(tree)
    return make_packing([tuple(np.shape(x)) for x in leaves], [x.dtype for x in leaves],
                        None if shardings is None else jax.tree.leaves(shardings), replicated, max_bytes)


def _jit(fn: Any, packing: Packing, out: Any, **kwargs: Any) -> Any:
    return jax.jit(fn, **kwargs) if packing.buffer_shardings is None else jax.jit(fn, out_shardings=out, **kwargs)


@functools.lru_cache(maxsize=64)
def _pack_program(packing: Packing) -> Any:
    return _jit(packing.buffers, packing, packing.buffer_shardings and list(packing.buffer_shardings))


@functools.lru_cache(maxsize=64)
def _unpack_program(packing: Packing) -> Any:
    # Every leaf a new array: a loose one is copied too (returned as it is, it would alias).
    return _jit(lambda buffers: [jnp.copy(x) for x in packing.leaves(buffers)], packing,
                packing.leaf_shardings and list(packing.leaf_shardings))


@functools.lru_cache(maxsize=256)
def _read_program(packing: Packing, indices: tuple[int, ...]) -> Any:
    out = packing.leaf_shardings and [packing.leaf_shardings[i] for i in indices]
    return _jit(lambda buffers: [packing.leaves(buffers)[i] for i in indices], packing, out)


@functools.lru_cache(maxsize=256)
def _write_program(packing: Packing, indices: tuple[int, ...]) -> Any:
    touched = sorted({packing.slot[i][0] for i in indices})

    def write(buffers: list[Any], values: list[Any]) -> list[Any]:
        new = dict(zip(touched, buffers))
        for i, value in zip(indices, values):
            b, offset = packing.slot[i]
            if offset < 0:
                new[b] = jnp.copy(value)  # into the donated old leaf's memory
            else:
                new[b] = jax.lax.dynamic_update_slice(new[b], jnp.ravel(value).astype(new[b].dtype), (offset,))
        return [new[b] for b in touched]

    out = packing.buffer_shardings and [packing.buffer_shardings[b] for b in touched]
    # keep_unused: a loose leaf written whole is not read, but its memory is still donated.
    return _jit(write, packing, out, donate_argnums=0, keep_unused=True)
