"""Emulated fp16/bf16 numerics: a GPU's rounding around fp32 kernels, at close to fp32 speed on a
CPU.

PyTorch's CUDA kernels compute a half or bfloat16 op in fp32 ("opmath") and round the result to the
storage type; matmuls and convolutions take fp16/bf16 inputs, accumulate in fp32 and round the
output. A CPU's own fp16/bf16 kernels are exact IEEE too but run reference code, far slower than
fp32 (docs/numerics.md). Emulation keeps fp32 storage and kernels and rounds wherever the real run
would store an fp16/bf16 tensor:

- `Emulated` is a tensor that reports dtype float16 or bfloat16 and holds an fp32 tensor (`_data`)
  whose values are exactly representable in that dtype. Everything above the dispatcher (autograd,
  nn.Module.half(), GradScaler's fp16-gradient check, the optimizers' grouping by dtype) sees the
  low-precision dtype.
- `EmulationMode`, a TorchDispatchMode active for the whole job, runs every op that touches a
  low-precision tensor (or asks for a low dtype) on the fp32 data, and rounds each new low-precision
  output once, as the CUDA kernel does: `x.to(dtype).to(float32)` is round-to-nearest-even, the
  conversion the kernels' stores make. The output dtypes are those of the real op, found by running
  it once on meta tensors of the real dtypes (cached). In-place ops round what they wrote, views
  share the data unrounded (it is representable already). Ops with no low-precision tensor run
  untouched: fp32 work costs nothing extra.
- `autocast(dtype)`, a TorchFunctionMode, applies CUDA autocast's policy, not the CPU's: the op
  lists of the installed PyTorch's ATen/autocast_mode.h (tests/unit/precision/test_emulation.py
  parses the header and checks every op is here). It sits above autograd, so its casts are
  recorded and the gradients are rounded on the way back.

Numbers in an op (`x * 0.1`) stay unrounded, as in CUDA's binary kernels, which read a CPU scalar in
fp32 (ATen/native/cuda/Loops.cuh: scalar_value<opmath_t>; a CPU's Half kernels round some of them
first). Where it differs from a GPU (docs/numerics.md measures it): a kernel's accumulation order
(matmul, conv, sums); cuDNN's fused RNN cell, which keeps the gate arithmetic in fp32 where the
emulation (PyTorch's per-step LSTM, as a CPU runs it in fp16) rounds every intermediate; libraries
that may accumulate fp16 GEMMs in reduced precision. Timings of an emulated job are fp32 timings
plus the rounding, never fp16 speed.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

log = logging.getLogger(__name__)

LOW = (torch.float16, torch.bfloat16)
FP32 = torch.float32
aten = torch.ops.aten


class Emulated(torch.Tensor):
    """A float16/bfloat16 tensor held as fp32 values that dtype can represent (see the module
    docstring)."""
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype):
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            dtype=dtype,
            storage_offset=data.storage_offset(),
            device=data.device,
            layout=data.layout,
            requires_grad=False,
        )
        t._data = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with EmulationMode():   # an Emulated tensor used outside a job's mode: the same rules
            return func(*args, **(kwargs or {}))

    def to_real(self) -> torch.Tensor:
        """The same values as a real float16/bfloat16 tensor (exact)."""
        with _disable_current_modes():
            return self._data.to(self.dtype)

    def __repr__(self, *, tensor_contents=None):
        return f"Emulated({self.to_real()!r})"

    def __reduce_ex__(self, proto):
        # saved as a real tensor: checkpoints load anywhere
        return self.to_real().__reduce_ex__(proto)


PLAIN = (torch.Tensor, torch.nn.Parameter, Emulated)


# elements rounded per pass: the fp32 chunk and its fp16 copy stay in the CPU's L2 cache
CHUNK = 1 << 15


def round_(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 `x` to `dtype` in place (round to nearest even, as a kernel's store; the values of
    x.to(dtype).to(float32)): chunk by chunk through a small buffer
    where its elements are dense in memory, so that the data crosses main memory once each way
    (faster than x.to(dtype).to(float32) on large activations: docs/numerics.md)."""
    if x.numel() <= CHUNK:
        return x.copy_(x.to(dtype))
    if x.is_contiguous():
        flat = x.view(-1)
    elif x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        # a view: channels-last data is dense in NHWC order
        flat = x.permute(0, 2, 3, 1).reshape(-1)
    else:
        return x.copy_(x.to(dtype))
    buf = torch.empty(min(CHUNK, flat.numel()), dtype=dtype, device=x.device)
    for chunk in flat.split(CHUNK):
        b = buf[:chunk.numel()]
        b.copy_(chunk)
        chunk.copy_(b)
    return x


