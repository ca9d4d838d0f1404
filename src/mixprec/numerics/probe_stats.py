"""Number formats and what they would do to a tensor: the arithmetic behind the numerics probe
(probe.py) and the one-batch advisor (scripts/numerics.py).

FORMATS holds the facts of each low-precision format (IEEE binary16, bfloat16, and the two FP8
formats of Micikevicius et al. 2022, so that an FP8 workload can reuse them). A value x, rounded to
nearest-even into a format, overflows when |x| >= max + ulp(max)/2, is lost (rounds to zero) when
|x| <= min_subnormal/2, and lands in the subnormal range (fewer significant bits) when it is above
that but below min_normal.

`tensor_counts` measures a tensor on its own device in one pass and returns two small tensors
(counts, absmax), so that a probed step can stack every tensor's counts and copy them to the host
once; `describe` turns a row of counts into plain fractions and a sparse log2 histogram: one bin per
power of two, bin e holding 2^e <= |x| < 2^(e+1), from 2^LO (below fp32's smallest subnormal) to
2^HI (fp32's max), plus zero / inf / nan.

The denominators: `nonfinite` and `zero` are fractions of all elements; `overflow`, `subnormal` and
`lost` are fractions of the finite non-zero elements (a ReLU's exact zeros are not underflow).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    mantissa_bits: int       # stored fraction bits
    max: float               # largest finite value
    min_normal: float
    min_subnormal: float
    dtype: str               # torch dtype name

    @property
    def overflow_at(self) -> float:
        """Round to nearest-even sends |x| >= this past max (to inf, or NaN / saturation in
        e4m3fn)."""
        top = 2.0 ** (int.bit_length(int(self.max)) - 1) if self.max >= 1 else 1.0
        return self.max + top * 2.0 ** -self.mantissa_bits / 2

    @property
    def lost_at(self) -> float:
        """|x| <= this rounds to zero (half the smallest subnormal: the tie goes to the even
        zero)."""
        return self.min_subnormal / 2


FORMATS = {
    "fp16": Format("fp16", 10, 65504.0, 2.0 ** -14, 2.0 ** -24, "float16"),
    "bf16": Format("bf16", 7, (2 - 2.0 ** -7) * 2.0 ** 127, 2.0 ** -126, 2.0 ** -133, "bfloat16"),
    "fp8_e4m3fn": Format("fp8_e4m3fn", 3, 448.0, 2.0 ** -6, 2.0 ** -9, "float8_e4m3fn"),
    "fp8_e5m2": Format("fp8_e5m2", 2, 57344.0, 2.0 ** -14, 2.0 ** -16, "float8_e5m2"),
}
# what every probed tensor is measured against, whatever the run's dtype
MEASURED = ("fp16", "bf16")
# log2 bins [LO, HI): fp32's smallest subnormal is 2^-149, its max < 2^128
LO, HI = -150, 128
NBINS = HI - LO
HEAD = ("n", "nonfinite", "nan", "zero", "finite_nonzero") + tuple(
    f"{f}_{k}" for f in MEASURED for k in ("overflow", "subnormal", "lost"))


def format_of(dtype: torch.dtype) -> Format | None:
    """The Format of a low-precision torch dtype (None for fp32/fp64)."""
    return next((f for f in FORMATS.values() if getattr(torch, f.dtype, None) == dtype), None)


def tensor_counts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 counts: HEAD then the NBINS log2 bins, float32 absmax of the finite values), on t's
    device. Few passes over the tensor: every finite non-zero element goes to its log2 bin (zeros
    and non-finite ones to one extra bin) and the per-format counts are read off the bins, since
    each format's `lost_at` and `min_normal` are powers of two (bin edges); only the overflow
    threshold and the values exactly at `lost_at` (they round to zero, yet sit in the bin above)
    take a pass of their own."""
    x = t.detach().reshape(-1).float()
    a = x.abs()
    finite = torch.isfinite(a)
    af = torch.where(finite, a, torch.zeros((), device=a.device))
    nonfinite = x.numel() - finite.sum()
    exponent = torch.frexp(af)[1] - 1   # 2^e <= |x| < 2^(e+1)
    bins = torch.where(af > 0, exponent.clamp(LO, HI - 1) - LO, NBINS).long()
    # Into a fixed NBINS + 1 tensor: no host sync (torch.bincount reads the largest bin on the host
    # to size its output, and torch.tensor(n, device=...) is a host-to-device copy); integer sums
    # are exact in any order.
    hist = torch.zeros(NBINS + 1, dtype=torch.long, device=x.device)
    hist.scatter_add_(0, bins, torch.ones((), dtype=torch.long, device=x.device).expand_as(bins))
    head = [
        torch.full((), x.numel(), dtype=torch.long, device=x.device),
        nonfinite,
        torch.isnan(x).sum(),
        hist[NBINS] - nonfinite,
        hist[:NBINS].sum(),
    ]
    for name in MEASURED:
        f = FORMATS[name]
        lost, normal = _EDGES[name]
        at_lost = (af == f.lost_at).sum()
        head += [
            (af >= f.overflow_at).sum(),
            hist[lost:normal].sum() - at_lost,
            hist[:lost].sum() + at_lost,
        ]
    absmax = af.max() if x.numel() else torch.zeros((), device=x.device)
    return torch.cat([torch.stack(head).long(), hist[:NBINS]]), absmax.float()


