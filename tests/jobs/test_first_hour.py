"""A first hour that teaches: every long job talks, every stop is recorded. Evaluation that can be
capped (trainer.eval_batches) and stopped by a signal; a job whose process died reads `killed`; a
line per log window without a terminal; the GPT's default optimizer (AdamW); W&B offline says where
its run is; a job that fails before training says so once and makes no folder; a smoke run on every
dataset; reproduce.py's --plan/--estimate and check_quotes.py saying what they need."""
import json
import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import mixprec.train.parts
from mixprec import records
from mixprec.config import validate_job
from mixprec.records import SUMMARY
from mixprec.report import plots
from mixprec.report.analyse import Group
from mixprec.report.load import Job, load_jobs
from mixprec.train.loop import EvalStopped, Scored
from helpers import compose_config, load_script, ROOT, run_cli, run_tiny
from helpers.official_formats import UNREACHABLE


# ------------------------------------------------------------------------------ 6: eval_batches


def test_eval_batches_caps_an_image_jobs_evaluation_and_says_so(tmp_path):
    s = run_tiny(tmp_path, "dataset.test_size=64", "trainer.eval_batch_size=16",
                 "trainer.eval_batches=2")
    assert s["status"] == "completed"
    assert s["metrics"]["eval_batches"] == 2 and s["epochs"][-1]["eval_samples"] == 32
    whole = run_tiny(tmp_path / "whole", "dataset.test_size=64", "trainer.eval_batch_size=16")
    assert whole["metrics"]["eval_batches"] is None and whole["epochs"][-1]["eval_samples"] == 64
    from mixprec.report.console import job_block

    assert ("evaluation  eval: 2 batches (evenly spaced) of each split: not the whole split's"
            in job_block(s))
    assert "evaluation  " not in job_block(whole)


def test_eval_batches_caps_a_language_models_evaluation(tmp_path):
    base = ["model=lstm", "dataset=synthetic_text", "dataset.vocab_size=40",
            "dataset.train_size=400", "dataset.test_size=400", "model.emsize=8", "model.nhid=8",
            "trainer.batch_size=4", "trainer.eval_batch_size=4", "dataset.bptt=5",
            "trainer.max_steps=2", "logger=none", "trainer.device=cpu", "optimizer=sgd"]
    s = run_tiny(tmp_path, "trainer.eval_batches=3", base=base)
    assert s["status"] == "completed" and s["metrics"]["eval_batches"] == 3
    # 3 windows of 5 tokens on 4 columns, per split
    assert s["epochs"][-1]["eval_tokens"] == {"valid": 60, "test": 60}


def test_eval_batches_of_an_image_job_are_spread_over_a_split_stored_by_class():
    """A test split stored by class (the JPEG copy of CIFAR-10: its first 1,000 images class 0)
    scored on its first batches gives the accuracy of one class; an image job's capped evaluation
    takes batches evenly spaced over the split, a language model's its first (consecutive)."""
    from types import SimpleNamespace

    from mixprec.train.loop import Scored

    loop = SimpleNamespace(trainer=SimpleNamespace(eval_batches=4), stop=lambda: None)
    by_class = [(torch.zeros(1), torch.full((8,), c)) for c in range(10) for _ in range(3)]
    spread = [int(y[0]) for _, y in Scored(by_class, loop, spread=True)]
    assert spread == [0, 2, 5, 7] and len(set(spread)) == 4
    assert [int(y[0]) for _, y in Scored(by_class, loop)] == [0, 0, 0, 1]


def test_eval_batches_is_said_in_the_sweep_table():
    from mixprec.report.analyse import sweep_rows

    summary = {"status": "completed", "choices": {"model": "small_cnn", "precision": "fp32"},
               "config": {"trainer": {"eval_batches": 2}}, "metrics": {"eval_batches": 2}}
    assert "eval: 2 batches (evenly spaced)" in sweep_rows([summary])[0]["note"]


def test_eval_batches_below_one_is_refused():
    with pytest.raises(Exception, match=r"trainer.eval_batches=0: must be an integer >= 1"):
        validate_job(compose_config("trainer.eval_batches=0"))


