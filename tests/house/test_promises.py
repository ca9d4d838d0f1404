"""The headline numbers a job records, each against a value computed independently of the code that
records it: a fake clock for throughput and time to target, the torch flags for TF32, `resource` for
peak memory, the pitfalls' own arithmetic. Real tiny jobs on the CPU (trainer.device=cpu), read back
from summary.json and metrics.jsonl."""
import json
import resource

import pytest
import torch
from torch import nn

import mixprec.train.parts
from helpers import TINY, compose_config, run_tiny
from helpers.fakes import STEPS_PER_EPOCH, with_clock
from mixprec.config import validate
from mixprec.data import build_image_data
from mixprec.models import small_cnn
from mixprec.precision import modes

CPU = ["trainer.device=cpu"]


def rows(run_dir, kind):
    return [
        r
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == kind
    ]


# --------------------------------------------------------------------------------------- throughput


@pytest.mark.slow
def test_throughput_leaves_out_exactly_the_warmup_steps(tmp_path, monkeypatch):
    # 8 steps of 16 samples; the 3 warm-up steps take 10 s each, the 5 others 1 s each:
    # steady throughput = 5 * 16 samples / 5 s = 16 samples/s (warm-up counted: 128 / 35 s = 3.7;
    # one step too few left out: 96 / 15 s = 6.4; one too many: 64 / 4 s = 16 as well, but 4 s is
    # not 5 s)
    with_clock(monkeypatch, cost=lambda k: 10.0 if k <= 3 else 1.0)
    s = run_tiny(
        tmp_path, *CPU, "trainer.max_steps=null", "trainer.epochs=2", "trainer.warmup_steps=3"
    )
    m = s["metrics"]
    assert m["steps"] == 8 and m["warmup_steps"] == 3 and not m["throughput_includes_warmup"]
    assert m["throughput"] == pytest.approx(16.0, rel=1e-9)
    assert m["train_time_s"] == pytest.approx(3 * 10.0 + 5 * 1.0, rel=1e-9)
    assert m["epoch_times_s"] == pytest.approx([3 * 10.0 + 1.0, 4 * 1.0], rel=1e-9)


def test_throughput_leaves_out_exactly_the_warmup_steps_in_one_epoch(tmp_path, monkeypatch):
    # the quick loop's guard of the promise above: 4 steps of 16 samples; the 2 warm-up steps take
    # 10 s each, the 2 others 1 s each: steady throughput = 2 * 16 / 2 s = 16 samples/s (warm-up
    # counted: 64 / 22 s = 2.9; one step too few left out: 48 / 12 s = 4; one too many: 16 / 1 s =
    # 16 as well, but 1 s is not 2 s)
    with_clock(monkeypatch, cost=lambda k: 10.0 if k <= 2 else 1.0)
    s = run_tiny(
        tmp_path, *CPU, "trainer.max_steps=null", "trainer.epochs=1", "trainer.warmup_steps=2"
    )
    m = s["metrics"]
    assert m["steps"] == 4 and m["warmup_steps"] == 2 and not m["throughput_includes_warmup"]
    assert m["throughput"] == pytest.approx(16.0, rel=1e-9)
    assert m["train_time_s"] == pytest.approx(2 * 10.0 + 2 * 1.0, rel=1e-9)


def test_too_few_steps_for_a_warmup_count_every_sample(tmp_path, monkeypatch):
    with_clock(monkeypatch, cost=lambda k: 2.0)
    s = run_tiny(tmp_path, *CPU, "trainer.max_steps=3", "trainer.warmup_steps=5")
    m = s["metrics"]
    assert m["throughput_includes_warmup"] and m["throughput"] == pytest.approx(
        3 * 16 / (3 * 2.0), rel=1e-9
    )


# ----------------------------------------------------------------------------------- time to target


