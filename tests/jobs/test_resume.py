"""Checkpoints and resume: killed jobs continue exactly, sweeps survive a failing job, bad files
give one clear line."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import mixprec.train.loop
import mixprec.job
import mixprec.train.parts
from helpers import ROOT, TINY, compose_config, run_tiny
from helpers.fakes import SignalAt
from mixprec.train.checkpoint import CHECKPOINT, WEIGHTS, load_fp32_model
from mixprec.config import validate
from mixprec.data import DeviceBatches, LoaderBatches, synthetic_images
from mixprec.data.wikitext import TokenWindows, batchify
from mixprec.records import METRICS, SUMMARY

# 64 steps an epoch (about a second on a CPU core): long enough to land a signal in the middle of
# epoch 2.
KILLABLE = [
    "model=small_cnn",
    "model.width=8",
    "dataset.train_size=1024",
    "dataset.test_size=64",
    "trainer.batch_size=16",
    "trainer.eval_batch_size=64",
    "trainer.epochs=2",
    "trainer.deterministic=true",
    "trainer.log_every=4",
    "logger=none",
    "trainer.device=cpu",
]
# A 2-layer LSTM language model, 125 bptt windows an epoch: the same for the shared loop's LM steps.
LM_KILLABLE = [
    "model=lstm",
    "dataset=synthetic_text",
    "dataset.vocab_size=40",
    "dataset.train_size=3004",
    "dataset.test_size=200",
    "dataset.bptt=6",
    "model.emsize=16",
    "model.nhid=16",
    "trainer.batch_size=4",
    "trainer.eval_batch_size=5",
    "schedule=plateau",
    "optimizer.lr=5",
    "optimizer.momentum=0",
    "optimizer.weight_decay=0",
    "trainer.grad_clip=0.25",
    "trainer.epochs=2",
    "trainer.device=cpu",
    "trainer.deterministic=true",
    "trainer.log_every=4",
    "logger=none",
]
TIMING = {"samples_per_s", "tokens_per_s", "epoch_time_s", "train_time_s", "eval_time_s"}
SIZES = [o for o in TINY if not o.startswith(("model", "logger", "trainer.max_steps"))]


def train(*args, wait=True):
    """train.py in a subprocess (one thread: the same math in every process)."""
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src"))
    # set by an in-process W&B run of an earlier test: the job starts its own service
    env.pop("WANDB_SERVICE", None)
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    if wait:
        out, err = p.communicate(timeout=300)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return p


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]


def signal_in_epoch_2(run_dir, sig, *extra, base=KILLABLE, group=False):
    """Start a job, send `sig` once it has logged a training row of epoch 2 (to its whole process
    group if `group`, as `timeout` and Slurm's scancel do), and wait for it to end."""
    p = train(*base, *extra, f"hydra.run.dir={run_dir}", wait=False)
    deadline = time.monotonic() + 240
    while not any(r["kind"] == "train" and r["epoch"] == 2 for r in _rows_so_far(run_dir)):
        assert p.poll() is None, f"the job ended before epoch 2: {p.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    if group:
        os.killpg(p.pid, sig)   # the job leads its own session (train): its group is its pid
    else:
        p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    if sig == signal.SIGKILL:
        kill_wandb_service_of(p.pid)
    return p.returncode, out, err


def kill_wandb_service_of(pid: int) -> None:
    """A pre-emption kills a job with its W&B service (wandb-core --pid <job>); a SIGKILL of the job
    process alone leaves that service running, holding the run id, so do what the pre-emption
    would."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            cmd
            and cmd[0].endswith(b"wandb-core")
            and b"--pid" in cmd
            and cmd[cmd.index(b"--pid") + 1] == str(pid).encode()
        ):
            os.kill(int(proc.name), signal.SIGKILL)


def _rows_so_far(run_dir):
    try:
        lines = (run_dir / METRICS).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in lines if line.endswith("}")]


def assert_same_run(run_dir, reference_dir):
    """Same final metrics, same metrics.jsonl rows (timings aside) and bit-identical final
    weights."""
    a, b = (json.loads((d / SUMMARY).read_text()) for d in (run_dir, reference_dir))
    assert a["status"] == b["status"] == "completed"
    for key in (
        "final_test_acc",
        "final_test_loss",
        "best_test_acc",
        "steps",
        "epochs",
        "skipped_steps",
    ):
        assert a["metrics"][key] == b["metrics"][key], key
    strip = [
        [{k: v for k, v in r.items() if k not in TIMING} for r in rows(d)]
        for d in (run_dir, reference_dir)
    ]
    # every row once, the same values: nothing lost, nothing duplicated
    assert strip[0] == strip[1]
    wa, wb = (torch.load(d / WEIGHTS) for d in (run_dir, reference_dir))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # a resumed job's training time is the sum over all its epochs, before and after
    m = a["metrics"]
    assert len(m["epoch_times_s"]) == 2 and m["train_time_s"] == pytest.approx(
        sum(m["epoch_times_s"])
    )
    assert not (run_dir / CHECKPOINT).exists()   # a completed job keeps only its final weights
    return a


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same job run through in this process, on one thread like the subprocesses."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert run_tiny(run_dir, *KILLABLE, "trainer.max_steps=null")["status"] == "completed"
    finally:
        torch.set_num_threads(threads)
    return run_dir


@pytest.mark.slow
def test_sigkill_in_epoch_2_then_resume_gives_the_uninterrupted_run(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    code, _, _ = signal_in_epoch_2(run_dir, signal.SIGKILL, "logger=wandb")
    assert code == -signal.SIGKILL
    killed = json.loads((run_dir / SUMMARY).read_text())
    # no handler runs on SIGKILL: the start-of-job summary stays
    assert killed["status"] == "running"
    run_id = killed["wandb"]["run_id"]
    assert (
        run_dir / "wandb" / killed["wandb"]["dir"].rsplit("/", 1)[1] / f"run-{run_id}.wandb"
    ).is_file()
    done = rows(run_dir)
    # killed inside epoch 2 ...
    assert [r["epoch"] for r in done if r["kind"] == "epoch"] == [1]
    # ... after some of its steps
    assert any(r["kind"] == "train" and r["epoch"] == 2 for r in done)
    # the epoch-1 checkpoint
    assert torch.load(run_dir / CHECKPOINT, weights_only=True)["loop"]["epoch"] == 1

    r = train(*KILLABLE, "logger=wandb", f"hydra.run.dir={run_dir}", "trainer.resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" in r.stderr and "its last status: running" in r.stderr
    s = assert_same_run(run_dir, uninterrupted)
    assert (
        s["resumed"]["from_step"] == 64
        and s["resumed"]["from_epoch"] == 1.0
        and not s["resumed"]["mid_epoch"]
    )
    # W&B: the same run continues; each process left an offline folder with that id, for `wandb
    # sync` in order
    assert s["wandb"]["run_id"] == run_id and s["wandb"]["dir"] != killed["wandb"]["dir"]
    assert (
        len(
            [
                d
                for d in (run_dir / "wandb").glob(f"offline-run-*-{run_id}")
                if (d / f"run-{run_id}.wandb").is_file()
            ]
        )
        == 2
    )


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_status_interrupted_and_resume_continues(
    tmp_path, uninterrupted
):
    run_dir = tmp_path / "run"
    code, _, err = signal_in_epoch_2(run_dir, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads((run_dir / SUMMARY).read_text())
    assert (
        s["status"] == "interrupted"
        and s["interrupted_by"] == "SIGTERM"
        and "SIGTERM after step" in s["reason"]
    )
    ckpt = torch.load(run_dir / CHECKPOINT, weights_only=True)
    loop = ckpt["loop"]
    # mid-epoch 2, right after the signal's step
    assert loop["epoch"] == 1 and 0 < loop["batch"] < 64
    assert loop["step"] == s["metrics"]["steps"] == 64 + loop["batch"]
    assert "Traceback" not in err
    hint = err.strip().splitlines()[-1]
    assert "To continue: python train.py" in hint and "trainer.resume=auto" in hint
    # the printed command, as a user would paste it
    cmd = shlex.split(hint.split("To continue: ", 1)[1])[2:]

    r = train(*cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    s = assert_same_run(run_dir, uninterrupted)
    assert s["resumed"]["mid_epoch"] and s["resumed"]["from_step"] == loop["step"]
    assert s["resumed"]["previous_status"] == "interrupted"


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_ends_interrupted(tmp_path):
    """`timeout` and scancel signal every process of the job: the DataLoader's workers leave
    stopping to the job, which ends `interrupted` with its checkpoint, as on the device pipeline
    (the H200 run: the workers died of the signal and the job ended `failed`, a RuntimeError raised
    inside the traceback's formatting)."""
    run_dir = tmp_path / "run"
    code, _, err = signal_in_epoch_2(
        run_dir, signal.SIGTERM, "dataset.pipeline=dataloader", "dataset.workers=2", group=True
    )
    assert code == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads((run_dir / SUMMARY).read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == "SIGTERM", s.get("reason")
    assert (run_dir / CHECKPOINT).is_file()
    assert "Traceback" not in err and "killed by signal" not in err


@pytest.mark.parametrize(
    "precision",
    [[], ["precision=apex_fp16", "precision.emulate=true"]],
    ids=["fp32", "emulated_fp16"],
)
@pytest.mark.slow
def test_a_language_model_sigtermed_in_epoch_2_resumes_to_the_uninterrupted_run(
    tmp_path, precision
):
    """The LM steps run in the shared loop: a checkpoint on SIGTERM (the hidden state and the window
    position with it), status interrupted, and trainer.resume=auto ends with the perplexities and
    weights of one run through; the job's notes are in <job dir>/train.log. Emulated fp16 weights
    load too (an LSTM's weak references to its weights once stopped the load that swaps parameters'
    contents)."""
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    base = [*LM_KILLABLE, *precision]
    r = train(*base, f"hydra.run.dir={reference}")
    assert r.returncode == 0, r.stderr[-3000:]
    code, _, err = signal_in_epoch_2(run_dir, signal.SIGTERM, base=base)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads((run_dir / SUMMARY).read_text())
    assert (
        s["status"] == "interrupted"
        and s["interrupted_by"] == "SIGTERM"
        and "SIGTERM after step" in s["reason"]
    )
    loop = torch.load(run_dir / CHECKPOINT, weights_only=True)["loop"]
    assert loop["epoch"] == 1 and 0 < loop["batch"] < 125 and loop["step"] == 125 + loop["batch"]
    log = (run_dir / "train.log").read_text()
    assert "SIGTERM: stopping after this step and writing a checkpoint" in log
    assert "checkpoint saved. To continue: python train.py" in log and "trainer.resume=auto" in log

    r = train(*base, f"hydra.run.dir={run_dir}", "trainer.resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    a = assert_same_run(run_dir, reference)
    b = json.loads((reference / SUMMARY).read_text())
    for key in (
        "final_valid_ppl",
        "final_test_ppl",
        "best_valid_ppl",
        "test_ppl_at_best_valid",
        "final_lr",
        "tokens",
    ):
        assert a["metrics"][key] == b["metrics"][key], key
    assert (
        a["metrics"]["steps"] == 250
        and a["resumed"]["mid_epoch"]
        and a["resumed"]["from_step"] == loop["step"]
    )
    assert (
        f"[mixprec.job][INFO] - mixprec: resuming {run_dir} at step {loop['step']}"
        in (run_dir / "train.log").read_text()
    )


@pytest.mark.parametrize("kind", ["device", "dataloader", "windows"])
@pytest.mark.slow
def test_a_loader_restored_mid_epoch_serves_the_rest_of_the_epoch_and_the_next_as_before(kind):
    """A loader owns its place in the epoch: restored from state_dict() taken after 2 batches of
    epoch 2, it serves exactly the batches the original serves next (augmentation draws included),
    then the same epoch 3."""
    data = synthetic_images(validate(compose_config("dataset.train_size=80")).dataset)
    cpu = torch.device("cpu")
    augment = dict(crop_padding=2, flip=True, cutout=4, seed=3)
    make = {
        "device": lambda: DeviceBatches(
            data.train_x, data.train_y, 16, data.mean, data.std, device=cpu, train=True, **augment
        ),
        "dataloader": lambda: LoaderBatches(
            data.train_x,
            data.train_y,
            16,
            data.mean,
            data.std,
            device=cpu,
            train=True,
            workers=0,
            **augment,
        ),
        "windows": lambda: TokenWindows(batchify(torch.arange(500), 4), 6),
    }[kind]
    original, restored = make(), make()
    list(original)   # epoch 1
    it = iter(original)
    done = [next(it) for _ in range(2)]
    state = original.state_dict()
    assert state["batch"] == 2 and len(done) == 2
    # the global RNG (the DataLoader's workers=0 augmentation) as the checkpoint restores it
    torch.manual_seed(7)
    rest = list(it) + list(original)
    restored.load_state_dict(state)
    torch.manual_seed(7)
    again = list(restored) + list(restored)
    assert len(rest) == len(again) == 2 * len(original) - 2
    assert all(torch.equal(a, b) for pair in zip(rest, again) for a, b in zip(*pair))


@pytest.mark.slow
def test_resume_restores_master_weights_loss_scaler_and_optimizer_exactly(tmp_path, monkeypatch):
    build = mixprec.train.parts.build_model
    # fp16 weights with fp32 masters (apex O2) stepped by Adam, under a dynamic loss scale that
    # grows every 2 steps, overflows and backs off: each piece of state must come back exactly for
    # the same result
    args = [
        "precision=o2",
        "precision.init_scale=524288",
        "precision.growth_interval=2",
        "optimizer=adam",
        "optimizer.lr=0.01",
        "trainer.max_steps=null",
        "trainer.epochs=2",
        "trainer.deterministic=true",
    ]
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: SignalAt(build(cfg, n), at=0))
    reference = run_tiny(tmp_path / "reference", *args)

    # epoch 2, step 2
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: SignalAt(build(cfg, n), at=6))
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path / "run", *args)
    assert e.value.code == 128 + signal.SIGTERM
    assert json.loads((tmp_path / "run" / SUMMARY).read_text())["status"] == "interrupted"
    monkeypatch.setattr(mixprec.train.parts, "build_model",
                        lambda cfg, n: SignalAt(build(cfg, n), at=0))
    resumed = run_tiny(tmp_path / "run", *args, "trainer.resume=auto")
    assert resumed["resumed"]["from_step"] == 6 and resumed["resumed"]["mid_epoch"]
    m, ref = resumed["metrics"], reference["metrics"]
    assert m["loss_scale"] == ref["loss_scale"] and m["skipped_steps"] == ref["skipped_steps"]
    # the scale did back off
    assert 0 < ref["skipped_steps"] < 6 and ref["loss_scale"]["min"] < 524288
    assert_same_run(tmp_path / "run", tmp_path / "reference")


@pytest.mark.slow
def test_sweep_records_a_failing_job_goes_on_and_resume_skips_completed_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "seed=1,2,3", "model=small_cnn", *SIZES, "trainer.epochs=2", "logger=none"]
    # Job 1 fails inside the job, at its very end: its weights file cannot be written (a directory
    # is in the way). Hydra's name for job 1
    job1 = "1_" + compose_config("seed=2", *args[2:]).hydra.job.override_dirname
    (sweep / job1 / WEIGHTS).mkdir(parents=True)
    r = train(*args, f"hydra.sweep.dir={sweep}")
    assert r.returncode == 1, r.stderr[-3000:]
    s = {
        int(p.parent.name.split("_")[0]): json.loads(p.read_text())
        for p in sweep.glob(f"*/{SUMMARY}")
    }
    assert [s[i]["status"] for i in range(3)] == ["completed", "failed", "completed"]
    assert "IsADirectoryError" in s[1]["error"] and "Traceback" in s[1]["traceback"]
    table = r.stdout[r.stdout.index(f"sweep {sweep}: 3 jobs"):].splitlines()
    assert (
        table[4].split()[:3] == ["1", "small_cnn", "fp32"]   # then its swept seed, its status
        and table[4].split()[3].startswith("seed=") and table[4].split()[4] == "failed"
        and "IsADirectoryError" in table[4]
    )
    assert "trainer.resume=auto" in r.stderr and f"hydra.sweep.dir={sweep}" in r.stderr
    done = {
        i: [
            (p.read_bytes(), p.stat().st_mtime_ns)
            for p in (sweep / s[i]["job"]["output_dir"]).iterdir()
            if p.is_file()
        ]
        for i in (0, 2)
    }

    (sweep / job1 / WEIGHTS).rmdir()   # the obstacle is gone: the retry can finish
    r = train(*args, f"hydra.sweep.dir={sweep}", "trainer.resume=auto")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("skipped (trainer.resume=auto") == 2
    # report/: the sweep's report
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name != "report")
    # no new job dirs
    assert jobs == sorted(v["job"]["output_dir"].rsplit("/", 1)[1] for v in s.values())
    # completed jobs: every file byte- and mtime-identical (summary, metrics, weights)
    for i in (0, 2):
        out = sweep / s[i]["job"]["output_dir"]
        assert [
            (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()
        ] == done[i]
    retried = json.loads((sweep / job1 / SUMMARY).read_text())
    assert retried["status"] == "completed" and retried["metrics"]["steps"] == 8
    assert (
        retried["resumed"]["from_epoch"] == 1.0
        and retried["resumed"]["previous_status"] == "failed"
    )
    assert (sweep / job1 / WEIGHTS).is_file() and not (sweep / job1 / CHECKPOINT).exists()
    assert f"sweep {sweep}: 3 jobs" in r.stdout and r.stdout.count("completed") >= 3


def test_a_corrupt_summary_gives_one_line_naming_the_file(tmp_path, capsys):
    run_tiny(tmp_path)
    path = tmp_path / SUMMARY
    path.write_text('{"status": "compl')
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path, "trainer.resume=auto")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mixprec: {path}: not a readable summary.json")
    assert path.read_text() == '{"status": "compl'   # left as it was


