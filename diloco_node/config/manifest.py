"""The run's parameters: what every site of one run must agree on (the run manifest).

One frozen dataclass per concern (model, data, inner optimizer, outer optimizer, sync), composed
into `RunManifest`. Every value is validated on construction, so a manifest that exists is
usable. `from_dict` refuses unknown keys (a typo in a config file must not be silently ignored)
and `digest()` gives a stable fingerprint that joiners compare with the run they join.

Node-local settings (listen address, data directory, secret file, role) are not part of the
manifest: sites differ in those.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Mapping

from diloco_node.config.presets import expand_preset

CODEC_NAMES = ("fp32", "bf16", "int8", "int4", "e3m0", "topk2", "union8")
MERGE_METHODS = ("mean", "rda", "support_mean")
# "median": each contribution rescaled to the round's median norm before the merge (Covenant-72B;
# sync/contribution_norm.py, which holds the same names).
CONTRIBUTION_NORMS = ("none", "median")
# Uplink codecs that send a sparse or low-bit approximation whose error must be carried to the
# next send (error feedback, learn/error_feedback.py); the dense codecs never use it, so a run that
# names them reproduces the runs made before error feedback existed.
ERROR_FEEDBACK_CODECS = ("topk2",)
WEIGHTINGS = ("uniform", "tokens")
APPLY_MODES = ("overwrite", "mix", "eager")  # eager: the in-process runner only (sync/apply.py)
OUTER_LR_SCHEDULES = ("constant", "linear", "cosine", "step")
INNER_OPTIMIZERS = ("adamw", "muon")
INNER_SCHEDULES = ("cosine", "wsd")
# The horizon of a cosine schedule when neither inner.total_steps nor [run.stop] tokens / steps
# bound the run (the value total_steps had before it could follow [run.stop]).
COSINE_FALLBACK_STEPS = 1000


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names it."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    _require(value in allowed, f"{section}.{name} = {value!r}: must be one of {', '.join(allowed)}")


OptionValue = Any  # a TOML scalar or list: str, int, float, bool, or a list of those
TensorSignature = tuple[str, tuple[int, ...], str]  # (flat parameter name, shape, dtype)
# Keys of [run.model] that are ModelSpec's own, never factory options: the factory is not called
# with them. `init_from` (a Hugging Face Llama directory the founder imports) and `init_sha256`
# (the digest of the imported weights, sealed by the founder) are read by learn/factory.py.
MODEL_KEYS = ("factory", "vocab_size", "seq_len", "tensors", "init_from", "init_sha256")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Which model every site trains: a factory, the vocabulary and context every factory gets, and
    the factory's own options (every other key of `[run.model]`).

    `factory` is "bytes" (the built-in byte-level transformer), "llama" (the built-in Llama-style
    family) or "package.module:function" for a user's own (docs/MODELS.md). `tensors` is the
    parameter signature (names, shapes, dtypes) the founding site's factory produced: filled in
    when a run is founded, so a site whose factory builds something else is refused with the
    differing tensors named. Empty means "not sealed yet" (a config file never sets it).

    `init_from` names a Hugging Face Llama directory the run starts from (factory "llama" only;
    docs/MODELS.md "Hugging Face Llama in and out"): only the founder reads it, filling the
    options in from its config.json and sealing `init_sha256`, the digest of the imported
    weights (learn/hf_llama.py `weights_sha256`). Both are "" for a run that starts from the seed,
    and are then absent from the table (so the manifests of such runs keep their digests).
    """

    factory: str = "bytes"
    vocab_size: int = 256
    seq_len: int = 128
    options: tuple[tuple[str, OptionValue], ...] = ()
    tensors: tuple[TensorSignature, ...] = ()
    init_from: str = ""
    init_sha256: str = ""

    def __post_init__(self) -> None:
        _require(isinstance(self.factory, str) and bool(self.factory.strip()),
                 "model.factory: must name a factory: \"bytes\", \"llama\" or \"package.module:function\"")
        if self.factory not in ("bytes", "llama"):
            module, sep, function = self.factory.partition(":")
            _require(bool(sep) and bool(module) and bool(function) and " " not in self.factory,
                     f"model.factory = {self.factory!r}: must be \"bytes\", \"llama\" or \"package.module:function\"")
        _require(isinstance(self.vocab_size, int) and 2 <= self.vocab_size <= 2**31 - 1,
                 f"model.vocab_size = {self.vocab_size}: must be an integer in [2, 2^31 - 1]")
        _require(8 <= self.seq_len <= 1 << 20, f"model.seq_len = {self.seq_len}: must be in [8, 1048576]")
        names = [name for name, _ in self.options]
        _require(names == sorted(set(names)), "model options: keys must be unique and sorted (use ModelSpec.of)")
        for name, value in self.options:
            _require(name not in MODEL_KEYS, f"model.{name}: reserved key, not a factory option")
            _require(_is_option_value(value), f"model.{name} = {value!r}: must be a string, number, boolean or list")
        _require(isinstance(self.init_from, str), f"model.init_from = {self.init_from!r}: must be a directory path")
        _require(not self.init_from or self.factory == "llama",
                 f"model.init_from = {self.init_from!r} imports a Hugging Face Llama: it needs factory = \"llama\" "
                 f"(not {self.factory!r})")
        digest = self.init_sha256
        _require(isinstance(digest, str) and (digest == "" or (len(digest) == 64 and all(c in "0123456789abcdef" for c in digest))),
                 f"model.init_sha256 = {digest!r}: must be the 64 lowercase hex digits of a sha256 (or empty)")
        _require(not digest or bool(self.init_from),
                 "model.init_sha256: the digest of imported weights needs model.init_from (the directory)")

    @classmethod
    def of(cls, factory: str = "bytes", *, vocab_size: int = 256, seq_len: int = 128,
           tensors: tuple[TensorSignature, ...] = (), init_from: str = "", init_sha256: str = "",
           **options: OptionValue) -> ModelSpec:
        """A spec from keyword options, e.g. `ModelSpec.of("llama", vocab_size=32000, size="1m")`."""
        return cls(factory, vocab_size, seq_len, tuple(sorted((k, _frozen(v)) for k, v in options.items())), tensors,
                   init_from, init_sha256)

    def option(self, name: str, default: OptionValue = None) -> OptionValue:
        return dict(self.options).get(name, default)

    def factory_config(self) -> dict[str, OptionValue]:
        """What the factory is called with: its options plus vocab_size and seq_len."""
        config = {name: _thawed(value) for name, value in self.options}
        config.update(vocab_size=self.vocab_size, seq_len=self.seq_len)
        return config

    def sealed(self, tensors: tuple[TensorSignature, ...]) -> ModelSpec:
        return dataclasses.replace(self, tensors=tuple((n, tuple(s), d) for n, s, d in tensors))

    def to_table(self) -> dict[str, Any]:
        """The flat `[run.model]` table: the factory's options side by side with the fixed keys."""
        table: dict[str, Any] = {"factory": self.factory, "vocab_size": self.vocab_size, "seq_len": self.seq_len}
        table.update((name, _thawed(value)) for name, value in self.options)
        if self.tensors:
            table["tensors"] = [[name, list(shape), dtype] for name, shape, dtype in self.tensors]
        for key in ("init_from", "init_sha256"):  # only when set: older manifests keep their form
            if getattr(self, key):
                table[key] = getattr(self, key)
        return table

    @classmethod
    def from_table(cls, raw: Mapping[str, Any]) -> ModelSpec:
        _require(isinstance(raw, Mapping), f"model: expected a table/mapping, got {type(raw).__name__}")
        factory = raw.get("factory", "bytes")
        _require(isinstance(factory, str), f"model.factory = {factory!r}: must be a string")
        fixed: dict[str, int] = {}
        for key, default in (("vocab_size", 256), ("seq_len", 128)):
            value = raw.get(key, default)
            _require(isinstance(value, int) and not isinstance(value, bool), f"model.{key} = {value!r}: must be an integer")
            fixed[key] = value
        tensors: list[TensorSignature] = []
        for item in raw.get("tensors", ()) or ():
            ok = (isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[0], str)
                  and isinstance(item[1], (list, tuple)) and all(isinstance(d, int) for d in item[1])
                  and isinstance(item[2], str))
            _require(ok, f"model.tensors: malformed entry {item!r}; expected [name, [shape], dtype]")
            tensors.append((item[0], tuple(item[1]), item[2]))
        imported: dict[str, str] = {}
        for key in ("init_from", "init_sha256"):
            value = raw.get(key, "")
            _require(isinstance(value, str), f"model.{key} = {value!r}: must be a string")
            imported[key] = value
        options = {k: v for k, v in raw.items() if k not in MODEL_KEYS}
        return cls.of(factory, tensors=tuple(tensors), **fixed, **imported, **options)


