"""The language model's part of the shared training loop (loop.fit): truncated BPTT over a
batchified token stream, as PyTorch's word_language_model.

Each epoch walks the training stream (batchify: [nbatch, batch] on the device) in bptt windows
(TokenWindows), the hidden state starting at zeros and carried from window to window, cut from the
previous window's graph (repackage_hidden) so that backward stops at the window's start. A step is
step.train_step: backward of the (scaled) loss, unscale, clip the global norm to trainer.grad_clip
(the fp32 master gradients under master weights), step, update. After each epoch
the validation and test splits are scored in perplexity, exp(mean cross-entropy per token), with the
hidden state carried across their windows too; a `plateau` schedule then divides the lr by its
factor when the validation loss did not improve (the example's rule; per-step schedules are stepped
per window instead). The test perplexity of the best validation epoch is the example's reported
number (it reloads the best model and scores the test split).

Timing, the non-finite policy, checkpoints, stop signals and resume are the shared loop's:
TrainClock (eval excluded), throughput in tokens/s without the first trainer.warmup_steps windows,
one host sync per trainer.log_every windows; a checkpoint holds the hidden state and the windows'
position, so a run stopped in the middle of an epoch continues exactly.

The forward of a window is step.lm_forward, under the policy's recurrent_autocast (oneDNN's LSTM off
under a CPU's autocast: precision/policy.py says why).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from .compile import mark_step
from .loop import Loop, LoopState, Scored, Window
from .step import lm_forward, train_step
from ..precision.policy import PrecisionPolicy
from ..models.rnnlm import repackage_hidden
from ..data.wikitext import TokenWindows


def perplexity(loss: float) -> float:
    """exp(loss); inf where exp overflows (a diverged model), nan stays nan."""
    return math.inf if loss > 709.0 else math.exp(loss)


def evaluate(
    model, source: torch.Tensor, bptt: int, policy: PrecisionPolicy, compile_mode: str = "none",
    windows=None,
) -> float:
    """Mean cross-entropy per token over every target of a batchified split ((rows - 1) x columns
    tokens), or over `windows` (its TokenWindows in a Scored: the first trainer.eval_batches, the
    stop flag read between them). Each window is a CUDA-graph step of its own under a graph mode
    (only its loss, an eager op's output, is kept)."""
    model.eval()
    hidden = model.init_hidden(source.size(1))
    total = torch.zeros((), device=source.device, dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for x, y in TokenWindows(source, bptt) if windows is None else windows:
            mark_step(compile_mode)
            loss, _, hidden = lm_forward(model, x, y, hidden, policy)
            total += loss.double() * y.numel()
            tokens += y.numel()
    model.train()
    return total.item() / tokens


def carried(hidden, device: torch.device):
    """The hidden state without its graph, on `device` (what a checkpoint holds and a resume
    restores)."""
    return repackage_hidden(hidden).to(device) if isinstance(hidden, torch.Tensor) else \
        tuple(carried(h, device) for h in hidden)


@dataclass
class LMSteps:
    """A language model's part of the shared loop (loop.fit): a step is one bptt window, the hidden
    state carried from window to window (from zeros at each epoch's start; a checkpoint holds it, so
    a run stopped mid-epoch continues with it); after each epoch the validation and test perplexity
    and the plateau rule."""
    model: nn.Module
    schedule: object
    valid_source: torch.Tensor
    test_source: torch.Tensor
    bptt: int
    columns: int            # the training batch (columns of the batchified stream)
    hidden: object = None
    rate = "tokens_per_s"
    setup_time_s = 0.0

    @property
    def plateau(self) -> bool:
        return isinstance(self.schedule, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def start_epoch(self, batch: int) -> None:
        self.model.train()
        if batch == 0 or self.hidden is None:
            self.hidden = self.model.init_hidden(self.columns)

    def step(self, x, y, loop: Loop, state: LoopState):
        # CUDA graphs: a new step (the GPT, compiled, carries no hidden state)
        mark_step(loop.trainer.compile)
        loop.probe.before_step(state.step + 1, loop.policy)
        start, (loss, _, self.hidden) = (
            self.hidden,
            lm_forward(self.model, x, y, self.hidden, loop.policy),
        )
        train_step(
            loss,
            loop,
            state,
            replay=functools.partial(lm_forward, self.model, x, y, start, loop.policy),
        )
        if not self.plateau:
            self.schedule.step()
        return loss.detach(), None, y.numel()

    def row(self, loss: float, window: Window, loop: Loop) -> dict:
        return {"ppl": perplexity(loss)}

    def evaluate(self, state: LoopState, loop: Loop, final: bool) -> dict:
        losses, tokens = {}, {}
        for split, source in (("valid", self.valid_source), ("test", self.test_source)):
            windows = Scored(TokenWindows(source, self.bptt), loop)
            losses[split] = evaluate(self.model, source, self.bptt, loop.policy,
                                     loop.trainer.compile, windows)
            tokens[split] = windows.count
        valid_loss, test_loss = losses["valid"], losses["test"]
        record = {
            "valid_loss": valid_loss,
            "valid_ppl": perplexity(valid_loss),
            "test_loss": test_loss,
            "test_ppl": perplexity(test_loss),
            "eval_tokens": tokens,
        }
        best = state.best.get("record")
        if best is None or valid_loss < best["valid_loss"]:
            state.best["record"] = {**record, "epoch": state.epoch + 1}
        if self.plateau:
            lr = loop.lr
            self.schedule.step(valid_loss)
            record["annealed"] = loop.lr < lr
        return record

    def metrics(self, state: LoopState, loop: Loop) -> dict:
        final = state.epochs[-1] if state.epochs and loop.status == "completed" else {}
        best = state.best.get("record")
        # what the recurrent layers really ran in (models/rnnlm.py)
        rnn_dtype = getattr(self.model, "rnn_dtype", None)
        return {
            "tokens": state.samples,
            "final_valid_loss": final.get("valid_loss"),
            "final_valid_ppl": final.get("valid_ppl"),
            "final_test_loss": final.get("test_loss"),
            "final_test_ppl": final.get("test_ppl"),
            "best_valid_ppl": best and best["valid_ppl"],
            "best_valid_epoch": best and best["epoch"],
            "test_ppl_at_best_valid": best and best["test_ppl"],
            "final_test_acc": None,  # a language model has no accuracy: perplexity instead
            "best_test_acc": None,
            "final_lr": loop.lr,
            "throughput_unit": "tokens/s",
            "rnn_dtype": rnn_dtype and str(rnn_dtype).removeprefix("torch."),
            "rnn_cudnn": getattr(self.model, "rnn_cudnn", None),
        }

    def state_dict(self) -> dict:
        return {
            "hidden": None if self.hidden is None else carried(self.hidden, torch.device("cpu"))
        }

    def load_state_dict(self, state: dict) -> None:
        device = next(self.model.parameters()).device
        self.hidden = None if state["hidden"] is None else carried(state["hidden"], device)