# --------------------------------------------------------- 7: a stop signal during evaluation


class SignalInEval(nn.Module):
    """Wraps a model; its first evaluation forward after training began sends this process SIGTERM
    (torchrun's, as the ranks evaluate), when armed. Counts those evaluation forwards."""

    def __init__(self, inner, armed=True):
        super().__init__()
        self.inner, self.armed, self.trained, self.eval_calls = inner, armed, False, 0

    def forward(self, x):
        self.trained = self.trained or self.training
        if self.trained and not self.training:
            self.eval_calls += 1
            if self.eval_calls == 1 and self.armed:
                os.kill(os.getpid(), signal.SIGTERM)
        return self.inner(x)


def test_a_stop_signal_during_evaluation_stops_it_and_resume_evaluates(tmp_path, monkeypatch):
    args = ["dataset.test_size=64", "trainer.eval_batch_size=16"]
    build = mixprec.train.parts.build_model
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: SignalInEval(build(cfg, n), armed=False))
    reference = run_tiny(tmp_path / "reference", *args)
    seen = []
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: seen.append(SignalInEval(build(cfg, n))) or seen[-1])
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path / "run", *args)
    assert e.value.code == 128 + signal.SIGTERM
    s = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert s["status"] == "interrupted" and "during evaluation" in s["reason"], s.get("reason")
    assert seen[-1].eval_calls <= 2   # stopped between batches, not after 4 (and TTA's 4 more)
    # the checkpoint's keys are the wrapper's
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: SignalInEval(build(cfg, n), armed=False))
    resumed = run_tiny(tmp_path / "run", *args, "trainer.resume=auto")
    assert resumed["status"] == "completed"
    assert resumed["metrics"]["final_test_acc"] == reference["metrics"]["final_test_acc"]
    assert resumed["metrics"]["final_test_loss"] == reference["metrics"]["final_test_loss"]
    assert len(resumed["epochs"]) == len(reference["epochs"]) == 1


def test_scored_takes_the_first_batches_and_stops_between_them_on_the_agreed_flag():
    """loop.Scored: the first trainer.eval_batches batches; loop.stop (the ranks' agreed flag under
    DDP/FSDP: every rank reads it at the same batch) read before each one."""
    batches = [(torch.zeros(2), torch.zeros(4)) for _ in range(5)]
    flags = iter([None, None, "SIGTERM"])
    capped = SimpleNamespace(trainer=SimpleNamespace(eval_batches=2), stop=lambda: None)
    scored = Scored(batches, capped)
    assert len(list(scored)) == 2 and scored.count == 8
    stopped = SimpleNamespace(trainer=SimpleNamespace(eval_batches=None), stop=lambda: next(flags))
    seen = []
    with pytest.raises(EvalStopped, match="SIGTERM"):
        seen.extend(Scored(batches, stopped))
    assert len(seen) == 2


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_running_summary_whose_process_is_gone_reads_killed(tmp_path):
    s = run_tiny(tmp_path / "job")
    # recorded at the start: the process to look for
    assert s["process"] == {"pid": os.getpid(), "host": socket.gethostname()}
    running = {**s, "status": "running", "process": {"pid": dead_pid(),
                                                     "host": socket.gethostname()}}
    assert records.status(running) == "killed"
    assert "killed" in records.reason(running) and str(running["process"]["pid"]) in \
        records.reason(running)
    alive = {**running, "process": {"pid": os.getpid(), "host": socket.gethostname()}}
    elsewhere = {**running, "process": {"pid": dead_pid(), "host": "another-host"}}
    assert records.status(alive) == records.status(elsewhere) == "running"


def test_a_killed_job_is_listed_killed_with_its_reason_and_not_plotted(tmp_path):
    s = run_tiny(tmp_path / "job", "trainer.max_steps=4", "trainer.log_every=1")
    (tmp_path / "job" / SUMMARY).write_text(json.dumps(
        {**s, "status": "running", "process": {"pid": dead_pid(), "host": socket.gethostname()}}))
    jobs, problems = load_jobs([tmp_path / "job" / SUMMARY])
    (job,) = jobs
    assert job.status == "killed" and not problems
    group = Group("small_cnn", "", "fp32", [job])
    assert plots._curves([group]) == [] and plots._loss_scale_traces([group]) == []
    done = Job(tmp_path / "job", s)
    assert plots._curves([Group("small_cnn", "", "fp32", [done])])   # the completed one is