def fail_at_the_end(monkeypatch):
    def no_space(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(mixprec.job.checkpoint, "save_weights", no_space)


EPOCHS2 = ["trainer.max_steps=null", "trainer.epochs=2"]


@pytest.fixture(scope="module")
def failed_job(tmp_path_factory):
    """A job that failed after training (its weights could not be written): its epoch-1 checkpoint
    stays."""
    run_dir = tmp_path_factory.mktemp("failed")
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit):
        fail_at_the_end(mp)
        run_tiny(run_dir, *EPOCHS2)
    assert (run_dir / CHECKPOINT).exists()
    return run_dir


@pytest.mark.parametrize("damage,expect", [
    (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "not a readable checkpoint"),
    (lambda p: p.write_bytes(b"\x00garbage" * 100), "not a readable checkpoint"),
    (lambda p: torch.save({"weights": torch.zeros(3)}, p), "not a mixprec checkpoint"),
    # a second, complete job: slow; the refusal of a changed config is in the quick loop below
    pytest.param(None, "written by a different config (optimizer.lr: 0.1 -> 0.05)",
                 marks=pytest.mark.slow),
])
def test_a_bad_checkpoint_gives_one_line_naming_the_file(
    tmp_path, failed_job, capsys, damage, expect
):
    """Refused before any work, in one line (exit status 2, as a config error): the interrupted
    job's records are left as they were, its summary still the one that says how to continue."""
    path = tmp_path / CHECKPOINT
    shutil.copy(failed_job / CHECKPOINT, path)
    interrupted(failed_job, tmp_path)
    args = EPOCHS2 if damage else [*EPOCHS2, "optimizer.lr=0.05"]
    if damage:
        damage(path)
    err, _ = refused(tmp_path, capsys, *args)
    assert err == [f"mixprec: {path}: {expect}" + err[0].split(expect, 1)[1]]
    # trainer.resume=never starts over in the same dir: the records are those of one run
    if damage is None:
        s = run_tiny(tmp_path, *args, "trainer.resume=never")
        assert s["status"] == "completed" and "resumed" not in s and not path.exists()
        assert [r["epoch"] for r in rows(tmp_path) if r["kind"] == "epoch"] == [1, 2]


