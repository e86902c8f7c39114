"""Balanced tensor fragmentation: which parameter tensors sync together, and at which learner step.

The model's flat parameter dict is split into P disjoint fragments. Embedding tensors (merged by
weighted mean rather than RDA) get a fragment of their own so they stay identifiable; the other
tensors are spread by greedy bin-packing (largest tensor first, into the currently smallest
fragment) so every fragment carries about the same number of bytes. Fragment p is sent at learner
steps t with t mod H == t_p, the offsets spread evenly over [0, H).

Pure and deterministic: the same shapes and numbers always give the same plan on every site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

# Parameters cross module boundaries as float32 (see the training API contract).
BYTES_PER_ELEMENT = 4


def is_embedding(name: str) -> bool:
    """True for embedding tables: the first path component contains "embed" ("embed/embedding",
    "pos_embed/embedding", "tok_embed/..."), except unembedding heads ("unembed/..."), which are
    dense projections updated by every token and are merged like any other matrix.

    Why the first component only: a block's inner names (e.g. "blocks/0/embed_proj") are ordinary
    dense weights; embedding *tables* live at the top of the model tree in our models.
    """
    first = name.split("/", 1)[0].lower()
    return "embed" in first and not first.startswith("unembed")


@dataclass(frozen=True, slots=True)
class Fragment:
    """One group of tensors that is merged and versioned together."""

    index: int
    names: tuple[str, ...]
    num_elements: int
    nbytes: int
    is_embedding: bool

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"fragment index {self.index} must be >= 0")
        if not self.names:
            raise ValueError(f"fragment {self.index} has no tensors")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"fragment {self.index} lists a tensor twice")


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """P fragments covering every tensor exactly once, with the period H and overlap tau."""

    fragments: tuple[Fragment, ...]
    period: int
    overlap: int
    _owner: dict[str, int] = field(init=False, repr=False, compare=False)
    _slot_to_fragments: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        count = len(self.fragments)
        if count < 1:
            raise ValueError("a fragment plan needs at least one fragment")
        if [f.index for f in self.fragments] != list(range(count)):
            raise ValueError("fragments must be indexed 0..P-1 in order")
        if self.period < count:
            raise ValueError(f"period H = {self.period} < P = {count} fragments: each fragment needs its own offset")
        if not 0 <= self.overlap < self.period:
            raise ValueError(f"overlap tau = {self.overlap} must be in [0, period H = {self.period})")
        owner: dict[str, int] = {}
        for fragment in self.fragments:
            for name in fragment.names:
                if name in owner:
                    raise ValueError(f"tensor {name!r} is in fragments {owner[name]} and {fragment.index}")
                owner[name] = fragment.index
        slots: dict[int, list[int]] = {}
        for p in range(count):
            slots.setdefault(self.offset(p), []).append(p)
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_slot_to_fragments", {t: tuple(ps) for t, ps in slots.items()})

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    @property
    def names(self) -> tuple[str, ...]:
        """Every tensor name of the plan, sorted."""
        return tuple(sorted(self._owner))

    @property
    def embedding_names(self) -> tuple[str, ...]:
        """Every embedding tensor of the plan (what `merge_contributions` wants as embedding_names)."""
        return tuple(n for n in self.names if is_embedding(n))

    def fragment_of(self, name: str) -> int:
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the fragment plan") from None

    def offset(self, p: int) -> int:
        """t_p: fragment p's send slot within the period, spread evenly (distinct because P <= H)."""
        count = len(self.fragments)
        if not 0 <= p < count:
            raise IndexError(f"fragment {p} out of range 0..{count - 1}")
        return (p * self.period) // count

    def due(self, step: int) -> list[int]:
        """Fragments whose send slot is this learner step (step % H == t_p)."""
        return list(self._slot_to_fragments.get(step % self.period, ()))


