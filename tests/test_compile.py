"""trainer.compile: every model kind compiled gives the eager losses (CPU inductor), CUDA graphs' rules kept by the
loop (a step mark before every compiled call, no compiled output kept past the next call), and the warm-up
covering every shape the clock would otherwise pay for."""
import json

import pytest
import torch
from torch import nn

import mixprec.run as run
from helpers import run_tiny
from test_gpt import GPT_JOB
from test_speed import SMALL


class FakeGraphs(nn.Module):
    """What CUDA graphs do to a compiled module's outputs, on a CPU: each call overwrites (with NaN) the output of
    the previous call, as a graph's replay overwrites its output pool; a call not preceded by
    torch.compiler.cudagraph_mark_step_begin() since the previous one is counted in `unmarked`."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net
        self.previous = None
        self.calls = self.unmarked = self.marks = 0
        self.marks_at_last_call = -1

    def init_hidden(self, batch_size: int):   # torch.compile's module reaches the model's attributes likewise
        return self.net.init_hidden(batch_size)

    def mark(self):
        self.marks += 1

    def forward(self, *args):
        if self.previous is not None:
            with torch.no_grad():
                self.previous.fill_(float("nan"))
        self.calls += 1
        self.unmarked += self.marks == self.marks_at_last_call
        self.marks_at_last_call = self.marks
        out = self.net(*args)
        self.previous = out if isinstance(out, torch.Tensor) else out[0]
        return out


def fake_graphs(monkeypatch) -> list:
    made = []

    def compile_model(net, mode):
        if mode == "none":
            return net
        made.append(FakeGraphs(net))
        monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", made[-1].mark)
        return made[-1]
    monkeypatch.setattr(run, "compile_model", compile_model)
    return made


def train_rows(path):
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_mark_each_step_and_keep_no_graph_output(tmp_path, monkeypatch, mode):
    """Under the fake graphs, every call (warm-up, training, evaluation with flip TTA) is marked, and the job's
    losses and accuracies (TTA's too) are those of the eager run: nothing read a graph output after the next call."""
    made = fake_graphs(monkeypatch)
    common = ["trainer.max_steps=4", "trainer.log_every=1", "trick.tta=true"]
    s = run_tiny(tmp_path / "graphs", *common, f"trainer.compile={mode}", base=SMALL)
    eager = run_tiny(tmp_path / "eager", *common, base=SMALL)
    assert s["status"] == eager["status"] == "completed", s.get("error")
    fake = made[0]
    assert fake.calls > 4 + 2 and fake.unmarked == 0   # warm-up, 4 steps, evaluation (two calls a batch)
    assert [r["loss"] for r in train_rows(tmp_path / "graphs")] == [r["loss"] for r in train_rows(tmp_path / "eager")]
    assert [r["acc"] for r in train_rows(tmp_path / "graphs")] == [r["acc"] for r in train_rows(tmp_path / "eager")]
    for key in ("final_test_acc", "final_test_loss", "final_test_acc_tta", "final_test_acc_no_tta"):
        assert s["metrics"][key] == eager["metrics"][key], key


def test_a_compiled_gpt_under_cuda_graphs_marks_each_window(tmp_path, monkeypatch):
    made = fake_graphs(monkeypatch)
    s = run_tiny(tmp_path, "trainer.max_steps=3", "trainer.compile=reduce-overhead", "dataset.train_size=400",
                 "dataset.test_size=100", base=GPT_JOB)
    assert s["status"] == "completed", s.get("error")
    assert made[0].calls > 3 and made[0].unmarked == 0
    assert all(r["loss"] == r["loss"] for r in train_rows(tmp_path))   # not NaN