def _is_option_value(value: Any) -> bool:
    if isinstance(value, (str, bool, int, float)):
        return not (isinstance(value, float) and value != value)  # NaN would never compare equal
    return isinstance(value, tuple) and all(_is_option_value(v) and not isinstance(v, tuple) for v in value)


def _frozen(value: Any) -> OptionValue:
    return tuple(value) if isinstance(value, list) else value


def _thawed(value: OptionValue) -> Any:
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True, slots=True)
class DataAgreement:
    """What every site's data must agree on beyond `[run.model]`'s vocabulary and context.

    Where a site reads its data is its own setting (`[node.data]`); the run only fixes the
    tokenizer: `tokenizer_sha256` is the sha256 of the tokenizer.json that made the run's ids, set
    here or sealed by a founding site that tokenizes with one ("" names none). A site whose
    tokenizer differs is refused.
    """

    tokenizer_sha256: str = ""

    def __post_init__(self) -> None:
        value = self.tokenizer_sha256
        _require(isinstance(value, str) and (value == "" or (len(value) == 64 and all(c in "0123456789abcdef" for c in value))),
                 f"data.tokenizer_sha256 = {value!r}: must be the 64 lowercase hex digits of a sha256 (or empty)")


@dataclass(frozen=True, slots=True)
class InnerOptimizer:
    """Each learner's own optimizer and its learning-rate schedule.

    `optimizer` "adamw": AdamW on every parameter. "muon": Muon on the hidden matrices and AdamW
    on embeddings, the output head, norms and biases (learn/inner.py `muon_label`); the Muon
    group has its own peak, momentum and weight decay (`muon_*`), AdamW keeps `lr_peak`, `b1`,
    `b2` and `weight_decay`. Both groups follow one schedule shape scaled to their peaks: a linear
    warm-up, then "cosine" down to `lr_final_fraction` of the peak at `total_steps`, or "wsd"
    (warm-up, stable at the peak, linear decay to the same floor over the last `decay_fraction`
    of `total_steps`). `total_steps` 0 follows the run's [run.stop] (`RunManifest.inner_horizon`).
    """

    batch_size: int = 16
    lr_peak: float = 3e-3
    lr_final_fraction: float = 0.1
    warmup_steps: int = 50
    # Horizon of the schedule, in this learner's steps; 0: follow [run.stop] (RunManifest.inner_horizon).
    total_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip_norm: float = 1.0
    optimizer: str = "adamw"
    schedule: str = "cosine"
    decay_fraction: float = 0.2
    horizon_learners: int = 1
    muon_lr_peak: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _require(self.batch_size >= 1, f"inner.batch_size = {self.batch_size}: must be >= 1")
        _require(0.0 < self.lr_peak < 1.0, f"inner.lr_peak = {self.lr_peak}: must be in (0, 1)")
        _require(0.0 <= self.lr_final_fraction <= 1.0, "inner.lr_final_fraction: must be in [0, 1]")
        _require(self.total_steps >= 0, f"inner.total_steps = {self.total_steps}: must be >= 0 (0: follow [run.stop])")
        _require(self.warmup_steps >= 0, f"inner.warmup_steps = {self.warmup_steps}: must be >= 0")
        _require(self.total_steps == 0 or self.warmup_steps < self.total_steps,
                 f"inner.warmup_steps = {self.warmup_steps}: must be >= 0 and < total_steps = {self.total_steps}")
        _require(self.weight_decay >= 0.0, "inner.weight_decay: must be >= 0")
        _require(0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0, "inner.b1 and inner.b2: must be in [0, 1)")
        _require(self.grad_clip_norm > 0.0, "inner.grad_clip_norm: must be > 0")
        _choice("inner", "optimizer", self.optimizer, INNER_OPTIMIZERS)
        _choice("inner", "schedule", self.schedule, INNER_SCHEDULES)
        _require(0.0 < self.decay_fraction <= 1.0, f"inner.decay_fraction = {self.decay_fraction}: must be in (0, 1]")
        _require(self.horizon_learners >= 1, f"inner.horizon_learners = {self.horizon_learners}: must be >= 1")
        _require(0.0 < self.muon_lr_peak < 1.0, f"inner.muon_lr_peak = {self.muon_lr_peak}: must be in (0, 1)")
        _require(0.0 <= self.muon_momentum < 1.0, f"inner.muon_momentum = {self.muon_momentum}: must be in [0, 1)")
        _require(self.muon_weight_decay >= 0.0, f"inner.muon_weight_decay = {self.muon_weight_decay}: must be >= 0")

    def horizon(self) -> int:
        """The schedule's horizon in learner steps: `total_steps`, or without it (nothing resolved
        it from [run.stop]) none for "wsd" (0: stable at the peak after warm-up) and the fixed
        COSINE_FALLBACK_STEPS for "cosine", which cannot decay without an end."""
        if self.total_steps:
            return self.total_steps
        return 0 if self.schedule == "wsd" else max(COSINE_FALLBACK_STEPS, self.warmup_steps + 1)


