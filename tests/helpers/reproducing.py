"""scripts/reproduce.py run as a user runs it, and a tiny plan for it."""
import os
import subprocess
import sys

import yaml

from helpers import ROOT


SCRIPT = ROOT / "scripts" / "reproduce.py"


def reproduce(*args, timeout=1500, wait=True):
    env = dict(os.environ, WANDB_SILENT="true", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env.pop("WANDB_SERVICE", None)
    cmd = [sys.executable, str(SCRIPT), *map(str, args)]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


TINY_PLAN = {
    "datasets": {},
    "smoke_common": [
        "logger=none",
        "trainer.device=cpu",
        "trainer.max_steps=4",
        "trainer.warmup_steps=1",
        "trainer.epochs=1",
        "model.width=8",
        "dataset.train_size=128",
        "dataset.test_size=32",
        "trainer.batch_size=16",
        "dataset.image_size=8",
    ],
    "articles": [
        {
            "id": "half_pitfalls",
            "title": "tiny",
            "sweeps": [
                {
                    "name": "broken",
                    "command": "train",
                    "overrides": ["experiment=smoke", "dataset.num_classes=7"],
                    "grid": {"seed": [0]},
                    "cuts": ["drop"],
                },
                # the CPU's own fp16 kernels: amp's time is a real time, its ratio to fp32 computed
                # (emulated: none)
                {
                    "name": "seeds",
                    "command": "train",
                    "overrides": [
                        "experiment=smoke",
                        "name=fastai_cifar100",
                        "precision.emulate=false",
                    ],
                    "grid": {"precision": ["fp32", "amp"], "seed": [0, 1, 2]},
                    "cuts": [{"grid": {"seed": [0]}}, "drop"],
                },
            ],
        }
    ],
}


def _tiny_plan(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(TINY_PLAN))
    return path
