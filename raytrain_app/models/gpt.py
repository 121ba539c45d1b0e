"""A small decoder-only transformer (GPT-2's layout, after nanoGPT) for `task: language_model`.

It maps (B, T) token ids to (B, T, vocab) logits. Attention is PyTorch's fused causal
`scaled_dot_product_attention` (flash or memory-efficient kernels on GPUs), and the blocks sit
in `model.blocks` so that a sharding strategy can wrap them one by one.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings, as in GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than the model's block_size {self.block_size}")
        x = self.drop(self.tok(ids) + self.pos(torch.arange(t, device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(input_shape: tuple = (257,), num_classes: int = 256, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
        dropout: float = 0.0, block_size: int = 0) -> nn.Module:
    """`num_classes` is the vocabulary size and `input_shape` the sample's length, both from the
    dataset; `block_size` (the longest sequence the model takes) defaults to that length."""
    if n_embd % n_head:
        raise ValueError(f"n_embd {n_embd} is not divisible by n_head {n_head}")
    return GPT(num_classes, block_size or input_shape[0], n_layer, n_head, n_embd, dropout)
