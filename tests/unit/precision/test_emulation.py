"""Emulated fp16/bf16 (precision/emulation.py) against the real dtypes, op by op and model by model.

The reference is the CPU's own float16/bfloat16 kernels (slow but exact IEEE: each op computes in
fp32 and rounds its output, as CUDA's do), under the same CUDA autocast policy
(emulation.AutocastMode on real tensors). Bounds:
- elementwise ops, views, copies, pooling, softmax: bit-identical (ELEMENTWISE);
- matmul, linear, convolution, sums: within 1 ulp of each element (ACCUMULATING): both sum in fp32,
  the CPU's Half GEMM and oneDNN's fp32 one in their own order; and within 1 ulp of fp32 arithmetic
  rounded once (a GPU kernel's), gradients included. Not every CPU's real-dtype convolution is that
  kernel: without oneDNN support for the dtype (AMD EPYC with AVX2, for one) PyTorch runs
  slow_conv2d, whose weight gradient is rounded to the low dtype after each sample (measured:
  hundreds of ulps from the once-rounded value); there the convolution's gradients are checked
  against the once-rounded reference only;
- ops that reduce (BatchNorm, LayerNorm, attention, log_softmax's backward, cross-entropy): every
  element within 2 units in the last place of the tensor's largest magnitude (REDUCING): the kernels
  sum in fp32 in a different order, and a difference after cancellation is small against the tensor,
  large against the element;
- tanh's and sigmoid's backward: CUDA's kernels compute them in the storage type, rounding after
  every operator (`a * (scalar_t{1.} - b * b)` with c10::Half arithmetic); the CPU's own kernels
  round tanh's once (and bf16 sigmoid's once), so the CPU reference runs CUDA's formula in
  real-dtype ops (CudaFormulas): bit-identical;
- whole models: the training losses of a few steps within a stated relative bound (rounding
  differences of 1 ulp grow through the steps).
"""
from __future__ import annotations

import contextlib
import copy
import math
import io
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.precision import emulation
from mixprec.precision.emulation import Emulated
from mixprec.train.step import backward_and_step

LOW = [torch.float16, torch.bfloat16]
aten = torch.ops.aten


def real(t):
    """A result as a real tensor: Emulated -> its real-dtype twin; anything else as it is."""
    if isinstance(t, Emulated):
        return t.to_real()
    return t


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference between a and b in units in the last place of b's dtype at b's
    magnitude."""
    a, b = real(a).float(), real(b).float()
    both_nan = a.isnan() & b.isnan()
    fin = b.isfinite() & a.isfinite()
    if not torch.equal(a.isfinite() | both_nan, b.isfinite() | both_nan) or not torch.equal(
        a[~fin & ~both_nan], b[~fin & ~both_nan]
    ):
        return float("inf")
    if not fin.any():
        return 0.0
    info = torch.finfo(real(b).dtype if real(b).dtype in LOW else torch.float16)
    ulp = torch.clamp(b[fin].abs(), min=info.tiny) * info.eps
    return float(((a[fin] - b[fin]).abs() / ulp).max())


class CudaFormulas(TorchDispatchMode):
    """On real float16/bfloat16 tensors, tanh's and sigmoid's backward as CUDA computes them
    (BinaryMiscBackwardOpsKernels.cu: c10::Half/BFloat16 arithmetic, one rounding per operator),
    where the CPU's kernels round tanh_backward once (and bf16 sigmoid_backward once); every other
    op runs the CPU's kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func in (aten.tanh_backward.default, aten.sigmoid_backward.default)
            and args[0].dtype in LOW
        ):
            g, y = args
            return g * (1 - y * y) if func is aten.tanh_backward.default else (g * (1 - y)) * y
        return func(*args, **(kwargs or {}))


def run_op(fn, inputs: list[torch.Tensor], dtype, emulate: bool, grad: bool = True, autocast=None):
    """fn on `inputs` (fp32, cast to dtype unless autocast is given), forward and backward of a
    fixed-weight sum; returns the outputs and the input gradients as real tensors. The real-dtype
    run (emulate=False) takes tanh's and sigmoid's backward as CUDA computes them (CudaFormulas)."""
    with emulation.numerics(emulate), (contextlib.nullcontext() if emulate else CudaFormulas()):
        xs = [
            x.to(dtype) if autocast is None and x.is_floating_point() else x.clone() for x in inputs
        ]
        for x in xs:
            if grad and x.is_floating_point():
                x.requires_grad_(True)
        ctx = emulation.autocast(autocast) if autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            out = fn(*xs)
        outs = out if isinstance(out, (tuple, list)) else [out]
        outs = [o for o in outs if isinstance(o, torch.Tensor)]
        grads = []
        if grad:
            w = [
                torch.linspace(-1, 1, o.numel()).reshape(o.shape).to(o.dtype)
                for o in outs
                if o.requires_grad
            ]
            loss = sum(
                (o.float() * wi.float()).sum()
                for o, wi in zip([o for o in outs if o.requires_grad], w)
            )
            loss.backward()
            grads = [x.grad for x in xs if x.is_floating_point()]
        return [real(o.detach()) for o in outs], [real(g) for g in grads]


