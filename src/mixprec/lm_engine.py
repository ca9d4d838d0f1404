"""The language-model loop: truncated BPTT over a batchified token stream, as PyTorch's word_language_model.

Each epoch walks the training stream (batchify: [nbatch, batch] on the device) in bptt windows (TokenWindows),
the hidden state starting at zeros and carried from window to window, cut from the previous window's graph
(repackage_hidden) so that backward stops at the window's start. A step is engine.train_step: backward of the
(scaled) loss, then PrecisionPolicy.step: unscale, clip the global norm to trainer.grad_clip (the fp32 master
gradients under master weights), step. After each epoch the validation and test splits are scored in
perplexity, exp(mean cross-entropy per token), with the hidden state carried across their windows too; a
`plateau` schedule then divides the lr by its factor when the validation loss did not improve (the example's
rule; per-step schedules are stepped per window instead). The test perplexity of the best validation epoch is
the example's reported number (it reloads the best model and scores the test split).

Timing and the non-finite policy are the image engine's: TrainClock (eval excluded; each reading synchronizes),
throughput in tokens/s without the first trainer.warmup_steps windows, one host sync per trainer.log_every
windows (engine.check_window).

Autocast and the recurrent layers: on CUDA, autocast runs cuDNN's RNN (every kind) in fp16: its autocast
wrapper (aten/src/ATen/cudnn/AutocastRNN.cpp) casts input, hidden state and the flat weights to fp16. The
embedding is not on autocast's lists (its output stays fp32) and the decoder (linear) runs in fp16. On a CPU,
autocast sends nn.LSTM to oneDNN's fp16/bf16 LSTM, which fails on CPUs without AVX512-BF16/AMX ("could not
create a primitive descriptor for the LSTM forward propagation primitive"); this loop therefore turns oneDNN
off inside CPU autocast, and nn.LSTM then runs PyTorch's own kernel in fp32 (autocast leaves it there); nn.GRU
is not on CPU autocast's list (fp32) while nn.RNN runs in the autocast dtype. Low-precision weights (half, o2,
bf16) need none of this: the RNN runs in the weights' dtype on both devices.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import TrainerConfig
from .engine import TrainClock, Window, check_window, loop_metrics, train_step
from .precision import PrecisionPolicy
from .probe import Attribution
from .rnnlm import repackage_hidden
from .wikitext import TokenWindows


def perplexity(loss: float) -> float:
    """exp(loss); inf where exp overflows (a diverged model), nan stays nan."""
    return math.inf if loss > 709.0 else math.exp(loss)


@contextlib.contextmanager
def autocast(policy: PrecisionPolicy):
    """The policy's autocast, with oneDNN off under CPU autocast (see the module docstring)."""
    if policy.device.type != "cpu" or policy.autocast_dtype is None:
        with policy.autocast():
            yield
        return
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        with policy.autocast():
            yield
    finally:
        torch.backends.mkldnn.enabled = was


def forward(model, x: torch.Tensor, y: torch.Tensor, hidden, policy: PrecisionPolicy):
    """One window: the hidden state detached from the previous window, the forward under the policy, and the
    mean cross-entropy per token (computed in fp32). Returns (loss, logits, next hidden state)."""
    hidden = repackage_hidden(hidden)
    with autocast(policy):
        out, hidden = model(x, hidden)
    loss = F.cross_entropy(out.float().view(-1, out.size(-1)), y.reshape(-1))
    return loss, out, hidden


def evaluate(model, source: torch.Tensor, bptt: int, policy: PrecisionPolicy) -> float:
    """Mean cross-entropy per token over every target of a batchified split: ((rows - 1) x columns) tokens."""
    model.eval()
    hidden = model.init_hidden(source.size(1))
    total = torch.zeros((), device=source.device, dtype=torch.float64)
    with torch.no_grad():
        for x, y in TokenWindows(source, bptt):
            loss, _, hidden = forward(model, x, y, hidden, policy)
            total += loss.double() * y.numel()
    model.train()
    return total.item() / ((len(source) - 1) * source.size(1))


