"""A decoder-only character-level transformer (GPT; Radford et al. 2018, after nanoGPT).

Shapes: B batch, T time (context), C channels (n_embd), H heads, D head size, V vocabulary.
Blocks: [Embedding, Block x n_layer, Head]. Attention infers its local head count from the
width of its projection, so a tensor-parallel shard of it runs the same code (Megatron).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from polytrain.errors import ConfigError
from polytrain.models.base import BlockModel, cross_entropy_loss

__all__ = ["SIZES", "GPTConfig", "build_gpt", "generate"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    block_size: int = 64
    dropout: float = 0.0


SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 4, "n_embd": 128, "n_head": 4, "block_size": 64},
    "small": {"n_layer": 6, "n_embd": 256, "n_head": 8, "block_size": 128},
    "medium": {"n_layer": 8, "n_embd": 512, "n_head": 8, "block_size": 256},
}


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(pos))  # (B, T, C)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, H*D) with H local heads
        H = q.size(-1) // self.head_dim
        q, k, v = (t.view(B, T, H, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.n_embd)
        self.out = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))  # (B, T, V)


def _init_weights(module: nn.Module, n_layer: int) -> None:
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)


def build_gpt(cfg: GPTConfig) -> BlockModel:
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(
            f"model.n_embd = {cfg.n_embd} is not divisible by model.n_head = {cfg.n_head}: "
            "choose a width that is a multiple of the head count"
        )
    blocks: list[nn.Module] = [Embedding(cfg)]
    blocks += [Block(cfg) for _ in range(cfg.n_layer)]
    blocks.append(Head(cfg))
    model = BlockModel(blocks, cross_entropy_loss)
    _init_weights(model, cfg.n_layer)
    return model


@torch.no_grad()
def generate(
    model: nn.Module, prompt: torch.Tensor, num_tokens: int, block_size: int, seed: int = 0
) -> torch.Tensor:
    """Sample ``num_tokens`` continuations of ``prompt`` (1, T) at temperature 0.8."""
    g = torch.Generator(device=prompt.device).manual_seed(seed)
    idx = prompt
    model.eval()
    for _ in range(num_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :] / 0.8
        probs = F.softmax(logits.float(), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=g)], dim=1)
    return idx
