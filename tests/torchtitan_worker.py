"""One rank of the gloo world that tests/fp8/test_fsdp_gather_torchtitan.py spawns: torchtitan's
llama3 debug model built through :class:`mixprec.integrations.torchtitan.MixprecConverter`,
sharded with FSDP2, trained a few steps in a plain loop, with and without the gather.

Usage: ``python torchtitan_worker.py RANK WORLD_SIZE PORT_FILE OUTDIR``; writes
``OUTDIR/titan-<rank>.pt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from dist_worker import run_rank

POLICY = "nn.Linear=fp8:rowwise, lm_head=bf16"
STEPS = 2


class CausalSDPA(torch.nn.Module):
    """Causal scaled-dot-product attention on (batch, tokens, heads, dim): stands in for
    torchtitan's flex attention, which has no backward on the CPU."""

    def forward(self, q: Any, k: Any, v: Any, *, scale: Any = None, **kwargs: Any) -> Any:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=kwargs.get("enable_gqa", False)
        )
        return out.transpose(1, 2)


def build(gather: bool) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torchtitan_trainer import stand_in_triton

    stand_in_triton()  # where triton is not installed (tests/torchtitan_trainer.py says why)
    from torchtitan.models.llama3 import model_registry

    from mixprec.integrations.torchtitan import MixprecConverter

    converter = MixprecConverter.Config(policy=POLICY, gather=gather)
    spec = model_registry("debugmodel", converters=[converter])
    config = spec.model
    config.layers = config.layers[:2]  # two of the six blocks: the test stays small
    torch.manual_seed(0)
    model = config.build()
    model.init_weights(buffer_device=None)
    blocks = model.layers.values() if hasattr(model.layers, "values") else model.layers
    for block in blocks:
        block.attention.inner_attention = CausalSDPA()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def train(gather: bool, rank: int) -> dict[str, Any]:
    model = build(gather)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, 2048, (2, 33), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    handle = model.__dict__.get("_mixprec", {}).get("gather")
    return {
        "losses": losses,
        "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
        "class": type(model).__name__,
        "gathered": [] if handle is None else handle.names,
        "collectives": 0 if handle is None else handle.collectives,
    }


def _both(rank: int, world: int, outdir: Path, args: list[str]) -> None:
    warnings.simplefilter("ignore")
    result = {"plain": train(False, rank), "low": train(True, rank)}
    torch.save(result, outdir / f"titan-{rank}.pt")


if __name__ == "__main__":
    run_rank(sys.argv[1:], _both, timeout_s=60)
