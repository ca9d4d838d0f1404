"""Speed features that must not change what is trained: torch.compile (trainer.compile), the
optimizer's implementation (optimizer.impl, fused steps under GradScaler), the host syncs per step,
and prewarm."""
import json

import pytest
import torch

from mixprec.train import loop
from helpers import compose_config, run_tiny
from helpers.configs import LM, SMALL
from helpers.fakes import SyncCounter
from mixprec.config import ConfigError, validate
from mixprec.models import small_cnn
from mixprec.train.optim import build_optimizer
from mixprec.precision.policy import PrecisionPolicy
from mixprec.train.step import backward_and_step
from mixprec.numerics.probe import Attribution


def losses(tmp_path, *overrides):
    s = run_tiny(tmp_path, *overrides, base=SMALL)
    assert s["status"] == "completed", s.get("error")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"], s


@pytest.mark.slow
def test_compiled_small_cnn_gives_the_eager_losses(tmp_path):
    """20 deterministic steps, one loss logged per step: inductor's kernels round differently from
    eager's, so the two agree to 1e-4 relative, not bit for bit; the compile warm-up must leave the
    weights untouched."""
    eager, _ = losses(tmp_path / "eager", "trainer.max_steps=20", "trainer.log_every=1")
    compiled, s = losses(
        tmp_path / "compiled",
        "trainer.max_steps=20",
        "trainer.log_every=1",
        "trainer.compile=default",
    )
    assert len(eager) == len(compiled) == 20
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert s["metrics"]["compile_time_s"] > 0 and s["config"]["trainer"]["compile"] == "default"


def test_prewarm_leaves_the_trained_weights_identical(tmp_path):
    _, plain = losses(tmp_path / "plain", "trainer.max_steps=6", "trainer.prewarm_steps=0")
    _, warmed = losses(tmp_path / "warm", "trainer.max_steps=6", "trainer.prewarm_steps=3")
    assert warmed["metrics"]["prewarm_time_s"] > 0 and plain["metrics"]["prewarm_time_s"] == 0.0
    a = torch.load(tmp_path / "plain" / "model_fp32.pt", weights_only=True)
    b = torch.load(tmp_path / "warm" / "model_fp32.pt", weights_only=True)
    a, b = (s.get("state_dict", s) for s in (a, b))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prewarm_leaves_a_language_model_identical(tmp_path):
    """The LM prewarm (random windows, hidden state from zeros) on copies: the same trained
    weights."""
    plain = run_tiny(tmp_path / "plain", "trainer.max_steps=4", "trainer.prewarm_steps=0", base=LM)
    warmed = run_tiny(tmp_path / "warm", "trainer.max_steps=4", "trainer.prewarm_steps=2", base=LM)
    assert warmed["metrics"]["prewarm_time_s"] > 0 and plain["metrics"]["prewarm_time_s"] == 0.0
    a, b = (
        torch.load(tmp_path / d / "model_fp32.pt", weights_only=True) for d in ("plain", "warm")
    )
    a, b = (s.get("state_dict", s) for s in (a, b))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_peak_is_reset_after_prewarm_and_compile_with_the_copies_freed(tmp_path, monkeypatch):
    """prewarm's throwaway copies must not count in peak_memory_mb: once prewarm and the compile
    warm-up are done, the copies are freed and the device's peak is reset (a counter in place of
    torch.accelerator's reset)."""
    import copy
    import gc
    import weakref

    from mixprec.train import warmup
    from mixprec.train import parts
    copies, events = [], []
    deepcopy = copy.deepcopy

    def watched_copy(obj, memo=None):
        made = deepcopy(obj, memo)
        # run_prewarm's (model, policy)
        if isinstance(made, tuple) and isinstance(made[0], torch.nn.Module):
            copies.extend(weakref.ref(o) for o in made)
        return made
    monkeypatch.setattr(copy, "deepcopy", watched_copy)
    warm_compile = parts.warm_compile
    monkeypatch.setattr(
        parts, "warm_compile", lambda *a, **k: events.append("compiled") or warm_compile(*a, **k)
    )

    def reset(device):
        gc.collect()
        events.append(("reset", str(device), sum(c() is not None for c in copies)))
    monkeypatch.setattr(torch.accelerator, "reset_peak_memory_stats", reset)
    # as on a GPU
    monkeypatch.setattr(parts, "reset_peak", lambda device: warmup.reset_peak(torch.device("cuda")))
    s = run_tiny(tmp_path, "trainer.max_steps=2", "trainer.prewarm_steps=2", base=SMALL)
    assert s["status"] == "completed" and len(copies) == 2
    assert events == ["compiled", ("reset", "cuda", 0)]   # after compile, no copy alive
    warmup.reset_peak(torch.device("cpu"))   # a CPU's peak is its RSS: nothing to reset
    assert len(events) == 2


