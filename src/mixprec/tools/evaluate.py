"""Evaluation of a finished job's saved weights (scripts/evaluate.py): the fp32 weights it saved,
in an fp32 model with fp32 math, on the job's own test split."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import PrecisionConfig
from ..data import build_image_data, image_loaders
from ..precision import modes
from ..runtime import hardware
from ..train import checkpoint, image_steps
from ..train.build import build_trained


def evaluate_saved(run_dir: Path, device: str = "auto") -> dict:
    """Evaluate a finished job's saved weights (model_fp32.pt) in an fp32 model, with fp32 math, on
    the job's own test split: apex's promise that whatever the training precision, the saved model
    is fp32 and usable. The model is built as the job built it (train/build.py), under fp32; nothing
    is stepped, so the optimizer takes the device's own kernels (impl=auto)."""
    model, config = checkpoint.load_fp32_model(run_dir)
    trained_in = config.precision.name   # what the job trained in; it is evaluated in fp32
    auto = dataclasses.replace(config.optimizer, impl="auto")
    config = dataclasses.replace(config, precision=PrecisionConfig(name="fp32"), optimizer=auto)
    device = hardware.select_device(device)
    modes.configure(device, config.trainer, config.precision, config.seed)
    data = build_image_data(config.dataset)
    _, test_batches = image_loaders(data, config.dataset, config.trainer, device, seed=config.seed)
    built = build_trained(model, config, device, channels_last=config.trainer.channels_last)
    loss, acc, _ = image_steps.evaluate(built.model, test_batches, built.policy)
    recorded = checkpoint.prior_summary(Path(run_dir))["metrics"]
    return {
        "test_acc": acc,
        "test_loss": loss,
        "recorded_test_acc": recorded.get("final_test_acc"),
        "recorded_test_loss": recorded.get("final_test_loss"),
        "precision": trained_in,
    }
