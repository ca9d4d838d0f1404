"""The numerics probe (src/mixprec/numerics/probe.py, probe_stats.py): format facts, per-tensor
counts, hooks, attribution."""
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import TINY
from helpers.probes import Scale
from mixprec.train.loop import Loop, LoopState, fit, total_steps
from mixprec.numerics import probe_stats
from mixprec.config import PrecisionConfig, ProbeConfig, TrainerConfig
from mixprec.precision.policy import PrecisionPolicy
from mixprec.numerics.probe import NUMERICS, build_probe
from mixprec.train import image_steps
from mixprec.train.step import backward_and_step

CPU = torch.device("cpu")
TINY8 = [*TINY, "dataset.image_size=8", "trainer.device=cpu"]
TINY_RESNET9 = [o for o in TINY8 if not o.startswith("model")] + [
    "model=resnet9",
    "model.channels=[8,8,8,8]",
]
LM = [
    "logger=none",
    "trainer.max_steps=2",
    "model=lstm",
    "dataset=synthetic_text",
    "dataset.vocab_size=40",
    "dataset.train_size=1200",
    "dataset.test_size=200",
    "model.emsize=8",
    "model.nhid=8",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=5",
    "dataset.bptt=6",
    "trainer.device=cpu",
    "schedule=constant",
]


def run_tiny(tmp_path, *overrides):
    from helpers import run_tiny as run
    return run(tmp_path, *overrides, base=[])


def rows_of(job_dir):
    return [json.loads(line) for line in (job_dir / NUMERICS).read_text().splitlines()]


# -- format facts and counts -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(probe_stats.FORMATS))
def test_format_facts_match_torch_and_rounding(name):
    f = probe_stats.FORMATS[name]
    dt = getattr(torch, f.dtype)
    info = torch.finfo(dt)
    assert (f.max, f.min_normal, f.min_subnormal) == (
        info.max,
        info.smallest_normal,
        info.smallest_normal * info.eps,
    )
    # fp32 (a cast from fp64 rounds twice)
    below = torch.tensor(f.overflow_at).nextafter(torch.tensor(0.0))
    # just below the threshold: rounds down to max
    assert below.to(dt).double().item() == f.max
    # e4m3fn has no inf: PyTorch's cast saturates at 448 (NaN in the format's own rule)
    if name != "fp8_e4m3fn":
        assert not math.isfinite(torch.tensor(f.overflow_at).to(dt).float().item())
    assert torch.tensor(f.lost_at).to(dt).float().item() == 0.0
    above = torch.tensor(f.lost_at).nextafter(torch.tensor(1.0))
    assert above.to(dt).double().item() == f.min_subnormal


def test_tensor_counts_by_hand():
    x = torch.tensor([0.0, 0.0, 1e5, 3.0, 1e-6, 2.0**-26, float("nan"), float("inf"), -0.75, 1e-40])
    counts, absmax = probe_stats.tensor_counts(x)
    row = probe_stats.describe(counts.tolist(), absmax.item())
    # finite non-zero: 1e5, 3, 1e-6, 2^-26, -0.75, 1e-40 -> 6
    assert (
        row["n"] == 10 and row["zero"] == 0.2 and row["nonfinite"] == 0.2 and absmax.item() == 1e5
    )
    # 1e5; 1e-6; 2^-26 and 1e-40
    assert row["fp16"] == {"overflow": 1 / 6, "subnormal": 1 / 6, "lost": 2 / 6}
    # 2^-134 < 1e-40 < 2^-126
    assert row["bf16"] == {"overflow": 0.0, "subnormal": 1 / 6, "lost": 0.0}
    h = row["hist"]
    assert (h["zero"], h["inf"], h["nan"]) == (2, 1, 1) and sum(h["counts"]) == 6
    bins = {h["lo"] + i: v for i, v in enumerate(h["counts"]) if v}
    assert bins == {16: 1, 1: 1, -20: 1, -26: 1, -1: 1, math.floor(math.log2(1e-40)): 1}