def train(model, policy: PrecisionPolicy, optimizer, schedule, train_source: torch.Tensor,
          valid_source: torch.Tensor, test_source: torch.Tensor, trainer: TrainerConfig, bptt: int, *,
          log=lambda row: None, progress: bool = True, probe: Attribution | None = None) -> dict:
    device = policy.device
    probe = probe or Attribution()
    clock = TrainClock(device)
    windows = TokenWindows(train_source, bptt)
    steps_per_epoch = len(windows)
    total_steps = trainer.epochs * steps_per_epoch
    if trainer.max_steps is not None:
        total_steps = min(total_steps, trainer.max_steps)
    plateau = isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau)
    state = {"step": 0, "samples": 0, "skipped": 0, "nonfinite_steps": 0, "nonfinite": None, "steady_samples": 0,
             "scale_min": policy.scale_value, "scale_max": policy.scale_value}
    epochs, best = [], None   # best: the epoch record with the lowest validation loss
    status, reason, running = "completed", None, True

    def flush(window: Window, epoch: int) -> bool:
        nonlocal status, reason
        loss, what = check_window(window, state, policy, trainer, probe=probe)
        elapsed = time.perf_counter() - window.t0
        log({"kind": "train", "step": state["step"], "epoch": epoch + 1, "loss": loss, "ppl": perplexity(loss),
             "lr": optimizer.param_groups[0]["lr"], "loss_scale": policy.scale_value,
             "tokens_per_s": window.samples / elapsed if elapsed > 0 else None})
        if what is not None and trainer.on_nonfinite == "stop":
            status, reason = "diverged", what
            return False
        return True

    for epoch in range(trainer.epochs):
        if not running or state["step"] >= total_steps:
            break
        model.train()
        hidden = model.init_hidden(train_source.size(1))
        bar = tqdm(total=min(steps_per_epoch, total_steps - state["step"]), desc=f"epoch {epoch + 1}/{trainer.epochs}",
                   disable=not progress, leave=False, dynamic_ncols=True)
        window = Window(first_step=state["step"] + 1)
        clock.start()
        for i, (x, y) in enumerate(windows):
            probe.before_step(state["step"] + 1, policy)
            start, (loss, _, hidden) = hidden, forward(model, x, y, hidden, policy)
            train_step(loss, policy, optimizer, trainer, state, probe=probe,
                       replay=lambda: forward(model, x, y, start, policy))
            if not plateau:
                schedule.step()
            state["step"] += 1
            state["samples"] += y.numel()
            if state["step"] > trainer.warmup_steps:
                state["steady_samples"] += y.numel()
            window.losses.append(loss.detach())
            window.samples += y.numel()
            bar.update(1)
            if state["step"] == trainer.warmup_steps:
                clock.mark_warm()
            last = i + 1 == steps_per_epoch or state["step"] >= total_steps
            if state["step"] % trainer.log_every == 0 or last:
                running = flush(window, epoch)
                bar.set_postfix(loss=f"{window.losses[-1].item():.3f}")
                window = Window(first_step=state["step"] + 1)
            if not running or state["step"] >= total_steps:
                break
        epoch_time = clock.stop()
        bar.close()
        record = {"kind": "epoch", "epoch": epoch + 1, "step": state["step"], "epoch_time_s": epoch_time,
                  "train_time_s": clock.total, "lr": optimizer.param_groups[0]["lr"]}
        if running:
            t_eval = time.perf_counter()
            valid_loss = evaluate(model, valid_source, bptt, policy)
            test_loss = evaluate(model, test_source, bptt, policy)
            record.update(valid_loss=valid_loss, valid_ppl=perplexity(valid_loss), test_loss=test_loss,
                          test_ppl=perplexity(test_loss), eval_time_s=time.perf_counter() - t_eval)
            if best is None or valid_loss < best["valid_loss"]:
                best = record
            if plateau:
                schedule.step(valid_loss)
                record["annealed"] = optimizer.param_groups[0]["lr"] < record["lr"]
        epochs.append(record)
        log(record)

    final = epochs[-1] if epochs and status == "completed" else {}
    return {
        "status": status,
        "reason": reason,
        "nonfinite": state["nonfinite"],
        "metrics": {
            **loop_metrics(state, steps_per_epoch, clock, epochs, trainer, policy),
            "tokens": state["samples"],
            "final_valid_loss": final.get("valid_loss"),
            "final_valid_ppl": final.get("valid_ppl"),
            "final_test_loss": final.get("test_loss"),
            "final_test_ppl": final.get("test_ppl"),
            "best_valid_ppl": best and best["valid_ppl"],
            "best_valid_epoch": best and best["epoch"],
            "test_ppl_at_best_valid": best and best["test_ppl"],
            "final_test_acc": None,   # a language model has no accuracy: perplexity instead
            "best_test_acc": None,
            "final_lr": optimizer.param_groups[0]["lr"],
            "throughput_unit": "tokens/s",
        },
        "epochs": epochs,
    }
