"""What the console prints: the one-screen block at the end of a job (job_block, which job.py
prints) and a sweep's tables (format_table over analyse.sweep_rows, the ladder's over
analyse.ladder_rows: the rows the report is made from; callbacks.py prints them). Only formatting
here: the numbers are analyse.py's, the cells they share with the report rows.py's.
"""
from __future__ import annotations

from .. import records
from ..config import RNN_KINDS
from ..runtime import busy
from .rows import HOST_BOUND_NOTE, format_value, memory_kinds, row_cells


APEX_NOTE = (
    "published test ppl: NVIDIA apex's word_language_model README (published/apex_word_lm.yaml), "
    "shown beside the runs of the model, precision and loss scale it was reported for, with the "
    "epochs it was reported at; test ppl here = the test perplexity of the best-validation epoch, "
    "as the example reports it"
)


FP8_EMULATED_NOTE = (
    "fp8(emulated): no FP8 tensor cores on this device (a CPU, or a GPU before compute capability "
    "8.9; before 10.0 for mxfp8's block-scaled FP8): torchao emulated the float8 matmuls (in "
    "fp32; mxfp8's in bf16), so its loss is FP8's but its time, tokens/s and speed-up are not FP8 "
    "timings"
)


EMULATED_NOTE = (
    "(emulated): fp16/bf16 rounding emulated on fp32 kernels (precision.emulate, "
    "docs/numerics.md): its loss and accuracy are a GPU's numerics, its time and samples/s are "
    "fp32 timings on this device, and no speed-up is shown"
)


def sweep_note(summaries: list[dict]) -> str | None:
    """What a sweep's table is to be read beside: the published numbers of a recurrent
    language-model sweep; that an emulated job's time is no fp16/bf16/FP8 time."""
    notes = []
    if summaries and all(records.arch(s) in RNN_KINDS for s in summaries):
        notes.append(APEX_NOTE)
    if any(records.fp8_emulated(s) for s in summaries):
        notes.append(FP8_EMULATED_NOTE)
    if any(s.get("arithmetic") == "emulated" for s in summaries):
        notes.append(EMULATED_NOTE)
    if any(
        busy.verdict(records.metrics(s).get("gpu_busy_fraction")) == "host-bound" for s in summaries
    ):
        notes.append(HOST_BOUND_NOTE)
    return "\n".join(notes) or None


SWEEP_COLUMNS = [
    ("job", "job", "d"),
    ("model", "model", "s"),
    ("precision", "precision", "s"),
    ("status", "status", "s"),
    ("epochs", "epochs", ".2f"),
    ("train_time_s", "time s", ".2f"),
    ("samples_per_s", "samples/s", ".1f"),
    ("batch", "batch", "d"),
    ("compile", "compile", "s"),
    ("busy", "GPU busy", ".2f"),
    ("speedup", "vs fp32", ".2f"),
    ("test_acc", "test acc", ".4f"),
    ("skipped", "skipped", "s"),
    ("peak_mem_mb", "peak MB", ".0f"),
    ("bytes_per_param", "B/param", ".2f"),
    ("act_mb_per_sample", "act MB/sample", ".3g"),
    ("note", "note", "s"),
]


# language models: tokens/s, MFU, and perplexity (best validation, test at that epoch) beside apex's
# published one, the validation-loss gap to fp32 after the same steps
LM_COLUMNS = SWEEP_COLUMNS[:6] + [
    ("samples_per_s", "tokens/s", ".0f"),
    *SWEEP_COLUMNS[7:10],
    ("speedup", "vs fp32", ".2f"),
    ("mfu", "MFU", ".1%"),
    ("valid_ppl", "valid ppl", ".2f"),
    ("test_ppl", "test ppl", ".2f"),
    ("loss_gap", "dloss vs fp32", "+.3g"),
    ("published", "published test ppl", "s"),
    ("skipped", "skipped", "s"),
    ("peak_mem_mb", "peak MB", ".0f"),
    ("bytes_per_param", "B/param", ".2f"),
    ("act_mb_per_sample", "act MB/token", ".3g"),
    ("note", "note", "s"),
]


