"""No import cycle in src/mixprec: the graph of every `import` / `from ... import` (top-level and
inside functions) between the package's modules, built with ast, has no cycle; the rooms import only
downward in their layers; an import waits inside a function only for a reason LAZY gives."""
import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC, package: str = "mixprec") -> dict[str, set[str]]:
    """module -> the package's modules it imports. Importing a.b.c also imports the packages a.b and
    a (except the importer's own enclosing packages, which Python has already started importing)."""
    files = {module_name(p, src): p for p in (src / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".")
                    base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module
                # `from pkg import submodule`
                targets = [stem] + [f"{stem}.{a.name}" for a in node.names]
            ancestors = {".".join(mod.split(".")[:i]) for i in range(1, mod.count(".") + 1)}
            for t in targets:
                parts = t.split(".")
                for i in range(1, len(parts) + 1):
                    name = ".".join(parts[:i])
                    if name in files and name != mod and name not in ancestors:
                        graph[mod].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_cycle_and_follows_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import x\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}          # its own package pkg.sub is no edge
    assert graph["pkg.d"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "b.py").write_text("x = 1\n")
    assert cycles(import_graph(tmp_path, "pkg")) == []


def test_mixprec_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles in src/mixprec: " + "; ".join(" <-> ".join(c) for c in found)


# The rooms of src/mixprec from the lowest layer to the highest: a module imports only from its own
# room or a lower layer's (rooms in one layer may import each other). The package root's __init__
# registers the resolvers and belongs to no room.
LAYERS = (
    ("config",),
    ("runtime",),
    ("records",),
    ("precision",),
    ("models", "data"),
    ("numerics",),
    ("train",),
    ("tools",),   # cli.py and search.py in tools/: they serve the scripts (issue 51)
    ("report",),
    ("job",),
)


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import (top-level or inside a function) from a room to a higher layer's, as 'a ->
    b'."""
    rank = {name: i for i, rooms in enumerate(layers) for name in rooms}
    found = []
    for mod, targets in graph.items():
        here = room(mod)
        for target in targets:
            there = room(target)
            if here is not None and there is not None and rank[there] > rank[here]:
                found.append(f"{mod} -> {target}")
    return sorted(found)


def test_the_layer_checker_finds_an_import_upward_even_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    for sub in ("low", "high"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "high" / "a.py").write_text("from ..low import b\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from ..high import a\n")
    layers = (("low",), ("high",))
    assert upward_imports(import_graph(tmp_path, "pkg"), layers) == [
        "pkg.low.b -> pkg.high",
        "pkg.low.b -> pkg.high.a",
    ]
    (pkg / "low" / "b.py").write_text("x = 1\n")
    assert upward_imports(import_graph(tmp_path, "pkg"), layers) == []


def test_mixprec_imports_only_downward_in_its_layers():
    graph = import_graph()
    rooms = {room(m) for m in graph} - {None}
    assert rooms == {name for layer in LAYERS for name in layer}, (
        "a room missing from LAYERS (or gone)"
    )
    found = upward_imports(graph)
    assert not found, "imports from a lower layer to a higher one: " + "; ".join(found)


def test_the_package_root_holds_at_most_8_modules():
    root = SRC / "mixprec"
    modules = sorted(p.name for p in root.glob("*.py"))
    assert len(modules) <= 8, modules


