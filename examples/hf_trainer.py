"""The 🤗 transformers ``Trainer`` with mixprec's scaler: the model, data and Trainer of
docs/transformers.md (its blocks show the same code: tests/docs/test_doc_snippets.py holds
them equal).

A tiny randomly initialised GPT-2 (nothing is downloaded) trained for 8 steps with
``fp16=True, use_cpu=True``, which alone would train in fp32; ``use_mixprec_scaler`` between
``Trainer(...)`` and ``train()`` gives fp16 compute with loss scaling.

Run: ``python examples/hf_trainer.py`` (needs ``pip install 'mixprec[accelerate]' transformers``).
"""

from __future__ import annotations

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import mixprec
from mixprec.integrations.accelerate import use_mixprec_scaler


class Tokens(torch.utils.data.Dataset):
    """32 random sequences of 16 token ids: a language-modelling batch without a tokenizer."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def trainer_for(output_dir: str, max_steps: int = 8) -> Trainer:
    args = TrainingArguments(
        output_dir=output_dir,
        fp16=True,
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_steps=4,
        logging_steps=1,
        report_to=[],
        disable_tqdm=True,
    )
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())


def main() -> None:
    trainer = trainer_for(tempfile.mkdtemp())
    scaler = use_mixprec_scaler(trainer.accelerator, mixprec.GradScaler(init_scale=2.0**20))
    trainer.train()
    print(scaler.stats())
    assert scaler.stats().steps_taken >= 1


if __name__ == "__main__":
    main()