@pytest.mark.parametrize("overrides, per_step", [
    (["precision=fp32"], 0),                                   # none between log steps
    (["precision=amp_bf16"], 0),
    (["precision=amp"], 1),                                    # GradScaler's found-inf check
    # the fused step's flag: read at the flush
    (["precision=amp", "optimizer.impl=fused"], 0),
    (["precision=fp32", "trainer.on_nonfinite=skip"], 1),      # the loss check before backward
    # GradScaler's check serves the skip policy too
    (["precision=amp", "trainer.on_nonfinite=skip"], 1),
])
def test_host_syncs_per_step(tmp_path, monkeypatch, overrides, per_step):
    counter = SyncCounter(monkeypatch)
    counter.off_during(monkeypatch, loop, "flush")           # the log step's sync, counted apart
    # step 1's input check, once a run, counted apart
    counter.off_during(monkeypatch, Attribution, "see_batch")
    counter.on_during(monkeypatch, loop, "run_epoch")
    s = run_tiny(tmp_path, "trainer.max_steps=6", "trainer.log_every=6", *overrides, base=SMALL)
    assert s["status"] == "completed" and s["metrics"]["steps"] == 6
    assert counter.count == 6 * per_step


def test_one_sync_per_flush_and_fused_skips_read_there(tmp_path, monkeypatch):
    """amp with a fused optimizer and an overflowing first scale (steps skipped): over 8 steps and 2
    log flushes, exactly 2 syncs (one transfer a flush: loop.to_host), none in any step; and the
    skip count, the skipped steps' scales and the scale range come out as GradScaler's own per-step
    check (foreach) gives them."""
    counter = SyncCounter(monkeypatch)
    counter.off_during(monkeypatch, Attribution, "see_batch")  # step 1's input check, once a run
    counter.on_during(monkeypatch, loop, "run_epoch")
    common = [
        "trainer.max_steps=8",
        "trainer.log_every=4",
        "precision=amp",
        "precision.init_scale=1e6",
    ]
    fused = run_tiny(tmp_path / "fused", *common, "optimizer.impl=fused", base=SMALL)
    assert fused["status"] == "completed" and counter.count == 2
    counter.on = False
    plain = run_tiny(tmp_path / "foreach", *common, "optimizer.impl=foreach", base=SMALL)
    assert fused["metrics"]["skipped_steps"] == plain["metrics"]["skipped_steps"] > 0
    assert fused["metrics"]["loss_scale"] == plain["metrics"]["loss_scale"]
    skips = [(e["step"], e["scale"]) for e in fused["numerics"]["skipped_steps"]]
    assert skips == [(e["step"], e["scale"]) for e in plain["numerics"]["skipped_steps"]]
    assert all(e["nonfinite_grads"] is None for e in fused["numerics"]["skipped_steps"])


def test_a_fused_step_under_gradscaler_still_reports_its_skip():
    """A fused optimizer is always called (it skips itself on the device): the policy must read the
    flag."""
    config = validate(
        compose_config(
            "precision=amp", "optimizer=adam", "optimizer.impl=fused", "trainer.device=cpu"
        )
    )
    torch.manual_seed(0)
    policy = PrecisionPolicy(config.precision, torch.device("cpu"))
    model = policy.prepare_model(small_cnn(8, 10))
    opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
    assert opt.param_groups[0]["fused"] is True
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
    before = [p.detach().clone() for p in model.parameters()]
    with policy.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    assert backward_and_step(loss * float("inf"), policy, opt) is True
    assert policy.scale_value == 65536.0 / 2
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad(set_to_none=True)
    with policy.autocast():
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    assert backward_and_step(loss, policy, opt) is False
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_optimizer_impl_and_prewarm_auto():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for impl, fused, foreach in [
        ("auto", None, True),
        ("foreach", None, True),
        ("loop", None, False),
        ("fused", True, None),
    ]:
        config = validate(compose_config("optimizer=sgd", f"optimizer.impl={impl}"))
        group = build_optimizer(config.optimizer, params).param_groups[0]
        assert (group["fused"], group["foreach"]) == (fused, foreach), impl
    config = validate(compose_config())
    assert config.trainer.prewarm_steps == "auto"
    assert config.trainer.prewarm_for("cpu") == 0 and config.trainer.prewarm_for("cuda") == 3
    assert validate(compose_config("trainer.prewarm_steps=2")).trainer.prewarm_for("cpu") == 2
    with pytest.raises(ConfigError, match="prewarm_steps"):
        validate(compose_config("trainer.prewarm_steps=-1"))
    with pytest.raises(ConfigError, match="trainer.compile"):
        validate(compose_config("trainer.compile=fast"))