# Every import inside a function in src/mixprec, (module, what it imports): why it waits for the
# call. Any other import belongs at the module's top.
OPTIONAL_WANDB = "wandb: optional (the wandb extra) and slow to import; only W&B's paths need it"
NO_TORCH = "torch: scripts/reproduce.py imports tools/cli without it"
NO_TORCH_LAUNCHER = (
    "torch: scripts/reproduce.py's --help and its launcher (that only runs jobs) import it not"
)
LAZY = {
    ("mixprec.tools.cli", "mixprec.data.files"): NO_TORCH,
    ("mixprec.tools.cli", "mixprec.train.checkpoint"): NO_TORCH,
    ("mixprec.job", "mixprec.records.wandb_mirror"): OPTIONAL_WANDB,
    ("mixprec.precision.fp8", "torchao.float8"): "torchao: optional (the fp8 extra)",
    ("mixprec.precision.fp8", "torchao.float8.float8_linear"): "torchao: optional (the fp8 extra)",
    ("mixprec.precision.mxfp8", "torchao.prototype.moe_training.mxfp8_linear"):
        "torchao: optional (the fp8 extra)",
    ("mixprec.precision.mxfp8", "torchao.prototype.mx_formats.config"):
        "torchao: optional (the fp8 extra)",
    ("mixprec.precision.mxfp8", "torchao.quantization.quantize_.common.kernel_preference"):
        "torchao: optional (the fp8 extra)",
    ("mixprec.train.optim", "torchao.optim"): "torchao: optional (the fp8 extra)",
    ("mixprec.train.optim", "torchao.optim.adam"): "torchao: optional (the fp8 extra)",
    ("mixprec.records.wandb_mirror", "wandb"): OPTIONAL_WANDB,
    ("mixprec.report.callbacks", "mixprec.report.make"): "matplotlib: only a sweep's report",
    ("mixprec.report.wandb_report", "wandb"): OPTIONAL_WANDB,
    ("mixprec.report.wandb_report", "wandb_workspaces.reports.v2"): "optional (the report extra)",
    ("mixprec.tools.estimate", "torch"): NO_TORCH_LAUNCHER,
    ("mixprec.tools.estimate", "mixprec.models"): NO_TORCH_LAUNCHER,
    ("mixprec.tools.estimate", "mixprec.precision.modes"): NO_TORCH_LAUNCHER,
    ("mixprec.tools.folder", "torch"): NO_TORCH_LAUNCHER,
    ("mixprec.tools.folder", "mixprec.runtime.hardware"): NO_TORCH_LAUNCHER,
    ("mixprec.runtime.defaults", "torch"): "`import mixprec` registers its resolvers without it",
    ("mixprec.runtime.dist", "submitit"): "optional (the SLURM launcher's extra)",
    ("mixprec.train.compile", "torch._inductor.async_compile"): "inductor: seconds to import",
}


def function_imports(src: Path = SRC, package: str = "mixprec") -> set[tuple[str, str]]:
    """(module, imported module) for every import inside a function of the package, relative
    imports resolved."""
    found = set()
    for path in (src / package).rglob("*.py"):
        mod, is_pkg = module_name(path, src), path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        functions = [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in (n for f in functions for n in ast.walk(f)):
            if isinstance(node, ast.Import):
                found |= {(mod, a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = mod.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)] if node.level else []
                found.add((mod, ".".join(base + ([node.module] if node.module else []))))
    return found


def test_the_function_import_finder_resolves_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text(
        "import json\n\ndef g():\n    import wandb\n    from ..sub import c\n"
    )
    assert function_imports(tmp_path, "pkg") == {
        ("pkg.sub", "pkg.sub"), ("pkg.sub.c", "wandb"), ("pkg.sub.c", "pkg.sub")
    }


def test_imports_wait_inside_functions_only_for_a_reason():
    found = function_imports()
    unexplained = sorted(f"{m}: {t}" for m, t in found - set(LAZY))
    assert not unexplained, (
        "imports inside functions: move them to the module's top, or give the reason in LAZY: "
        + "; ".join(unexplained)
    )
    assert set(LAZY) <= found, f"no longer inside a function: {sorted(set(LAZY) - found)}"


def test_the_package_and_cli_import_without_torch():
    """What LAZY's torch reasons promise: the resolvers and cli load without torch."""
    code = "import sys, mixprec, mixprec.tools.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


ROOT = SRC.parent
# (file, alias): why it stays
ALIASES_LEFT = {("scripts/numerics.py", "ps"): "probe_stats, renamed with that script's rewrite"}


def mixprec_aliases(paths) -> set[tuple[str, str]]:
    """(file, alias) for every import of a mixprec name under another name (`loop as engine`)."""
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                for a in node.names:
                    name = (a.name if module else a.name.rsplit(".", 1)[-1])
                    if (module or a.name).startswith("mixprec") and a.asname not in (None, name):
                        found.add((path.relative_to(ROOT).as_posix(), a.asname))
    return found


def test_tests_and_scripts_import_mixprec_by_its_names():
    paths = [*sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py")),
             ROOT / "train.py"]
    found = mixprec_aliases(paths)
    assert found - set(ALIASES_LEFT) == set(), f"aliased imports (use the names): {found}"
    assert set(ALIASES_LEFT) <= found, "an alias allowed but gone: drop it from ALIASES_LEFT"
