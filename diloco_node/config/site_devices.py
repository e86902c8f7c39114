"""A site's own accelerators as configured: `[node.mesh]` (how the devices are laid out) and
`[node.cluster]` (the hosts of a multi-host site). Plain validated values, no JAX: the mesh is
built from them in `learn/mesh.py`, the cluster joined in `learn/cluster.py`.

Both are site settings, not run settings: sites of one run differ in devices and hosts (1, 4 or 8
devices; one host or a TPU slice over four) and share one manifest. The number of microbatches
is here too, not in `[run.inner]`: it changes how much of the batch is in memory at once, not the
update (the mean of equal microbatches' gradients is the batch's), so each site picks its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_node.config.manifest import ConfigError

# `[node.cluster] coordinator = "auto"`: jax.distributed finds the cluster itself (Cloud TPU
# slices, SLURM, Open MPI, Kubernetes), process ids and count included.
AUTO_COORDINATOR = "auto"
# `[node.cluster] heartbeat_timeout_s`: how long jax.distributed's coordination service waits for a
# host's heartbeat before it declares the host dead and stops every process of the site (JAX's own
# default is 100 s). A killed host is noticed sooner, in under a second, by the collectives'
# broken connections (measured on loopback: 0.1 s); this bounds the case they cannot see, a host
# that hangs or whose network fails. The hosts of one site share a LAN, where 30 s of silence is
# a failure, not a blip; a site that is down restarts and catches up, so erring early is cheap.
HEARTBEAT_TIMEOUT_S = 30

# `[node.mesh] attention`: how the llama factory computes attention (learn/attention.py). Every
# choice computes the same function; they differ in memory and speed only, so sites of one run
# may choose differently. "auto": the fused kernel where the platform has one (cuDNN flash on
# NVIDIA GPUs, bf16), the chunked online-softmax path for long contexts elsewhere, XLA otherwise.
ATTENTION_CHOICES = ("auto", "xla", "cudnn", "chunked", "reference")
# `[node.mesh] remat`: what the llama blocks keep for the backward pass. "none" keeps every
# activation; "full" recomputes each block's forward; "dots" saves only the matmul outputs
# (jax.checkpoint_policies.dots_with_no_batch_dims_saveable) and recomputes the cheap rest.
REMAT_CHOICES = ("none", "full", "dots")
# `[node.mesh] platform`: the accelerator this site expects. "auto" trains on whatever JAX finds;
# naming one makes a site that got another (a GPU host with CPU JAX installed) refuse to start.
PLATFORM_CHOICES = ("auto", "cpu", "gpu", "tpu")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class MeshShape:
    """`[node.mesh]`: axis sizes (`-1`: every device the other axis leaves), microbatches, and the
    site's execution choices (attention, remat, platform, peak FLOP/s for MFU). None of these
    changes the model or its updates, only this site's memory, speed and what it reports."""

    data: int = -1
    fsdp: int = 1
    microbatches: int = 1
    attention: str = "auto"
    remat: str = "none"
    platform: str = "auto"
    # Peak dense bf16 TFLOP/s of ONE device, for MFU; 0: from the table of known devices
    # (learn/flops.py). Set it for a device the table does not know, or to count another dtype.
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        for name in ("data", "fsdp"):
            value = getattr(self, name)
            if not _is_int(value) or not (value == -1 or value >= 1):
                raise ConfigError(f"mesh.{name} = {value!r}: must be an integer >= 1, or -1 for every remaining device")
        if self.data == -1 and self.fsdp == -1:
            raise ConfigError("mesh.data and mesh.fsdp are both -1: at most one axis takes the remaining devices")
        if not _is_int(self.microbatches) or self.microbatches < 1:
            raise ConfigError(f"mesh.microbatches = {self.microbatches!r}: must be an integer >= 1")
        for name, choices in (("attention", ATTENTION_CHOICES), ("remat", REMAT_CHOICES),
                              ("platform", PLATFORM_CHOICES)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"mesh.{name} = {value!r}: must be one of {', '.join(choices)}")
        peak = self.peak_tflops
        if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not (peak >= 0 and peak < float("inf")):
            raise ConfigError(f"mesh.peak_tflops = {peak!r}: must be a number >= 0 (TFLOP/s of one device; "
                              "0: from the table of known devices)")

    def resolve(self, device_count: int) -> tuple[int, int]:
        """(data, fsdp) sizes for `device_count` devices; a `ConfigError` when they do not fit."""
        data, fsdp = self.data, self.fsdp
        if data == -1 or fsdp == -1:
            fixed = fsdp if data == -1 else data
            if device_count % fixed:
                raise ConfigError(f"mesh.{'fsdp' if data == -1 else 'data'} = {fixed}: does not divide this site's "
                                  f"{device_count} device(s)")
            data, fsdp = (device_count // fixed, fixed) if data == -1 else (fixed, device_count // fixed)
        if data * fsdp != device_count:
            raise ConfigError(f"mesh.data = {data} x mesh.fsdp = {fsdp} = {data * fsdp} devices, but this site has "
                              f"{device_count}; use -1 on one axis for 'every remaining device'")
        return data, fsdp


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """`[node.cluster]`: the processes (one per host) that are one site's JAX cluster.

    coordinator "" is a one-host site; HOST:PORT is where process 0 serves jax.distributed's
    coordination (reachable from every host of the site, never from other sites); "auto" lets
    jax.distributed detect it. Process 0 is the site to the rest of the run.
    """

    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not _is_int(self.num_processes) or self.num_processes < 1:
            raise ConfigError(f"cluster.num_processes = {self.num_processes!r}: must be an integer >= 1")
        if not _is_int(self.process_id) or not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"cluster.process_id = {self.process_id!r}: must be in 0..cluster.num_processes - 1 "
                              f"= {self.num_processes - 1}")
        if not _is_int(self.heartbeat_timeout_s) or self.heartbeat_timeout_s < 1:
            raise ConfigError(f"cluster.heartbeat_timeout_s = {self.heartbeat_timeout_s!r}: must be an integer >= 1 "
                              "(seconds)")
        if not isinstance(self.coordinator, str):
            raise ConfigError(f"cluster.coordinator = {self.coordinator!r}: must be a string HOST:PORT")
        if self.coordinator and self.coordinator != AUTO_COORDINATOR:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ConfigError(f"cluster.coordinator = {self.coordinator!r}: expected HOST:PORT (process 0's "
                                  f"host and a free port), or {AUTO_COORDINATOR!r}")
        if self.num_processes > 1 and not self.coordinator:
            raise ConfigError(f"cluster.num_processes = {self.num_processes}: a multi-host site needs "
                              "cluster.coordinator = \"HOST:PORT\" (process 0's host)")

    @property
    def enabled(self) -> bool:
        """Whether this site is a jax.distributed cluster (several hosts, or detected)."""
        return self.coordinator == AUTO_COORDINATOR or self.num_processes > 1