def scaled_ulps(a: torch.Tensor, b: torch.Tensor, dtype=None) -> float:
    """The largest difference between a and b in units of eps * the largest magnitude of b
    (non-finite values must agree); eps of `dtype`, else of b's low dtype."""
    a, b = real(a), real(b)
    if ulps(a, b) == float("inf"):
        return float("inf")
    fin = b.float().isfinite()
    if not fin.any():
        return 0.0
    eps = torch.finfo(dtype or (b.dtype if b.dtype in LOW else torch.float16)).eps
    a, b = a.float()[fin], b.float()[fin]
    scale = eps * b.abs().max()
    return (
        float((a - b).abs().max() / scale)
        if scale > 0
        else float((a - b).abs().max() > 0) * float("inf")
    )


def compare(fn, inputs, dtype, bound: float = 0.0, grad: bool = True, autocast=None, metric=ulps,
            native_grads: bool = True):
    """Emulated against the CPU's real-dtype kernels: outputs, and input gradients unless
    native_grads=False. Returns the emulated outputs and gradients, in one list."""
    native = run_op(fn, inputs, dtype, False, grad, autocast)
    emulated = run_op(fn, inputs, dtype, True, grad, autocast)
    assert len(native[0] + native[1]) == len(emulated[0] + emulated[1])
    if native_grads:
        assert_within(emulated[0] + emulated[1], native[0] + native[1], dtype, bound, metric, fn)
    else:
        assert_within(emulated[0], native[0], dtype, bound, metric, fn)
    return emulated[0] + emulated[1]


def assert_within(got: list, want: list, dtype, bound: float, metric=ulps, what=None) -> None:
    """Each tensor of `got` has the dtype and shape of its twin in `want`, and is within `bound` of
    it."""
    assert len(got) == len(want)
    for e, n in zip(got, want):
        assert e.dtype == n.dtype and e.shape == n.shape
        err = metric(e, n, dtype) if metric is scaled_ulps else metric(e, n)
        assert err <= bound, (what, dtype, err)


def rounded_once(fn, inputs: list[torch.Tensor], dtype) -> list[torch.Tensor]:
    """A GPU's accumulating kernel, by definition: fn in fp32 on the inputs rounded to dtype, each
    output and input gradient (of run_op's fixed-weight sum) rounded to dtype once."""
    xs = [x.to(dtype).float().requires_grad_(True) for x in inputs]
    out = fn(*xs)
    w = torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype).float()
    (out * w).sum().backward()
    return [out.detach().to(dtype)] + [x.grad.to(dtype) for x in xs]


def onednn_has(dtype) -> bool:
    """Whether this CPU's PyTorch runs float16/bfloat16 convolutions in oneDNN (fp32 sums, one
    rounding), rather than in slow_conv2d, whose weight gradient is summed sample by sample in the
    low dtype."""
    return (torch.ops.mkldnn._is_mkldnn_fp16_supported() if dtype == torch.float16
            else torch.ops.mkldnn._is_mkldnn_bf16_supported())


def rnd(*shape, scale=1.0):
    return torch.randn(*shape) * scale


