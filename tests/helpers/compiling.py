"""torch.compile under test: a dynamo backend that counts graphs and calls, and jobs traced with
the eager backend (seconds instead of inductor's minutes)."""
import torch

from mixprec import job
from mixprec.train import parts
from mixprec.train import compile, parallel


def traced_only(monkeypatch) -> list:
    """trainer.compile through dynamo with the eager backend: every (re)compilation counted, seconds
    instead of inductor's minutes, FSDP's units too (train/parallel.py compiles them before
    fully_shard; the job then leaves the root as it is). Returns the graphs made during fit
    (training and evaluation)."""
    made = []
    monkeypatch.setattr(parts, "compile_model",
                        lambda net, mode, **options: net if compile.compiled_parts(net)
                        else torch.compile(net, backend="eager"))
    monkeypatch.setattr(parallel, "compile_model",
                        lambda net, mode, **options: torch.compile(net, backend="eager"))
    fit = job.loop.fit

    def counted_fit(*args, **kwargs):
        before = compile.dynamo_graphs()
        try:
            return fit(*args, **kwargs)
        finally:
            made.append(compile.dynamo_graphs() - before)
    monkeypatch.setattr(job.loop, "fit", counted_fit)
    return made


class CountingBackend:
    """A dynamo backend that runs each graph as traced (the eager backend) and notes, per graph,
    whether a size of its inputs is symbolic (a dynamic-shape graph), the input shapes and its
    calls; `marked()` notes each graph's calls so far (at the start of fit: what the timed steps and
    evaluations call comes after)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        values = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        graph = {"dynamic": any(symbolic(v) for v in values), "calls": 0, "at_fit": None,
                 "shapes": [tuple(v.shape) for v in values
                            if isinstance(v, torch.Tensor) and v.dim() >= 2]}
        self.graphs.append(graph)

        def call(*args):
            graph["calls"] += 1
            return gm.forward(*args)
        return call

    def mark(self):
        for graph in self.graphs:
            graph["at_fit"] = graph["calls"]

    def after_warmup(self) -> list[dict]:
        """The graphs called after the mark (a graph compiled after it counts whole)."""
        return [g for g in self.graphs if g["calls"] > (g["at_fit"] or 0)]


def symbolic(value) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)
