"""Small models for the advisor tests (the GPT-like model lives in examples/advise_gpt.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: The "loud" block's weights are this many times their default initialisation: its outputs
#: reach about 1e5, above the float16 maximum (65504).
LOUD_GAIN = 1e5


class Loud(nn.Module):
    """A block with large-magnitude weights followed by a LayerNorm that brings values back."""

    def __init__(self, d: int, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        with torch.no_grad():
            self.fc.weight.mul_(gain)
            self.fc.bias.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(x))


class LoudNet(nn.Module):
    """An MLP regression whose middle block's activations exceed the float16 range."""

    def __init__(self, gain: float = LOUD_GAIN) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.loud = Loud(64, gain)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.hidden(self.loud(x)))
        return self.head(x)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def loud_task(seed: int = 0, gain: float = LOUD_GAIN) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss function) for the float16 target."""
    torch.manual_seed(seed)
    model = LoudNet(gain)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(256, 32, generator=gen)
    y = torch.sin(x @ torch.randn(32, 8, generator=gen))
    return model, (x, y), mse


class Small(nn.Module):
    """Linear, BatchNorm (buffers), Dropout (RNG), Conv: the state the advisor must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(8 * 16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.out(torch.relu(self.fc(h.flatten(1))))


def small_task(seed: int = 0) -> tuple[nn.Module, Any, Any]:
    torch.manual_seed(seed)
    model = Small()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(32, 4, 16, generator=gen)
    y = torch.randn(32, 4, generator=gen)
    return model, (x, y), mse


def not_a_triple() -> Any:
    """A factory that returns the wrong thing (for the command-line tests)."""
    model, batch, _ = loud_task()
    return model, batch


def not_a_model() -> Any:
    return "model", None, mse


NOT_CALLABLE = 3


# nanoGPT's model.py pattern, written for these tests: its own LayerNorm class over
# F.layer_norm, a ModuleDict with a ModuleList of blocks, lm_head tied to the token embedding.


class BiasLayerNorm(nn.Module):
    """A LayerNorm with an optional bias (nanoGPT's own class, over ``F.layer_norm``)."""

    def __init__(self, width: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoAttention(nn.Module):
    """Causal self-attention with one fused qkv projection (``c_attn``) and ``c_proj``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            part.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for part in self.c_attn(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class TorchAttention(nn.Module):
    """The same block's attention through ``nn.MultiheadAttention`` (a causal mask)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(width, heads, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        return self.mha(x, x, x, attn_mask=mask, need_weights=False)[0]


class NanoMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, width: int, heads: int, torch_attention: bool) -> None:
        super().__init__()
        self.ln_1 = BiasLayerNorm(width)
        attention = TorchAttention if torch_attention else NanoAttention
        self.attn = attention(width, heads)
        self.ln_2 = BiasLayerNorm(width)
        self.mlp = NanoMLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """``transformer`` (a ModuleDict: wte, wpe, drop, h, ln_f) and a tied ``lm_head``."""

    def __init__(
        self,
        vocab: int = 256,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        seq: int = 32,
        torch_attention: bool = False,
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, width),
                "wpe": nn.Embedding(seq, width),
                "drop": nn.Dropout(0.1),
                "h": nn.ModuleList(NanoBlock(width, heads, torch_attention) for _ in range(depth)),
                "ln_f": BiasLayerNorm(width),
            }
        )
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT does

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t, device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def next_token(model: nn.Module, batch: Any) -> torch.Tensor:
    idx, targets = batch
    logits = model(idx)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def nano_task(seed: int = 0, torch_attention: bool = False) -> tuple[nn.Module, Any, Any]:
    """(model, batch, loss function) of a nanoGPT-style model and generated tokens."""
    torch.manual_seed(seed)
    model = NanoGPT(torch_attention=torch_attention)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, 256, (8, 33), generator=gen)
    return model, (tokens[:, :-1], tokens[:, 1:]), next_token


def bn_cnn_task(seed: int = 3) -> tuple[nn.Module, Any, Any]:
    """A small CNN with BatchNorm (4 BN-conv-ReLU blocks, width 8), where the advisor's
    additive prediction for fp16 is far off: the errors of its convs are not independent."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    channels = 3
    for _ in range(4):
        layers += [nn.BatchNorm2d(channels), nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU()]
        channels = 8
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(16, 3, 8, 8, generator=gen)
    y = torch.randint(0, 10, (16,), generator=gen)
    return model, (x, y), classify


def classify(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)
