"""Plain-text tables of job summaries: the end-of-job block, the end-of-sweep table, and Page's ladder table."""
from __future__ import annotations

import json
import statistics



def _page_ladder() -> dict:
    """step -> (label, seconds to 94%, epochs) on one V100, from the published source (published/page_ladder.yaml),
    in ladder order; a range of seconds (step 9: 33.5-34 s) is shown as its upper end."""
    from .sources import PUBLISHED_DIR, load_source

    steps: dict[str, dict] = {}
    for v in load_source(PUBLISHED_DIR / "page_ladder.yaml").values:
        step = steps.setdefault(v.match["trick"], {"label": v.label.split(":")[0].split(" ", 1)[1]})
        if v.metric in ("time_to_target_s", "epochs"):
            step[v.metric] = max(v.value) if isinstance(v.value, tuple) else v.value
    return {k: (d["label"], float(d["time_to_target_s"]), int(d["epochs"])) for k, d in sorted(steps.items())}


PAGE_LADDER = _page_ladder()


def _fmt(v, spec: str = ".3g", none: str = "-") -> str:
    if v is None:
        return none
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def baseline_key(summary: dict) -> str:
    """Jobs whose resolved configs differ only in precision (and in the case label) share this key."""
    config = {k: v for k, v in (summary.get("config") or {}).items() if k not in ("precision", "case")}
    return json.dumps(config, sort_keys=True)


def sweep_rows(summaries: list[dict]) -> list[dict]:
    """One row per job; speedup = fp32 train time / this job's train time, for the fp32 job whose config is the
    same but for precision (None where the sweep has no such fp32 job)."""
    fp32_time = {}
    for s in summaries:
        if s.get("choices", {}).get("precision") == "fp32" and s.get("status") == "completed":
            fp32_time[baseline_key(s)] = (s.get("metrics") or {}).get("train_time_s")
    rows = []
    for s in summaries:
        m = s.get("metrics") or {}
        base = fp32_time.get(baseline_key(s))
        t = m.get("train_time_s")
        rows.append({
            "job": s.get("job", {}).get("num"),
            "model": s.get("choices", {}).get("model"),
            "precision": s.get("choices", {}).get("precision"),
            "status": s.get("status"),
            "epochs": m.get("epochs"),
            "train_time_s": t,
            "samples_per_s": m.get("throughput"),
            "speedup": base / t if base and t and s.get("status") == "completed" else None,
            "test_acc": m.get("final_test_acc"),
            "peak_mem_mb": m.get("peak_memory_mb"),
            "note": _case_note(s.get("case")) + (s.get("reason") or s.get("error") or ""),
        })
    return rows


def _case_note(case: dict | None) -> str:
    if not case:
        return ""
    verdict = "as expected" if case.get("as_expected") else f"NOT as expected ({case.get('expect')})"
    return f"[{case.get('name')}: {verdict}] "


SWEEP_COLUMNS = [("job", "job", "d"), ("model", "model", "s"), ("precision", "precision", "s"),
                 ("status", "status", "s"), ("epochs", "epochs", ".2f"), ("train_time_s", "time s", ".2f"),
                 ("samples_per_s", "samples/s", ".1f"), ("speedup", "vs fp32", ".2f"), ("test_acc", "test acc", ".4f"),
                 ("peak_mem_mb", "peak MB", ".0f"), ("note", "note", "s")]