def interrupted(job_dir, run_dir):
    """job_dir's summary.json and metrics.jsonl into run_dir, its summary made an interrupted
    job's (what a refused resume must leave as it was)."""
    s = json.loads((job_dir / SUMMARY).read_text())
    s.update(status="interrupted", reason="SIGTERM after step 4", stop_signal="SIGTERM",
             interrupted_by="SIGTERM")
    (run_dir / SUMMARY).write_text(json.dumps(s))
    shutil.copy(job_dir / METRICS, run_dir / METRICS)


def test_a_key_a_config_lacks_is_no_change_when_its_value_now_is_the_schemas_default():
    """config_diff: a key (or a whole section) the checkpoint's config lacks is no change when its
    value now is the schema's default; another value is, named with the key."""
    from mixprec.train.checkpoint import config_diff

    old = {"trainer": {"epochs": 2}}
    assert config_diff(old, {"trainer": {"epochs": 2, "replicate": "auto"}}) is None
    assert config_diff(old, {"trainer": {"epochs": 2, "replicate": 2}}) == (
        "trainer.replicate: (not set) -> 2")
    assert config_diff(old, {"trainer": {"epochs": 2}, "probe": {
        "name": "none", "every": 50, "max_skips": 20}}) is None
    assert config_diff(old, {"trainer": {"epochs": 2}, "probe": {"name": "ranges"}}) == (
        'probe: (not set) -> {"name": "ranges"}')
    assert config_diff({"trainer": {"epochs": 2, "replicate": 2}}, old) == (
        "trainer.replicate: 2 -> (not set)")