@dataclass(frozen=True, slots=True)
class OuterOptimizer:
    """The syncer's SGD with Nesterov momentum, applied per fragment, and its schedule over the
    fragment's rounds (`sync/outer_schedule.py` gives the step's lr and momentum at a round).

    lr 0.7 and momentum 0.6 were measured (docs/PARITY.md, "How the defaults were chosen"): with
    ~20 rounds per fragment from a random start, DiLoCo's momentum 0.9 overshoots. The schedule
    keys default to off, the constant step. `horizon_rounds` = 0 takes the run's own horizon,
    the learner's horizon // sync.period rounds (`RunManifest.outer_horizon_rounds`): replicas
    step with `RunManifest.resolved_outer()`, so the manifest's dict and digest stay what was
    configured and a changed total_steps, [run.stop] or period moves the horizon too.
    """

    lr: float = 0.7
    momentum: float = 0.6
    # Momentum ramps linearly from 0 (round 1) to `momentum` (round W + 1): a young model's first
    # outer gradients are not amplified by a full buffer. 0: off. 5 was measured a little better
    # than off on both seeds of the parity benchmark (docs/PARITY.md, "Outer-loop schedules (measured)").
    momentum_warmup_rounds: int = 5
    # Over the last D rounds of the horizon momentum moves linearly to `momentum_final`. 0: off.
    momentum_decay_rounds: int = 0
    momentum_final: float = 0.0
    # constant; or lr held until `lr_decay_start` (a fraction of the horizon), then linear or
    # cosine down to lr x lr_final_fraction at the horizon, or (step) cut to it at once.
    lr_schedule: str = "constant"
    lr_final_fraction: float = 0.65  # Covenant-72B's late cut (outer lr 1 -> 0.65); used only by a schedule
    lr_decay_start: float = 0.0
    horizon_rounds: int = 0  # rounds of a fragment the schedules span; 0: the run's own (see above)

    def __post_init__(self) -> None:
        _require(0.0 < self.lr <= 2.0, f"outer.lr = {self.lr}: must be in (0, 2]")
        _require(0.0 <= self.momentum < 1.0, f"outer.momentum = {self.momentum}: must be in [0, 1)")
        _require(self.momentum_warmup_rounds >= 0,
                 f"outer.momentum_warmup_rounds = {self.momentum_warmup_rounds}: must be >= 0 (0: off)")
        _require(self.momentum_decay_rounds >= 0,
                 f"outer.momentum_decay_rounds = {self.momentum_decay_rounds}: must be >= 0 (0: off)")
        _require(0.0 <= self.momentum_final < 1.0, f"outer.momentum_final = {self.momentum_final}: must be in [0, 1)")
        _choice("outer", "lr_schedule", self.lr_schedule, OUTER_LR_SCHEDULES)
        _require(0.0 <= self.lr_final_fraction <= 1.0,
                 f"outer.lr_final_fraction = {self.lr_final_fraction}: must be in [0, 1]")
        _require(0.0 <= self.lr_decay_start < 1.0, f"outer.lr_decay_start = {self.lr_decay_start}: must be in [0, 1)")
        _require(self.horizon_rounds >= 0,
                 f"outer.horizon_rounds = {self.horizon_rounds}: must be >= 0 (0: inner.total_steps // sync.period)")

    @property
    def horizon(self) -> int:
        """The rounds the schedules span (0: unknown; `RunManifest.resolved_outer` fills it in)."""
        return self.horizon_rounds

    @property
    def needs_horizon(self) -> bool:
        """Whether a schedule that ends at the horizon is on (the lr schedule or the momentum decay)."""
        return self.lr_schedule != "constant" or self.momentum_decay_rounds > 0