def format_table(rows: list[dict], cols: list[tuple] = SWEEP_COLUMNS) -> str:
    """rows as aligned text columns; cols: (row key, header, format spec) per column."""
    cells = [[h for _, h, _ in cols]]
    for r in rows:
        cells.append([_fmt(r[k], spec if spec not in ("s", "d") else "") if not isinstance(r[k], str) else r[k]
                      for k, _, spec in cols])
    cells = [[c if len(c) <= 90 else c[:87] + "..." for c in row] for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def job_block(summary: dict) -> str:
    """The one-screen summary printed when a job ends."""
    m = summary.get("metrics") or {}
    ch = summary.get("choices", {})
    env = summary.get("env", {})
    ls = m.get("loss_scale")
    warm = ("warm-up included: too few steps" if m.get("throughput_includes_warmup")
            else f"first {m.get('warmup_steps')} steps excluded")
    scale = "none" if not ls else f"min {ls['min']:g}, max {ls['max']:g}, final {ls['final']:g}"
    lines = [
        f"status      {summary.get('status')}" + (f"  ({summary.get('reason') or summary.get('error')})"
                                                   if summary.get("reason") or summary.get("error") else ""),
        f"job         model={ch.get('model')} precision={ch.get('precision')} dataset={ch.get('dataset')} "
        f"optimizer={ch.get('optimizer')}",
        f"device      {env.get('device_name')} ({env.get('device')}), torch {env.get('torch')}",
        f"training    {_fmt(m.get('epochs'), '.2f')} epochs, {m.get('steps')} steps, "
        f"{_fmt(m.get('train_time_s'), '.2f')} s (eval excluded), epochs {[round(t, 2) for t in m.get('epoch_times_s') or []]}",
        f"throughput  {_fmt(m.get('throughput'), '.1f')} samples/s ({warm})",
        f"accuracy    final {_fmt(m.get('final_test_acc'), '.4f')}, best {_fmt(m.get('best_test_acc'), '.4f')}"
        + (f", {_fmt(m.get('time_to_target_s'), '.2f')} s to {m.get('target_acc')}" if m.get("target_acc") else ""),
        f"memory      peak {_fmt(m.get('peak_memory_mb'), '.0f')} MB ({m.get('peak_memory_kind')})",
        f"loss scale  {scale}; skipped steps {m.get('skipped_steps')}",
    ]
    if summary.get("resumed"):
        r = summary["resumed"]
        lines.append(f"resumed     at step {r['from_step']} (epoch {r['from_epoch']:.2f}), {len(r['history'])} time(s); "
                     "the time before is included")
    if m.get("mfu") is not None:
        lines.append(f"MFU         {100 * m['mfu']:.1f}% of {summary.get('gpu_profile', {}).get('name')} peak")
    return "\n".join(lines)


LADDER_COLUMNS = [("step", "step", "s"), ("variant", "variant", "s"), ("runs", "runs", "s"),
                  ("epochs", "epochs", ".2f"), ("train_time_s", "time s", ".2f"), ("to_94_s", "to target s", ".2f"),
                  ("reached", "reached", "s"), ("acc", "acc (no TTA)", "s"), ("acc_tta", "acc (TTA)", "s"),
                  ("page_s", "Page s", ".1f"), ("page_epochs", "Page ep", "d"), ("note", "note", "s")]


def ladder_rows(summaries: list[dict]) -> list[dict]:
    """One row per ladder step (and per variant: the overrides other than seed and trick that differ between the
    sweep's jobs), in ladder order: means over the repeated runs (seeds) of epochs, training time (DAWNBench: eval
    excluded) and time to the target accuracy (over the runs that reached it), accuracy without and with flip TTA
    as mean +- sample std, beside Page's time and epochs. Empty when the sweep ran no ladder step."""
    jobs = [s for s in summaries if s.get("choices", {}).get("trick") in PAGE_LADDER]
    common = set.intersection(*(set(s.get("overrides", [])) for s in jobs)) if jobs else set()
    groups: dict[tuple, list[dict]] = {}
    for s in jobs:
        variant = ",".join(sorted(o for o in set(s.get("overrides", [])) - common
                                  if not o.startswith(("seed=", "trick="))))
        groups.setdefault((s["choices"]["trick"], variant), []).append(s)
    order = list(PAGE_LADDER)
    rows = []
    for (step, variant), group in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        done = [s["metrics"] for s in group if s.get("status") == "completed"]
        targets = [m["time_to_target_s"] for m in done if m.get("time_to_target_s") is not None]
        _, page_s, page_epochs = PAGE_LADDER[step]
        rows.append({
            "step": step, "variant": variant, "runs": f"{len(done)}/{len(group)}",
            "epochs": _mean([m.get("epochs") for m in done]),
            "train_time_s": _mean([m.get("train_time_s") for m in done]),
            "to_94_s": _mean(targets), "reached": f"{len(targets)}/{len(done)}",
            "acc": _mean_sd([m.get("final_test_acc_no_tta", m.get("final_test_acc")) for m in done]),
            "acc_tta": _mean_sd([m.get("final_test_acc_tta") for m in done]),
            "page_s": page_s, "page_epochs": page_epochs,
            "note": "; ".join(sorted({s.get("reason") or s.get("error") or "" for s in group} - {""})),
        })
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _mean_sd(values: list) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.fmean(values):.4f}" + (f" +- {statistics.stdev(values):.4f}" if len(values) > 1 else "")
