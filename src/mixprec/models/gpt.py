"""A decoder-only Transformer language model (GPT-2 / nanoGPT style) with the language-model loop's
interface.

Token and learned position embeddings, `n_layer` pre-LayerNorm blocks (causal self-attention through
F.scaled_dot_product_attention, then a GELU MLP of width 4 x n_embd, each added to the residual
stream), a final LayerNorm and an output head tied to the token embedding. Linear layers have
biases; weights start at N(0, 0.02), the residual projections at N(0, 0.02 / sqrt(2 n_layer))
(GPT-2). `vocab_multiple` pads the vocabulary as the RNN model's does (the padded rows never occur
as targets).

Interface of the language-model loop (train/lm_steps.py, as rnnlm.RNNModel): model(tokens, hidden)
-> (logits, hidden) with tokens [seq_len, batch] time-major (the TokenWindows layout) and logits
[seq_len, batch, ntoken]; a Transformer carries no state between windows, so init_hidden() is None
and hidden is returned as given. Each bptt window is one independent context of up to `block_size`
tokens.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int,
                 dropout: float = 0.0, vocab_multiple: int = 1):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be a multiple of n_head={n_head}")
        self.vocab_size, self.block_size, self.n_layer, self.n_embd = (
            vocab_size,
            block_size,
            n_layer,
            n_embd,
        )
        self.ntoken = math.ceil(vocab_size / vocab_multiple) * vocab_multiple
        self.wte = nn.Embedding(self.ntoken, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, self.ntoken, bias=False)
        self.lm_head.weight = self.wte.weight   # tied: one matrix embeds and scores the tokens
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = (
                    0.02 / math.sqrt(2 * n_layer)
                    if name.endswith(("attn.c_proj.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor, hidden=None):
        t = tokens.size(0)
        if t > self.block_size:
            raise ValueError(f"a window of {t} tokens is longer than block_size={self.block_size}")
        idx = tokens.t()                                   # [batch, seq_len]
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=tokens.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x).transpose(0, 1)), hidden   # time-major logits, contiguous

    def init_hidden(self, batch_size: int):
        return None

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Forward matmul FLOPs per token (2 per multiply-add) at a context of seq_len tokens
        (block_size by default): per layer the four Linear layers (12 n_embd^2 weights) and
        attention's two matmuls, QK^T and AV, over the whole window (4 seq_len n_embd: causal
        masking saves nothing in this count, as in nanoGPT's MFU and torch.utils.flop_counter); the
        tied output head (n_embd x ntoken). Embedding lookups, LayerNorm, softmax and GELU are left
        out."""
        t, d = seq_len or self.block_size, self.n_embd
        return float(self.n_layer * (24 * d * d + 4 * t * d) + 2 * d * self.ntoken)
