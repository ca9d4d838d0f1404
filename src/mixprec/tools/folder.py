"""The results folder of a reproduction (scripts/reproduce.py): where it goes, what it says of this
machine (ENVIRONMENT.md), the commands it ran (COMMANDS.md), what git keeps of it (.gitignore), and
earlier results set aside (replaced/) rather than taken for this run's."""
from __future__ import annotations

import datetime
import re
import shlex
import subprocess
import time
from pathlib import Path

from ..records import write_json_atomic, write_text_atomic
from .plan import markdown_table

ROOT = Path(__file__).resolve().parents[3]   # src/mixprec/tools/folder.py -> the project


def log(msg: str) -> None:
    print(f"reproduce: {msg}", flush=True)


def environment() -> dict:
    # lazy: torch (which these import) is slow to import; the launcher and --help need it not
    import torch
    from ..runtime.hardware import describe, select_device

    device = select_device("auto")   # the build's accelerator (torch.accelerator), else the CPU
    env = describe(device)
    env["gpus"] = (
        []
        if device.type == "cpu"
        else [
            torch.get_device_module(device).get_device_name(i)
            for i in range(torch.accelerator.device_count())
        ]
    )
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        env["driver"] = (
            out.stdout.strip().splitlines()[0]
            if out.returncode == 0 and out.stdout.strip()
            else None
        )
    except (OSError, subprocess.SubprocessError):
        env["driver"] = None
    return env


def default_out(env: dict, args) -> Path:
    name = (
        "cpu" if not env["gpus"] else re.sub(r"[^a-z0-9]+", "-", env["gpus"][0].lower()).strip("-")
    )
    profile = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("gpu=")), None)
    if profile and profile != "auto":
        name += f"-{profile}"
    date = datetime.date.today().isoformat()
    return ROOT / "outputs" / ("smoke" if args.smoke else "reference") / f"{name}-{date}"


def write_environment(out: Path, env: dict, args) -> None:
    rows = [
        ("GPU", ", ".join(env["gpus"]) or "none (CPU)"),
        ("driver", env.get("driver") or "-"),
        ("torch", env["torch"]),
        ("CUDA", env["cuda"] or "-"),
        ("cuDNN", env["cudnn"] or "-"),
        (
            "commit",
            f"{env['git_commit']}"
            + (" (with uncommitted changes)" if env.get("git_dirty") else ""),
        ),
        ("python", env["python"]),
        ("platform", env["platform"]),
        ("host", env["hostname"]),
        ("CPU cores", env["cpu_count"]),
        ("GPU memory (GB)", env.get("gpu_memory_gb") or "-"),
        ("capability", env.get("capability") or "-"),
        ("overrides", " ".join(args.overrides) or "-"),
        ("written", time.strftime("%Y-%m-%d %H:%M:%S %z")),
    ]
    text = "# Environment\n\n" + markdown_table(["", ""], [[k, v] for k, v in rows]) + "\n"
    write_text_atomic(out / "ENVIRONMENT.md", text)
    write_json_atomic(out / "environment.json", env)


GITIGNORE_UNFINISHED = """\
# Written by scripts/reproduce.py: this results folder is not complete (a --plan, or a run still
# going or stopped), so git leaves all of it out. The run that completes it (its report made)
# replaces this file with one that keeps the results and leaves out only the weights, checkpoints,
# W&B files and the calibration's jobs.
*
"""
GITIGNORE_FINISHED = """\
# Written by scripts/reproduce.py when this folder's run completed: commit the folder
# (runs/*/*/summary.json and metrics.jsonl, report/, ENVIRONMENT.md, COMMANDS.md, plan.md,
# plan.json, calibration.json, logs/); git leaves out:
*.pt
wandb/
.submitit/
calibration/
replaced/
"""


def write_gitignore(out: Path, finished: bool) -> None:
    """<out>/.gitignore (for a folder inside the repository): everything until the run is complete,
    then the heavy files only."""
    if out.resolve().is_relative_to(ROOT):
        write_text_atomic(
            out / ".gitignore", GITIGNORE_FINISHED if finished else GITIGNORE_UNFINISHED
        )


def record_command(out: Path, what: str, cmd: list[str]) -> None:
    """COMMANDS.md gets the command as it starts (a killed session's command is listed too),
    record_exit its end."""
    path = out / "COMMANDS.md"
    if not path.exists():
        path.write_text(
            "# Commands run\n\nEvery command this folder's results came from, in order (run from "
            "the repository root; the commands of a resumed plan are listed again, a command with "
            "no exit line was stopped).\n"
        )
    with path.open("a") as f:
        f.write(
            f"\n## {time.strftime('%Y-%m-%d %H:%M:%S')} {what}\n\n```bash\n{shlex.join(cmd)}\n```\n"
        )


def record_exit(out: Path, rc, wall: float) -> None:
    with (out / "COMMANDS.md").open("a") as f:
        f.write(f"exit code {rc}, {wall / 60:.1f} min\n")


def set_aside(out: Path, name: str, why: str) -> None:
    """<out>/<name> moved to <out>/replaced/<name>-<time>."""
    if not (out / name).exists():
        return
    dest = out / "replaced" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.parent.mkdir(exist_ok=True)
    (out / name).rename(dest)
    log(f"{name}: {why}; moved to {dest}")
