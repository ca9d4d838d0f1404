"""Every line of a precision mode's behaviour lives under src/mixprec/precision/, so that a new mode
touches that package, conf/precision/ and the schema only (docs/architecture.md, "A new precision
mode"). Checked with ast over every other module of src/mixprec (config.py, the schema, aside): none
branches on a mode's name, keeps a list of modes, compares a dtype with fp16/bf16, or reads a mode's
fields of the schema, except the labels below, each with its reason."""
import ast
import dataclasses
from pathlib import Path

from mixprec.config import PrecisionConfig

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "mixprec"
MODES = frozenset(p.stem for p in (ROOT / "conf" / "precision").glob("*.yaml"))
# PrecisionConfig's fields that make a mode's behaviour (its name is a label)
FIELDS = frozenset(f.name for f in dataclasses.fields(PrecisionConfig)) - {"name"}
LOW = frozenset({"float16", "bfloat16", "half"})

# (module, what it names): why it is data or a label, not a mode's behaviour
ALLOWED = {
    ("report/analyse.py", "mode fp32"): "speed-ups and accuracy changes are against the fp32 job",
    ("report/render.py", "mode fp32"): "the fp32 row is labelled the baseline",
    ("report/plots.py", "mode fp32"): "the speed-up figure leaves out the baseline, fp32 = 1x",
    ("report/reference.py", "mode amp"): "the published reference table is of amp's speed-ups",
    ("report/analyse.py", "modes fastai_fp16,fp32"): "published data: the fastai article's modes",
    ("tools/sweeps.py", "modes amp,fp32"): (
        "plan data: a max_batch sweep without a precision axis compares fp32 and amp"
    ),
    **{
        ("numerics/verdicts.py", f"field {f}"): "the diagnostics record the run's precision fields"
        for f in ("autocast_dtype", "keep_bn_fp32", "loss_scale", "master_weights", "param_dtype")
    },
}


def leaks(path: Path, modes=MODES, fields=FIELDS) -> set[str]:
    """What a module says of the precision modes: 'mode x' (a comparison with a mode's name), 'modes
    x,y' (a literal of several), 'dtype x' (a comparison with torch.float16/bfloat16/half), 'field
    x' (a PrecisionConfig field read)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            for side in ast.walk(ast.Module(body=[ast.Expr(node)], type_ignores=[])):
                if isinstance(side, ast.Constant) and side.value in modes:
                    found.add(f"mode {side.value}")
                if (isinstance(side, ast.Attribute) and side.attr in LOW
                        and isinstance(side.value, ast.Name) and side.value.id == "torch"):
                    found.add(f"dtype {side.attr}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            named = sorted(e.value for e in node.elts
                           if isinstance(e, ast.Constant) and e.value in modes)
            if len(named) > 1:
                found.add(f"modes {','.join(named)}")
        elif isinstance(node, ast.Attribute) and node.attr in fields:
            found.add(f"field {node.attr}")
    return found


def outside_precision() -> set[tuple[str, str]]:
    """(module, what it says of the modes) for every module outside precision/ and config.py."""
    found = set()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not (rel.startswith("precision/") or rel == "config.py"):
            found |= {(rel, what) for what in leaks(path)}
    return found


def test_the_checker_sees_each_kind_of_leak(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import torch\n"
        "def f(cfg, x, p):\n"
        "    if cfg.name == 'amp' or p in ('o2', 'half'):\n"
        "        return x.dtype is torch.bfloat16\n"
        "    ORDER = ['fp32', 'tf32']\n"
        "    return cfg.master_weights, 'amp is a word in a string', {'fp16': 1}\n"
    )
    assert leaks(module) == {
        "mode amp", "mode o2", "mode half", "modes half,o2", "dtype bfloat16", "modes fp32,tf32",
        "field master_weights",
    }
    module.write_text("def f(policy, x):\n    return policy.autocast(), x.float()\n")
    assert leaks(module) == set()


def test_no_mode_behaviour_outside_the_precision_package():
    found = outside_precision()
    leaked = sorted(f"{rel}: {what}" for rel, what in found if (rel, what) not in ALLOWED)
    assert not leaked, (
        "a precision mode's behaviour outside src/mixprec/precision/ (move it there, or allow a "
        "label in tests/house/test_precision_package.py with its reason): " + "; ".join(leaked)
    )
    stale = sorted(f"{rel}: {what}" for rel, what in ALLOWED if (rel, what) not in found)
    assert not stale, "allowed but no longer there (drop them from ALLOWED): " + "; ".join(stale)