def _low(a) -> bool:
    return (isinstance(a, torch.Tensor) and a.dtype in LOW) or (
        isinstance(a, torch.dtype) and a in LOW
    )


def _fp32(a):
    """An argument as the fp32 kernel takes it: Emulated -> its data, a real low tensor -> an fp32
    copy, a low dtype -> float32."""
    if isinstance(a, Emulated):
        return a._data
    if isinstance(a, torch.Tensor) and a.dtype in LOW:
        return a.to(FP32)
    if isinstance(a, torch.dtype) and a in LOW:
        return FP32
    return a


def leaves(args, kwargs=None) -> list:
    """The arguments of an op (or its outputs), lists and tuples opened one level: an aten op's
    nesting."""
    flat = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def mapped(fn, args, kwargs=None):
    """args and kwargs with fn applied to each leaf (see leaves)."""
    def one(a):
        return type(a)(fn(x) for x in a) if isinstance(a, (list, tuple)) else fn(a)
    return tuple(one(a) for a in args), {k: one(v) for k, v in (kwargs or {}).items()}


def _key(a):
    if isinstance(a, torch.Tensor):
        return a.dtype, a.dim() == 0
    if isinstance(a, (torch.dtype, str, bool)) or a is None:
        return a
    return type(a)


def _meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device="meta")
    return torch.device("meta") if isinstance(a, torch.device) else a


_OUT_DTYPES: dict = {}
_FALLBACKS: set = set()
# BatchNorm's running statistics are written in place without an alias annotation in the schema
_WRITES_STATS = {
    aten.native_batch_norm.default: (3, 4),
    aten._native_batch_norm_legit.default: (3, 4),
}


def out_dtypes(func, flat: list, args, kwargs) -> list:
    """The dtypes of func's tensor outputs for these argument dtypes: the real op run once on meta
    tensors. Cached by the argument dtypes, not shapes: a list output's length may differ from the
    cached one's."""
    key = (func, tuple(_key(a) for a in flat))
    found = _OUT_DTYPES.get(key)
    if found is None:
        try:
            margs, mkwargs = mapped(_meta, args, kwargs)
            out = func(*margs, **mkwargs)
            found = [t.dtype for t in leaves(out if isinstance(out, (list, tuple)) else (out,))
                     if isinstance(t, torch.Tensor)]
        # no meta kernel (data-dependent shapes): the low dtype of the inputs, if any
        except Exception:
            if func not in _FALLBACKS:
                _FALLBACKS.add(func)
                log.warning(
                    f"emulation: {func} has no meta kernel; its fp32 outputs take the dtype it was "
                    "asked for, else its inputs' low dtype"
                )
            found = None
        _OUT_DTYPES[key] = found
    return found


_SCHEMA: dict = {}


def schema_facts(func) -> tuple:
    """(the arguments an op writes: (position, name), whether it returns views, whether it returns
    nothing), per op."""
    facts = _SCHEMA.get(func)
    if facts is None:
        s = func._schema
        written = tuple(
            (i, a.name)
            for i, a in enumerate(s.arguments)
            if (a.alias_info is not None and a.alias_info.is_write)
            or i in _WRITES_STATS.get(func, ())
        )
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in s.returns)
        facts = _SCHEMA[func] = (written, views, len(s.returns) == 0)
    return facts


# Ops whose outputs take their values from their inputs (or are 0 or 1): nothing to round when every
# floating input is of the output's low dtype already (tests/unit/precision/test_emulation.py
# checks them against the real dtypes).
EXACT = {
    aten.relu.default,
    aten.relu_.default,
    aten.threshold_backward.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.cat.default,
    aten.stack.default,
    aten.index_select.default,
    aten.embedding.default,
    aten.gather.default,
    aten.where.self,
    aten.constant_pad_nd.default,
    aten.index.Tensor,
    aten.neg.default,
    aten.abs.default,
    aten.amax.default,
    aten.max.default,
    aten.max_pool2d_with_indices.default,
    aten.zeros_like.default,
    aten.zero_.default,
    aten.flip.default,
    aten.roll.default,
    aten.repeat.default,
    aten.max.dim,
    aten.fill_.Scalar,
}


def _exact(func, flat: list, dtype: torch.dtype) -> bool:
    """func only moves values: every floating input tensor already holds `dtype` values."""
    if func not in EXACT or func is aten.fill_.Scalar and not _fits(flat[1], dtype):
        return False
    return all(
        a.dtype == dtype for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point()
    )


def _fits(value, dtype: torch.dtype) -> bool:
    return isinstance(value, (int, float)) and torch.tensor(value, dtype=dtype).item() == value