# a sweep with sharded jobs: each job's strategy (ranks, param/reduce dtypes) and the most MB of
# parameters + gradients + optimizer state one rank held, before peak MB
SHARDED_COLUMNS = [("strategy", "strategy", "s"), ("held_mb", "MB/rank p+g+o", "s")]


def sweep_tables(rows: list[dict]) -> str:
    """A sweep's table, one per job kind (image models, then language models: each under its own
    columns), separated by a blank line."""
    kinds = [[r for r in rows if bool(r.get("lm")) == lm] for lm in (False, True)]
    return "\n\n".join(format_table(of) for of in kinds if of)


def format_table(rows: list[dict], cols: list[tuple] | None = None) -> str:
    """rows as aligned text columns; cols: (row key, header, format spec) per column; by default
    sweep_columns(rows)."""
    cols = sweep_columns(rows) if cols is None else cols
    cells = [[h for _, h, _ in cols]] + [row_cells(r, cols) for r in rows]
    cells = [[c if len(c) <= 90 else c[:87] + "..." for c in row] for row in cells]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sweep_columns(rows: list[dict]) -> list[tuple]:
    """A sweep table's columns: SWEEP_COLUMNS, or LM_COLUMNS when every row is a language model's,
    with the swept keys after precision when rows differ in other keys than model and precision,
    SHARDED_COLUMNS before peak MB when a row is a sharded job's, and peak MB saying what it
    measured."""
    cols = LM_COLUMNS if rows and all(r.get("lm") for r in rows) else SWEEP_COLUMNS
    if any(r.get("swept") for r in rows):
        at = [k for k, _, _ in cols].index("precision") + 1
        cols = cols[:at] + [("swept", "swept", "s")] + cols[at:]
    at = [k for k, _, _ in cols].index("peak_mem_mb")
    if any(r.get("strategy") for r in rows):
        cols, at = cols[:at] + SHARDED_COLUMNS + cols[at:], at + len(SHARDED_COLUMNS)
    return cols[:at] + [("peak_mem_mb", f"peak MB ({memory_kinds(rows)})", ".0f")] \
        + cols[at + 1:]


def job_block(summary: dict) -> str:
    """The one-screen summary printed when a job ends: how it ended (and the numerics verdict),
    what ran where, its time, speed, score, memory and loss scale; then the lines only some jobs
    have (record_lines)."""
    m = records.metrics(summary)
    lines = [
        status_line(summary),
        *verdict_lines(summary.get("verdict")),
        job_line(records.choices(summary)),
        device_line(summary),
        training_line(m),
        throughput_line(m),
        score_line(summary, m),
        f"memory      peak {format_value(m.get('peak_memory_mb'), '.0f')} MB "
        f"({m.get('peak_memory_kind')})",
        ledger_line(records.memory(summary)),
        *([f"evaluation  {records.eval_cap(summary)} of each split: not the whole split's "
           "numbers (trainer.eval_batches)"] if records.eval_cap(summary) else []),
        loss_scale_line(m),
    ]
    return "\n".join(lines + record_lines(summary, m))


def status_line(summary: dict) -> str:
    """How the job ended, and why when it did not complete."""
    return (f"status      {records.status(summary)}"
            + (f"  ({records.reason(summary)})" if records.reason(summary) else ""))


def verdict_lines(v: dict | None) -> list[str]:
    """The numerics verdict (numerics/verdicts.py) and the rows it cites; none without one."""
    if not v:
        return []
    return [f"verdict     {v['line']}"] + [f"            from {c}" for c in v["cites"]]


