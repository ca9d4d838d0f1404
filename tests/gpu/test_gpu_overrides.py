"""The jobs of tests/gpu/test_gpu.py composed on the CPU: an override that no config has (a stale
key, a model's option given to another model) fails here, in the quick loop, and not first on a GPU
machine (issue 36: `model.width` on resnet18 had never run). Every run_tiny / compose_config /
max_batch.compose call of that file is read with `ast`, its overrides resolved (string constants,
the module's lists, the test's own local lists, f-strings over its parametrize values), then
composed with Hydra's compose API and validated against the config schema."""
import ast
import itertools

import pytest

from helpers import ROOT, TINY, compose_config, load_test_module
from mixprec.config import validate

GPU_TESTS = ROOT / "tests" / "gpu" / "test_gpu.py"
# each call's base when it names none
DEFAULT_BASE = {"run_tiny": TINY, "compose_config": [], "compose": []}


def parametrize_values(fn: ast.FunctionDef) -> dict[str, list]:
    """name -> the literal values pytest.mark.parametrize gives it (names with non-literal values
    left out)."""
    out: dict[str, list] = {}
    for d in fn.decorator_list:
        if not (isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize"):
            continue
        names = [n.strip() for n in ast.literal_eval(d.args[0]).split(",")]
        for i, name in enumerate(names):
            try:
                out[name] = [
                    ast.literal_eval(el.elts[i] if len(names) > 1 else el) for el in d.args[1].elts
                ]
            except ValueError:  # e.g. torch.float16: not used in an override
                pass
    return out


def local_lists(fn: ast.FunctionDef) -> dict[str, list]:
    """The test's own `name = [...]` lists of constants."""
    found = {}
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.List)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return found


def resolve(node: ast.AST, module, lists: dict, params: dict[str, str]) -> list[str]:
    """The overrides one argument stands for."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(str(params[v.value.id]) if isinstance(v, ast.FormattedValue) else v.value
                        for v in node.values)]
    if isinstance(node, ast.Starred):
        return resolve(node.value, module, lists, params)
    if isinstance(node, ast.Name):
        return list(lists[node.id] if node.id in lists else getattr(module, node.id))
    if isinstance(node, ast.List):
        return [o for el in node.elts for o in resolve(el, module, lists, params)]
    raise ValueError(f"cannot read {ast.unparse(node)}")


def call_overrides(call: ast.Call, fn: ast.FunctionDef, module) -> list[list[str]]:
    """Every override list a run_tiny / compose_config / compose call in `fn` composes (one per
    parametrize case)."""
    name = call.func.attr if isinstance(call.func, ast.Attribute) else call.func.id
    # run_tiny's first argument is its directory
    args = call.args[1:] if name == "run_tiny" else call.args
    base_arg = next((k.value for k in call.keywords if k.arg == "base"), None)
    lists, values = local_lists(fn), parametrize_values(fn)
    used = sorted({v.value.id for a in args for j in ast.walk(a) if isinstance(j, ast.JoinedStr)
                   for v in j.values if isinstance(v, ast.FormattedValue)})
    out = []
    for combo in itertools.product(*(values[u] for u in used)):
        params = dict(zip(used, combo))
        base = (
            resolve(base_arg, module, lists, params) if base_arg is not None else DEFAULT_BASE[name]
        )
        out.append([*base, *(o for a in args for o in resolve(a, module, lists, params))])
    return out


def gpu_job_overrides() -> list[tuple[str, list[str]]]:
    module = load_test_module("test_gpu")
    tree = ast.parse(GPU_TESTS.read_text())
    found = []
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        for call in (c for c in ast.walk(fn) if isinstance(c, ast.Call)):
            name = getattr(call.func, "attr", getattr(call.func, "id", None))
            if name in DEFAULT_BASE:
                found += [(f"{fn.name}:{call.lineno}", o) for o in call_overrides(call, fn, module)]
    return found


JOBS = gpu_job_overrides()


def test_every_gpu_job_call_is_read():
    tree = ast.parse(GPU_TESTS.read_text())
    calls = {c.lineno for c in ast.walk(tree) if isinstance(c, ast.Call)
             and getattr(c.func, "attr", getattr(c.func, "id", None)) in DEFAULT_BASE}
    assert {int(where.rsplit(":", 1)[1]) for where, _ in JOBS} == calls and len(calls) >= 10


@pytest.mark.parametrize("overrides", [o for _, o in JOBS], ids=[w for w, _ in JOBS])
def test_a_gpu_jobs_overrides_compose_on_the_cpu(overrides):
    validate(compose_config(*overrides))