def test_a_compiled_rnn_is_refused_in_one_line(tmp_path):
    with pytest.raises(SystemExit):
        run_tiny(tmp_path, "trainer.compile=default", base=LM)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (
        "trainer.compile=default with model=lstm: the RNN language models run eagerly" in s["error"]
    )
    assert "\n" not in s["error"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision, optimizer_impl, per_step", [
    ("fp32", "auto", 0), ("amp_bf16", "auto", 0),
    ("amp", "auto", 0),   # auto: fused on CUDA, its found-inf flag read at the flush
    ("amp", "foreach", 1)])
def test_cuda_syncs_per_step(tmp_path, monkeypatch, precision, optimizer_impl, per_step):
    """CUDA's own count: torch.cuda.set_sync_debug_mode("warn") warns at every synchronizing call;
    it is on during the training steps only (not at the window flush, nor at the clock's explicit
    synchronize)."""
    import warnings

    def quiet(original):
        def wrapped(*args, **kwargs):
            was = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                return original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(was)
        return wrapped
    monkeypatch.setattr(loop, "flush", quiet(loop.flush))
    # step 1's input check, once
    monkeypatch.setattr(Attribution, "see_batch", quiet(Attribution.see_batch))
    for name in ("start", "stop", "mark_warm", "now"):   # now: around the ledger's measured step
        monkeypatch.setattr(loop.TrainClock, name, quiet(getattr(loop.TrainClock, name)))
    run_epoch = loop.run_epoch

    def watched(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            return run_epoch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    monkeypatch.setattr(loop, "run_epoch", watched)
    gpu = [o for o in SMALL if o != "trainer.device=cpu" and o != "trainer.deterministic=true"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = run_tiny(
            tmp_path,
            "trainer.max_steps=6",
            "trainer.log_every=6",
            f"precision={precision}",
            f"optimizer.impl={optimizer_impl}",
            "trainer.prewarm_steps=0",
            base=gpu,
        )
    assert s["status"] == "completed"
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 6 * per_step, [str(w.message) for w in syncs[:3]]


def test_the_weights_check_finds_one_bad_element_among_mixed_dtypes():
    """loop.finite_flag: one inf or NaN anywhere, in fp32 or fp16 tensors, is found; fp16 values
    whose squares or sum overflow are not mistaken for non-finite (an inf-norm, not a 2-norm)."""
    big = torch.full((4096,), 60000.0, dtype=torch.float16)
    tensors = [torch.zeros(3, 3), big, torch.ones(5, dtype=torch.float16), torch.zeros(7)]
    assert loop.finite_flag(tensors).item() == 1.0 and loop.finite_flag([]).item() == 1.0
    for i, bad in [(0, float("nan")), (2, float("inf")), (3, float("-inf")), (1, float("nan"))]:
        broken = [t.clone() for t in tensors]
        broken[i].view(-1)[-1] = bad
        assert loop.finite_flag(broken).item() == 0.0, (i, bad)


def test_the_first_cpu_job_of_a_process_pays_its_one_time_costs_before_the_clock(tmp_path,
                                                                                monkeypatch):
    """The process's first job (a sweep's first) pays the one-time costs (lazy imports and
    initialisation, the allocator's growth) in an untimed prewarm step, not inside its clock; a
    later job of the process has nothing of the kind to pay and prewarms nothing on a CPU."""
    from mixprec.runtime import hardware

    monkeypatch.setattr(hardware, "JOBS_IN_PROCESS", 0)
    first = run_tiny(tmp_path / "first", "trainer.max_steps=2")["metrics"]
    second = run_tiny(tmp_path / "second", "trainer.max_steps=2")["metrics"]
    assert first["prewarm_time_s"] > 0 and second["prewarm_time_s"] == 0.0
    config = validate(compose_config())
    assert config.trainer.prewarm_for("cpu", first_in_process=True) == 1
    assert config.trainer.prewarm_for("cpu") == 0