torch.manual_seed(0)
X = rnd(4, 8, 6, 6)
ELEMENTWISE = {
    "add": (lambda a, b: a + b, [rnd(64), rnd(64)]),
    "mul": (lambda a, b: a * b, [rnd(64), rnd(64)]),
    "div": (lambda a, b: a / b, [rnd(64), rnd(64) + 3]),
    "sub_scalar": (lambda a: a - 0.25, [rnd(64)]),
    "mul_scalar": (lambda a: a * 0.37, [rnd(64)]),
    "sqrt": (lambda a: a.abs().sqrt(), [rnd(64)]),
    "exp": (lambda a: a.exp(), [rnd(64)]),
    "relu": (F.relu, [rnd(64)]),
    "celu": (lambda a: F.celu(a, 0.3), [rnd(64)]),
    "gelu": (F.gelu, [rnd(64)]),
    "tanh": (torch.tanh, [rnd(64)]),
    "pow": (lambda a: a**2, [rnd(64)]),
    "clamp": (lambda a: a.clamp(-0.5, 0.5), [rnd(64)]),
    "overflow": (lambda a: a * 1e4, [rnd(64, scale=100)]),
    "underflow": (lambda a: a * 1e-6, [rnd(64)]),
    "max_pool2d": (lambda a: F.max_pool2d(a, 2), [X]),
    "avg_pool2d": (lambda a: F.adaptive_avg_pool2d(a, 1), [X]),
    "softmax": (lambda a: a.softmax(-1), [rnd(8, 16)]),
    "cat_view": (lambda a, b: torch.cat([a.t(), b.t()]).reshape(-1)[3:40], [rnd(8, 4), rnd(8, 4)]),
    "embedding": (
        lambda w: F.embedding(torch.tensor([[1, 3], [0, 3]], device=w.device), w),
        [rnd(5, 4)],
    ),
}
ACCUMULATING = {
    "linear": (F.linear, [rnd(8, 32), rnd(16, 32), rnd(16)]),
    "matmul": (torch.matmul, [rnd(2, 8, 32), rnd(32, 8)]),
    "conv2d": (lambda a, w: F.conv2d(a, w, padding=1), [X, rnd(8, 8, 3, 3)]),
    "sum": (lambda a: a.sum(1), [rnd(8, 64)]),
    "mean": (lambda a: a.mean(), [rnd(8, 64)]),
}
REDUCING = {
    "batch_norm_train": (
        lambda a, w, b: F.batch_norm(a, None, None, w, b, training=True),
        [X, rnd(8), rnd(8)],
    ),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, (16,), w, b), [rnd(8, 16), rnd(16), rnd(16)]),
    "log_softmax": (lambda a: a.log_softmax(-1), [rnd(8, 16)]),
    "sdpa": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [rnd(2, 2, 8, 16), rnd(2, 2, 8, 16), rnd(2, 2, 8, 16)],
    ),
    "cross_entropy": (
        lambda a: F.cross_entropy(a, torch.tensor([1, 0, 3, 2], device=a.device)),
        [rnd(4, 10)],
    ),
}


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_ops_are_bit_identical(name, dtype):
    fn, inputs = ELEMENTWISE[name]
    compare(fn, inputs, dtype, bound=0.0)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(ACCUMULATING))
def test_accumulating_ops_within_one_ulp(name, dtype):
    fn, inputs = ACCUMULATING[name]
    # Against the GPU's arithmetic (fp32 sums, one rounding), outputs and gradients, on every CPU: 1
    # ulp an element.
    emulated = run_op(fn, inputs, dtype, True)
    assert_within(
        emulated[0] + emulated[1], rounded_once(fn, inputs, dtype), dtype, bound=1.0, what=name
    )
    if name != "conv2d":   # the CPU's Half/BFloat16 GEMM and sums (fp32 sums): 1 ulp an element
        compare(fn, inputs, dtype, bound=1.0)
        return
    # The CPU's real-dtype convolution is not one kernel: oneDNN's where the CPU supports the dtype
    # (its blocked kernels differ in where they round: 1.85 ulps of an element on the H200's host
    # CPU, fp16, torch 2.11), else slow_conv2d, whose weight gradient is rounded per sample
    # (hundreds of ulps of an element here, on an AVX2 AMD EPYC). Against oneDNN: outputs and
    # gradients within 2 ulps of the tensor's largest value; against slow_conv2d: outputs only.
    compare(fn, inputs, dtype, bound=2.0, metric=scaled_ulps, native_grads=onednn_has(dtype))


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(REDUCING))
def test_reducing_ops_within_two_ulps_of_their_largest_value(name, dtype):
    fn, inputs = REDUCING[name]
    compare(fn, inputs, dtype, bound=2.0, metric=scaled_ulps)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_sigmoid(dtype):
    compare(torch.sigmoid, [rnd(64)], dtype, bound=0.0)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["tanh", "sigmoid"])
