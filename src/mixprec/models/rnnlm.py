"""The recurrent language model of PyTorch's word_language_model example (and apex's copy of it).

RNNModel: an embedding (the encoder), dropout, a stack of nn.LSTM / nn.GRU / nn.RNN layers (cuDNN on
a GPU), dropout, and a linear decoder to the vocabulary, optionally sharing the embedding's weights
(`tied`). It maps token ids [seq_len, batch] and a hidden state to logits [seq_len, batch, ntoken]
and the next hidden state. `vocab_multiple` pads the decoder to a multiple of that many rows (apex:
8, so that its GEMMs can use tensor cores); the padded rows never occur as targets and are left out
when sampling.

The dtype the recurrent layers really run in is recorded (`rnn_dtype`, after a forward; the job's
summary has it): it need not be the precision's label. The precision policy tells the model
(`rnn_outside_autocast`, set by PrecisionPolicy.prepare_model) when its recurrent layers run outside
autocast, in their weights' dtype: under CUDA autocast to bf16, where cuDNN's RNN would run fp16
(precision/policy.py says why; C++, not in the wheel: tests/gpu/test_gpu.py checks the recorded
dtype). Pure bf16 weights are not cuDNN dtypes (torch/backends/cudnn/__init__.py:117
CUDNN_TENSOR_DTYPES, used by flatten_parameters, nn/modules/rnn.py:260): the RNN then runs
PyTorch's own per-step kernels, in bf16 but slowly; `rnn_cudnn` records which.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..precision import emulation

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


class RNNModel(nn.Module):
    def __init__(
        self,
        kind: str,
        vocab_size: int,
        emsize: int,
        nhid: int,
        nlayers: int,
        dropout: float = 0.2,
        tied: bool = False,
        vocab_multiple: int = 1,
    ):
        super().__init__()
        if tied and emsize != nhid:
            raise ValueError(f"tied weights need emsize == nhid (got {emsize} and {nhid})")
        self.kind, self.nhid, self.nlayers, self.vocab_size = kind, nhid, nlayers, vocab_size
        self.ntoken = math.ceil(vocab_size / vocab_multiple) * vocab_multiple
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(self.ntoken, emsize)
        # between layers only (PyTorch warns on 1 layer)
        rnn_dropout = dropout if nlayers > 1 else 0.0
        if kind in ("lstm", "gru"):
            self.rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(
                emsize, nhid, nlayers, dropout=rnn_dropout
            )
        else:
            self.rnn = nn.RNN(
                emsize, nhid, nlayers, nonlinearity=kind.split("_")[1], dropout=rnn_dropout
            )
        self.decoder = nn.Linear(nhid, self.ntoken)
        # what the last forward's recurrent layers ran in
        self.rnn_dtype, self.rnn_cudnn = None, False
        # told by the precision policy: the recurrent layers outside autocast, in their weights'
        # dtype
        self.rnn_outside_autocast = False
        if tied:
            self.decoder.weight = self.encoder.weight
        # the example's init (the RNN keeps PyTorch's own)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        if not tied:
            nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, tokens: torch.Tensor, hidden):
        x = self.drop(self.encoder(tokens))
        if self.rnn_outside_autocast:
            with emulation.autocast_off(tokens.device.type):   # real or emulated autocast
                w = self.rnn.all_weights[0][0]
                out, hidden = self.rnn(x.to(w.dtype), rnn_cast(hidden, w.dtype))
        else:
            out, hidden = self.rnn(x, hidden)
        self.rnn_dtype = out.dtype
        self.rnn_cudnn = torch.backends.cudnn.is_acceptable(self.rnn.all_weights[0][0])
        return self.decoder(self.drop(out)), hidden

    def init_hidden(self, batch_size: int):
        """Zeros in the dtype and device of the weights (fp16 in a half model); a (h, c) pair for an
        LSTM."""
        w = self.decoder.weight
        h = w.new_zeros(self.nlayers, batch_size, self.nhid)
        return (h, w.new_zeros(self.nlayers, batch_size, self.nhid)) if self.kind == "lstm" else h

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Forward matmul FLOPs per token (2 per multiply-add): the gates of each layer on its input
        and on the hidden state, and the decoder; the embedding is a lookup and elementwise work is
        left out. The window length (seq_len) changes nothing for a recurrent model."""
        g, h = GATES[self.kind], self.nhid
        sizes = [self.encoder.embedding_dim] + [h] * (self.nlayers - 1)
        return float(sum(2 * g * h * (n + h) for n in sizes) + 2 * h * self.ntoken)


def rnn_cast(hidden, dtype: torch.dtype):
    """The hidden state (a tensor, or an LSTM's (h, c)) in `dtype`."""
    return (
        hidden.to(dtype) if isinstance(hidden, torch.Tensor) else tuple(h.to(dtype) for h in hidden)
    )


def repackage_hidden(hidden):
    """The hidden state cut from the graph of the window that produced it (truncated BPTT): the next
    window's backward stops here instead of running back to the start of the stream. None (a
    Transformer's) stays None."""
    if hidden is None or isinstance(hidden, torch.Tensor):
        return None if hidden is None else hidden.detach()
    return tuple(repackage_hidden(h) for h in hidden)


