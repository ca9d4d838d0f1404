"""Plain-text tables of job summaries: the end-of-job block, the end-of-sweep table, and Page's ladder table."""
from __future__ import annotations

import functools
import json
import math
import statistics

from .config import LM_ARCHS, RNN_KINDS
from .sources import PUBLISHED_DIR, load_source, matches


@functools.cache
def page_ladder() -> dict:
    """step -> (label, seconds, epochs) on one V100, from the published source (published/page_ladder.yaml), in ladder
    order: each step's fixed-schedule training time; a range of seconds (step 9: 33.5-34 s) is shown as its upper
    end."""
    steps: dict[str, dict] = {}
    for v in load_source(PUBLISHED_DIR / "page_ladder.yaml").values:
        step = steps.setdefault(v.match["trick"], {"label": v.label.split(":")[0].split(" ", 1)[1]})
        if v.metric in ("train_time_s", "epochs"):
            step[v.metric] = max(v.value) if isinstance(v.value, tuple) else v.value
    return {k: (d["label"], float(d["train_time_s"]), int(d["epochs"])) for k, d in sorted(steps.items())}


@functools.cache
def _apex_ppl_values() -> tuple:
    return tuple(v for v in load_source(PUBLISHED_DIR / "apex_word_lm.yaml").values if v.metric == "test_ppl")


APEX_NOTE = ("published test ppl: NVIDIA apex's word_language_model README (published/apex_word_lm.yaml), shown beside "
             "the runs of the model, precision and loss scale it was reported for, with the epochs it was reported "
             "at; test ppl here = the test perplexity of the best-validation epoch, as the example reports it")

FP8_EMULATED_NOTE = ("fp8(emulated): no FP8 tensor cores on this device (a CPU, or a GPU before compute capability "
                     "8.9): torchao emulated the float8 matmuls in fp32, so its loss is FP8's but its time, tokens/s "
                     "and speed-up are not FP8 timings")


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


# per experiment: the precision options that are its article's columns; the sweep's other precisions are labelled
# "modern column" (fastai's article compared fp32 with fastai 1.0's to_fp16; amp, tf32, amp_bf16 came later)
ARTICLE_PRECISIONS = {"fastai_cifar100": ("fp32", "fastai_fp16")}


def column_note(summary: dict) -> str:
    """"article's column " / "modern column " for a job of an experiment whose article had fewer precisions."""
    article = ARTICLE_PRECISIONS.get(summary.get("name") or (summary.get("config") or {}).get("name"))
    if not article:
        return ""
    return "[article's column] " if summary.get("choices", {}).get("precision") in article else "[modern column] "


def sweep_rows(summaries: list[dict]) -> list[dict]:
    """One row per job; speedup = fp32 train time / this job's train time, for the fp32 job whose config is the
    same but for precision (None where the sweep has no such fp32 job); loss_gap (language models) = this job's
    final validation loss - that fp32 job's, when both ran the same number of steps."""
    fp32 = {}
    for s in summaries:
        if s.get("choices", {}).get("precision") == "fp32" and s.get("status") == "completed":
            fp32[baseline_key(s)] = s.get("metrics") or {}
    rows = []
    for s in summaries:
        m = s.get("metrics") or {}
        f = fp32.get(baseline_key(s)) or {}
        base = f.get("train_time_s")
        t = m.get("train_time_s")
        gap = (m["final_valid_loss"] - f["final_valid_loss"] if f.get("steps") == m.get("steps")
               and isinstance(m.get("final_valid_loss"), float) and isinstance(f.get("final_valid_loss"), float)
               else None)
        rows.append({
            "job": s.get("job", {}).get("num"),
            "model": s.get("choices", {}).get("model"),
            "precision": _precision_label(s),
            "status": s.get("status"),
            "epochs": m.get("epochs"),
            "train_time_s": t,
            "samples_per_s": m.get("throughput"),
            "speedup": base / t if base and t and s.get("status") == "completed" else None,
            "test_acc": m.get("final_test_acc"),
            "lm": is_language_model(s),
            "valid_ppl": m.get("best_valid_ppl"),
            "test_ppl": m.get("test_ppl_at_best_valid"),
            "published": published_ppl(s),
            "loss_gap": gap,
            "mfu": m.get("mfu"),
            "peak_mem_mb": m.get("peak_memory_mb"),
            "note": column_note(s) + _case_note(s.get("case")) + (s.get("reason") or s.get("error") or ""),
        })
    return rows