def job_line(ch: dict) -> str:
    """The config groups chosen: model, precision, dataset, optimizer."""
    return (f"job         model={ch.get('model')} precision={ch.get('precision')} "
            f"dataset={ch.get('dataset')} optimizer={ch.get('optimizer')}")


def device_line(summary: dict) -> str:
    """The device, torch, TF32's absence where it changes nothing, and the ranks."""
    env = records.env(summary)
    return (f"device      {env.get('device_name')} ({env.get('device')}), torch {env.get('torch')}"
            + ("; TF32 does nothing here: plain fp32 arithmetic"
               if records.fp32_arithmetic(summary) else "")
            + ranks_said(summary.get("distributed")))


def training_line(m: dict) -> str:
    """Epochs, steps, the training time and each epoch's, and a compiled job's time before the
    clock."""
    compiled = (f"; compiled in {m['compile_time_s']:.2f} s and prewarmed "
                f"{format_value(m.get('prewarm_time_s'), '.2f')} s before the clock"
                if m.get("compile_time_s") else "")
    return (f"training    {format_value(m.get('epochs'), '.2f')} epochs, {m.get('steps')} steps, "
            f"{format_value(m.get('train_time_s'), '.2f')} s (eval excluded), epochs "
            f"{[round(t, 2) for t in m.get('epoch_times_s') or []]}"
            + compiled + compiled_note(m))


def throughput_line(m: dict) -> str:
    """The steady throughput, and whether the warm-up steps are in it."""
    warm = ("warm-up included: too few steps" if m.get("throughput_includes_warmup")
            else f"first {m.get('warmup_steps')} steps excluded")
    return (f"throughput  {format_value(m.get('throughput'), '.1f')} "
            f"{m.get('throughput_unit', 'samples/s')} ({warm})")


def score_line(summary: dict, m: dict) -> str:
    """A language model's perplexities, or an image model's accuracy (and its time to target)."""
    if records.is_language_model(summary):
        return (f"perplexity  valid final {format_value(m.get('final_valid_ppl'), '.2f')}, best "
                f"{format_value(m.get('best_valid_ppl'), '.2f')} (epoch "
                f"{m.get('best_valid_epoch')}); test final "
                f"{format_value(m.get('final_test_ppl'), '.2f')}, at best valid "
                f"{format_value(m.get('test_ppl_at_best_valid'), '.2f')}")
    target = (f", {format_value(m.get('time_to_target_s'), '.2f')} s to {m.get('target_acc')}"
              if m.get("target_acc") else "")
    return (f"accuracy    final {format_value(m.get('final_test_acc'), '.4f')}, best "
            f"{format_value(m.get('best_test_acc'), '.4f')}" + target)


def loss_scale_line(m: dict) -> str:
    """The loss scale's range and last value, and the steps skipped for non-finite gradients."""
    ls = m.get("loss_scale")
    scale = "none" if not ls else f"min {ls['min']:g}, max {ls['max']:g}, final {ls['final']:g}"
    return f"loss scale  {scale}; skipped steps {m.get('skipped_steps')}"


def record_lines(summary: dict, m: dict) -> list[str]:
    """The block's lines for what only some jobs record: a resume, FP8 layers, emulated numerics,
    the GPU's busy fraction, MFU."""
    lines = [resumed_line(summary.get("resumed")), fp8_line(summary.get("fp8")),
             EMULATED_LINE if summary.get("arithmetic") == "emulated" else None,
             busy_line(summary, m), mfu_line(summary, m)]
    return [line for line in lines if line]


EMULATED_LINE = (
    "numerics    emulated: fp16/bf16 rounding on fp32 kernels with CUDA's autocast "
    "policy; the losses are a GPU's, the time above is an fp32 time on this device, not a "
    "low-precision one"
)


def resumed_line(r: dict | None) -> str | None:
    """Where a resumed job picked up, and how many times."""
    if not r:
        return None
    return (f"resumed     at step {r['from_step']} (epoch {r['from_epoch']:.2f}), "
            f"{len(r['history'])} time(s); the time before is included")


