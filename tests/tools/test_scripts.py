"""Every script of scripts/ answers a user's mistake (a bad argument or override, an unknown name, a
missing file) as train.py does: a non-zero exit and one line naming the mistake and the fix, never a
traceback (mixprec.tools.cli)."""
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from mixprec.tools import cli
from mixprec.config import ConfigError

MODELS = "choose one of: gpt, gru, lstm"

CASES = [  # (script and arguments, what the one line must say)
    (
        ["reproduce.py", "--estimate", "nonexistent_gpu"],
        ["--estimate nonexistent_gpu: no GPU profile", "h100"],
    ),
    (
        ["reproduce.py", "--plan", "model=nonexistent", "--out", "{tmp}/r"],
        ["model=nonexistent: no such option", MODELS],
    ),
    (["reproduce.py", "--bogus"], ["unrecognized arguments: --bogus", "--help"]),
    (["numerics.py", "model=nonexistent"], ["model=nonexistent: no such option", MODELS]),
    (["numerics.py", "trainer.bogus=1"], ["trainer.bogus: no such key", "+trainer.bogus="]),
    (
        ["benchmark.py", "overhead", "model=nonexistent"],
        ["model=nonexistent: no such option", MODELS],
    ),
    (["benchmark.py", "table", "--steps", "0"], ["--steps and --warmup must be >= 1"]),
    (
        ["max_batch.py", "--device", "cpu", "model=nonexistent"],
        ["model=nonexistent: no such option", MODELS],
    ),
    (["evaluate.py", "{tmp}/no_run"], ["no_run: no summary.json there", "train.py job"]),
    (["generate.py", "{tmp}/no_run"], ["summary.json: not found", "train.py run"]),
    (
        ["generate.py", "{tmp}/no_run", "--device", "banana"],
        ["--device=banana: not a device", "cuda:N"],
    ),
    (["make_report.py", "{tmp}/no_sweep"], ["no_sweep: no such file or folder"]),
    (["data_stats.py", "dataset=nonexistent"], ["dataset=nonexistent: no such option", "cifar10"]),
    (["bench_pipeline.py", "model=["], ["an override does not parse", "key=value"]),
]


def run_script(args, tmp_path):
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    argv = [a.format(tmp=tmp_path) for a in args]
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / argv[0]), *argv[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow   # a subprocess each (torch's import)
@pytest.mark.parametrize("args,says", CASES, ids=[" ".join(c[0][:3]) for c in CASES])
def test_a_script_answers_bad_input_in_one_line(tmp_path, args, says):
    r = run_script(args, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert "Traceback" not in out
    # torchao's warning
    lines = [line for line in r.stderr.splitlines() if line.strip() and "_pytree.py" not in line]
    assert len(lines) == 1, r.stderr
    name = args[0].removesuffix(".py")
    assert lines[0].startswith(f"{name}: "), lines[0]
    for text in says:
        assert text in lines[0], lines[0]


def test_hydra_errors_become_one_line_config_errors():
    with pytest.raises(ConfigError) as e:
        cli.compose(["model=resnet9000"])
    assert str(e.value).startswith(
        "model=resnet9000: no such option of `model` (conf/model/); choose one of: gpt,"
    )
    assert "Config search path" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(
        ConfigError, match=r"^trainer\.bogus: no such key in the config.*\+trainer\.bogus=\.\.\.$"
    ):
        cli.compose(["trainer.bogus=1"])
    with pytest.raises(ConfigError, match="^an override does not parse"):
        cli.compose(["trainer"])
    assert cli.compose(["model=small_cnn"]).model.arch == "small_cnn"


def test_run_says_a_user_error_in_one_line_and_lets_a_bug_through(capsys, tmp_path):
    def missing(argv):
        open(tmp_path / "nope.json")

    assert cli.run("x", missing) == 2
    assert capsys.readouterr().err == f"x: {tmp_path / 'nope.json'}: no such file or directory\n"
    assert cli.run("x", lambda argv: (_ for _ in ()).throw(ConfigError("a.b=1: must be 2"))) == 2
    assert capsys.readouterr().err == "x: config error: a.b=1: must be 2\n"

    def bug(argv):
        raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError):
        cli.run("x", bug)


def test_argparse_errors_are_one_line(capsys):
    ap = cli.ArgumentParser(prog="thing.py")
    ap.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--n", "x"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "thing: error: argument --n: invalid int value: 'x'"
    )