def reference_counts(x: torch.Tensor) -> list[int]:
    """HEAD and the bins by direct comparisons, one element at a time (a second, plain
    implementation)."""
    head = dict.fromkeys(probe_stats.HEAD, 0)
    bins = [0] * probe_stats.NBINS
    for v in x.tolist():
        head["n"] += 1
        if not math.isfinite(v):
            head["nonfinite"] += 1
            head["nan"] += math.isnan(v)
        elif v == 0:
            head["zero"] += 1
        else:
            a = abs(v)
            head["finite_nonzero"] += 1
            bins[math.frexp(a)[1] - 1 - probe_stats.LO] += 1
            for name in probe_stats.MEASURED:
                f = probe_stats.FORMATS[name]
                head[f"{name}_overflow"] += a >= f.overflow_at
                head[f"{name}_subnormal"] += f.lost_at < a < f.min_normal
                head[f"{name}_lost"] += a <= f.lost_at
    return [head[k] for k in probe_stats.HEAD] + bins


@pytest.mark.parametrize("n", [0, 1, 5000])
def test_tensor_counts_histogram_is_bincounts_without_a_host_sync(monkeypatch, n):
    # probe=ranges measures every tensor of a probed step on its device: torch.bincount (and a
    # torch.tensor built on the device) made about three host syncs a tensor on a GPU. The same
    # histogram, from a fixed-size tensor.
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.exp2(
        torch.randint(-160, 130, (n,), generator=g).float()
    )
    if n > 1:
        x[::7], x[1::11], x[2::13], x[3::17] = 0.0, float("inf"), float("nan"), -float("inf")
        x[4], x[5] = 2.0 ** -149, -3.0e38   # fp32's smallest subnormal and a value near its max
    a = x.abs()
    af = torch.where(torch.isfinite(a), a, torch.zeros(()))
    lo, hi, nbins = probe_stats.LO, probe_stats.HI, probe_stats.NBINS
    bins = torch.where(af > 0, (torch.frexp(af)[1] - 1).clamp(lo, hi - 1) - lo, nbins)
    expected = torch.bincount(bins.long(), minlength=probe_stats.NBINS + 1)

    def no_sync(*args, **kwargs):
        raise AssertionError("a host sync in tensor_counts")

    for name in ("item", "tolist", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    monkeypatch.setattr(torch, "bincount", no_sync)
    monkeypatch.setattr(torch, "tensor", no_sync)
    counts, _ = probe_stats.tensor_counts(x)
    monkeypatch.undo()
    head = dict(zip(probe_stats.HEAD, counts[:len(probe_stats.HEAD)].tolist()))
    assert torch.equal(counts[len(probe_stats.HEAD):], expected[:probe_stats.NBINS])
    assert head["n"] == n and head["zero"] == int(expected[probe_stats.NBINS]) - head["nonfinite"]
    assert head["finite_nonzero"] == int(expected[:probe_stats.NBINS].sum())


def test_tensor_counts_equal_direct_comparisons_at_every_edge():
    """Random magnitudes over fp32's range plus every format edge exactly, just above and just below
    it."""
    torch.manual_seed(0)
    edges = [
        e
        for name in probe_stats.MEASURED
        for f in [probe_stats.FORMATS[name]]
        for e in (f.lost_at, f.min_normal, f.overflow_at, f.max)
    ]
    near = torch.tensor(edges)
    special = torch.cat(
        [
            near,
            near.nextafter(torch.tensor(0.0)),
            near.nextafter(torch.tensor(float("inf"))),
            torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38]),
        ]
    )
    x = torch.cat(
        [special, -special, torch.randn(4000) * 2.0 ** torch.randint(-150, 128, (4000,)).float()]
    )
    counts, _ = probe_stats.tensor_counts(x)
    assert counts.tolist() == reference_counts(x)