def _round_written(func, flat: list, originals: list, unwrapped: list) -> None:
    """After an in-place op: round what it wrote into each low-precision argument (or copy it
    back)."""
    for orig, data in zip(originals, unwrapped):
        if isinstance(orig, Emulated):
            if not _exact(func, flat, orig.dtype):
                round_(data, orig.dtype)
        elif isinstance(orig, torch.Tensor) and orig.dtype in LOW:
            orig.copy_(data)


def _mutated_args(func, args, kwargs, fargs, fkwargs) -> tuple[list, list]:
    originals, unwrapped = [], []
    for i, name in schema_facts(func)[0]:
        orig, data = (args[i], fargs[i]) if i < len(args) else (kwargs.get(name), fkwargs.get(name))
        if isinstance(orig, (list, tuple)):
            originals += list(orig)
            unwrapped += list(data)
        elif orig is not None:
            originals.append(orig)
            unwrapped.append(data)
    return originals, unwrapped


def _wrap_outputs(func, flat_args, out, dtypes, originals, unwrapped):
    """Real outputs -> what the op returns: in-place results are the original arguments, views of
    low data are wrapped unrounded, new low-precision outputs are rounded once."""
    back = {id(d): o for o, d in zip(originals, unwrapped)}
    views = schema_facts(func)[1]
    single = not isinstance(out, (list, tuple))
    flat = [out] if single else list(out)
    tensors = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)]
    # a list output (unbind, split): its length varies
    if dtypes is not None and len(dtypes) != len(tensors):
        dtypes = dtypes[:1] * len(tensors) if len(set(dtypes)) == 1 else None
    # no meta kernel: an fp32 output takes the dtype asked for, else the inputs' low one
    if dtypes is None:
        fallback = next((a for a in flat_args if isinstance(a, torch.dtype)), None) or next(
            (a.dtype for a in flat_args if isinstance(a, torch.Tensor) and a.dtype in LOW), FP32)
        dtypes = [fallback if flat[i].dtype == FP32 else flat[i].dtype for i in tensors]
    for i, dt in zip(tensors, dtypes):
        t = flat[i]
        if id(t) in back:
            flat[i] = back[id(t)]
        elif dt in LOW:
            flat[i] = Emulated(t if views or _exact(func, flat_args, dt) else round_(t, dt), dt)
    return flat[0] if single else type(out)(flat)


# CUDA kernels that compute in the storage type, not in fp32: c10::Half and c10::BFloat16 arithmetic
# rounds the result of every operator, so `a * (scalar_t{1.} - b * b)`
# (ATen/native/cuda/BinaryMiscBackwardOpsKernels.cu, tanh_backward_kernel_cuda and
# sigmoid_backward_kernel_cuda, Half and BFloat16) rounds three times. The CPU's kernels differ by
# dtype (its Half sigmoid_backward rounds each step, its tanh_backward rounds once); the emulation
# follows CUDA. Each function takes the fp32 data and the storage dtype and rounds as the kernel
# does.
def _tanh_backward(grad, out, dtype):
    return round_(grad * round_(1 - round_(out * out, dtype), dtype), dtype)


def _sigmoid_backward(grad, out, dtype):
    return round_(round_(grad * round_(1 - out, dtype), dtype) * out, dtype)


STORAGE_ARITHMETIC = {
    aten.tanh_backward.default: _tanh_backward,
    aten.sigmoid_backward.default: _sigmoid_backward,
}


def _run(func, fargs, fkwargs, dtypes):
    """The fp32 kernel, or, for a kernel that rounds as it goes on a GPU (STORAGE_ARITHMETIC), its
    steps."""
    steps = STORAGE_ARITHMETIC.get(func)
    if steps is not None and dtypes and dtypes[0] in LOW and not fkwargs:
        return steps(*fargs, dtypes[0])
    return func(*fargs, **fkwargs)