@dataclass(frozen=True, slots=True)
class SyncSpec:
    """How and when fragments cross sites, and how contributions are merged.

    fragments (P), period (H) and overlap (tau) are in learner steps; min_quorum is K;
    grace_gamma and grace_cap_s shape the adaptive grace window. The caps bound what a learner
    may claim in its counters (they come from the network).
    """

    fragments: int = 4
    # H 28 was measured better than 32 in quality and still >= 200x fewer bytes than data-parallel
    # with int4 both ways (docs/PARITY.md, "Re-sweep at 600 steps").
    period: int = 28
    overlap: int = 2
    min_quorum: int = 1
    grace_gamma: float = 0.5
    grace_cap_s: float = 5.0
    codec_up: str = "int4"
    codec_down: str = "int4"
    merge: str = "rda"
    weighting: str = "tokens"
    # Off: level in the sparseloco recipe (uniform, two seeds) and 4.0% worse with a straggler
    # (docs/PARITY.md, "The `sparseloco` preset, two seeds").
    contribution_norm: str = "none"
    apply: str = "overwrite"
    mix_alpha: float = 0.5
    # A merge that lacks this learner's contribution: keep its unsent progress on top of the merge
    # (and its counters) instead of discarding it. Off: measured worse with a straggler (1.8837 vs
    # 1.8535) and equal otherwise (docs/PARITY.md, "The apply rule").
    keep_unmerged: bool = False
    max_tokens_per_step: int = 1 << 20
    max_steps_per_contribution: int = 1 << 16
    # Error feedback (a learner sends Q(beta * e + delta) and keeps e <- beta * e + delta - Q(...)):
    # on by default, but only a codec of ERROR_FEEDBACK_CODECS uses it (see `uses_error_feedback`).
    error_feedback: bool = True
    # beta: 0.95 measured 1.1% better than 1.0 and level with 0.9 (topk2, docs/PARITY.md "Sparse
    # outer gradients with error feedback").
    error_feedback_decay: float = 0.95

    def __post_init__(self) -> None:
        _require(self.fragments >= 1, f"sync.fragments = {self.fragments}: must be >= 1")
        _require(self.period >= 1, f"sync.period = {self.period}: must be >= 1")
        _require(self.fragments <= self.period,
                 f"sync.fragments = {self.fragments} > sync.period = {self.period}: each fragment needs its own offset")
        _require(0 <= self.overlap < self.period, f"sync.overlap = {self.overlap}: must be in [0, period)")
        _require(self.min_quorum >= 1, f"sync.min_quorum = {self.min_quorum}: must be >= 1")
        _require(0.0 <= self.grace_gamma < 1.0, f"sync.grace_gamma = {self.grace_gamma}: must be in [0, 1)")
        _require(self.grace_cap_s >= 0.0, "sync.grace_cap_s: must be >= 0")
        _choice("sync", "codec_up", self.codec_up, CODEC_NAMES)
        _choice("sync", "codec_down", self.codec_down, CODEC_NAMES)
        _choice("sync", "merge", self.merge, MERGE_METHODS)
        _choice("sync", "weighting", self.weighting, WEIGHTINGS)
        _choice("sync", "contribution_norm", self.contribution_norm, CONTRIBUTION_NORMS)
        _choice("sync", "apply", self.apply, APPLY_MODES)
        _require(0.0 <= self.mix_alpha <= 1.0, "sync.mix_alpha: must be in [0, 1]")
        _require(self.max_tokens_per_step >= 1, "sync.max_tokens_per_step: must be >= 1")
        _require(self.max_steps_per_contribution >= 1, "sync.max_steps_per_contribution: must be >= 1")
        _require(math.isfinite(self.error_feedback_decay) and 0.0 <= self.error_feedback_decay <= 1.0,
                 f"sync.error_feedback_decay = {self.error_feedback_decay}: must be in [0, 1]")

    @property
    def uses_error_feedback(self) -> bool:
        """Whether learners keep an error-feedback remainder: `error_feedback` and a codec_up that
        needs it (ERROR_FEEDBACK_CODECS); int4 and the other dense codecs send as before."""
        return self.error_feedback and self.codec_up in ERROR_FEEDBACK_CODECS