def test_update_stall_is_half_the_spacing():
    torch.manual_seed(0)
    w = torch.randn(20000) * 3
    dw = torch.randn(20000) * 10.0 ** torch.empty(20000).uniform_(-7, -1)
    w16 = w.half().float()
    # fp16 ulp at w (all |w| here are normal)
    spacing = 2.0 ** (torch.floor(torch.log2(w16.abs())) - 10)
    expected = dw.abs() < spacing / 2
    ties = dw.abs() == spacing / 2
    got = probe_stats.update_stall(w, dw, probe_stats.FORMATS["fp16"])
    assert (got[~ties] == expected[~ties]).all() and 0.1 < expected.float().mean() < 0.9


def test_smallest_scale_lifts_the_histogram():
    x = torch.cat([torch.full((990,), 2.0 ** -20), torch.full((10,), 2.0 ** -30)])
    row = probe_stats.describe(
        *[v.tolist() if v.dim() else v.item() for v in probe_stats.tensor_counts(x)]
    )
    # 2^-20 * 2^6 = 2^-14; the 1% at 2^-30 may stay below
    assert probe_stats.smallest_scale(row["hist"]) == 6
    assert probe_stats.smallest_scale(row["hist"], tolerance=0.0) == 16
    assert probe_stats.largest_scale(1000.0) == 6          # 1000 * 2^6 = 64000 <= 65504 < 128000


# -- hooks -----------------------------------------------------------------------------------------

@pytest.fixture
def hook_count(monkeypatch):
    """Counts every hook registration (module forward/backward hooks, tensor hooks) during a
    test."""
    calls = []
    for cls, name in (
        (nn.Module, "register_forward_hook"),
        (nn.Module, "register_forward_pre_hook"),
        (nn.Module, "register_full_backward_hook"),
        (nn.Module, "register_backward_hook"),
        (torch.Tensor, "register_hook"),
    ):
        original = getattr(cls, name)

        def counted(self, *a, _original=original, _name=name, **k):
            calls.append(_name)
            return _original(self, *a, **k)
        monkeypatch.setattr(cls, name, counted)
    return calls


@pytest.mark.slow
def test_probe_none_registers_no_hooks(tmp_path, hook_count):
    s = run_tiny(tmp_path / "none", *TINY8, "probe=none", "precision=amp")
    assert (
        s["status"] == "completed"
        and hook_count == []
        and not (tmp_path / "none" / NUMERICS).exists()
    )
    # the same counter sees the probe's
    s = run_tiny(tmp_path / "ranges", *TINY8, "probe=ranges", "probe.every=1")
    assert (
        s["status"] == "completed"
        and "register_forward_hook" in hook_count
        and "register_hook" in hook_count
    )


def test_a_probe_none_job_registers_no_hook(tmp_path, hook_count):
    """The quick loop's guard of "probe=none registers no hook at all" (docs/numerics.md; the test
    above, which also runs a probed job, is slow): one tiny amp job, and the counter's own check on
    a module and a tensor instead of a second job."""
    s = run_tiny(tmp_path, *TINY8, "probe=none", "precision=amp")
    assert s["status"] == "completed" and hook_count == [] and not (tmp_path / NUMERICS).exists()
    nn.Linear(1, 1).register_forward_hook(lambda *a: None)
    torch.zeros(1, requires_grad=True).register_hook(lambda g: g)
    assert hook_count == ["register_forward_hook", "register_hook"]


def manual_steps(model, policy, probe, loss_fn, steps=1, lr=0.0):
    opt = torch.optim.SGD(policy.optimizer_params(model), lr=lr)
    torch.manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randn(16, 8)
        probe.before_step(step, policy)
        with policy.autocast():
            out = model(policy.cast_input(x))
        loss = loss_fn(out.float())
        probed = lambda: probe.after_backward(step, loss, policy, lambda: model(x))
        skipped = backward_and_step(loss, policy, opt, after_backward=probed)
        probe.after_step(step, policy, skipped)
        opt.zero_grad(set_to_none=True)
    probe.close()
    return probe.summary()