def refused(run_dir, capsys, *overrides):
    """The job in run_dir under trainer.resume=auto, refused (exit status 2) with the dir's records
    left as they were: its stderr lines and stdout."""
    before = {f: (run_dir / f).read_bytes() for f in (SUMMARY, CHECKPOINT, METRICS)}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_tiny(run_dir, *overrides, "trainer.resume=auto")
    assert e.value.code == 2
    assert {f: (run_dir / f).read_bytes() for f in before} == before
    out, err = capsys.readouterr()
    return err.strip().splitlines(), out


def without(run_dir, key):
    """Remove `key` (dotted) from the config of run_dir's checkpoint and summary.json, as a version
    before that field wrote them."""
    section, name = key.split(".")
    ckpt = torch.load(run_dir / CHECKPOINT, weights_only=True)
    del ckpt["config"][section][name]
    torch.save(ckpt, run_dir / CHECKPOINT)
    s = json.loads((run_dir / SUMMARY).read_text())
    del s["config"][section][name]
    (run_dir / SUMMARY).write_text(json.dumps(s))


def test_a_checkpoint_written_before_a_new_config_field_resumes_bit_for_bit(
    tmp_path, failed_job, through
):
    """trainer.replicate came after the checkpoint: its value now is the schema's default (auto),
    so the job resumes, to the uninterrupted run's weights."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(failed_job, run_dir)
    without(run_dir, "trainer.replicate")
    s = run_tiny(run_dir, *EPOCHS2, "trainer.resume=auto")
    assert s["status"] == "completed" and s["resumed"]["from_step"] == 4
    assert_same_run(run_dir, through)


def test_a_checkpoint_without_a_field_set_otherwise_now_is_refused_as_it_was(
    tmp_path, failed_job, capsys
):
    """The checkpoint's config lacks trainer.eval_batch_size and the job sets 32, not the schema's
    default (256): a change, refused in one line naming the key; the interrupted job's records
    are left as they were."""
    shutil.copy(failed_job / CHECKPOINT, tmp_path / CHECKPOINT)
    interrupted(failed_job, tmp_path)
    without(tmp_path, "trainer.eval_batch_size")
    err, _ = refused(tmp_path, capsys, *EPOCHS2)
    assert len(err) == 1 and err[0].startswith(
        f"mixprec: {tmp_path / CHECKPOINT}: written by a different config "
        "(trainer.eval_batch_size: (not set) -> 32)"), err


def test_a_resume_on_another_world_size_is_refused_before_any_work(tmp_path, failed_job, capsys):
    """A checkpoint of 2 ranks (one RNG state each) resumed by one process: one line naming both
    world sizes and the command, before any work (no summary block); the interrupted job's
    records are left as they were."""
    shutil.copy(failed_job / CHECKPOINT, tmp_path / CHECKPOINT)
    interrupted(failed_job, tmp_path)
    ckpt = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    ckpt["rng"] = ckpt["rng"] * 2
    torch.save(ckpt, tmp_path / CHECKPOINT)
    err, out = refused(tmp_path, capsys, *EPOCHS2)
    assert err == [
        f"mixprec: {tmp_path / CHECKPOINT}: written by 2 rank(s), this job has 1; resume with as "
        "many ranks (torchrun --nproc_per_node=2), or delete it to start over"]
    assert "status" not in out   # no summary block: nothing ran


def test_an_older_default_batch_resumes_with_its_batch_and_says_so(tmp_path, caplog):
    """The default batch moved (64 on CUDA, then 256; here the CPU default 16, then 64) between a
    run and its resume: a job that never set the batch resumes with its checkpoint's."""
    from mixprec.runtime import defaults

    base = [o for o in TINY if not o.startswith(("trainer.batch_size", "trainer.max_steps"))]
    with pytest.MonkeyPatch.context() as mp, pytest.raises(SystemExit):
        mp.setattr(defaults, "CPU_BATCH", 16)   # the default when the job ran
        fail_at_the_end(mp)
        run_tiny(tmp_path, *EPOCHS2, base=base)
    assert json.loads((tmp_path / SUMMARY).read_text())["config"]["trainer"]["batch_size"] == 16
    with caplog.at_level("INFO"):
        s = run_tiny(tmp_path, *EPOCHS2, "trainer.resume=auto", base=base)   # the default is 64 now
    assert s["status"] == "completed" and s["resumed"]["from_step"] == 4
    assert s["metrics"]["steps"] == 8
    assert s["config"]["trainer"]["batch_size"] == 16
    notes = [r.message for r in caplog.records if "trainer.batch_size=16" in r.message]
    assert len(notes) == 1 and "the default is 64 now" in notes[0], notes