def fp8_line(fp8: dict | None) -> str | None:
    """An FP8 job's recipe, its layers in float8 and in bf16, and whether FP8 was emulated."""
    if not fp8:
        return None
    return (f"fp8         recipe {fp8['recipe']}, {len(fp8['float8_layers'])} Linear layers in "
            f"float8, {len(fp8['bf16_layers'])} in bf16 "
            f"({', '.join(fp8['bf16_layers']) or 'none'}); fp8_emulated: "
            + (f"true ({fp8['emulation_reason']}: the time above is not an FP8 time)"
               if fp8["fp8_emulated"] else "false"))


def busy_line(summary: dict, m: dict) -> str | None:
    """The GPU's busy fraction of a steady step (runtime/busy.py), and advice when host-bound."""
    if m.get("gpu_busy_fraction") is None:
        return None
    return (f"GPU busy    {100 * m['gpu_busy_fraction']:.0f}% of a steady step "
            f"({format_value(m.get('gpu_step_ms'), '.2f')} of "
            f"{format_value(m.get('wall_step_ms'), '.2f')} ms; "
            f"batch {records.lookup(summary, 'trainer.batch_size')}, compile "
            f"{records.lookup(summary, 'trainer.compile')})"
            + (f": {busy.note(m['gpu_busy_fraction'])}" if m.get("host_bound") else ""))


def mfu_line(summary: dict, m: dict) -> str | None:
    """Model FLOPs utilisation against the GPU profile's peak."""
    if m.get("mfu") is None:
        return None
    return f"MFU         {100 * m['mfu']:.1f}% of {summary.get('gpu_profile', {}).get('name')} peak"


def ledger_line(mem: dict) -> str:
    """The end-of-job block's memory ledger (train/memory.py): its parts in MB, bytes per parameter,
    activations per sample, and on an accelerator the peak of allocated bytes beside what the parts
    held at once (an older record's unaccounted_bytes: the peak less the total)."""
    if not mem:
        return "ledger      none (no training step measured)"
    mb = {k: v / 2**20 for k, v in mem["bytes"].items()}
    parts = ", ".join(f"{k} {v:.3g}" for k, v in mb.items() if v)
    line = (f"ledger      {mem['total_bytes'] / 2**20:.3g} MB at step {mem['step']} ({parts}); "
            f"{format_value(mem['bytes_per_param'], '.2f')} B/param, "
            f"{format_value(mem['activation_mb_per_sample'], '.3g')} MB activations/sample")
    if mem.get("device_peak_allocated_bytes") is not None:
        outside = mem.get("outside_ledger_bytes", mem.get("unaccounted_bytes"))
        line += (f"; device peak {mem['device_peak_allocated_bytes'] / 2**20:.3g} MB, "
                 f"{outside / 2**20:.3g} MB beyond what the parts held at once (workspaces, the "
                 f"backward's temporaries)")
    return line


def ranks_said(distributed: dict | None) -> str:
    """"; 2 ranks, fsdp (gloo)" for a job on several ranks or sharded; "" for one process."""
    if not distributed:
        return ""
    d = distributed
    return f"; {d.get('world_size')} ranks, {d.get('strategy')} ({d.get('backend')})"


def compiled_note(m: dict) -> str:
    """A compiled job's graphs, the graph breaks dynamo took if it took some, and its calls after
    the warm-up that ran eagerly if some did (GraphWatch)."""
    if m.get("compiled_graphs") is None:
        return ""
    breaks, eager = m.get("graph_breaks"), m.get("eager_calls")
    return (f" ({m['compiled_graphs']} graphs"
            + (f"; {breaks} GRAPH BREAK{'S' if breaks > 1 else ''}" if breaks else "")
            + (f"; {eager} calls ran EAGERLY after the warm-up)" if eager else ")"))