@dataclass(frozen=True, slots=True)
class StopSpec:
    """When the run is complete (0: no limit). `tokens` and `steps` count what has been merged into
    the global model: the least any fragment has merged, so every parameter has seen that much.
    `wall_s` counts from the founding of the run to the newest commit's time (the lease holder's
    clock when it planned the commit): the first commit past it completes the run."""

    tokens: int = 0
    steps: int = 0
    wall_s: float = 0.0

    def __post_init__(self) -> None:
        _require(self.tokens >= 0, f"stop.tokens = {self.tokens}: must be >= 0 (0: no limit)")
        _require(self.steps >= 0, f"stop.steps = {self.steps}: must be >= 0 (0: no limit)")
        _require(math.isfinite(self.wall_s) and self.wall_s >= 0, f"stop.wall_s = {self.wall_s}: must be >= 0 (0: no limit)")

    def reached(self, tokens: int, steps: int, elapsed_s: float = 0.0) -> str | None:
        """Why the run is complete with these merged totals and this much time since founding, or None."""
        if self.tokens and tokens >= self.tokens:
            return f"{tokens} tokens merged into every fragment (stop.tokens = {self.tokens})"
        if self.steps and steps >= self.steps:
            return f"{steps} inner steps merged into every fragment (stop.steps = {self.steps})"
        if self.wall_s and elapsed_s >= self.wall_s:
            return f"a commit {elapsed_s:.0f} s after the run was founded (stop.wall_s = {self.wall_s:g})"
        return None