def test_backward_from_the_output_rounds_each_step_as_cuda(name, dtype):
    """CUDA's tanh_backward and sigmoid_backward round after every operator; rounding once instead
    (the CPU's tanh kernel, the emulation before it followed CUDA) differs in about half the
    elements of this sample."""
    g = torch.linspace(-1, 1, 4096).to(dtype)
    y = (torch.tanh if name == "tanh" else torch.sigmoid)(
        torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 2
    )
    y = y.to(dtype)
    op = aten.tanh_backward.default if name == "tanh" else aten.sigmoid_backward.default
    with emulation.numerics(True):
        got = real(op(Emulated(g.float(), dtype), Emulated(y.float(), dtype)))
    cuda = g * (1 - y * y) if name == "tanh" else (g * (1 - y)) * y
    once = (
        g.float() * (1 - y.float() * y.float())
        if name == "tanh"
        else g.float() * (1 - y.float()) * y.float()
    )
    assert torch.equal(got, cuda)
    assert (once.to(dtype) != cuda).sum() > 100   # the sample tells the two apart


def test_numbers_in_an_op_stay_unrounded_as_in_cuda_kernels():
    """x - 0.1 on fp16: CUDA's binary kernels read the CPU scalar in fp32 (Loops.cuh), so the result
    is half(float(x) - 0.1f), not half(float(x) - float(half(0.1))) as the CPU's Half sub
    computes."""
    x = rnd(256)
    with emulation.numerics(True):
        out = (x.half() - 0.1).to_real()
    assert torch.equal(out, (x.half().float() - 0.1).half())


# -- CUDA autocast's policy ------------------------------------------------------------------------
def autocast_header() -> str:
    path = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not path.exists():
        pytest.skip(f"{path} is not in this PyTorch wheel")
    return path.read_text()


def header_list(text: str, macro: str) -> set[str]:
    body = re.search(rf"#define {macro}\(_\)(.*?)(?:\n\n|\n#)", text, re.S).group(1)
    return set(re.findall(r"_\((?:ADD_NS\()?(\w+)", body))


@pytest.mark.parametrize(
    "macro, rule",
    [
        ("AT_FORALL_LOWER_PRECISION_FP", "lower"),
        ("AT_FORALL_FP32", "fp32"),
        ("AT_FORALL_FP32_SET_OPT_DTYPE", "fp32"),
        ("AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE", "fp32"),
        ("AT_FORALL_PROMOTE", "promote"),
    ],
)
def test_every_op_of_the_installed_cuda_autocast_lists_is_handled(macro, rule):
    ops = header_list(autocast_header(), macro)
    assert ops, macro
    wrong = {op: emulation.cast_rule(op) for op in ops if emulation.cast_rule(op) != rule}
    assert not wrong, f"{macro}: {wrong}"


AUTOCAST = {
    "conv2d": (lambda a, w: F.conv2d(a, w, padding=1), [X, rnd(8, 8, 3, 3)]),
    "linear": (F.linear, [rnd(8, 32), rnd(16, 32), rnd(16)]),
    "matmul_operator": (lambda a, b: a @ b, [rnd(8, 32), rnd(32, 8)]),
    "softmax": (lambda a: a.softmax(-1), [rnd(8, 16)]),
    "cross_entropy": (
        lambda a, w: F.cross_entropy(F.linear(a, w), torch.tensor([1, 0, 3, 2], device=a.device)),
        [rnd(4, 16), rnd(10, 16)],
    ),
    "layer_norm_after_linear": (
        lambda a, w: F.layer_norm(F.linear(a, w), (16,)),
        [rnd(8, 32), rnd(16, 32)],
    ),
    "sdpa": (
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        [rnd(2, 2, 8, 16), rnd(2, 2, 8, 16), rnd(2, 2, 8, 16)],
    ),
}
EXPECTED = {"conv2d": "low", "linear": "low", "matmul_operator": "low", "softmax": torch.float32,
            "cross_entropy": torch.float32, "layer_norm_after_linear": torch.float32, "sdpa": "low"}


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(AUTOCAST))
def test_autocast_ops_match_the_real_dtypes(name, dtype):
    fn, inputs = AUTOCAST[name]
    with emulation.numerics(True), emulation.autocast(dtype):
        out = fn(*inputs)
    assert out.dtype == (dtype if EXPECTED[name] == "low" else EXPECTED[name])
    compare(fn, inputs, dtype, bound=2.0, autocast=dtype, metric=scaled_ulps)


