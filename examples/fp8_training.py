"""Train a small language model with every Linear in fp8 except the output head.

The policy ``"nn.Linear=fp8:rowwise, lm_head=bf16"`` runs each Linear's three matmuls on fp8
operands with dynamic per-row scales and keeps ``lm_head`` (the most precision-sensitive layer of
most language models) in bf16. The same model is trained in fp32 next to it, and ``Fp8Stats``
shows what the fp8 casts did on the last step. On a CPU fp8 is simulated (fp8 values, fp32
matmuls): this shows the numerics of fp8 training, not its speed, which needs a GPU with fp8
tensor cores. Runs in a few seconds: ``python examples/fp8_training.py``.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

VOCAB, CONTEXT, WIDTH = 32, 8, 64
STEPS = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "60"))


class TinyLM(nn.Module):
    """Embeddings of the last CONTEXT tokens -> an MLP -> next-token logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(
            nn.Linear(CONTEXT * WIDTH, 4 * WIDTH),
            nn.GELU(),
            nn.Linear(4 * WIDTH, WIDTH),
            nn.LayerNorm(WIDTH),
        )
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(tokens).flatten(1)))


def batch(gen: torch.Generator, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up modulo VOCAB from a random start, with a little noise."""
    start = torch.randint(0, VOCAB, (size, 1), generator=gen)
    seq = (start + torch.arange(CONTEXT + 1)) % VOCAB
    noise = torch.rand(seq.shape, generator=gen) < 0.05
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=gen), seq)
    return seq[:, :CONTEXT], seq[:, CONTEXT]


def main() -> None:
    torch.manual_seed(0)
    fp32_model = TinyLM()
    fp8_model = copy.deepcopy(fp32_model)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (fp32_model, fp8_model)]
    policy = mixprec.Policy("nn.Linear=fp8:rowwise, lm_head=bf16")
    stats = mixprec.Fp8Stats()
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens, target = batch(gen)
        losses = []
        for model, opt in zip((fp32_model, fp8_model), opts, strict=True):
            if model is fp8_model:
                if step == STEPS - 1:
                    stats.__enter__()  # record the last step only
                with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
                    logits = model(tokens)
                if step == STEPS - 1:
                    stats.__exit__(None, None, None)
            else:
                logits = model(tokens)
            loss = F.cross_entropy(logits.float(), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d}  loss fp32 {losses[0]:.4f}  fp8 {losses[1]:.4f}")

    print("\nfp8 casts on the last step (lm_head is bf16, so it is not listed):")
    print(stats.summary())
    # Checkpoints are ordinary state dicts: the fp8 model's loads into a plain model.
    plain = TinyLM()
    plain.load_state_dict(fp8_model.state_dict())
    print(f"\npolicy: {policy}")


if __name__ == "__main__":
    main()
