"""A site's device mesh: which devices train, how the batch and the parameters are laid out on them.

`[node.mesh]` names two axes, `data` and `fsdp` (`-1`: every device the other axis leaves; the
default is every device on `data`). The mesh is built by `jax.make_mesh` over all devices of the
site: one host's GPUs, or every host of a multi-host site once `jax.distributed` is initialised.

Layout rules (one place, so the step, the fragment reads and writes and the benchmark agree):
- the batch `[B, L]` is split over both axes along B: every device holds B / devices rows;
- a parameter (and the AdamW moments of the same shape) is sharded along `fsdp` on its largest
  dimension divisible by the `fsdp` size (the first such one on a tie), or replicated when it has
  fewer than `min_sharded_elements` elements, when no dimension divides, or when `fsdp` is 1.
  Replicated everywhere else (over `data`). Scalars (AdamW's step count) are replicated.
The rule depends on a tensor's shape only: the optimizer state's layout follows from the
parameters' without naming them, and every process of a multi-host site computes the same one.

`inner.batch_size` is the site's global batch whatever its device count, so a run's sites with 1,
4 or 8 devices share one manifest; it must divide by devices x microbatches (a `ConfigError`
naming the key otherwise). Microbatches (gradient accumulation) are a site's own memory choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from diloco_node.config.manifest import ConfigError
from diloco_node.config.site_devices import MeshShape

__all__ = ["AXES", "MIN_SHARDED_ELEMENTS", "MeshShape", "SiteMesh", "build_site_mesh", "host_copies", "host_view",
           "place"]

AXES = ("data", "fsdp")
# Tensors below this many elements are replicated even on an fsdp axis: 64 Ki float32 is 256 KiB,
# less memory than sharding saves is worth an all-gather in every step (norm scales, biases, tiny
# test models). Real models' matrices are millions of elements.
MIN_SHARDED_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class SiteMesh:
    """The mesh a site trains on and its layout rules. Hashable: compiled steps are cached by it."""

    mesh: Mesh
    microbatches: int = 1
    min_sharded_elements: int = MIN_SHARDED_ELEMENTS
    # The site's execution choices (`[node.mesh] attention`, `remat`), compiled into its step: the
    # same model and update, this site's memory and speed (learn/attention.py).
    attention: str = "auto"
    remat: str = "none"

    @property
    def data_size(self) -> int:
        return int(self.mesh.shape["data"])

    @property
    def fsdp_size(self) -> int:
        return int(self.mesh.shape["fsdp"])

    @property
    def device_count(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def multi_process(self) -> bool:
        return len({d.process_index for d in self.mesh.devices.flat}) > 1

    def describe(self) -> dict[str, Any]:
        """What `/status` shows under `devices`."""
        first = self.mesh.devices.flat[0]
        return {"platform": first.platform, "count": self.device_count,
                "processes": len({d.process_index for d in self.mesh.devices.flat}),
                "mesh": {"data": self.data_size, "fsdp": self.fsdp_size},
                "kind": str(getattr(first, "device_kind", "")),
                "attention": self.attention, "remat": self.remat}

    # ---- the layout rules -------------------------------------------------------------------

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec(AXES))

    def microbatch_sharding(self) -> NamedSharding:
        """[microbatches, B / microbatches, L]: every microbatch spread over every device."""
        return NamedSharding(self.mesh, PartitionSpec(None, AXES))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def sharded_dim(self, shape: Sequence[int]) -> int | None:
        """The dimension a tensor of this shape is split along `fsdp`, or None (replicated)."""
        fsdp = self.fsdp_size
        if fsdp == 1 or math.prod(shape) < self.min_sharded_elements:
            return None
        candidates = [(size, -dim) for dim, size in enumerate(shape) if size % fsdp == 0]
        if not candidates:
            return None
        return -max(candidates)[1]

    def param_sharding(self, shape: Sequence[int]) -> NamedSharding:
        dim = self.sharded_dim(shape)
        if dim is None:
            return self.replicated()
        spec = [None] * len(shape)
        spec[dim] = "fsdp"
        return NamedSharding(self.mesh, PartitionSpec(*spec))

    def tree_shardings(self, tree: Any) -> Any:
        """The sharding of every leaf of a parameter or optimizer-state tree, by the leaf's shape."""
        return jax.tree.map(lambda leaf: self.param_sharding(tuple(np.shape(leaf))), tree)

    def check_batch(self, batch_size: int) -> None:
        """`inner.batch_size` is the site's global batch: it must split evenly into every device's
        rows of every microbatch."""
        parts = self.device_count * self.microbatches
        if batch_size % parts:
            raise ConfigError(f"inner.batch_size = {batch_size}: must be divisible by this site's {self.device_count} "
                              f"device(s) x mesh.microbatches = {self.microbatches} (= {parts}); it is the site's "
                              "global batch, split over the devices")

    # ---- host <-> devices -------------------------------------------------------------------

    def put(self, value: Any, sharding: NamedSharding) -> jax.Array:
        return place(value, sharding)

    def put_batch(self, tokens_BxL: np.ndarray) -> jax.Array:
        return self.put(tokens_BxL, self.batch_sharding())

    def put_tree(self, tree: Any) -> Any:
        """Every leaf of a host (or local device) tree onto the mesh by the layout rule."""
        def one(leaf: Any) -> jax.Array:
            sharding = self.param_sharding(tuple(np.shape(leaf)))
            if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
                return leaf  # already in place (on a multi-host site, not readable from here alone)
            if isinstance(leaf, jax.Array) and sharding.is_fully_addressable:
                return jax.device_put(leaf, sharding)  # device to device, no host round trip
            return self.put(np.asarray(leaf), sharding)

        return jax.tree.map(one, tree)