def test_a_layer_multiplying_by_1e6_is_the_fp16_forward_overflow(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(8, 8))
    model.add_module("boom", Scale(1e6))
    model.add_module("head", nn.Linear(8, 2))
    policy = PrecisionPolicy(PrecisionConfig(name="fp32"), CPU)
    s = manual_steps(
        model, policy, build_probe(ProbeConfig(name="ranges"), model, tmp_path), lambda o: o.mean()
    )
    assert s["fp16_forward_overflow_first"]["layer"] == "boom"
    # |lin output| > 65504e-6 for almost every element: the fraction is that of the lin output
    # measured by hand
    lin = model.lin(torch.randn(16, 8, generator=torch.Generator().manual_seed(1)))
    assert s["fp16_forward_overflow_first"]["fp16_fraction"] == pytest.approx(
        ((lin.abs() * 1e6 >= 65520) & (lin != 0)).float().mean().item())
    assert not [
        r
        for r in rows_of(tmp_path)
        if r["kind"] == "forward" and r["name"] == "lin" and r["fp16"]["overflow"]
    ]


def test_tiny_loss_is_lost_in_fp16_unscaled_and_kept_at_a_large_scale(tmp_path):
    results = {}
    for scale in ("none", 2.0 ** 32):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))
        policy = PrecisionPolicy(PrecisionConfig(name="fp32", loss_scale=scale), CPU)
        out = tmp_path / str(scale)
        out.mkdir()
        results[scale] = manual_steps(
            model,
            policy,
            build_probe(ProbeConfig(name="ranges"), model, out),
            lambda o: (o**2).mean() * 1e-10,
        )["act_grad_fp16"]
    # 1e-10 x O(1) / 128 elements is far below fp16's smallest subnormal (6e-8); x 2^32 it is ~0.03:
    # normal
    assert (
        results["none"]["unscaled"]["lost"] > 0.95
        and results["none"]["at_scale_used"]["lost"] > 0.95
    )
    assert (
        results[2.0**32]["unscaled"]["lost"] > 0.95
        and results[2.0**32]["at_scale_used"]["lost"] < 0.02
    )
    assert results[2.0 ** 32]["scales"] == [2.0 ** 32]