# ------------------------------------------------------------------- 8: a line per log window


def test_without_a_terminal_each_log_window_prints_a_line_and_train_log_has_it(tmp_path):
    r = run_cli("model=small_cnn", "model.width=8", "dataset.train_size=64",
                "dataset.test_size=32", "trainer.batch_size=16", "trainer.max_steps=4",
                "trainer.log_every=2", "logger=none", "trainer.device=cpu",
                f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"], r.stdout
    assert all("loss" in line and "samples/s" in line and "loss scale" in line for line in lines)
    log = (tmp_path / "train.log").read_text()
    assert "step 2/4" in log and "step 4/4" in log


# --------------------------------------------------------------------- 9: the GPT's optimizer


def test_the_gpt_trains_with_adamw_and_its_decay_groups_by_default():
    assert compose_config("model=gpt").optimizer.name == "adamw"
    assert compose_config("model=gpt", "optimizer=sgd").optimizer.name == "sgd"
    assert compose_config("model=resnet18").optimizer.name == "sgd"
    assert compose_config("experiment=apex_word_lm").optimizer.name == "sgd"
    cfg = validate_job(compose_config("model=gpt", "dataset=synthetic_text"))
    assert cfg.optimizer.name == "adamw" and cfg.optimizer.decay == "auto"


# ---------------------------------------------------------------------- 10: W&B offline


def test_wandb_offline_says_where_its_run_is_and_how_to_sync_it(tmp_path, capsys):
    pytest.importorskip("wandb")
    s = run_tiny(tmp_path, "logger=wandb", "logger.mode=offline", "logger.project=mine")
    said = capsys.readouterr()
    run_dir = s["wandb"]["dir"]
    assert f"wandb sync {run_dir}" in said.out + said.err
    assert "logger" not in s["wandb"]["name"] and "model=small_cnn" in s["wandb"]["name"]


# -------------------------------------------------------- 11: a job that fails before training


def test_a_job_failing_before_training_says_it_once_and_makes_no_folder(tmp_path):
    typo = tmp_path / "dtaa" / "cifar"
    r = run_cli("dataset=cifar10", f"dataset.data_dir={typo}", f"dataset.urls=[{UNREACHABLE}]",
                "model=small_cnn", "logger=none", "trainer.device=cpu",
                f"hydra.run.dir={tmp_path / 'run'}")
    said = r.stdout + r.stderr
    assert r.returncode == 1 and "None steps" not in said, said
    assert said.count("CIFAR-10 not found in") == 1, said
    assert "does not exist" in said
    assert not (tmp_path / "dtaa").exists()


# --------------------------------------------------------------- 13: a smoke run on any dataset


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100", "synthetic"])
def test_a_smoke_run_composes_on_every_image_dataset(dataset):
    cfg = validate_job(compose_config("experiment=smoke", f"dataset={dataset}"))
    if dataset == "synthetic":   # as before: 2 epochs of 512 images
        assert cfg.dataset.train_size == 512 and cfg.trainer.max_steps is None
    else:   # real splits are whole: a few steps and a few evaluation batches
        assert cfg.trainer.max_steps and cfg.trainer.eval_batches


@pytest.mark.parametrize("dataset", ["wikitext2", "synthetic_text"])
def test_a_smoke_run_composes_on_text_with_a_language_model(dataset):
    cfg = validate_job(compose_config("experiment=smoke", f"dataset={dataset}", "model=lstm"))
    assert cfg.trainer.max_steps and cfg.trainer.eval_batches


def test_a_sweep_over_synthetic_and_cifar_takes_a_data_dir():
    for name in ("synthetic", "synthetic_text"):
        cfg = compose_config(f"dataset={name}", "dataset.data_dir=/data")
        assert cfg.dataset.data_dir == "/data"


# ------------------------------------------------------------ 12: reproduce.py --plan, --estimate


def test_reproduce_help_says_plan_runs_calibration_jobs():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--help"],
                       capture_output=True, text=True)
    text = " ".join(r.stdout.split())
    assert "the calibration runs jobs" in text and "11 min" in text, text
    docs = " ".join((ROOT / "docs" / "reproduce.md").read_text().split())
    assert "`--plan` runs jobs" in docs and "--estimate h100 --budget 30m" in docs