@dataclass(frozen=True, slots=True)
class RunManifest:
    """Everything the sites of one run must agree on; joiners receive it and must not contradict it."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataAgreement = field(default_factory=DataAgreement)
    inner: InnerOptimizer = field(default_factory=InnerOptimizer)
    outer: OuterOptimizer = field(default_factory=OuterOptimizer)
    sync: SyncSpec = field(default_factory=SyncSpec)
    stop: StopSpec = field(default_factory=StopSpec)
    seed: int = 0
    founded_at: float = 0.0  # unix time the run was founded (set by the founding site, never configured)

    def inner_horizon(self) -> tuple[int, str]:
        """A learner's schedule horizon in its own steps, and where it comes from.

        `inner.total_steps` when set. Otherwise [run.stop]'s budget: `stop.steps` and `stop.tokens`
        count the work of every learner together (what every fragment has merged), so a learner's
        share is the budget divided by `inner.horizon_learners` (the learners expected to train
        side by side; tokens become steps at `batch_size * seq_len` tokens per step); with both
        set, the one reached first. At least `warmup_steps + 1`. With neither, `inner.horizon()`:
        0 (no end) for "wsd", COSINE_FALLBACK_STEPS for "cosine".
        A pure function of the manifest, so the daemon, `train` and the runner agree.
        """
        inner, stop = self.inner, self.stop
        if inner.total_steps:
            return inner.total_steps, f"inner.total_steps = {inner.total_steps}"
        learners = inner.horizon_learners
        bounds: list[tuple[int, str]] = []
        if stop.steps:
            bounds.append((math.ceil(stop.steps / learners),
                           f"stop.steps = {stop.steps} shared by inner.horizon_learners = {learners}"))
        if stop.tokens:
            tokens_per_step = inner.batch_size * self.model.seq_len
            bounds.append((math.ceil(stop.tokens / (learners * tokens_per_step)),
                           f"stop.tokens = {stop.tokens} shared by inner.horizon_learners = {learners} at "
                           f"{tokens_per_step} tokens per step"))
        if bounds:
            steps, source = min(bounds)
            return max(steps, inner.warmup_steps + 1), source
        if inner.schedule == "wsd":
            return 0, "nothing bounds the run ([run.stop] sets no tokens or steps): WSD stays at its peak"
        return inner.horizon(), (f"nothing bounds the run ([run.stop] sets no tokens or steps): cosine falls back "
                                 f"to {inner.horizon()} steps; set inner.total_steps or use schedule = \"wsd\"")

    def learner_inner(self) -> InnerOptimizer:
        """The inner optimizer a learner runs: `inner` with `total_steps` resolved (`inner_horizon`)."""
        return dataclasses.replace(self.inner, total_steps=self.inner_horizon()[0])

    def outer_horizon_rounds(self) -> int:
        """The rounds of a fragment the outer schedules span: `outer.horizon_rounds`, or (0) the
        run's horizon, the learner's horizon (`inner_horizon`) // sync.period (each fragment syncs
        once a period), at least 1; 0 when the learner's horizon is unknown (an unbounded WSD run)."""
        if self.outer.horizon_rounds:
            return self.outer.horizon_rounds
        steps = self.inner_horizon()[0]
        return max(1, steps // self.sync.period) if steps else 0

    def resolved_outer(self) -> OuterOptimizer:
        """The outer optimizer a replica steps with: `outer` with `horizon_rounds` resolved
        (`outer_horizon_rounds`), so the schedule needs nothing else. The manifest itself (its dict
        and digest) keeps what was configured."""
        return dataclasses.replace(self.outer, horizon_rounds=self.outer_horizon_rounds())

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/TOML-compatible dict (tuples become lists); the model is its flat table."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        plain = {name: (value.to_table() if isinstance(value, ModelSpec)
                        else dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
                 for name, value in plain.items()}
        return json.loads(json.dumps(plain))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "RunManifest":
        """Build from a nested mapping; unknown sections or keys are errors, missing ones default."""
        _require(isinstance(raw, Mapping), "manifest: expected a table/mapping")
        try:
            raw = expand_preset(raw)  # [run.sync] preset: its keys, where the config sets none
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        sections = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(sections))
        _require(not unknown, f"manifest: unknown key(s) {', '.join(unknown)}; known: {', '.join(sections)}")
        kwargs: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "seed":
                _require(isinstance(value, int) and not isinstance(value, bool), "seed: must be an integer")
                kwargs[name] = value
                continue
            if name == "founded_at":
                _require(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                         and value >= 0, "founded_at: must be a non-negative unix time")
                kwargs[name] = float(value)
                continue
            if name == "model":
                kwargs[name] = ModelSpec.from_table(value)
                continue
            section_cls = _SECTION_TYPES[name]
            kwargs[name] = _section_from_dict(name, section_cls, value)
        return cls(**kwargs)

    def canonical_bytes(self) -> bytes:
        """The one canonical JSON form (sorted keys, no spaces): what peers exchange and digests cover."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def digest(self) -> str:
        """Stable sha256 over the canonical JSON form; equal manifests have equal digests."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    def digest_bytes(self) -> bytes:
        """The digest as the 32 raw bytes a JoinRequest carries."""
        return bytes.fromhex(self.digest())

    def differences(self, other: "RunManifest") -> list[str]:
        """Human-readable list of `section.key: ours != theirs` (empty when they agree)."""
        ours, theirs = self.to_dict(), other.to_dict()
        diffs: list[str] = []
        for section in ours:
            a, b = ours[section], theirs[section]
            if isinstance(a, dict):
                for key in sorted(set(a) | set(b)):
                    if key == "tensors" and section == "model":
                        continue  # compared tensor by tensor below, and only when both are sealed
                    if a.get(key) != b.get(key):
                        diffs.append(f"{section}.{key}: {_shown(a, key)} != {_shown(b, key)}")
            elif a != b:
                diffs.append(f"{section}: {a!r} != {b!r}")
        if self.model.tensors and other.model.tensors:
            diffs.extend(f"model.tensors: {d}" for d in tensor_differences(self.model.tensors, other.model.tensors))
        return diffs