class NanFrom(nn.Module):
    """Emits NaN from its k-th training-mode call on."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.calls = k, 0

    def forward(self, x):
        self.calls += self.training
        return x * float("nan") if self.training and self.calls >= self.k else x


def nan_net(k: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), NanFrom(k),
                         nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))


def train_constructed(
    model, precision: PrecisionConfig, probe_cfg: ProbeConfig, tmp_path, steps=6, **trainer
):
    """The shared training loop (loop.fit) on a constructed model and list-of-batches data, with a
    probe."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))) for _ in range(steps)]
    policy = PrecisionPolicy(precision, CPU)
    model = policy.prepare_model(model)
    opt = torch.optim.SGD(policy.optimizer_params(model), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    tr = TrainerConfig(epochs=1, warmup_steps=0, channels_last=False, **trainer)
    probe = build_probe(probe_cfg, model, tmp_path)
    loop = Loop(
        policy, opt, tr, total_steps(tr, len(batches)), progress=False, probe=probe
    )
    result = fit(
        image_steps.ImageSteps(model, sched, batches[:1]), batches, loop, LoopState()
    )
    probe.close()
    return result, probe.summary()


@pytest.mark.parametrize("precision,probe", [
    # unscaled: the probe checks every loss before the update
    (PrecisionConfig(name="fp32"), "ranges"),
    # GradScaler skips
    (PrecisionConfig(name="amp", autocast_dtype="float16", loss_scale="dynamic"), "none")])
def test_a_layer_emitting_nan_at_step_k_is_named_in_the_diverged_reason(tmp_path, precision, probe):
    result, summary = train_constructed(nan_net(3), precision, ProbeConfig(name=probe), tmp_path)
    assert result["status"] == "diverged"
    assert result["reason"].startswith(
        "loss became nan at step 3; first non-finite: step 3 forward, 3 output: NaN"
    ), result["reason"]
    e = summary["first_nonfinite"]
    assert (e["step"], e["pass"], e["module"], e["tensor"], e["what"]) == (
        3,
        "forward",
        "3",
        "output",
        "NaN",
    )


def test_a_skipped_step_lists_the_parameters_with_nonfinite_gradients(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    # h = 60 everywhere, out = 0.01 * 4 * 60 - 2.3 = 0.1: dL/dw1 = 65536 * 0.1 * 60 overflows
    with torch.no_grad():
        (
            model[0].weight.fill_(0.5),
            model[0].bias.zero_(),
            model[1].weight.fill_(0.01),
            model[1].bias.fill_(-2.3),
        )
    x = torch.full((8, 4), 30.0)
    # expected, in fp32 by hand: the gradient of each parameter of 65536 x mean((30 *
    # lin(lin(x)))^2) / 2
    ref = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ref.load_state_dict(model.state_dict())
    (65536 * (ref(x) ** 2).mean() / 2).backward()
    expected = [n for n, p in ref.named_parameters() if p.grad.abs().max() >= 65520]
    # clear of fp16 rounding
    assert all(not 30000 < p.grad.abs().max() < 140000 for p in ref.parameters())
    assert expected and len(expected) < 4

    policy = PrecisionPolicy(PrecisionConfig(name="o2", param_dtype="float16", master_weights=True,
                                             loss_scale="dynamic"), CPU)
    model = policy.prepare_model(model)
    opt = torch.optim.SGD(policy.optimizer_params(model), lr=0.0)
    probe = build_probe(ProbeConfig(name="none"), model, tmp_path)
    probe.before_step(1, policy)
    loss = (model(x.half()).float() ** 2).mean() / 2
    probed = lambda: probe.after_backward(1, loss, policy, None)
    skipped = backward_and_step(loss, policy, opt, after_backward=probed)
    probe.after_step(1, policy, skipped)
    assert skipped
    assert probe.summary()["skipped_steps"] == [
        {"step": 1, "scale": 65536.0, "nonfinite_grads": expected}
    ]


@pytest.mark.slow
def test_skips_are_attributed_in_a_job(tmp_path):
    # o2's fp16 gradients overflow at a scale of 1e20: the first steps are skipped
    s = run_tiny(
        tmp_path,
        *TINY8,
        "precision=o2",
        "precision.init_scale=1e20",
        "trainer.max_steps=3",
        "probe=ranges",
        "probe.every=100",
    )
    n = s["numerics"]
    assert n["skipped_total"] == s["metrics"]["skipped_steps"] > 0
    first = n["skipped_steps"][0]
    assert (
        first["step"] == 1
        and first["scale"] == pytest.approx(1e20, rel=1e-7)
        and first["nonfinite_grads"]
    )
    skipped_rows = [r for r in rows_of(tmp_path) if r.get("skipped")]
    assert {r["step"] for r in skipped_rows} == {e["step"] for e in n["skipped_steps"]}


# -- every precision mode and model kind -----------------------------------------------------------

PRECISIONS = ["fp32", "tf32", "amp", "amp_bf16", "half", "bf16", "o0", "o1", "o2", "o3"]


def check_job(s, job_dir, scaled: bool):
    assert s["status"] == "completed", s.get("error") or s.get("reason")
    rows = rows_of(job_dir)
    kinds = {r["kind"] for r in rows}
    assert {"forward", "act_grad", "grad", "update"} <= kinds
    assert ("act_grad_unscaled" in kinds) == scaled
    assert {r["step"] for r in rows} == {1, 2}
    for r in rows:  # every row's pooled counts add up
        assert (
            sum(r["hist"]["counts"]) + r["hist"]["zero"] + r["hist"]["inf"] + r["hist"]["nan"]
            == r["n"]
        )
    n = s["numerics"]
    assert n["probed_steps"] == [1, 2] and set(n["update_stall"]) >= {"stepped"}


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_mode(tmp_path, precision):
    s = run_tiny(tmp_path, *TINY8, f"precision={precision}", "probe=ranges", "probe.every=1")
    check_job(s, tmp_path, scaled=precision in ("amp", "o1", "o2"))
    stall = s["numerics"]["update_stall"]
    # what-ifs for fp32-stepped weights
    assert ("fp16" in stall) == (precision not in ("half", "bf16", "o3"))


@pytest.mark.slow
def test_ema_and_ghost_bn_resnet9(tmp_path):
    s = run_tiny(
        tmp_path,
        *TINY_RESNET9,
        "trick.ghost_bn=true",
        "trick.ghost_splits=2",
        "trick.ema=true",
        "precision=amp",
        "probe=ranges",
        "probe.every=1",
    )
    check_job(s, tmp_path, scaled=True)


@pytest.mark.parametrize("arch", ["lstm", "gru"])
@pytest.mark.slow
def test_rnn_language_models(tmp_path, arch):
    s = run_tiny(tmp_path, *LM, f"model={arch}", "precision=amp", "probe=ranges", "probe.every=1")
    check_job(s, tmp_path, scaled=True)
    names = {r["name"] for r in rows_of(tmp_path) if r["kind"] == "forward"}
    assert "rnn" in names and (
        {"rnn[1]", "rnn[2]"} <= names if arch == "lstm" else "rnn[1]" in names
    )


# -- the one-batch advisor -------------------------------------------------------------------------

@pytest.mark.slow
def test_numerics_script_gives_a_verdict_per_precision(tmp_path, capsys):
    from helpers import load_script
    script = load_script("numerics")
    assert (
        script.main(
            [
                "model=small_cnn",
                "model.width=8",
                "trainer.device=cpu",
                "precision=amp,amp_bf16,o2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["amp", "amp_bf16", "o2"]
    assert lines[0].startswith("amp: fp16 needs") and lines[1].startswith("amp_bf16: bf16: ")
    md = (tmp_path / "numerics.md").read_text()
    assert "| layer | forward error |" in md and (tmp_path / "numerics.png").stat().st_size > 10_000


@pytest.mark.slow
def test_make_report_draws_the_probed_jobs(tmp_path):
    from mixprec.report.make import make_report

    s = run_tiny(
        tmp_path / "job",
        *TINY8,
        "precision=amp",
        "trainer.max_steps=3",
        "probe=ranges",
        "probe.every=2",
    )
    assert s["status"] == "completed"
    run_tiny(tmp_path / "plain", *TINY8, "precision=amp")   # not probed: no figure
    data = make_report([str(tmp_path)], out=tmp_path / "report")
    figs = sorted(
        Path(f["path"]).name
        for e in data["experiments"]
        for f in e["plots"]
        if "numerics_" in f["path"]
    )
    assert [f.split("_")[:3] for f in figs] == [
        ["numerics", "heatmap", "job"],
        ["numerics", "hist", "job"],
    ]
    md = (tmp_path / "report" / "report.md").read_text()
    assert figs[1] in md and "unscaled and scaled" in md


# -- a finished job leaves nothing behind ----------------------------------------------------------

@pytest.mark.parametrize("overrides", [TINY8, [*TINY8, "probe=ranges"], LM,
                                       # diverges, then replays
                                       [*TINY8, "precision=half", "optimizer=adam"]],
                         ids=["image", "image-ranges", "lstm", "half-adam-replay"])
def test_a_finished_job_frees_its_model_without_the_cycle_collector(
    tmp_path, monkeypatch, overrides
):
    # The probe kept the last step's replay, a closure over the loop (whose probe kept it: a
    # reference cycle), holding the model, its batch and the optimizer until Python's cycle
    # collector ran: in a sweep's process the next job's peak memory counted them. With the
    # collector off, reference counting alone must free the model.
    import gc
    import weakref

    from mixprec.train import parts

    models = []

    def build_model(*args, **kwargs):
        model = build(*args, **kwargs)
        models.append(weakref.ref(model))
        return model

    build = parts.build_model
    monkeypatch.setattr(parts, "build_model", build_model)
    gc.collect()
    gc.disable()
    try:
        s = run_tiny(tmp_path, *overrides)
        assert s["status"] in ("completed", "diverged"), s.get("error")
        assert models and [m() for m in models] == [None] * len(models)
    finally:
        gc.enable()
