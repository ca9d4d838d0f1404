"""Search for the largest integer that satisfies a monotone predicate (e.g. the batch size that
fits)."""
from __future__ import annotations

from typing import Callable


def largest_fitting(
    fits: Callable[[int], bool], start: int = 1, limit: int = 65536
) -> tuple[int, list]:
    """Largest n in [start, limit] with fits(n), assuming fits is monotone (true up to some n, false
    after): double from `start` until a failure, then binary search between the last success and the
    first failure. Returns (n, probes) where probes lists (n, fitted) in the order tried; n is 0 if
    even `start` fails."""
    probes = []

    def probe(n: int) -> bool:
        ok = fits(n)
        probes.append((n, ok))
        return ok

    if not probe(start):
        return 0, probes
    good, bad = start, None
    while bad is None:
        nxt = min(good * 2, limit)
        if nxt == good:
            return good, probes
        if probe(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, probes
