"""Small statistics the harness reports: percentiles, an empirical CDF, a two-sample
Kolmogorov-Smirnov test (scipy's when installed, else our own with the asymptotic
p-value), rates per node-hour."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank rule; None for no values. inf counts."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[min(len(ordered), rank) - 1]


def summary(values: Sequence[float], digits: int = 3) -> dict[str, float | int | None]:
    """count, p50, p90, p99, max, mean (of the finite ones), and how many were infinite."""
    finite = [v for v in values if math.isfinite(v)]

    def r(v: float | None) -> float | None:
        return None if v is None else (round(v, digits) if math.isfinite(v) else math.inf)

    return {
        "count": len(values), "missed": len(values) - len(finite),
        "p50": r(percentile(values, 0.50)), "p90": r(percentile(values, 0.90)),
        "p99": r(percentile(values, 0.99)), "max": r(max(values) if values else None),
        "mean": r(sum(finite) / len(finite)) if finite else None,
    }


def ecdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Sorted finite values and the fraction of ALL values at or below each."""
    ordered = sorted(v for v in values if math.isfinite(v))
    n = len(values)
    return ordered, [(k + 1) / n for k in range(len(ordered))]


def _ks_p_value(d: float, n: int, m: int) -> float:
    """Asymptotic p-value of the two-sample KS statistic (Kolmogorov's series, with the
    usual small-sample correction of the effective size)."""
    if d <= 0:
        return 1.0
    en = math.sqrt(n * m / (n + m))
    lam = (en + 0.12 + 0.11 / en) * d
    total = 0.0
    for k in range(1, 101):
        term = 2.0 * (-1) ** (k - 1) * math.exp(-2.0 * k * k * lam * lam)
        total += term
        if abs(term) < 1e-12:
            break
    return min(1.0, max(0.0, total))


def ks_two_sample(a: Sequence[float], b: Sequence[float]) -> dict[str, float | int | str]:
    """Two-sample KS: the largest gap between the two empirical CDFs and its p-value."""
    xs = sorted(v for v in a if math.isfinite(v))
    ys = sorted(v for v in b if math.isfinite(v))
    n, m = len(xs), len(ys)
    if n == 0 or m == 0:
        return {"statistic": math.nan, "p_value": math.nan, "n": n, "m": m,
                "method": "none (an empty sample)"}
    try:
        from scipy.stats import ks_2samp  # type: ignore[import-not-found, unused-ignore]
        res = ks_2samp(xs, ys)
        return {"statistic": float(res.statistic), "p_value": float(res.pvalue), "n": n,
                "m": m, "method": "scipy.stats.ks_2samp"}
    except ImportError:
        pass
    i = j = 0
    d = 0.0
    while i < n and j < m:
        x = min(xs[i], ys[j])
        while i < n and xs[i] <= x:
            i += 1
        while j < m and ys[j] <= x:
            j += 1
        d = max(d, abs(i / n - j / m))
    return {"statistic": d, "p_value": _ks_p_value(d, n, m), "n": n, "m": m,
            "method": "asymptotic Kolmogorov (built in)"}


def per_node_hour(count: float, node_seconds: float) -> float:
    return count / (node_seconds / 3600.0) if node_seconds > 0 else math.nan


__all__ = ["ecdf", "ks_two_sample", "per_node_hour", "percentile", "summary"]