def test_a_batch_the_user_set_then_is_not_taken_for_a_default(tmp_path, failed_job, capsys):
    """A job run with trainer.batch_size=16 (failed_job: TINY sets it), resumed without it: the user
    changed the config (the batch is the default now), refused as any change, not resumed at 16 as
    a moved default."""
    base = [o for o in TINY if not o.startswith(("trainer.batch_size", "trainer.max_steps"))]
    shutil.copytree(failed_job, tmp_path, dirs_exist_ok=True)
    with pytest.raises(SystemExit):
        run_tiny(tmp_path, *EPOCHS2, "trainer.resume=auto", base=base)
    assert "written by a different config (trainer.batch_size: 16 -> 64)" in capsys.readouterr().err


def test_a_checkpoint_is_refused_when_the_user_sets_another_batch(tmp_path, failed_job, capsys):
    shutil.copy(failed_job / CHECKPOINT, tmp_path / CHECKPOINT)   # at TINY's batch, 16
    with pytest.raises(SystemExit):
        run_tiny(tmp_path, *EPOCHS2, "trainer.resume=auto", "trainer.batch_size=32")
    assert "written by a different config (trainer.batch_size: 16 -> 32)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def through(tmp_path_factory):
    """failed_job's 2 epochs run through (the uninterrupted run its resumes must end as)."""
    run_dir = tmp_path_factory.mktemp("through")
    assert run_tiny(run_dir, *EPOCHS2)["status"] == "completed"
    return run_dir