def plan_fragments(
    shapes: Mapping[str, tuple[int, ...]], num_fragments: int, period: int, overlap: int
) -> FragmentPlan:
    """Split tensors into `num_fragments` fragments: embeddings alone, the rest balanced by bytes.

    With P >= 2 and at least one embedding tensor, fragment 0 holds all embedding tensors and the
    other P-1 fragments are bin-packed. With P == 1 everything is one fragment (plain DiLoCo); the
    merge still recognises embedding tensors by name. Ties are broken by name, so the plan is the
    same on every site.
    """
    if num_fragments < 1:
        raise ValueError(f"number of fragments P = {num_fragments} must be >= 1")
    if not shapes:
        raise ValueError("cannot plan fragments of a model with no tensors")
    sizes: dict[str, int] = {}
    for name, shape in shapes.items():
        if not name:
            raise ValueError("tensor names must be non-empty")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {tuple(shape)}")
        count = 1
        for d in dims:
            count *= d
        sizes[name] = count

    embeddings = sorted(n for n in sizes if is_embedding(n))
    others = sorted(n for n in sizes if not is_embedding(n))

    if num_fragments == 1:
        groups = [sorted(sizes)]
        embedding_flags = [not others]  # an embedding fragment only if it holds nothing else
    else:
        bins = num_fragments - 1 if embeddings else num_fragments
        if len(others) < bins:
            what = f"{len(others)} non-embedding tensor(s)" + (" (embeddings take a fragment of their own)" if embeddings else "")
            raise ValueError(f"cannot split {what} into {bins} non-empty fragment(s); use P <= {len(others) + (1 if embeddings else 0)}")
        packed = _greedy_pack(others, sizes, bins)
        groups = ([embeddings] if embeddings else []) + packed
        embedding_flags = ([True] if embeddings else []) + [False] * len(packed)

    fragments = tuple(
        Fragment(
            index=i,
            names=tuple(sorted(group)),
            num_elements=sum(sizes[n] for n in group),
            nbytes=BYTES_PER_ELEMENT * sum(sizes[n] for n in group),
            is_embedding=flag,
        )
        for i, (group, flag) in enumerate(zip(groups, embedding_flags))
    )
    return FragmentPlan(fragments=fragments, period=period, overlap=overlap)


def _greedy_pack(names: list[str], sizes: Mapping[str, int], bins: int) -> list[list[str]]:
    """Largest tensor first into the currently smallest bin (ties: lower bin index).

    The first `bins` tensors seed one bin each, so no bin is empty. Invariant kept by every
    placement: max bin size - min bin size <= the largest tensor's size.
    """
    order = sorted(names, key=lambda n: (-sizes[n], n))
    groups: list[list[str]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for name in order:
        # An empty bin counts as smallest even next to zero-size tensors, so every bin gets one.
        target = min(range(bins), key=lambda b: (len(groups[b]) > 0, loads[b], b))
        groups[target].append(name)
        loads[target] += sizes[name]
    return groups


# A commit entry wraps the merged delta in a small msgpack map (contributors, weights); a log
# append adds its own framing. 1 MiB covers both with room to spare.
WIRE_OVERHEAD_BYTES = 1 << 20


def wire_fit_problems(
    plan: FragmentPlan,
    shapes: Mapping[str, tuple[int, ...]],
    codec_up: str,
    codec_down: str,
    *,
    max_log_append_bytes: int,
) -> list[str]:
    """Why some fragment's messages could never cross the wire (empty: every fragment fits).

    A contribution (codec_up) is streamed tensor by tensor in chunks (wire/contribution_stream.py),
    so no fragment or tensor is too large for it: only a chunk must fit the per-chunk limits, and
    the plan cuts every tensor so that it does (checked here all the same, from the shapes alone).
    A commit (codec_down) still carries one whole fragment in one log entry (decoded as one message,
    bounded by the fragment's own size): a fragment too big for the log entry limit would be refused by every peer on every try while its
    learner kept training, so a node checks this before it starts. The sizes are the codecs' own
    upper bounds (before zstd, which may only shrink them).
    """
    from wire.codecs.container import CODECS  # local: the plan itself needs no codec
    from wire.contribution_stream import chunk_problems

    problems = [f"contribution: {why}" for why in chunk_problems(shapes, codec_up)]
    total = sum(f.num_elements for f in plan.fragments)
    for fragment in plan.fragments:
        decoded = fragment.num_elements
        scheme = CODECS[codec_down]
        size = WIRE_OVERHEAD_BYTES + sum(
            scheme.estimate_encoded_size(math.prod(shapes[n]), max(1, len(shapes[n]))) for n in fragment.names)
        if size > max_log_append_bytes:
            problems.append(f"fragment {fragment.index}: its commit ({codec_down}, {decoded:,} parameters) can reach "
                            f"{size / 2**20:,.0f} MiB, over the {max_log_append_bytes / 2**20:,.0f} MiB wire limit")
    if problems:
        largest = max(f.num_elements for f in plan.fragments)
        problems.append(f"the model has {total:,} parameters in {len(plan.fragments)} fragment(s), the largest "
                        f"{largest:,}: raise run.sync.fragments (and run.sync.period with it) or pick a smaller "
                        "codec_down so that every fragment's commit fits")
    return problems

