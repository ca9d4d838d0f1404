"""Defaults that depend on the device, as Hydra resolvers (registered when mixprec is imported).

`${mixprec.batch_default:${trainer.device},${model.arch}}` (conf/config.yaml's trainer.batch_size):
256 for an image model on a CUDA device, else 64 (the CPU default, and the language models', whose
presets set their own). Why 256 on a GPU: at batch 64 an eager ResNet-18 step on a fast GPU is
the host's time to launch its ops, alike in every precision, so a sweep's speed-up column would
measure Python; at 256 the GPU's work shows (the measurements: docs/speed.md, "Defaults that measure
precision"). A preset or an override that sets trainer.batch_size wins, so the articles' batches
are kept.

`${mixprec.by_data:${dataset.name},A,B,C}` (conf/experiment/smoke.yaml): A on the synthetic
images, B on the synthetic text, C on real data (CIFAR, Wikitext-2), so that one preset sizes a
short run on every dataset: synthetic data by its size, real splits (used whole) by their steps and
evaluation batches.
"""
from __future__ import annotations

from omegaconf import OmegaConf

from ..config import LM_ARCHS

RESOLVER = "mixprec.batch_default"
BY_DATA = "mixprec.by_data"
CPU_BATCH, GPU_BATCH = 64, 256


def on_cuda(device: str) -> bool:
    """Whether trainer.device names, or auto picks, a CUDA device."""
    if device == "auto":
        import torch   # lazy: `import mixprec` registers this resolver and stays without torch

        acc = torch.accelerator.current_accelerator(check_available=True)
        return acc is not None and acc.type == "cuda"
    return str(device).startswith("cuda")


def batch_default(device: str, arch: str) -> int:
    return GPU_BATCH if on_cuda(device) and arch not in LM_ARCHS else CPU_BATCH


def by_data(dataset: str, synthetic, synthetic_text, real):
    """The value for the kind of data `dataset` names: synthetic images, synthetic text, real."""
    return {"synthetic": synthetic, "synthetic_text": synthetic_text}.get(dataset, real)


def register() -> None:
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, batch_default)
    if not OmegaConf.has_resolver(BY_DATA):
        OmegaConf.register_new_resolver(BY_DATA, by_data)