def test_a_job_resumed_from_its_epoch_1_checkpoint_ends_as_the_uninterrupted_run(
    tmp_path, failed_job, through
):
    """The quick loop's guard of "a resumed run gives the same metrics and bit-identical weights"
    (docs/checkpoints.md; the SIGKILL and SIGTERM tests above, in subprocesses, are slow):
    failed_job's epoch-1 checkpoint resumed in this process, against the same 2 epochs run
    through."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(failed_job, run_dir)
    s = run_tiny(run_dir, *EPOCHS2, "trainer.resume=auto")
    assert s["resumed"]["from_step"] == 4 and not s["resumed"]["mid_epoch"]
    assert_same_run(run_dir, through)


@pytest.mark.slow
def test_final_weights_are_fp32_and_load_into_a_rebuilt_model(tmp_path):
    s = run_tiny(tmp_path, "precision=o2")
    assert s["weights"] == {"file": WEIGHTS, "dtype": "float32", "num_classes": 10}
    model, config = load_fp32_model(tmp_path)
    assert config.model.arch == "small_cnn" and config.precision.name == "o2"
    saved = torch.load(tmp_path / WEIGHTS)
    state = model.state_dict()
    assert all(state[k].dtype == torch.float32 for k in state if state[k].is_floating_point())
    assert all(torch.equal(state[k], saved[k]) for k in saved) and not model.training


@pytest.mark.slow
def test_a_run_without_final_weights_is_refused_by_name(tmp_path, monkeypatch):
    fail_at_the_end(monkeypatch)
    with pytest.raises(SystemExit):
        run_tiny(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path}: no final weights recorded .*status failed"):
        load_fp32_model(tmp_path)


def test_the_training_clock_syncs_the_device_at_every_reading(tiny, monkeypatch):
    calls = []
    monkeypatch.setattr(mixprec.train.loop, "synchronize", lambda device: calls.append(device.type))
    s = tiny(
        "trainer.max_steps=null",
        "trainer.epochs=2",
        "trainer.warmup_steps=2",
        "dataset.train_size=32",
    )
    # start and stop of each epoch, the end of the warm-up, and either side of the memory ledger's
    # measured step (step 4, left out of the steady time): no time is read without a sync first
    assert calls == ["cpu"] * (2 * 2 + 1 + 2) and len(s["metrics"]["epoch_times_s"]) == 2
    assert s["memory"]["step"] == 4
    # its GPU memory stats: tests/gpu/test_gpu.py
    monkeypatch.setattr(mixprec.train.loop, "mark_steady", lambda device: None)
    # the clock itself, for a GPU device
    clock = mixprec.train.loop.TrainClock(torch.device("cuda"))
    calls.clear()
    clock.start(), clock.mark_warm(), clock.now(), clock.stop()
    assert calls == ["cuda"] * 4


@pytest.fixture
def fresh_unpickler():
    """torch.load's weights-only allow-list as a new process starts it: torchao's import adds its
    optimizer states to it, and a resumed job reads its checkpoint before it builds an optimizer
    (the allow-list of this test process has them from any earlier test's import). Restored
    after."""
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)


# every optimizer that trains, as its state is kept: plain, torch's AdamW, torchao's three
# quantized moments (model.width=32: tensors of 4096 values and more, so the states are quantized)
# and AdamW with bf16 stochastic rounding (a pure-bf16 model; its rounding draws from the RNG)
OPTIMIZERS = {
    "sgd": ["optimizer=sgd"],
    "adamw": ["optimizer=adamw"],
    "adamw8bit": ["optimizer=adamw8bit"],
    "adamw4bit": ["optimizer=adamw4bit"],
    "adamw_fp8": ["optimizer=adamw_fp8"],
    "stochastic_round": ["optimizer=adamw", "optimizer.stochastic_round=true", "precision=bf16",
                         "optimizer.lr=1e-3"],
}


@pytest.mark.parametrize("optimizer", [
    # 4 s each on a CPU core: the quick loop keeps the one whose class the unpickler once refused
    name if name == "adamw8bit" else pytest.param(name, marks=pytest.mark.slow)
    for name in OPTIMIZERS
])
def test_a_job_of_every_optimizer_sigtermed_mid_epoch_resumes_to_the_run_through(
    tmp_path, monkeypatch, fresh_unpickler, optimizer
):
    """A pre-empted job continues with the command its summary prints, whatever its optimizer:
    SIGTERM at epoch 2's second step writes the checkpoint; the resume, reading it as a new process
    would (fresh_unpickler), ends as the uninterrupted run, bit for bit. torchao's low-bit states
    were refused once ("not a readable checkpoint (Weights only load failed ... Unsupported global:
    torchao.optim.subclass_8bit.OptimState8bit)"), and the message said to delete it."""
    build = mixprec.train.parts.build_model
    args = [*OPTIMIZERS[optimizer], "model.width=32", *EPOCHS2, "trainer.deterministic=true"]

    def signal_at(at):
        monkeypatch.setattr(mixprec.train.parts, "build_model",
                            lambda cfg, n: SignalAt(build(cfg, n), at=at))

    signal_at(0)
    reference = run_tiny(tmp_path / "reference", *args)
    signal_at(6)
    with pytest.raises(SystemExit) as e:
        run_tiny(tmp_path / "run", *args)
    assert e.value.code == 128 + signal.SIGTERM
    torch.serialization.clear_safe_globals()   # the job's optimizer imported torchao: a new process
    signal_at(0)
    resumed = run_tiny(tmp_path / "run", *args, "trainer.resume=auto")
    assert resumed["resumed"]["from_step"] == 6 and resumed["resumed"]["mid_epoch"]
    assert resumed["config"]["optimizer"]["name"] == reference["config"]["optimizer"]["name"]
    assert_same_run(tmp_path / "run", tmp_path / "reference")