def test_autocast_casts_are_recorded_by_autograd():
    """The fp32 weight's gradient comes back through the cast: fp32, from an fp16 matmul's fp16
    gradient."""
    w = rnd(16, 32).requires_grad_(True)
    with emulation.numerics(True):
        with emulation.autocast(torch.float16):
            out = F.linear(rnd(8, 32), w)
        out.float().sum().backward()
    assert (
        out.dtype == torch.float16
        and type(w.grad) is torch.Tensor
        and w.grad.dtype == torch.float32
    )
    assert torch.equal(w.grad, w.grad.half().float())   # it was an fp16 gradient, cast back to fp32


def test_autocast_off_inside_an_emulated_region():
    with emulation.numerics(True), emulation.autocast(torch.bfloat16):
        assert emulation.autocast_dtype("cpu") == torch.bfloat16
        with emulation.autocast_off("cpu"):
            assert emulation.autocast_dtype("cpu") is None
            assert torch.matmul(rnd(2, 2), rnd(2, 2)).dtype == torch.float32
        assert emulation.autocast_dtype("cpu") == torch.bfloat16


# -- layers, optimizers, loss scaling --------------------------------------------------------------
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_lstm_within_bound(dtype):
    """nn.LSTM in fp16 runs PyTorch's per-step cell on the CPU, each intermediate rounded: the
    emulation does the same at fp32 speed."""
    torch.manual_seed(0)
    lstm = nn.LSTM(16, 16, 2)
    x = rnd(5, 3, 16)

    def fn(inp):
        return lstm(inp)[0]

    def run(emulate):
        with emulation.numerics(emulate):
            m = copy.deepcopy(lstm).to(dtype)
            xi = x.to(dtype).requires_grad_(True)
            out = m(xi)[0]
            out.float().sum().backward()
            return [real(out.detach()), real(xi.grad), real(m.weight_hh_l0.grad)]
    for e, n in zip(run(True), run(False)):
        assert scaled_ulps(e, n) <= 2.0


def optimizer_steps(name: str, dtype, emulate: bool, eps: float = 1e-8, steps: int = 3, **impl):
    torch.manual_seed(0)
    w0, grads = rnd(64, scale=0.1), [rnd(64, scale=s) for s in (1e-3, 1e-5, 1e-6)][:steps]
    grads[0][::4] = 0.0   # a weight that got no gradient (a dead unit): Adam's m and v stay 0 there
    with emulation.numerics(emulate):
        p = w0.to(dtype).requires_grad_(True)
        opt = (torch.optim.SGD([p], lr=0.125, momentum=0.875, **impl) if name == "sgd"
               else torch.optim.Adam([p], lr=1e-3, eps=eps, **impl))
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
        return real(p.detach()), [
            real(v) for v in opt.state[p].values() if torch.is_tensor(v) and v.dim()
        ]


def fused_sgd_arithmetic(dtype, steps: int = 3):
    """optimizer_steps' SGD as CUDA's fused kernel computes it (FusedSgdKernel.cu, sgd_math): buf =
    momentum * buf + g in fp32 (the first step: g), stored rounded; p -= lr * buf with the fp32 buf
    before its rounding, lr a double; each stored tensor rounded once (lr and momentum are 1/8 and
    7/8: the products are exact)."""
    torch.manual_seed(0)
    w0, grads = rnd(64, scale=0.1), [rnd(64, scale=s) for s in (1e-3, 1e-5, 1e-6)][:steps]
    grads[0][::4] = 0.0
    p, stored = w0.to(dtype).float(), None
    for g in grads:
        g = g.to(dtype).float()
        buf = g if stored is None else 0.875 * stored + g
        stored = buf.to(dtype).float()
        p = (p.double() - 0.125 * buf.double()).float().to(dtype).float()
    return p.to(dtype), [stored.to(dtype)]


