"""Jobs on 2 gloo ranks: train.py under torchrun, functions on spawned ranks, and what their
records must show (the FSDP, DDP, memory and low-bit tests share them)."""
import json
import math
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as tdist

from helpers import ROOT
from mixprec.models.gpt import GPT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args, cwd, timeout=300):
    """train.py on 2 gloo ranks; the completed process."""
    env = dict(os.environ, WANDB_SILENT="true", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MIXPREC_RUN_TIME", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(ROOT / "train.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def job(args, out, cwd):
    """A 2-rank job that must complete; its summary."""
    r = torchrun([*args, f"hydra.run.dir={out}"], cwd)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed", summary.get("error")
    return summary


def rows(job_dir, key="loss"):
    return [json.loads(line)[key] for line in (job_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "train"]


def weights(job_dir):
    return torch.load(job_dir / "model_fp32.pt", weights_only=True)


def assert_same_weights(a, b, atol):
    assert set(a) == set(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=k)


def on_ranks(fn, *args, world=2, backend="gloo"):
    """fn(rank, *args) on `world` ranks (gloo; "nccl": one GPU each, cuda:rank), spawned: a fork
    of this process after an in-process FSDP job (its gloo group's threads) can hang."""
    torch.multiprocessing.start_processes(_rank_main, args=(world, free_port(), fn, args, backend),
                                          nprocs=world, start_method="spawn")


def _rank_main(rank, world, port, fn, args, backend="gloo"):
    if backend != "gloo":
        torch.cuda.set_device(rank)
    tdist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    try:
        fn(rank, *args)
    finally:
        tdist.destroy_process_group()


def whole_bytes() -> dict:
    """One process's bytes of the tiny GPT's parameters, gradients and AdamW's two moments (fp32;
    the tied embedding once)."""
    n = sum(p.numel() for p in {id(p): p for p in GPT(64, 2, 2, 32, 16).parameters()}.values())
    return {"params": 4 * n, "grads": 4 * n, "optimizer": 2 * 4 * n}


# the dtype FSDP all-gathers and computes in, per mode (docs/fsdp.md's table)
PARAM_DTYPE = {"fp32": "float32", "tf32": "float32", "amp_bf16": "bfloat16", "amp": "float16",
               "o2": "float16", "apex_fp16": "float16", "fp8": "bfloat16"}


def assert_one_rank_fsdp_job(s: dict, job_dir, mode: str, device: str) -> None:
    """What a completed 1-rank FSDP job of the tiny GPT with AdamW must show: on `device`, native
    arithmetic, the mode's param dtype and a float32 reduction in its distributed block, every
    fp32 byte of one process held by its one rank, and finite training and validation losses
    that fall (tests/distributed/test_fsdp_records.py runs it on the CPU)."""
    assert s["status"] == "completed", s.get("error")
    assert s["env"]["device"] == device and s["arithmetic"] == "native"
    d = s["distributed"]
    assert (d["strategy"], d["world_size"], d["param_dtype"], d["reduce_dtype"]) == \
        ("fsdp", 1, PARAM_DTYPE[mode], "float32")
    assert d["held_bytes"] == [whole_bytes()]
    losses = rows(job_dir)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses
    assert math.isfinite(s["metrics"]["final_valid_loss"])
