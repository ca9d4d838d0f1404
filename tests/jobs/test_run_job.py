"""Real tiny jobs through mixprec.job.run_job on the CPU: records, learning, the non-finite policy,
timing."""
import json

import pytest
from torch import nn

import mixprec.job
import mixprec.train.parts
from mixprec.records import METRICS, SUMMARY
from helpers.expected import small_cnn_flops


class NaNAt(nn.Module):
    """Wraps a model; its `at`-th training forward returns NaN logits (an injected divergence)."""

    def __init__(self, inner, at):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x):
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                out = out * float("nan")
        return out


def inject_nan(monkeypatch, at):
    build = mixprec.train.parts.build_model
    monkeypatch.setattr(mixprec.train.parts, "build_model", lambda cfg, n: NaNAt(build(cfg, n), at))


def read_rows(path):
    return [json.loads(line) for line in (path / METRICS).read_text().splitlines()]


@pytest.mark.slow
def test_tiny_job_writes_complete_records(tiny, tmp_path):
    s = tiny(
        "precision=amp", "trainer.max_steps=null", "trainer.epochs=2", "trainer.warmup_steps=2"
    )
    on_disk = json.loads((tmp_path / SUMMARY).read_text())
    assert on_disk["status"] == s["status"] == "completed"
    assert on_disk["choices"]["precision"] == "amp" and on_disk["choices"]["model"] == "small_cnn"
    assert on_disk["config"]["trainer"]["batch_size"] == 16 and "hydra" not in on_disk["config"]
    for key in (
        "torch",
        "cuda",
        "device_name",
        "capability",
        "tf32_matmul",
        "tf32_cudnn",
        "cudnn_benchmark",
        "git_commit",
    ):
        assert key in on_disk["env"]
    m = on_disk["metrics"]
    assert m["steps"] == 8 and m["epochs"] == 2.0 and len(m["epoch_times_s"]) == 2
    assert m["train_time_s"] == pytest.approx(sum(m["epoch_times_s"]))
    assert not m["throughput_includes_warmup"]   # its value: test_promises.py, with a fake clock
    # Linux: VmHWM reset at the job's start (runtime/hardware.py)
    assert m["peak_memory_kind"] == "process_rss_since_job_start" and m["skipped_steps"] == 0
    assert m["loss_scale"] == {"min": 65536.0, "max": 65536.0, "final": 65536.0}
    rows = read_rows(tmp_path)
    epochs = [r for r in rows if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2] and epochs[-1]["test_acc"] == m["final_test_acc"]
    assert m["best_test_acc"] == max(r["test_acc"] for r in epochs)
    assert [r["epoch_time_s"] for r in epochs] == m["epoch_times_s"]
    assert not list(tmp_path.glob(".summary.json.*"))   # the atomic write left no temp file


@pytest.mark.slow
def test_synthetic_data_is_learnable(tiny):
    s = tiny(
        "dataset.train_size=512",
        "dataset.test_size=256",
        "trainer.max_steps=null",
        "trainer.epochs=3",
        "model.width=16",
        "trainer.batch_size=32",
    )
    assert s["metrics"]["final_test_acc"] > 0.5   # chance is 0.1


@pytest.mark.slow
def test_same_seed_same_metrics_on_cpu(tmp_path):
    from helpers import run_tiny

    runs = [
        run_tiny(
            tmp_path / name, "trainer.deterministic=true", "trainer.max_steps=4", f"seed={seed}"
        )
        for name, seed in (("a", 3), ("b", 3), ("c", 4))
    ]
    keys = ("final_test_acc", "final_test_loss", "steps")
    assert [runs[0]["metrics"][k] for k in keys] == [runs[1]["metrics"][k] for k in keys]
    losses = [[r["loss"] for r in read_rows(tmp_path / n) if r["kind"] == "train"] for n in "abc"]
    assert losses[0] == losses[1] and losses[0] != losses[2]


def test_injected_nan_stops_the_run_as_diverged(tiny, tmp_path, monkeypatch):
    inject_nan(monkeypatch, at=3)
    s = tiny("trainer.max_steps=8", "trainer.log_every=2")
    on_disk = json.loads((tmp_path / SUMMARY).read_text())
    assert on_disk["status"] == "diverged"
    assert on_disk["nonfinite"]["step"] == 3 and on_disk["nonfinite"]["policy"] == "stop"
    assert "step 3" in on_disk["reason"]
    assert on_disk["metrics"]["steps"] == 4 and on_disk["metrics"]["final_test_acc"] is None
    assert s["status"] == "diverged"


def test_skip_policy_skips_the_nonfinite_step(tiny, monkeypatch):
    inject_nan(monkeypatch, at=3)
    s = tiny("trainer.max_steps=6", "trainer.on_nonfinite=skip")
    assert s["status"] == "completed" and s["nonfinite"]["step"] == 3
    assert s["metrics"]["nonfinite_steps"] == 1 and s["metrics"]["final_test_acc"] is not None


def test_continue_policy_records_and_goes_on(tiny, monkeypatch):
    inject_nan(monkeypatch, at=2)
    s = tiny("trainer.max_steps=6", "trainer.on_nonfinite=continue", "trainer.log_every=3")
    n = s["nonfinite"]
    assert s["status"] == "completed" and (n["step"], n["policy"]) == (2, "continue")
    # the probe's attribution follows: the NaN came from the loss, so replaying the forward finds
    # the weights that step 2's NaN update spoiled (probe.py)
    assert n["what"].startswith("loss became nan at step 2; first non-finite: ") and n[
        "what"
    ].endswith(" weights")


def test_a_failing_job_still_writes_its_summary(tiny, tmp_path, monkeypatch):
    def broken(cfg, n):
        raise RuntimeError("the model could not be built")
    monkeypatch.setattr(mixprec.train.parts, "build_model", broken)
    with pytest.raises(SystemExit) as e:
        tiny()
    assert e.value.code == 1
    s = json.loads((tmp_path / SUMMARY).read_text())
    assert (
        s["status"] == "failed"
        and "the model could not be built" in s["error"]
        and "Traceback" in s["traceback"]
    )


def test_time_to_target_is_training_time_until_first_reached(tiny):
    s = tiny("trainer.max_steps=null", "trainer.epochs=2", "trainer.target_acc=0.01")
    m = s["metrics"]
    assert m["epochs_to_target"] == 1 and m["time_to_target_s"] == pytest.approx(
        m["epoch_times_s"][0]
    )


def test_a_gpu_profile_that_does_not_match_is_reported_not_used(tiny):
    s = tiny("gpu=h100")
    assert s["gpu_profile"]["matched"] is False and "not used" in s["gpu_profile"]["note"]
    assert s["metrics"]["mfu"] is None
    assert s["metrics"]["train_flops_per_sample"] == pytest.approx(3 * small_cnn_flops(8))
