"""Experiment presets do what they say: a sweep preset sweeps without -m; a single-job preset runs
one job."""
import json

import pytest

from helpers import CONF, TINY, compose_config, run_cli
from helpers.configs import sweep_params

PRESETS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.slow
def test_every_sweep_preset_runs_as_a_sweep_and_the_others_as_one_job():
    sweeps = [p for p in PRESETS if sweep_params(p)]
    assert "smoke" not in sweeps and {
        "page_ladder",
        "torch_amp",
        "half_pitfalls",
        "apex_word_lm",
    } <= set(sweeps)
    for name in PRESETS:
        mode = compose_config(f"experiment={name}").hydra.mode
        assert str(mode) == ("RunMode.MULTIRUN" if name in sweeps else "None"), name


@pytest.mark.slow
def test_a_sweep_preset_sweeps_without_dash_m(tmp_path):
    sweep = tmp_path / "sweep"
    sizes = [o for o in TINY if not o.startswith("model=")]
    r = run_cli("experiment=precision_sweep", "model=small_cnn", *sizes, "dataset.image_size=8",
                "trainer.max_steps=1", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    got = sorted(
        json.loads(p.read_text())["choices"]["precision"] for p in sweep.glob("*/summary.json")
    )
    assert got == sorted(sweep_params("precision_sweep")["precision"].split(","))
    assert f"sweep {sweep}: 4 jobs" in r.stdout
    assert (sweep / "report" / "report.md").exists()