def _precision_label(summary: dict) -> str | None:
    """The precision choice, with its static loss scale when it has one (apex's fp16: o2(x128)), or marked
    `(emulated)` when it is fp8 without FP8 tensor cores (its time is then not an FP8 time)."""
    choice = summary.get("choices", {}).get("precision")
    if (summary.get("fp8") or {}).get("fp8_emulated"):
        return f"{choice}(emulated)"
    scale = ((summary.get("config") or {}).get("precision") or {}).get("loss_scale")
    return f"{choice}(x{scale:g})" if isinstance(scale, (int, float)) and not isinstance(scale, bool) else choice


def _case_note(case: dict | None) -> str:
    if not case:
        return ""
    verdict = "as expected" if case.get("as_expected") else f"NOT as expected ({case.get('expect')})"
    return f"[{case.get('name')}: {verdict}] "


def is_language_model(summary: dict) -> bool:
    return ((summary.get("config") or {}).get("model") or {}).get("arch") in LM_ARCHS


def published_ppl(summary: dict) -> str | None:
    """apex's published test perplexity for a job that is the run it was reported for (its model, data, precision
    and loss scale: the value's match keys in published/apex_word_lm.yaml, at any number of epochs), with the
    epochs it was reported at; None for any other job."""
    for v in _apex_ppl_values():
        if matches({k: w for k, w in v.match.items() if k != "trainer.epochs"}, summary):
            return f"{v.value:g} ({v.match.get('trainer.epochs')} epochs)"
    return None


def sweep_note(summaries: list[dict]) -> str | None:
    """What a sweep's table is to be read beside: the published numbers of a recurrent language-model sweep;
    that an emulated fp8 job's time is no FP8 time."""
    notes = []
    if summaries and all(((s.get("config") or {}).get("model") or {}).get("arch") in RNN_KINDS for s in summaries):
        notes.append(APEX_NOTE)
    if any((s.get("fp8") or {}).get("fp8_emulated") for s in summaries):
        notes.append(FP8_EMULATED_NOTE)
    return "\n".join(notes) or None


SWEEP_COLUMNS = [("job", "job", "d"), ("model", "model", "s"), ("precision", "precision", "s"),
                 ("status", "status", "s"), ("epochs", "epochs", ".2f"), ("train_time_s", "time s", ".2f"),
                 ("samples_per_s", "samples/s", ".1f"), ("speedup", "vs fp32", ".2f"), ("test_acc", "test acc", ".4f"),
                 ("peak_mem_mb", "peak MB", ".0f"), ("note", "note", "s")]
# language models: tokens/s, MFU, and perplexity (best validation, test at that epoch) beside apex's published
# one, the validation-loss gap to fp32 after the same steps
LM_COLUMNS = SWEEP_COLUMNS[:6] + [("samples_per_s", "tokens/s", ".0f"), ("speedup", "vs fp32", ".2f"),
                                  ("mfu", "MFU", ".1%"), ("valid_ppl", "valid ppl", ".2f"),
                                  ("test_ppl", "test ppl", ".2f"), ("loss_gap", "dloss vs fp32", "+.3g"),
                                  ("published", "published test ppl", "s"), ("peak_mem_mb", "peak MB", ".0f"),
                                  ("note", "note", "s")]


def format_table(rows: list[dict], cols: list[tuple] | None = None) -> str:
    """rows as aligned text columns; cols: (row key, header, format spec) per column; by default SWEEP_COLUMNS,
    or LM_COLUMNS when every row is a language model's."""
    if cols is None:
        cols = LM_COLUMNS if rows and all(r.get("lm") for r in rows) else SWEEP_COLUMNS
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
        f"{_fmt(m.get('train_time_s'), '.2f')} s (eval excluded), epochs {[round(t, 2) for t in m.get('epoch_times_s') or []]}"
        + (f"; compiled in {m['compile_time_s']:.2f} s and prewarmed {_fmt(m.get('prewarm_time_s'), '.2f')} s before the clock"
           if m.get("compile_time_s") else ""),
        f"throughput  {_fmt(m.get('throughput'), '.1f')} {m.get('throughput_unit', 'samples/s')} ({warm})",
        f"perplexity  valid final {_fmt(m.get('final_valid_ppl'), '.2f')}, best {_fmt(m.get('best_valid_ppl'), '.2f')} "
        f"(epoch {m.get('best_valid_epoch')}); test final {_fmt(m.get('final_test_ppl'), '.2f')}, at best valid "
        f"{_fmt(m.get('test_ppl_at_best_valid'), '.2f')}" if is_language_model(summary) else
        f"accuracy    final {_fmt(m.get('final_test_acc'), '.4f')}, best {_fmt(m.get('best_test_acc'), '.4f')}"
        + (f", {_fmt(m.get('time_to_target_s'), '.2f')} s to {m.get('target_acc')}" if m.get("target_acc") else ""),
        f"memory      peak {_fmt(m.get('peak_memory_mb'), '.0f')} MB ({m.get('peak_memory_kind')})",
        f"loss scale  {scale}; skipped steps {m.get('skipped_steps')}",
    ]
    if summary.get("resumed"):
        r = summary["resumed"]
        lines.append(f"resumed     at step {r['from_step']} (epoch {r['from_epoch']:.2f}), {len(r['history'])} time(s); "
                     "the time before is included")
    fp8 = summary.get("fp8")
    if fp8:
        lines.append(f"fp8         recipe {fp8['recipe']}, {len(fp8['float8_layers'])} Linear layers in float8, "
                     f"{len(fp8['bf16_layers'])} in bf16 ({', '.join(fp8['bf16_layers']) or 'none'}); fp8_emulated: "
                     + (f"true ({fp8['emulation_reason']}: the time above is not an FP8 time)" if fp8["fp8_emulated"]
                        else "false"))
    if m.get("mfu") is not None:
        lines.append(f"MFU         {100 * m['mfu']:.1f}% of {summary.get('gpu_profile', {}).get('name')} peak")
    return "\n".join(lines)


