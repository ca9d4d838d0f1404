"""The rows the console's tables (console.py) and the report (render.py) share: a statistic as
`mean ± std (n=k)`, a value by its column's format spec, what a peak memory column measured, the
ladder's columns and cells, the host-bound note. Text only: the numbers are analyse.py's; no
renderer of either side is imported here.
"""
from __future__ import annotations

import math

from ..runtime import busy
from ..runtime.hardware import CPU_PEAK_KINDS


def mean_sd(
    st: dict | None,
    spec: str = ".3g",
    scale: float = 1.0,
    unit: str = "",
    of: int = 0,
    pm: str = " ± ",
    counts: bool = True,
) -> str:
    """`mean ± std unit (n=k)` of analyse.stats() (`-` for None); `of`: how many runs could have had
    a value (says when some had none); counts=False leaves out the (n=...)."""
    if st is None:
        return "-"
    s = format(scale * st["mean"], spec)
    if st["n"] > 1:
        s += f"{pm}{format(scale * st['std'], spec)}"
    s += f" {unit}" if unit else ""
    if not counts:
        return s
    if of > st["n"]:
        s += f" (n={st['n']} of {of})"
    elif st["n"] > 1:
        s += f" (n={st['n']})"
    return s


def format_value(v, spec: str = ".3g", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


# what a peak memory figure measured (summary metrics' peak_memory_kind), as a column says it
MEMORY_KINDS = {**CPU_PEAK_KINDS, "cuda_max_allocated": "allocated by tensors"}


def memory_kinds(groups_or_rows: list[dict]) -> str:
    """What the peak memory column measured, over the groups' (peak_memory_kind lists) or the
    sweep rows' (peak_mem_kind) kinds."""
    kinds = sorted({k for g in groups_or_rows
                    for k in (g.get("peak_memory_kind") or [g.get("peak_mem_kind")]) if k}
                   - {"?"})
    return " / ".join(MEMORY_KINDS.get(k, k) for k in kinds) or "not recorded"


def row_cells(row: dict, cols: list[tuple]) -> list[str]:
    """A row's cells as text, each formatted by its column's spec."""
    return [
        row[k] if isinstance(row.get(k), str)
        else format_value(row.get(k), spec if spec not in ("s", "d") else "")
        for k, _, spec in cols
    ]


HOST_BOUND_NOTE = (
    f"host-bound: GPU busy below {busy.HOST_BOUND:.0%} of a steady step (GPU busy column; "
    "docs/speed.md): the GPU waited for Python, so a speed-up measured there says little about "
    f"the precision; use {busy.ADVICE}. GPU busy '-': not measured (a CPU job)"
)


LADDER_COLUMNS = [
    ("step", "step", "s"),
    ("variant", "variant", "s"),
    ("runs", "runs", "s"),
    ("epochs", "epochs", ".2f"),
    ("train_time_s", "time s", "s"),
    ("page_clock_s", "time+prep s", ".2f"),
    ("setup_s", "setup s", ".2f"),
    ("acc", "acc (no TTA)", "s"),
    ("acc_tta", "acc (TTA)", "s"),
    ("reached", "reached", "s"),
    ("to_94_s", "to target s (median)", "s"),
    ("page_s", "Page s", ".1f"),
    ("page_epochs", "Page ep", "d"),
    ("note", "note", "s"),
]


NOT_REACHED = "not reached"


def ladder_cells(row: dict) -> dict:
    """An analyse.ladder_rows row as the ladder table's text cells (mean +- sample std over the
    step's runs)."""
    to_target = row["to_94_s"]
    return dict(row, runs="{}/{}".format(*row["runs"]), reached="{}/{}".format(*row["reached"]),
                train_time_s=mean_sd(row["train_time_s"], ".2f", pm=" +- ", counts=False),
                acc=mean_sd(row["acc"], ".4f", pm=" +- ", counts=False),
                acc_tta=mean_sd(row["acc_tta"], ".4f", pm=" +- ", counts=False),
                to_94_s=NOT_REACHED if math.isinf(to_target) else f"{to_target:.2f}")
