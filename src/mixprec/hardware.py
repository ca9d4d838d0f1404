"""Hardware: pick the device, set the math flags (TF32, cudnn.benchmark, determinism), describe the machine,
and match the chosen GPU profile against the GPU that is really there."""
from __future__ import annotations

import os
import platform
import random
import resource
import subprocess
from pathlib import Path

import torch

from .config import ConfigError, GpuConfig, PrecisionConfig, TrainerConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.device={name}: no CUDA GPU is visible here; use trainer.device=auto or cpu")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"trainer.device={name}: only {torch.cuda.device_count()} GPU(s) visible")
    return torch.device(name)


def configure(device: torch.device, trainer: TrainerConfig, precision: PrecisionConfig, seed: int) -> None:
    """Seed every RNG and set the global math flags this job's precision and trainer config ask for."""
    if trainer.deterministic:
        # cuBLAS reads this when it first initialises; setting it before any CUDA work is enough.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.benchmark = trainer.cudnn_benchmark and not trainer.deterministic
    torch.backends.cudnn.deterministic = trainer.deterministic
    torch.backends.cuda.matmul.allow_tf32 = precision.tf32
    torch.backends.cudnn.allow_tf32 = precision.tf32
    random.seed(seed)
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory and what it measures: CUDA max allocated on a GPU, the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process_peak_rss"


def describe(device: torch.device) -> dict:
    """What ran the job: versions, device, math flags, commit."""
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "device_name": platform.processor() or platform.machine(),
        "capability": None,
        "gpu_memory_gb": None,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                   gpu_memory_gb=round(props.total_memory / 2**30, 1))
    env.update(git_state())
    return env


def git_state() -> dict:
    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": None if dirty is None else bool(dirty)}


def gpu_profile(gpu: GpuConfig, device_name: str) -> dict:
    """The profile to use for MFU, or why none is used. A profile that does not match the detected device is
    reported (matched: false) and its peaks are not used."""
    if gpu.name == "auto":
        return {"name": "auto", "matched": None, "peak_tflops": None,
                "note": "gpu=auto records the device but has no peak numbers; choose gpu=<profile> for MFU"}
    matched = bool(gpu.match) and gpu.match.lower() in device_name.lower()
    info = {"name": gpu.name, "matched": matched, "peak_tflops": dict(gpu.peak_tflops) if matched else None,
            "memory_gb": gpu.memory_gb, "bandwidth_gbs": gpu.bandwidth_gbs, "source": gpu.source}
    if not matched:
        info["note"] = (f"gpu={gpu.name} expects a device named like '{gpu.match}' but this job ran on "
                        f"'{device_name}': its peak numbers are not used")
    return info


def peak_kind(precision: PrecisionConfig) -> str:
    """Which peak a precision's main math runs at: the tensor-core dtype, or fp32/tf32."""
    low = precision.autocast_dtype or (precision.param_dtype if precision.param_dtype != "float32" else None)
    if low == "float16":
        return "fp16"
    if low == "bfloat16":
        return "bf16"
    return "tf32" if precision.tf32 else "fp32"
