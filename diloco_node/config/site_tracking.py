"""`[node.tracking]`: where a site sends its figures for experiment trackers (TensorBoard event
files, Weights & Biases). Plain validated values; the writers are in ops/tracking.py.

A site setting, not a run setting: each site chooses its own trackers (or none), and a tracker
never changes training.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diloco_node.config.manifest import ConfigError

# `wandb_mode`: "offline" writes the run under the data dir and needs no network (sync it later
# with `wandb sync`); "online" streams to the W&B server; "disabled" keeps the calls as no-ops.
WANDB_MODES = ("offline", "online", "disabled")
# W&B project, entity and run names: what its API accepts without escaping (and no path separators).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


@dataclass(frozen=True, slots=True)
class TrackingSpec:
    """`[node.tracking]`: `tensorboard_dir` ("" off; relative to the data dir, or absolute),
    `wandb_project` ("" off), `wandb_mode`, `wandb_entity` ("" the account's default), `run_name`
    ("" the node id)."""

    tensorboard_dir: str = ""
    wandb_project: str = ""
    wandb_mode: str = "offline"
    wandb_entity: str = ""
    run_name: str = ""

    def __post_init__(self) -> None:
        for name in ("tensorboard_dir", "wandb_project", "wandb_mode", "wandb_entity", "run_name"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"tracking.{name} = {getattr(self, name)!r}: must be a string")
        if "\0" in self.tensorboard_dir:
            raise ConfigError("tracking.tensorboard_dir: must be a path without NUL characters")
        if self.wandb_mode not in WANDB_MODES:
            raise ConfigError(f"tracking.wandb_mode = {self.wandb_mode!r}: must be one of {', '.join(WANDB_MODES)}")
        for name in ("wandb_project", "wandb_entity", "run_name"):
            value = getattr(self, name)
            if value and not _NAME.match(value):
                raise ConfigError(f"tracking.{name} = {value!r}: must be 1-128 letters, digits, '_', '.', '-' "
                                  "starting with a letter or digit (or \"\")")

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard_dir or self.wandb_project)