LADDER_COLUMNS = [("step", "step", "s"), ("variant", "variant", "s"), ("runs", "runs", "s"),
                  ("epochs", "epochs", ".2f"), ("train_time_s", "time s", "s"), ("setup_s", "setup s", ".2f"),
                  ("acc", "acc (no TTA)", "s"), ("acc_tta", "acc (TTA)", "s"), ("reached", "reached", "s"),
                  ("to_94_s", "to target s (median)", "s"), ("page_s", "Page s", ".1f"),
                  ("page_epochs", "Page ep", "d"), ("note", "note", "s")]
NOT_REACHED = "not reached"


def ladder_rows(summaries: list[dict]) -> list[dict]:
    """One row per ladder step (and per variant: the overrides other than seed and trick that differ between the
    sweep's jobs), in ladder order, every statistic over ALL the step's runs (seeds), as Page reported his ladder
    (bag_of_tricks.ipynb: the fixed-schedule `total time` of Timer and `summary(logs)`, the final-epoch accuracy's
    count, mean, min, max, std over the runs): the mean +- sample std of the fixed-schedule training time (eval
    excluded; the whitening fit and the untimed prewarm are not in it, setup s is shown apart), the final accuracy
    without and with flip TTA, the fraction of runs that reached the target ("k/n", n counting every run of the
    step, failed or diverged ones too), and the median time to the target over all runs, a run that never reached
    it counting as never (so the median is "not reached" when half the runs or more did not). Empty when the sweep
    ran no ladder step."""
    jobs = [s for s in summaries if s.get("choices", {}).get("trick") in page_ladder()]
    common = set.intersection(*(set(s.get("overrides", [])) for s in jobs)) if jobs else set()
    groups: dict[tuple, list[dict]] = {}
    for s in jobs:
        variant = ",".join(sorted(o for o in set(s.get("overrides", [])) - common
                                  if not o.startswith(("seed=", "trick="))))
        groups.setdefault((s["choices"]["trick"], variant), []).append(s)
    order = list(page_ladder())
    rows = []
    for (step, variant), group in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        done = [s["metrics"] for s in group if s.get("status") == "completed"]
        to_target = [(s.get("metrics") or {}).get("time_to_target_s") for s in group]
        reached = [t for t in to_target if t is not None]
        _, page_s, page_epochs = page_ladder()[step]
        rows.append({
            "step": step, "variant": variant, "runs": f"{len(done)}/{len(group)}",
            "epochs": _mean([m.get("epochs") for m in done]),
            "train_time_s": _mean_sd([m.get("train_time_s") for m in done], ".2f"),
            "setup_s": _mean([m.get("setup_time_s") for m in done]),
            "acc": _mean_sd([m.get("final_test_acc_no_tta", m.get("final_test_acc")) for m in done]),
            "acc_tta": _mean_sd([m.get("final_test_acc_tta") for m in done]),
            "reached": f"{len(reached)}/{len(group)}",
            "to_94_s": _median_all(to_target),
            "page_s": page_s, "page_epochs": page_epochs,
            "note": "; ".join(sorted({s.get("reason") or s.get("error") or "" for s in group} - {""})),
        })
    return rows


def _median_all(times: list) -> str:
    """The median of every run's time to the target, a run that never reached it counting as infinitely slow."""
    if not times:
        return "-"
    median = statistics.median([math.inf if t is None else t for t in times])
    return NOT_REACHED if math.isinf(median) else f"{median:.2f}"


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _mean_sd(values: list, spec: str = ".4f") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    sd = f" +- {format(statistics.stdev(values), spec)}" if len(values) > 1 else ""
    return format(statistics.fmean(values), spec) + sd
