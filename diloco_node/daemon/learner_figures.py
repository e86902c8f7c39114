"""What the node needs to turn the learner's step windows into MFU: the model's training FLOPs per
token, the site's device count and one device's peak FLOP/s (learn/flops.py).

Resolved once, after the site's model is built, off the event loop (XLA's cost analysis of a
user's model compiles it). Anything unknown (a CPU, a device kind missing from the table without
`[node.mesh] peak_tflops`, a cost analysis that fails) leaves MFU unreported, never guessed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from diloco_node.config.manifest import ModelSpec
from diloco_node.learn import flops

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SiteFlops:
    """MFU's fixed inputs for one site. `peak_per_device` None: MFU is not reported."""

    device_kind: str
    device_count: int
    peak_per_device: float | None
    flops_per_token: float | None

    def __post_init__(self) -> None:
        if self.device_count < 0:
            raise ValueError(f"site flops: device_count = {self.device_count}: must be >= 0")

    def mfu(self, tokens_per_s: float) -> float | None:
        return flops.mfu(tokens_per_s, self.flops_per_token, self.device_count, self.peak_per_device)

    def describe(self) -> str:
        if self.peak_per_device is None:
            return f"MFU not reported: no peak FLOP/s known for {self.device_kind!r} (set [node.mesh] peak_tflops)"
        return (f"MFU against {self.device_count} x {self.peak_per_device / 1e12:g} TFLOP/s ({self.device_kind}), "
                f"{self.flops_per_token or 0:.4g} training FLOPs per token")

    @classmethod
    def resolve(cls, model: ModelSpec, devices: Mapping[str, Any], override_tflops: float = 0.0,
                device_kind: str | None = None) -> SiteFlops:
        """From the site's `SiteMesh.describe()` and `[node.mesh] peak_tflops`; `device_kind`
        defaults to JAX's first device's (every device of a site is of one kind)."""
        if device_kind is None:
            import jax

            device_kind = str(jax.devices()[0].device_kind)
        count = int(devices.get("count", 0))
        peak = flops.peak_flops_per_device(device_kind, override_tflops)
        per_token = None
        if peak is not None and count > 0:  # the FLOPs are only worth computing when MFU will be
            try:
                per_token = flops.flops_per_token(model)
            except Exception as error:  # a user's model XLA cannot analyse: MFU unreported, training goes on
                log.warning("MFU not reported: the model's FLOPs per token are unknown (%s: %s)",
                            type(error).__name__, error)
                peak = None
        return cls(device_kind, count, peak, per_token)