def test_a_calibration_job_that_gave_no_time_says_why():
    from mixprec.tools.plan import untimed_reason

    diverged = {"status": "diverged", "nonfinite": {"step": 1}, "metrics": {"steps": 1}}
    short = {"status": "completed", "metrics": {"steps": 2, "warmup_steps": 2,
                                                "throughput_includes_warmup": True}}
    failed = {"status": "failed", "error": "data error: CIFAR-10 not found\nmore"}
    assert untimed_reason(diverged) == "diverged at step 1"
    assert untimed_reason(short).startswith("too few steps (2, with 2 of warm-up")
    assert untimed_reason(failed) == "failed: data error: CIFAR-10 not found"
    from mixprec.tools.state import plan_rows

    entry = {"article": "a", "name": "s", "jobs": 1, "planned_jobs": 1, "epochs": "1",
             "predicted_s": 60.0, "prediction": "estimate", "untimed": "diverged at step 1",
             "cuts": [], "dropped": False}
    _, rows = plan_rows({"sweeps": [entry]}, actual=False)
    assert "(estimate: diverged at step 1)" in rows[0][4]


def test_estimate_with_a_budget_says_what_would_be_cut_where(monkeypatch, capsys):
    """--estimate --budget: the plan's cuts applied to the FLOP minutes (stubbed here: a minute per
    job and epoch, so that the cuts' effect is plain); the real FLOP count is the slow test's."""
    from mixprec.tools.sweeps import job_configs

    reproduce = load_script("reproduce")

    def minute_per_job_epoch(plan, args, sweep, peaks):
        configs = job_configs(plan, sweep, args)
        secs = 0.0 if sweep.dropped else sum(60.0 * c["trainer"]["epochs"] for c in configs)
        return {p: secs for p in peaks}

    monkeypatch.setattr("mixprec.tools.estimate.flop_seconds", minute_per_job_epoch)
    assert reproduce.main(["--estimate", "v100", "--budget", "8m", "--only", "opt_levels"]) == 0
    out = capsys.readouterr().out
    cut = out[out.index("--budget 8m on v100"):]
    assert "epochs 3->1" in cut and "OVER BUDGET" not in cut, cut
    uncut = reproduce.main(["--estimate", "v100", "--only", "opt_levels"])
    assert uncut == 0 and "--budget" not in capsys.readouterr().out


@pytest.mark.slow
def test_estimate_with_a_budget_cuts_the_flop_minutes(capsys):
    reproduce = load_script("reproduce")
    assert reproduce.main(["--estimate", "v100", "--budget", "80s", "--only", "half_pitfalls"]) == 0
    out = capsys.readouterr().out
    assert "--budget 80s on v100" in out and "epochs 2->1" in out and "OVER BUDGET" not in out


# ------------------------------------------------------------------------ 15: check_quotes.py


def test_check_quotes_help_and_docs_name_every_source_text_and_where_it_is_read():
    from mixprec.report.published import load_sources

    seeds = [d.seed for s in load_sources() for d in s.documents.values() if d.seed]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_quotes.py"), "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "not in the repository" in r.stdout, r.stdout
    listed = [line for line in r.stdout.splitlines() if line.strip().startswith(tuple(seeds))]
    assert len(listed) == len(seeds) == 4
    assert all("from http" in line or "find it by the title" in line for line in listed)
    docs = (ROOT / "docs" / "sources" / "README.md").read_text()
    assert all(f"`{seed}`" in docs for seed in seeds) and "check_quotes.py" in docs
