"""A small byte-level GPT: token and position embeddings, pre-norm causal transformer blocks,
tied output head."""

from __future__ import annotations

import torch
from torch import nn


class ByteGPT(nn.Module):
    def __init__(self, context: int, width: int, layers: int, heads: int):
        super().__init__()
        self.tokens = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        block = nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        for embedding in (self.tokens, self.positions):  # GPT-2's initialization
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the next byte at every position of `tokens` ([batch, seq])."""
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        mask = self.causal_mask[:seq, :seq].to(x.dtype)
        x = self.blocks(x, mask=mask, is_causal=True)
        return self.norm(x) @ self.tokens.weight.t()
