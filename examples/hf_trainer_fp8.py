"""The 🤗 transformers ``Trainer`` under the advisor's fp8 policy: GPT-2 from a tiny config.

``mixprec.advise`` measures each layer of a randomly initialised GPT-2 (2 blocks, width 128;
nothing is downloaded) in fp8 on one batch and proposes the policy that keeps the whole model's
gradient above 25 dB (fp8 layers, the sensitive matmuls in bf16). ``use_mixprec_policy(trainer,
advice.policy, advice.dtype)`` makes the Trainer compute every loss inside
``mixprec.autocast("cpu", advice.dtype, policy=advice.policy)``; ``Fp8Stats`` records which
layers ran in fp8. The model and code are docs/transformers.md's (tests/docs/test_doc_snippets.py
holds them equal).

Run: ``python examples/hf_trainer_fp8.py`` (needs ``pip install 'mixprec[accelerate]'
transformers``); ``MIXPREC_EXAMPLE_STEPS`` sets the number of steps (default 20).
"""

from __future__ import annotations

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import mixprec
from mixprec.integrations.accelerate import use_mixprec_policy


class TokenBatches(torch.utils.data.Dataset):
    """64 random sequences of 32 token ids: a language-modelling data set without a tokenizer."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def small_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=32, n_embd=128, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def next_token_loss(model: GPT2LMHeadModel, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def fp8_trainer(model: GPT2LMHeadModel, output_dir: str, max_steps: int) -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir,
        bf16=True,  # the region's dtype of an fp8 policy: no loss scaling
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=16,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    return Trainer(model=model, args=args, train_dataset=TokenBatches())


def main() -> None:
    steps = int(os.environ.get("MIXPREC_EXAMPLE_STEPS", "20"))
    model, data = small_gpt2(), TokenBatches()
    advice = mixprec.advise(model, data.ids[:16], next_token_loss, candidates=["fp8"], min_sqnr=25)
    print(f"policy: {advice.policy}")

    trainer = fp8_trainer(model, tempfile.mkdtemp(), steps)
    use_mixprec_policy(trainer, advice.policy, advice.dtype)
    stats = mixprec.Fp8Stats()
    with stats:
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"{len(stats.read())} layers ran in fp8; loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert len(stats.read()) >= 1 and losses[-1] < losses[0]


if __name__ == "__main__":
    main()
