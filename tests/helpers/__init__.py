"""Helpers shared by the tests: compose a config as a job sees it, run a tiny job in this process,
run train.py in a subprocess, load a script of scripts/ as a module, read another test file's job
lists. The package's other modules hold what test modules of several folders share."""
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

# Tiny but real: a small CNN on a few synthetic images, 2 optimizer steps, no W&B, on the CPU (what
# the tests assert is CPU behaviour; on a GPU machine trainer.device=auto would pick the GPU:
# tests/gpu/test_gpu.py covers that).
TINY = ["model=small_cnn", "model.width=8", "dataset.train_size=64", "dataset.test_size=32",
        "trainer.batch_size=16", "trainer.eval_batch_size=32", "trainer.max_steps=2", "logger=none",
        "trainer.device=cpu"]


def compose_config(*overrides, output_dir=None):
    """Compose conf/config.yaml with Hydra's compose API (hydra node included), as a job would see
    it."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    if output_dir is not None:
        with open_dict(cfg):
            cfg.hydra.runtime.output_dir = str(output_dir)
            cfg.hydra.job.override_dirname = ",".join(overrides)
            cfg.hydra.overrides.task = list(overrides)
    return cfg


def run_tiny(tmp_path, *overrides, base=TINY):
    """Run one real job in this process through mixprec.job.run_job; returns its summary dict. base:
    the overrides that make it tiny (TINY; tests of other models pass their own)."""
    from mixprec.job import run_job

    cfg = compose_config(*base, *overrides, output_dir=tmp_path)
    HydraConfig.instance().set_config(cfg)
    return run_job(cfg)


def run_cli(*args, cwd=ROOT, timeout=600):
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1")
    # an in-process W&B run of an earlier test sets it: a job starts its own service
    env.pop("WANDB_SERVICE", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def load_script(name: str):
    """scripts/<name>.py as a module (its functions called in this process)."""
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_test_module(name: str):
    """The test module tests/<folder>/<name>.py as pytest imports it (its folder on sys.path, its
    file name the module's), for the tests that read the job lists of another test file (that their
    jobs stay on the CPU, that their overrides compose) whichever files pytest was given."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:
            raise
    sys.path.insert(0, str(next((ROOT / "tests").rglob(f"{name}.py")).parent))
    return importlib.import_module(name)