def tensor_differences(ours: Sequence[TensorSignature], theirs: Sequence[TensorSignature],
                       limit: int = 8) -> list[str]:
    """The parameters two signatures disagree on, named: missing, extra, or another shape or dtype."""
    a = {name: (tuple(shape), dtype) for name, shape, dtype in ours}
    b = {name: (tuple(shape), dtype) for name, shape, dtype in theirs}
    out = []
    for name in sorted(set(a) | set(b)):
        if name not in b:
            out.append(f"{name}: {_describe(a[name])} here, absent in the run")
        elif name not in a:
            out.append(f"{name}: absent here, {_describe(b[name])} in the run")
        elif a[name] != b[name]:
            out.append(f"{name}: {_describe(a[name])} here, {_describe(b[name])} in the run")
    if len(out) > limit:
        out = out[:limit] + [f"... and {len(out) - limit} more"]
    return out


def _shown(table: Mapping[str, Any], key: str) -> str:
    return repr(table[key]) if key in table else "(unset: the factory's default)"


def _describe(signature: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = signature
    return f"{dtype}[{', '.join(map(str, shape))}]"


# The data recipe's keys before it moved from [run.data] to each site's [node.data]: named in the
# refusal, so an old config says where its keys went instead of only "unknown key".
MOVED_DATA_KEYS = ("source", "paths", "token_file", "token_dtype", "eval_fraction", "seed")

_SECTION_TYPES: dict[str, type] = {
    "model": ModelSpec,
    "data": DataAgreement,
    "inner": InnerOptimizer,
    "outer": OuterOptimizer,
    "sync": SyncSpec,
    "stop": StopSpec,
}


def _section_from_dict(section: str, section_cls: type, raw: Any) -> Any:
    _require(isinstance(raw, Mapping), f"{section}: expected a table/mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    unknown = sorted(set(raw) - set(fields))
    moved = [key for key in unknown if section == "data" and key in MOVED_DATA_KEYS]
    _require(not moved, f"run.data.{moved[0] if moved else ''}: where a site reads its data is a site setting now; "
             f"move {', '.join(moved)} to [node.data] (token_file becomes paths = [...]; see docs/DATA.md)")
    _require(not unknown, f"{section}: unknown key(s) {', '.join(unknown)}; known: {', '.join(fields)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        default = getattr(section_cls(), key) if _has_all_defaults(section_cls) else None
        kwargs[key] = _coerce(f"{section}.{key}", value, default)
    try:
        return section_cls(**kwargs)
    except TypeError as exc:  # e.g. a required field missing
        raise ConfigError(f"{section}: {exc}") from None


def _has_all_defaults(section_cls: type) -> bool:
    return all(
        f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        for f in dataclasses.fields(section_cls)
    )


def _coerce(name: str, value: Any, default: Any) -> Any:
    """Check a value against the type of the field's default; ints are accepted for floats."""
    if default is None:
        return value
    if isinstance(default, bool):
        _require(isinstance(value, bool), f"{name} = {value!r}: must be true or false")
        return value
    if isinstance(default, int):
        _require(isinstance(value, int) and not isinstance(value, bool), f"{name} = {value!r}: must be an integer")
        return value
    if isinstance(default, float):
        _require(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} = {value!r}: must be a number")
        return float(value)
    if isinstance(default, str):
        _require(isinstance(value, str), f"{name} = {value!r}: must be a string")
        return value
    if isinstance(default, tuple):
        _require(isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value),
                 f"{name} = {value!r}: must be a list of strings")
        return tuple(value)
    return value