@pytest.mark.slow
def test_time_to_target_sums_the_epochs_until_the_target_is_first_reached(tmp_path, monkeypatch):
    """4 epochs; each step of epoch e costs e seconds (epochs of 4, 8, 12, 16 s). The evaluation
    answers class 10, which no label has, until 3 epochs are done, then always the test set's most
    common class: accuracy 0, 0, f, f with f counted here from the labels. Target 0.05: first
    reached after epoch 3, at 4 + 8 + 12 = 24 s."""
    cfg = validate(compose_config(*TINY, *CPU))
    labels = build_image_data(cfg.dataset).test_y
    top = int(torch.bincount(labels, minlength=10).argmax())
    share = (labels == top).float().mean().item()
    assert share > 0.05

    def answer(x, trained_steps):
        out = torch.zeros(len(x), 11)
        out[:, 10 if trained_steps < 3 * STEPS_PER_EPOCH else top] = 1.0
        return out

    with_clock(monkeypatch, cost=lambda k: float((k - 1) // STEPS_PER_EPOCH + 1), eval_out=answer)
    s = run_tiny(
        tmp_path, *CPU, "trainer.max_steps=null", "trainer.epochs=4", "trainer.target_acc=0.05"
    )
    m = s["metrics"]
    assert [r["test_acc"] for r in rows(tmp_path, "epoch")] == pytest.approx(
        [0.0, 0.0, share, share]
    )
    assert m["epochs_to_target"] == 3
    assert m["time_to_target_s"] == pytest.approx(4.0 + 8.0 + 12.0, rel=1e-9)
    assert m["best_test_acc"] == pytest.approx(share) and m["final_test_acc"] == pytest.approx(
        share
    )


def test_time_to_target_is_the_time_of_the_epochs_until_it_is_reached(tmp_path, monkeypatch):
    """The quick loop's guard of the promise above: 2 epochs of 4 and 8 s; accuracy 0 after epoch 1
    (class 10, which no label has), then the test set's most common class: target 0.05 first reached
    after epoch 2, at 12 s."""
    cfg = validate(compose_config(*TINY, *CPU))
    labels = build_image_data(cfg.dataset).test_y
    top = int(torch.bincount(labels, minlength=10).argmax())
    share = (labels == top).float().mean().item()
    assert share > 0.05

    def answer(x, trained_steps):
        out = torch.zeros(len(x), 11)
        out[:, 10 if trained_steps < STEPS_PER_EPOCH + 1 else top] = 1.0
        return out

    with_clock(monkeypatch, cost=lambda k: float((k - 1) // STEPS_PER_EPOCH + 1), eval_out=answer)
    s = run_tiny(
        tmp_path, *CPU, "trainer.max_steps=null", "trainer.epochs=2", "trainer.target_acc=0.05"
    )
    m = s["metrics"]
    assert [r["test_acc"] for r in rows(tmp_path, "epoch")] == pytest.approx([0.0, share])
    assert m["epochs_to_target"] == 2 and m["time_to_target_s"] == pytest.approx(
        4.0 + 8.0, rel=1e-9
    )


# --------------------------------------------------------------------------------------------- TF32


@pytest.fixture
def restore_math_flags():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# The precision table of the README: TF32 tensor cores for tf32 only among the fp32-math modes.
TF32_ON = {"fp32": False, "tf32": True, "o0": False}


@pytest.mark.parametrize("precision", sorted(TF32_ON))
def test_configure_sets_tf32_for_matmul_and_cudnn(precision, restore_math_flags):
    want = TF32_ON[precision]
    c = validate(compose_config(f"precision={precision}", *CPU))
    # the opposite beforehand
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not want
    modes.configure(torch.device("cpu"), c.trainer, c.precision, c.seed)
    assert torch.backends.cuda.matmul.allow_tf32 is want
    assert torch.backends.cudnn.allow_tf32 is want


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_the_job_records_the_tf32_flags_it_ran_with(tmp_path, precision, restore_math_flags):
    want = TF32_ON[precision]
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = not want
    run_tiny(tmp_path, *CPU, f"precision={precision}")
    env = json.loads((tmp_path / "summary.json").read_text())["env"]
    assert env["tf32_matmul"] is want and env["tf32_cudnn"] is want
    # what the job's math ran with, still set at its end
    assert torch.backends.cuda.matmul.allow_tf32 is want


# -------------------------------------------------------------------------------------- peak memory


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_cpu_peak_memory_is_the_jobs_peak_rss(tmp_path, monkeypatch):
    """A job whose model holds an extra 256 MB buffer (touched, so resident) reports a peak at least
    the resident size before the job plus 256 MB, and no more than the process's peak read from
    `resource` after it: the process's peak RSS since the job's start (an earlier job's peak is not
    its own:
    tests/unit/runtime/test_hardware.py::test_a_cpu_jobs_peak_is_its_own_not_an_earlier_jobs)."""
    extra = 256
    build = mixprec.train.parts.build_model

    def with_buffer(cfg, n, **kw):
        model = build(cfg, n, **kw)
        model.register_buffer("ballast", torch.ones(extra * 2**20 // 4), persistent=False)
        return model

    monkeypatch.setattr(mixprec.train.parts, "build_model", with_buffer)
    before = rss_mb()
    s = run_tiny(tmp_path, *CPU)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m = s["metrics"]
    assert m["peak_memory_kind"] == "process_rss_since_job_start"
    # VmHWM and ru_maxrss read the kernel's per-thread RSS counters at different moments (they are
    # folded in every 64 page faults a thread): within 1 MB of each other
    assert before + 0.95 * extra <= m["peak_memory_mb"] <= after + 1


# ----------------------------------------------------------------------------------------- pitfalls


@pytest.mark.parametrize(
    "case", ["adam_fp16_eps1e4", pytest.param("adam_amp", marks=pytest.mark.slow)]
)
def test_the_fixes_loss_falls(tmp_path, case):
    """The fixed Adam cases train: the mean loss of the last 4 of 12 logged steps is below that of
    the first 4."""
    s = run_tiny(
        tmp_path,
        *CPU,
        f"pitfall={case}",
        "trainer.max_steps=12",
        "trainer.epochs=3",
        "trainer.log_every=1",
        "dataset.image_size=8",
        "schedule=constant",
    )
    assert s["status"] == "completed"
    losses = [r["loss"] for r in rows(tmp_path, "train")]
    assert len(losses) == 12
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.05, losses


def first_nonfinite_step_by_hand(lr: float, steps: int = 6) -> int | None:
    """Pure fp16 Adam at eps=1e-8 written out with torch.optim on the same small CNN: the first step
    after which a weight is not finite (the second moment of a small gradient underflows to 0 in
    fp16, and m / (0 + 0) is inf)."""
    torch.manual_seed(0)
    model = small_cnn(8, 10).half()
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-8)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 3, 32, 32).half(), torch.randint(0, 10, (16,))
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            return step
    return None


def test_the_diverged_pitfall_names_the_step_it_diverged_at(tmp_path):
    c = validate(compose_config(*TINY, *CPU, "pitfall=adam_fp16"))
    expected = first_nonfinite_step_by_hand(c.optimizer.lr)
    assert expected is not None
    s = run_tiny(tmp_path, *CPU, "pitfall=adam_fp16", "trainer.max_steps=6", "trainer.log_every=1")
    assert s["status"] == "diverged" and s["nonfinite"]["step"] == expected
    assert f"by step {expected} " in s["reason"] and s["metrics"]["steps"] == expected
