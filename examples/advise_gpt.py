"""The precision advisor on a small GPT: which Linear layers can run in fp8?

A GPT-like model (2 blocks, width 256, 9 Linear layers, random initialisation) and a generated
batch of token ids. ``mixprec.advise`` puts each Linear alone in fp8 (the tensorwise recipe),
measures the whole model's gradient against float32, and proposes the policy that reaches 30 dB
with at most two layers kept in bf16; ``check=True`` applies it and measures the real figure.

Run: ``python examples/advise_gpt.py`` (it writes the plot to ``advise_gpt.png`` in the folder
named by ``MIXPREC_EXAMPLE_OUT``, the current one by default), or from the command line::

    mixprec advise examples/advise_gpt.py:make_gpt --candidates fp8 --min-sqnr 30 \\
        --keep-at-most 2 --check --plot advice.png
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for part in self.qkv(x).split(c, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, pre-norm blocks, a final LayerNorm and an lm_head."""

    def __init__(
        self, vocab: int = 512, width: int = 256, depth: int = 2, heads: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def next_token_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_gpt(seed: int = 0, batch: int = 16, seq: int = 64, vocab: int = 512) -> Any:
    """The advisor's factory: (model, batch, loss function), all generated from ``seed``."""
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, seq=seq)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return model, (tokens[:, :-1], tokens[:, 1:]), next_token_loss


def main() -> None:
    model, batch, loss_fn = make_gpt()
    advice = mixprec.advise(
        model, batch, loss_fn, candidates=["fp8"], min_sqnr=30.0, keep_at_most=2, check=True
    )
    print(advice.table())
    assert advice.met and len(advice.kept) <= 2
    assert advice.measured_sqnr is not None and advice.measured_sqnr >= 30.0

    # A training step with the proposal: fp8 matmuls inside a bf16 region, the kept layers in
    # bf16 (bf16 has float32's range: no GradScaler needed).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with mixprec.autocast("cpu", dtype=advice.dtype, policy=advice.policy):
        loss = loss_fn(model, batch)
    loss.backward()
    optimizer.step()
    print(f"one step with {advice.policy}: loss {float(loss.detach()):.4f}")

    path = Path(os.environ.get("MIXPREC_EXAMPLE_OUT", ".")) / "advise_gpt.png"
    try:
        advice.plot(path)
    except ImportError as exc:  # matplotlib is the [plot] extra
        print(f"no plot: {exc}")
    else:
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