def _edge(value: float) -> int:
    """The histogram bin that starts at `value`, a power of two."""
    e = math.log2(value)
    assert e.is_integer() and LO <= e < HI, value
    return int(e) - LO


_EDGES = {
    name: (_edge(FORMATS[name].lost_at), _edge(FORMATS[name].min_normal)) for name in MEASURED
}


def describe(counts: list[int], absmax: float) -> dict:
    """Plain fractions and the sparse histogram of one tensor's (or a pooled set's) counts."""
    c = dict(zip(HEAD, counts[:len(HEAD)]))
    n, nz = max(c["n"], 1), max(c["finite_nonzero"], 1)
    row = {"n": c["n"], "absmax": absmax, "nonfinite": c["nonfinite"] / n, "zero": c["zero"] / n}
    for name in MEASURED:
        row[name] = {k: c[f"{name}_{k}"] / nz for k in ("overflow", "subnormal", "lost")}
    row["hist"] = sparse_hist(counts[len(HEAD):], c["zero"], c["nonfinite"] - c["nan"], c["nan"])
    return row


def sparse_hist(bins: list[int], zero: int, inf: int, nan: int) -> dict:
    """{"lo": e0, "counts": counts of 2^e0, 2^(e0+1), ...} trimmed to the non-empty span, plus
    zero/inf/nan."""
    used = [i for i, v in enumerate(bins) if v]
    lo, hi = (used[0], used[-1] + 1) if used else (0, 0)
    return {"lo": LO + lo, "counts": list(bins[lo:hi]), "zero": zero, "inf": inf, "nan": nan}


def dense_hist(hist: dict) -> list[int]:
    """The NBINS-long bin list of a sparse histogram (to pool histograms)."""
    out = [0] * NBINS
    for i, v in enumerate(hist["counts"]):
        out[hist["lo"] - LO + i] += v
    return out


def pool(rows: list[dict]) -> dict:
    """One row describing the union of the tensors of `rows` (as describe's output): counts add,
    absmax is the max."""
    total = sum(r["n"] for r in rows)
    nz = {name: [r["n"] * (1 - r["zero"] - r["nonfinite"]) for r in rows] for name in MEASURED}
    out = {"n": total, "absmax": max((r["absmax"] for r in rows), default=0.0),
           "nonfinite": sum(r["n"] * r["nonfinite"] for r in rows) / max(total, 1),
           "zero": sum(r["n"] * r["zero"] for r in rows) / max(total, 1)}
    for name in MEASURED:
        weight = sum(nz[name])
        out[name] = {k: sum(w * r[name][k] for w, r in zip(nz[name], rows)) / max(weight, 1)
                     for k in ("overflow", "subnormal", "lost")}
    bins = [sum(col) for col in zip(*(dense_hist(r["hist"]) for r in rows))] or [0] * NBINS
    out["hist"] = sparse_hist(
        bins, *(sum(r["hist"][k] for r in rows) for k in ("zero", "inf", "nan"))
    )
    return out


def update_stall(w: torch.Tensor, dw: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Elements where w + dw == w once both live in `fmt` (|dw| below half the spacing at w): the
    update is lost. Computed by IEEE rounding itself: round w into the format, add dw exactly (in
    fp32), round again."""
    dt = getattr(torch, fmt.dtype)
    w_low = w.detach().to(dt)
    return (w_low.float() + dw.float()).to(dt) == w_low


def stall_counts(
    w_old: torch.Tensor,
    w_new: torch.Tensor,
    dw: torch.Tensor,
    grad: torch.Tensor | None,
    what_if: tuple[str, ...],
) -> torch.Tensor:
    """[moving, stalled, stalled in each format of `what_if`]: moving = elements with a non-zero
    gradient (all, without one); stalled = those whose weight did not change in the stepped dtype;
    stalled in a format = those whose update dw = w_new - w_old (in fp32, as the probe measured it)
    that format would lose (w + dw == w there; an fp32 stall is one too)."""
    moving = (grad != 0) if grad is not None else torch.ones_like(w_old, dtype=torch.bool)
    out = [moving.sum(), (moving & (w_new == w_old)).sum()]
    out += [(moving & update_stall(w_old, dw, FORMATS[name])).sum() for name in what_if]
    return torch.stack(out)


def smallest_scale(hist: dict, fmt: Format = FORMATS["fp16"], tolerance: float = 0.01) -> int:
    """log2 of the smallest power-of-two scale that leaves at most `tolerance` of a histogram's
    non-zero finite values below `fmt`'s smallest normal once multiplied by it (0 or less: no scale
    needed)."""
    counts, lo = hist["counts"], hist["lo"]
    total = sum(counts)
    if not total:
        return 0
    floor = int(torch.tensor(fmt.min_normal).log2())   # bin of the smallest normal
    below, k = 0, None
    # bins in rising order: the first bin that must reach the normal range
    for i, v in enumerate(counts):
        below += v
        if below / total > tolerance:
            k = floor - (lo + i)
            break
    return max(k, 0) if k is not None else 0


def largest_scale(absmax: float, fmt: Format = FORMATS["fp16"]) -> int | None:
    """log2 of the largest power-of-two scale that keeps |x| <= absmax below `fmt`'s overflow (None:
    any)."""
    if absmax <= 0:
        return None
    k = int(torch.floor(torch.log2(torch.tensor(fmt.max / absmax, dtype=torch.float64))))
    return k
