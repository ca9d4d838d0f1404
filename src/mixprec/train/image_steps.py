"""An image classifier's part of the shared loop (loop.fit): its step (step.py's image_forward and
train_step, with the tricks' label smoothing, EMA and schedule), its evaluation (flip TTA under a
trick) and its final metrics."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models import set_bn_eval
from ..precision.policy import PrecisionPolicy
from .compile import GRAPH_MODES, GraphCalls, mark_step
from .loop import Loop, LoopState, Scored, Window
from .step import forward, image_forward, train_step
from .tricks import tta_logits


def evaluate(model, batches, policy: PrecisionPolicy, tta: bool = False,
             compile_mode: str = "none") -> tuple[float, float, float | None]:
    """Mean cross-entropy and accuracy over every sample of `batches` (no label smoothing), and with
    tta the accuracy of the mean logits of each image and its mirror (None without). Under CUDA
    graphs (compile_mode) each call of the model is a graph step of its own, its output cloned out
    of the graph's pool (GraphCalls)."""
    model = GraphCalls(model, compile_mode) if compile_mode in GRAPH_MODES else model
    model.eval()
    loss_sum = torch.zeros((), device=policy.device, dtype=torch.float64)
    correct = torch.zeros((), device=policy.device, dtype=torch.int64)
    correct_tta = torch.zeros_like(correct)
    n = 0
    with torch.no_grad(), policy.autocast():
        for x, y in batches:
            x = policy.cast_input(x)
            out, out_tta = tta_logits(model, x) if tta else (model(x).float(), None)
            loss_sum += F.cross_entropy(out, y, reduction="sum")
            correct += (out.argmax(1) == y).sum()
            if tta:
                correct_tta += (out_tta.argmax(1) == y).sum()
            n += len(y)
    model.train()
    return loss_sum.item() / n, correct.item() / n, correct_tta.item() / n if tta else None


@dataclass
class ImageSteps:
    """An image classifier's part of the loop: its training step, its evaluation, its final metrics.
    ema: a tricks.EMA, updated after every optimizer step and evaluated instead of the model. tta:
    test accuracy (and time to target) from flip test-time augmentation; the final evaluation
    reports both. setup_time_s: preparation timed apart from training (the whitening fit), reported
    beside train_time_s. bn_eval: BatchNorm stays in eval."""
    model: nn.Module
    schedule: object
    test_batches: object
    label_smoothing: float = 0.0
    loss_sum: bool = False
    ema: object = None
    tta: bool = False
    bn_eval: bool = False
    setup_time_s: float = 0.0
    rate = "samples_per_s"

    def start_epoch(self, batch: int) -> None:
        self.model.train()
        if self.bn_eval:
            set_bn_eval(self.model)

    def step(self, x, y, loop: Loop, state: LoopState):
        """One batch trained; returns (its mean loss, its correct count, its size) on the device."""
        # CUDA graphs: a new step (nothing compiled is kept past it)
        mark_step(loop.trainer.compile)
        policy = loop.policy
        loop.probe.before_step(state.step + 1, policy)
        # step 1 only: a blank batch, one label
        loop.probe.see_batch(state.step + 1, x, y, policy)
        loss, out = image_forward(self.model, x, y, policy, self.label_smoothing, self.loss_sum)
        # eager ops on the step's output, before the next step
        correct = (out.detach().argmax(1) == y).sum()
        # the probe replays a batch on one rank: not through DDP
        inner = getattr(self.model, "module", self.model)
        # no closure
        train_step(loss, loop, state, replay=functools.partial(forward, inner, x, policy))
        if self.ema is not None:
            self.ema.update(self.model)
        self.schedule.step()
        return loss.detach() / len(y) if self.loss_sum else loss.detach(), correct, len(y)

    def row(self, loss: float, window: Window, loop: Loop) -> dict:
        return {"acc": window.correct_total / max(window.samples, 1)}

    def evaluate(self, state: LoopState, loop: Loop, final: bool) -> dict:
        b, scored = state.best, Scored(self.test_batches, loop, spread=True)
        loss, plain, tta = evaluate(
            self.model if self.ema is None else self.ema.model,
            scored,
            loop.policy,
            tta=self.tta or final,
            compile_mode=loop.trainer.compile,
        )
        acc = tta if self.tta else plain
        b.update(test_loss=loss, test_acc=acc, acc_plain=plain, acc_tta=tta,
                 best_acc=acc if b.get("best_acc") is None else max(b["best_acc"], acc))
        target = loop.trainer.target_acc
        if target is not None and b.get("time_to_target") is None and acc >= target:
            b.update(time_to_target=loop.clock.total, epochs_to_target=state.epoch + 1)
        return {"test_loss": loss, "test_acc": acc, "test_acc_no_tta": plain, "test_acc_tta": tta,
                "eval_samples": scored.count}

    def metrics(self, state: LoopState, loop: Loop) -> dict:
        b, done = state.best, loop.status == "completed"
        return {
            "final_test_acc": b.get("test_acc") if done else None,
            "final_test_loss": b.get("test_loss") if done else None,
            "final_test_acc_no_tta": b.get("acc_plain") if done else None,
            "final_test_acc_tta": b.get("acc_tta") if done else None,
            "best_test_acc": b.get("best_acc"),
            "setup_time_s": self.setup_time_s,
            "time_to_target_s": b.get("time_to_target"),
            "epochs_to_target": b.get("epochs_to_target"),
            "target_acc": loop.trainer.target_acc,
        }