def build_site_mesh(shape: MeshShape, devices: Sequence[Any] | None = None,
                    min_sharded_elements: int = MIN_SHARDED_ELEMENTS) -> SiteMesh:
    """The site's mesh over `devices` (default: every device of every process of the site)."""
    devices = list(jax.devices() if devices is None else devices)
    check_platform(shape.platform, devices[0].platform)
    data, fsdp = shape.resolve(len(devices))
    mesh = jax.make_mesh((data, fsdp), AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)
    return SiteMesh(mesh, shape.microbatches, min_sharded_elements, shape.attention, shape.remat)


# What JAX calls each `[node.mesh] platform` choice's devices (an NVIDIA or AMD GPU is "gpu" to the
# config; JAX's device platform says "gpu" or "cuda"/"rocm" depending on the plugin).
_PLATFORM_NAMES = {"cpu": {"cpu"}, "gpu": {"gpu", "cuda", "rocm"}, "tpu": {"tpu"}}


def check_platform(expected: str, found: str) -> None:
    """A site that names its accelerator refuses to start on another one: a GPU host whose venv
    has CPU JAX would otherwise train, silently, a hundred times slower."""
    if expected == "auto" or found in _PLATFORM_NAMES[expected]:
        return
    hint = {"gpu": "install JAX for CUDA into the site's venv: pip install -e '.[cuda12]' from the clone, and check "
                   "`python -c 'import jax; print(jax.devices())'` lists the GPUs",
            "tpu": "install JAX for TPU into the site's venv: pip install -e '.[tpu]' from the clone",
            "cpu": "unset JAX_PLATFORMS or set JAX_PLATFORMS=cpu, or set mesh.platform to what this host has"}
    raise ConfigError(f"mesh.platform = {expected!r}, but JAX found {found!r} devices; {hint[expected]}")


def place(value: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array (the same on every process) onto devices with `sharding`. Each process fills
    only its own devices' shards, so this is local work even on a multi-host site."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def host_view(array: jax.Array) -> np.ndarray:
    """A fully addressable device array's host value without a copy of our own: the buffer its
    transfer to the host filled (`copy_to_host_async`), read-only; float32 as the merge needs."""
    value = np.asarray(array)
    return value if value.dtype == np.float32 else value.astype(np.float32)


def host_copies(arrays: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """float32 host copies of fully addressable device arrays (gathered from their shards)."""
    return {name: np.array(array, dtype=np.float32) for name, array in arrays.items()}
