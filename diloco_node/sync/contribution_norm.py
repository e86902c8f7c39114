"""Median-norm scaling of one round's contributions (`sync.contribution_norm`), pure arithmetic.

Covenant-72B (SparseLoCo at scale) rescales each contribution before the merge so that its norm
equals the median of the round's contributors' norms: no learner moves the merged update more
than a typical one because its outer gradient happened to be larger (more steps, a harder shard,
an error-feedback remainder that grew). `merge_contributions` computes the norms of the outer
gradients it is about to merge (rebased ones included), asks `median_norm_factors` for one factor
per contribution and multiplies each contribution's values by its factor as they are folded in.

Choices where the paper is silent (docs/MERGE.md): the median is over the contributions whose
norm is above zero (a learner that sent nothing has no scale to vote with); a zero contribution
stays zero (it has no direction to scale); with no nonzero contribution every factor is 1.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

# "none": contributions are merged as sent. "median": each is rescaled to the round's median norm.
CONTRIBUTION_NORMS = ("none", "median")


def median_nonzero_norm(norms: Sequence[float]) -> float:
    """The median of the norms above zero (0.0 when none is), the norm every contribution is
    brought to. A negative, NaN or infinite norm is a ValueError (see `median_norm_factors`)."""
    values = [float(n) for n in norms]
    bad = [n for n in values if not (math.isfinite(n) and n >= 0.0)]
    if bad:
        raise ValueError(f"contribution norms must be finite and >= 0, got {bad[:3]}")
    nonzero = [n for n in values if n > 0.0]
    return float(np.median(nonzero)) if nonzero else 0.0


def median_norm_factors(norms: Sequence[float]) -> list[float]:
    """For each contribution's L2 norm, the factor that brings it to the median of the nonzero
    norms (1.0 for a zero norm, and for every norm when none is above zero).

    A norm that is negative, NaN or infinite is a ValueError: the merge measures norms of values it
    has already checked finite, so such a norm is a caller's bug, not a peer's input.
    """
    median = median_nonzero_norm(norms)
    return [median / float(n) if n > 0.0 and median > 0.0 else 1.0 for n in norms]
