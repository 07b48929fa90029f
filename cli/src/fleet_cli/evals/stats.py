"""The statistics a receipt and a comparison report: nearest-rank percentiles, and two paired
tests of B against A on the same rows (exact McNemar when every score is 0 or 1, otherwise a
sign-flip permutation test of the mean difference, exact up to 16 differing rows)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

EXACT_UP_TO = 16  # differing rows: 2^16 sign patterns; past that, a seeded sample of them
SAMPLES = 20_000


def percentile(values: Sequence[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def mcnemar(pairs: Sequence[tuple[float, float]]) -> tuple[float, str]:
    """Two-sided exact McNemar: of the rows where A and B disagree, how surprising is the split."""
    only_a = sum(1 for a, b in pairs if a == 1 and b == 0)
    only_b = sum(1 for a, b in pairs if a == 0 and b == 1)
    n = only_a + only_b
    if n == 0:
        return 1.0, "McNemar (exact): no row where they disagree"
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail), f"McNemar (exact): {only_b} rows right only in B, {only_a} only in A"


def sign_flip(pairs: Sequence[tuple[float, float]], seed: int = 0) -> tuple[float, str]:
    """Two-sided paired permutation test: under no difference each row's B - A is as likely to
    have the other sign, so count the sign patterns whose mean is at least as far from 0."""
    diffs = [b - a for a, b in pairs if b != a]
    if not diffs:
        return 1.0, "sign-flip permutation: no row where they differ"
    observed = abs(sum(diffs))
    if len(diffs) <= EXACT_UP_TO:
        patterns = itertools.product((1, -1), repeat=len(diffs))
        extreme = sum(
            1
            for signs in patterns
            if abs(sum(s * d for s, d in zip(signs, diffs, strict=True))) >= observed - 1e-12
        )
        return extreme / 2 ** len(diffs), f"sign-flip permutation (exact, {len(diffs)} differing rows)"
    rng = random.Random(seed)
    extreme = sum(
        1
        for _ in range(SAMPLES)
        if abs(sum(d if rng.random() < 0.5 else -d for d in diffs)) >= observed - 1e-12
    )
    return (extreme + 1) / (
        SAMPLES + 1
    ), f"sign-flip permutation ({SAMPLES} samples, {len(diffs)} differing rows)"


def paired_test(pairs: Sequence[tuple[float, float]]) -> tuple[float, str]:
    """The p-value of B's scores differing from A's on the same rows, and which test gave it."""
    if all(a in (0, 1) and b in (0, 1) for a, b in pairs):
        return mcnemar(pairs)
    return sign_flip(pairs)