@pytest.mark.parametrize("impl", [{"foreach": True}, {"foreach": False}, {"fused": True}],
                         ids=["foreach", "loop", "fused"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_optimizer_steps_on_low_precision_weights(name, dtype, impl):
    """Adam's steps (foreach, loop, fused) are bit-identical. SGD's weight update `p + (-lr) * buf`
    is within 1 ulp: the fp32 kernel (as CUDA's) fuses it into one fma, the CPU's Half kernel rounds
    the product first. SGD's lr and momentum are representable here: the CPU's foreach Half kernels
    round a scalar to fp16/bf16 before using it, CUDA's (ATen/native/cuda/ForeachBinaryOpScalar.cu:
    opmath_t) and the emulation do not."""
    if name == "sgd" and impl.get("fused"):
        # The reference for fused SGD is its arithmetic, not the CPU's kernel: torch 2.11's fused
        # Half/BFloat16 SGD on the CPU (its vectorized path) loses the momentum, its buffer comes
        # out as the last gradient (146 ulps off the weights; torch 2.14.1's is right). CUDA's fused
        # kernel computes in fp32 and rounds each store.
        (pe, se), (pn, sn) = optimizer_steps(name, dtype, True, **impl), fused_sgd_arithmetic(dtype)
    else:
        (pe, se), (pn, sn) = (
            optimizer_steps(name, dtype, True, **impl),
            optimizer_steps(name, dtype, False, **impl),
        )
    assert ulps(pe, pn) <= (1.0 if name == "sgd" and not impl.get("fused") else 0.0)
    for e, n in zip(se, sn):
        assert ulps(e, n) == 0.0


def test_adam_eps_rounds_to_zero_in_fp16_and_turns_weights_nan():
    """The pitfall: eps=1e-8 is 0 in fp16; where the moments are 0 the update is 0/0, where only the
    second moment underflowed it is m/0 = inf."""
    p, _ = optimizer_steps("adam", torch.float16, True, eps=1e-8, foreach=True)
    assert p[::4].isnan().all() and p.isinf().any()
    p, _ = optimizer_steps("adam", torch.float16, True, eps=1e-4, foreach=True)
    assert p.isfinite().all()


def test_grad_scaler_refuses_fp16_gradients_as_on_a_gpu():
    with emulation.numerics(True):
        p = rnd(4).half().requires_grad_(True)
        opt = torch.optim.SGD([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(p.float().sum()).backward()
        with pytest.raises(ValueError, match="FP16 gradients"):
            scaler.unscale_(opt)


def test_grad_scaler_skips_an_overflowing_fp16_backward():
    """Under emulated amp a scale of 2**24 makes the fp16 gradient inf: GradScaler skips the step
    and halves."""
    with emulation.numerics(True):
        w = rnd(8, 8).requires_grad_(True)
        opt = torch.optim.SGD([w], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
        with emulation.autocast(torch.float16):
            out = F.linear(rnd(4, 8, scale=100), w)
        scaler.scale(out.float().pow(2).sum()).backward()
        before = w.detach().clone()
        scaler.step(opt)
        scaler.update()
    assert torch.equal(w.detach(), before) and scaler.get_scale() == 2.0 ** 23


# -- tensors and modules ---------------------------------------------------------------------------
def test_module_half_makes_emulated_parameters_that_copy_and_save_as_real_tensors(tmp_path):
    with emulation.numerics(True):
        m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()
        m[1].float()
        assert isinstance(m[0].weight, Emulated) and isinstance(m[0].weight, nn.Parameter)
        assert type(m[1].weight) is nn.Parameter and m[1].weight.dtype == torch.float32
        twin = copy.deepcopy(m)
        assert isinstance(twin[0].weight, Emulated) and torch.equal(
            twin[0].weight.to_real(), m[0].weight.to_real()
        )
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert type(state["0.weight"]) is torch.Tensor and state["0.weight"].dtype == torch.float16
    assert torch.equal(state["0.weight"], m[0].weight.to_real())
    with emulation.numerics(True):
        fresh = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).half()
        fresh.load_state_dict(state)
        assert isinstance(fresh[0].weight, Emulated) and torch.equal(
            fresh[0].weight.to_real(), state["0.weight"]
        )


def test_emulated_values_are_representable():
    with emulation.numerics(True):
        x = rnd(1000) * 3
        for dt in LOW:
            y = (x.to(dt) * 1.1 + 0.3).exp()
            assert torch.equal(y._data, y._data.to(dt).float())
            assert y.dtype == dt and torch.equal(y.to_real().float(), y._data)


# -- whole models: a few training steps, emulated against the real dtypes --------------------------
MODELS = {
    "resnet18": ["model=resnet18"],
    "resnet9": ["model=resnet9", "model.channels=[8,16,32,64]"],
    "lstm": [
        "model=lstm",
        "dataset=synthetic_text",
        "model.emsize=32",
        "model.nhid=32",
        "model.dropout=0",
    ],
    "gpt": [
        "model=gpt",
        "dataset=synthetic_text",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "model.dropout=0",
        "dataset.bptt=8",
    ],
}


def train_losses(
    model_name: str, precision: str, emulate: bool, steps: int = 3, device: str = "cpu"
) -> list[float]:
    """`steps` optimizer steps of a small model under precision's policy (CUDA autocast's policy
    either way), on emulated or on real fp16/bf16 tensors (on a CUDA device: the GPU's own kernels
    and autocast); the losses."""
    from helpers import compose_config

    from mixprec.config import validate
    from mixprec.models import build_model
    from mixprec.train.optim import build_optimizer
    from mixprec.precision.policy import PrecisionPolicy

    config = validate(
        compose_config(
            *MODELS[model_name],
            f"precision={precision}",
            f"precision.emulate={'auto' if device == 'cuda' else 'true'}",
            "optimizer=sgd",
            "optimizer.lr=0.01",
            f"trainer.device={device}",
        )
    )
    torch.manual_seed(0)
    lm = config.model.is_language_model
    vocab = 50
    model = build_model(config.model, vocab if lm else 10)
    losses = []
    with emulation.numerics(emulate):
        policy = PrecisionPolicy(config.precision, torch.device(device))
        model = policy.prepare_model(model)
        opt = build_optimizer(config.optimizer, policy.optimizer_params(model))
        gen = torch.Generator().manual_seed(1)
        for _ in range(steps):
            if lm:
                x = torch.randint(0, vocab, (8, 4), generator=gen).to(device)
                y = torch.randint(0, vocab, (8, 4), generator=gen).to(device)
                with policy.autocast():
                    out = model(x, model.init_hidden(4) if model_name == "lstm" else None)[0]
                loss = F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1))
            else:
                x, y = (
                    torch.randn(16, 3, 16, 16, generator=gen),
                    torch.randint(0, 10, (16,), generator=gen),
                )
                x, y = x.to(device), y.to(device)
                with policy.autocast():
                    out = model(policy.cast_input(x))
                loss = F.cross_entropy(out.float(), y)
            backward_and_step(loss, policy, opt)
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["amp", "amp_bf16", "half", "bf16", "o2", "apex_fp16"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_whole_models_train_as_with_the_real_dtypes(model_name, precision):
    emulated, native = (
        train_losses(model_name, precision, True),
        train_losses(model_name, precision, False),
    )
    print(model_name, precision, emulated, native)
    assert all(math.isfinite(v) for v in native)
    for e, n in zip(emulated, native):
        assert abs(e - n) <= 0.01 * abs(n), (emulated, native)


# -- against a GPU (pytest -m gpu): the emulation's reference is CUDA's kernels --------------------
def on_cuda(fn, inputs, dtype, autocast=None):
    """fn's outputs and input gradients with real fp16/bf16 tensors on the GPU
    (torch.autocast("cuda") for an autocast op), as CPU tensors."""
    xs = [(x.cuda() if autocast else x.to("cuda", dtype)).requires_grad_(True) for x in inputs]
    with torch.autocast("cuda", dtype=autocast or torch.float16, enabled=autocast is not None):
        out = fn(*xs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    w = [torch.linspace(-1, 1, o.numel(), device="cuda").reshape(o.shape) for o in outs]
    sum((o.float() * wi).sum() for o, wi in zip(outs, w)).backward()
    return [o.detach().cpu() for o in outs] + [x.grad.cpu() for x in xs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(ELEMENTWISE) + sorted(ACCUMULATING) + sorted(REDUCING))
def test_emulated_cpu_ops_match_cuda(name, dtype):
    """Elementwise ops within 1 ulp (CUDA's fp32 math library may differ from the CPU's by an fp32
    ulp, which rounding to fp16/bf16 can make one ulp); the rest within 2 ulps of the tensor's
    largest value. The gradient of an op whose backward reads its output (tanh, softmax) is checked
    from the same output (below): a 1-ulp difference of tanh(x) near +-1 is many ulps of 1 -
    tanh(x)**2."""
    fn, inputs = {**ELEMENTWISE, **ACCUMULATING, **REDUCING}[name]
    out, grads = run_op(fn, inputs, dtype, True)
    for i, (e, c) in enumerate(zip(out + grads, on_cuda(fn, inputs, dtype))):
        what = (name, dtype, "output" if i < len(out) else f"gradient {i - len(out)}")
        assert e.dtype == c.dtype, what
        if name in BACKWARD_OF_OUTPUT and i >= len(out):
            check_backward_on_cuda(name, out[0], grads[0], dtype)
        elif name in ELEMENTWISE:
            assert ulps(e, c) <= 1.0, what + (ulps(e, c),)
        else:
            assert scaled_ulps(e, c, dtype) <= 2.0, what + (scaled_ulps(e, c, dtype),)


BACKWARD_OF_OUTPUT = {"tanh", "softmax"}


def check_backward_on_cuda(name, y, grad, dtype):
    """The emulated gradient against CUDA's backward kernel run on the same output y and upstream
    gradient g (run_op's fixed weights). tanh: bit-identical (both round after each operator).
    softmax: CUDA sums g*y over the row in fp32 in a warp's order (PersistentSoftmax.cuh), the
    emulation in the CPU's; the sums differ by at most (n-1) * 2**-24 * sum|g*y|, which y * (g -
    sum) carries to an element as y_j times that, before both round: |e - c| <= ulp(c) + y_j *
    ((n+1) * 2**-24 * (sum|g*y| + |g_j|)) (docs/numerics.md)."""
    g = torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(dtype)
    if name == "tanh":
        cuda = aten.tanh_backward(g.cuda(), y.cuda()).cpu()
        assert torch.equal(grad, cuda), (name, dtype, ulps(grad, cuda))
        return
    cuda = aten._softmax_backward_data(g.cuda(), y.cuda(), -1, dtype).cpu()
    yf, gf, e, c = y.float(), g.float(), grad.float(), cuda.float()
    n = y.shape[-1]
    slack = yf * (n + 1) * 2.0 ** -24 * ((gf * yf).abs().sum(-1, keepdim=True) + gf.abs())
    ulp = torch.clamp(c.abs(), min=torch.finfo(dtype).tiny) * torch.finfo(dtype).eps
    assert ((e - c).abs() <= ulp + slack).all(), (name, dtype, float(((e - c).abs() / ulp).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(AUTOCAST))
def test_emulated_autocast_matches_cuda_autocast(name, dtype):
    fn, inputs = AUTOCAST[name]
    out, grads = run_op(fn, inputs, dtype, True, autocast=dtype)
    for e, c in zip(out + grads, on_cuda(fn, inputs, dtype, autocast=dtype)):
        assert e.dtype == c.dtype, (name, e.dtype, c.dtype)
        assert scaled_ulps(e, c, dtype) <= 2.0, (name, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["amp", "amp_bf16", "half", "o2"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_whole_models_train_emulated_on_the_cpu_as_on_cuda(model_name, precision):
    emulated, cuda = (
        train_losses(model_name, precision, True),
        train_losses(model_name, precision, False, device="cuda"),
    )
    for e, c in zip(emulated, cuda):
        assert abs(e - c) <= 0.01 * abs(c), (emulated, cuda)


# -- a job -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("emulate", ["auto", "false"])
def test_a_job_records_and_shows_its_arithmetic(tmp_path, emulate):
    from helpers import run_tiny

    from mixprec.report.analyse import precision_label, sweep_rows
    from mixprec.report.console import job_block, sweep_note

    s = run_tiny(tmp_path, "precision=amp", f"precision.emulate={emulate}", "dataset.image_size=8")
    assert s["status"] == "completed"
    emulated = emulate == "auto"   # on this CPU: auto emulates
    assert s["arithmetic"] == ("emulated" if emulated else "native")
    assert ("numerics    emulated" in job_block(s)) == emulated
    assert precision_label(s) == ("amp(emulated)" if emulated else "amp")
    assert sweep_rows([s])[0]["speedup"] is None
    assert ("(emulated): fp16/bf16 rounding emulated" in (sweep_note([s]) or "")) == emulated


def test_compile_is_refused_under_emulation(tmp_path):
    from helpers import run_tiny

    # a single job that fails ends the process, its summary written
    with pytest.raises(SystemExit):
        run_tiny(tmp_path, "precision=amp", "trainer.compile=default")
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "failed" and "runs eagerly; use trainer.compile=none" in s["error"]


def test_fp8_bf16_part_emulated_as_with_the_real_dtype():
    """precision=fp8: torchao's float8 Linear layers (its own emulation on a CPU) beside the bf16
    autocast part, which runs emulated here: 3 steps of a small GPT, emulated against real bf16
    tensors, losses within 1%."""
    emulated, native = train_losses("gpt", "fp8", True), train_losses("gpt", "fp8", False)
    for e, n in zip(emulated, native):
        assert abs(e - n) <= 0.01 * abs(n), (emulated, native)


def test_a_bad_emulate_value_is_one_line():
    from helpers import compose_config

    from mixprec.config import ConfigError, validate

    with pytest.raises(
        ConfigError, match=r"^precision.emulate='maybe': allowed values are true, false, auto$"
    ):
        validate(compose_config("precision=amp", "precision.emulate=maybe"))