class EmulationMode(TorchDispatchMode):
    """Runs every op that touches a float16/bfloat16 tensor on fp32 kernels and rounds as the GPU
    stores."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = leaves(args, kwargs)
        if not any(_low(a) for a in flat):
            return func(*args, **kwargs)
        if any(isinstance(a, torch.Tensor) and type(a) not in PLAIN for a in flat):
            # another tensor subclass (torchao's float8): it runs its op on its own tensors
            return NotImplemented
        dtypes = None if schema_facts(func)[2] else out_dtypes(func, flat, args, kwargs)
        fargs, fkwargs = mapped(_fp32, args, kwargs)
        originals, unwrapped = _mutated_args(func, args, kwargs, fargs, fkwargs)
        out = _run(func, fargs, fkwargs, dtypes)
        _round_written(func, flat, originals, unwrapped)
        return _wrap_outputs(func, flat, out, dtypes, originals, unwrapped)


# -- CUDA autocast's policy ------------------------------------------------------------------------
# From the installed PyTorch's ATen/autocast_mode.h (the CUDA lists): AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32 with AT_FORALL_FP32_SET_OPT_DTYPE and norm (fp32_append_dtype), AT_FORALL_PROMOTE.
LOWER = frozenset(
    """_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d
    convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
    chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
    rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
    scaled_dot_product_attention""".split()
)
TO_FP32 = frozenset(
    """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus
    layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm cosine_similarity
    poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss
    smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
    logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d
    upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d
    _upsample_bicubic2d_aa prod softmax log_softmax cumprod cumsum linalg_vector_norm
    linalg_matrix_norm sum norm""".split()
)
PROMOTE = frozenset(
    """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
    scatter_add""".split()
)
# Seen at Python level only, as composites of listed ops: cross_entropy runs log_softmax and
# nll_loss (fp32); F.interpolate and friends reach the upsample kernels. cuDNN's RNNs are cast to
# fp16 whatever the autocast dtype (aten/src/ATen/cudnn/AutocastRNN.cpp, _cudnn_rnn_cast_reflatten;
# not in the header).
COMPOSITE_FP32 = frozenset("cross_entropy interpolate upsample softmin".split())
RNN_FP16 = frozenset("lstm gru rnn_tanh rnn_relu".split())
DUNDERS = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow", "__rpow__": "pow"}


def cast_rule(name: str) -> str | None:
    """What CUDA autocast does to an op, by its name: lower, fp32, promote, rnn (fp16), or None
    (untouched)."""
    name = DUNDERS.get(name, name)
    if name in LOWER:
        return "lower"
    if name in TO_FP32 or name in COMPOSITE_FP32:
        return "fp32"
    if name in PROMOTE:
        return "promote"
    return "rnn" if name in RNN_FP16 else None


def _cast(args, kwargs, eligible, dtype, floats):
    """args and kwargs with each of `floats` (floating tensors, fp64 excepted) that is `eligible`
    cast to dtype."""
    ids = {id(a) for a in floats}
    return mapped(lambda a: a.to(dtype) if id(a) in ids and eligible(a) else a, args, kwargs)


class AutocastMode(TorchFunctionMode):
    """CUDA autocast's casts, as a function mode over any device (see cast_rule)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = cast_rule(getattr(func, "__name__", ""))
        if rule is None or not _STATE["enabled"]:
            return func(*args, **kwargs)
        floats = [
            a
            for a in leaves(args, kwargs)
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64
        ]
        if rule == "lower" or rule == "rnn":
            to = self.dtype if rule == "lower" else torch.float16
            args, kwargs = _cast(args, kwargs, lambda a: a.dtype != to, to, floats)
        elif rule == "fp32":
            args, kwargs = _cast(args, kwargs, lambda a: a.dtype in LOW, FP32, floats)
        elif len({a.dtype for a in floats}) > 1:   # promote: the widest floating type among them
            widest = FP32 if FP32 in {a.dtype for a in floats} else torch.float16
            args, kwargs = _cast(args, kwargs, lambda a: True, widest, floats)
        return func(*args, **kwargs)


_STATE = {"dtype": None, "enabled": True}


@contextlib.contextmanager
def autocast(dtype: torch.dtype):
    """CUDA autocast's policy to `dtype` on emulated numerics (needs EmulationMode: numerics())."""
    was = dict(_STATE)
    _STATE.update(dtype=dtype, enabled=True)
    try:
        with AutocastMode(dtype):
            yield
    finally:
        _STATE.update(was)


@contextlib.contextmanager
def autocast_off(device_type: str):
    """No autocast inside, real or emulated (torch.autocast(device_type, enabled=False) for
    both)."""
    was = _STATE["enabled"]
    _STATE["enabled"] = False
    try:
        with torch.autocast(device_type, enabled=False):
            yield
    finally:
        _STATE["enabled"] = was


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The active autocast dtype, emulated or real (None without autocast)."""
    if _STATE["dtype"] is not None:
        return _STATE["dtype"] if _STATE["enabled"] else None
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


@contextlib.contextmanager
def numerics(emulate: bool):
    """The job's numerics: EmulationMode throughout when emulating, nothing otherwise. Module.half()
    and friends then swap each parameter's contents in place (torch.utils.swap_tensors): an Emulated
    tensor cannot take over a plain Parameter's storage by `param.data = ...`, and a new Parameter
    per module would untie tied weights."""
    if not emulate:
        yield
        return
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with EmulationMode():
            yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
