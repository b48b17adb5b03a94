"""The 🤗 ``Trainer`` and accelerate under a mixprec policy (``use_mixprec_policy``), GPT-2 from a
tiny config on the CPU.

Oracles: the same Trainer with ``compute_loss`` written by hand inside ``mixprec.autocast(...,
policy=...)`` (every parameter after training bitwise equal), and the model called inside
``mixprec.autocast`` directly (logits bitwise equal). ``Fp8Stats`` says which modules ran in fp8:
exactly those the policy rules fp8.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mixprec
from mixprec.errors import ConfigError

pytest.importorskip("accelerate", reason="needs the [accelerate] extra")
transformers = pytest.importorskip("transformers", reason="needs transformers (make venv)")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

from mixprec.integrations.accelerate import use_mixprec_policy  # noqa: E402

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_state() -> Iterator[None]:
    """accelerate keeps process-wide singletons; each test starts from a clean one."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def trainer(cls: type = transformers.Trainer, **kwargs: Any) -> Any:
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        **kwargs,
    )
    return cls(model=tiny_gpt2(), args=args, train_dataset=Tokens())


def hand_written(policy: Any, dtype: torch.dtype) -> type:
    class PolicyTrainer(transformers.Trainer):  # the oracle: compute_loss inside the region
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            with mixprec.autocast("cpu", dtype, policy=policy):
                return super().compute_loss(*args, **kwargs)

    return PolicyTrainer


def advised_policy() -> mixprec.Policy:
    ids = Tokens().ids[:4]
    loss_fn = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
    return mixprec.advise(tiny_gpt2(), ids, loss_fn, candidates=["fp8"], min_sqnr=25).policy


POLICIES = {
    "advised": advised_policy,
    "class rule and a name": lambda: mixprec.Policy(modules={Conv1D: "fp8", "lm_head": "bf16"}),
    "string, per matmul": lambda: "transformer.h.*.mlp.c_fc=fp8/fp8/bf16, lm_head=fp8",
}


def fp8_modules(model: torch.nn.Module, policy: mixprec.Policy) -> set[str]:
    """The modules ``policy`` rules fp8-family (a matmul of theirs runs in a recipe)."""
    rows = mixprec.policy_table("cpu", policy, model).rows
    wide = ("bf16", "fp16", "fp32")
    return {
        r.target
        for r in rows
        if r.kind == "module" and any(p not in wide for p in r.effective.split("/"))
    }


@pytest.mark.parametrize("make_policy", POLICIES.values(), ids=POLICIES.keys())
def test_the_trainer_trains_as_with_compute_loss_under_mixprec_autocast(make_policy: Any) -> None:
    policy = make_policy()
    ours = trainer(bf16=True)
    in_use = use_mixprec_policy(ours, policy, torch.bfloat16)
    stats = mixprec.Fp8Stats()
    with stats:
        ours.train()
    oracle = trainer(hand_written(in_use, torch.bfloat16), bf16=True)
    oracle.train()
    plain = trainer(bf16=True)
    plain.train()
    pairs = list(zip(ours.model.parameters(), oracle.model.parameters(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not all(
        torch.equal(a, b)
        for a, b in zip(ours.model.parameters(), plain.model.parameters(), strict=True)
    )
    assert set(stats.read()) == fp8_modules(ours.model, in_use) != set()


def test_evaluation_runs_under_the_policy_too() -> None:
    ours = trainer(bf16=True)
    use_mixprec_policy(ours, "lm_head=fp8")
    stats = mixprec.Fp8Stats()
    with stats:
        ours.evaluate(Tokens())
    assert set(stats.read()) == {"lm_head"}


def test_accelerate_autocast_enters_the_policy_around_the_prepared_model() -> None:
    policy = mixprec.Policy("transformer.h.0.mlp.c_fc=fp8, lm_head=fp8:rowwise")
    ids = Tokens().ids[:4]
    model = tiny_gpt2()
    torch.manual_seed(1)
    with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        reference = model(input_ids=ids).logits.float()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    use_mixprec_policy(accelerator, policy)  # dtype: the accelerator's bf16
    prepared = accelerator.prepare(model)
    stats = mixprec.Fp8Stats()
    torch.manual_seed(1)
    with stats, accelerator.autocast():
        logits = prepared(input_ids=ids).logits
    assert torch.equal(logits, reference)
    assert set(stats.read()) == {"transformer.h.0.mlp.c_fc", "lm_head"}


def test_a_second_call_replaces_the_policy() -> None:
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    use_mixprec_policy(accelerator, "lm_head=fp8")
    use_mixprec_policy(accelerator, "transformer.h.1.mlp.c_fc=fp8")
    model = accelerator.prepare(tiny_gpt2())
    stats = mixprec.Fp8Stats()
    with stats, accelerator.autocast():
        model(input_ids=Tokens().ids[:2])
    assert set(stats.read()) == {"transformer.h.1.mlp.c_fc"}


@pytest.mark.parametrize(
    ("mixed", "policy", "dtype", "says"),
    [
        ("fp16", "lm_head=fp8", torch.bfloat16, "make them agree"),
        ("no", "lm_head=fp8", None, "pass dtype=advice.dtype"),
        ("bf16", "lm_head=fp8", torch.float32, "pass torch.bfloat16 or torch.float16"),
        ("bf16", "lm_head=fp9", None, "fp9"),
    ],
)
def test_bad_input_is_a_config_error_and_changes_nothing(
    mixed: str, policy: str, dtype: torch.dtype | None, says: str
) -> None:
    accelerator = Accelerator(mixed_precision=mixed, cpu=True)
    before = accelerator.autocast
    with pytest.raises(ConfigError, match=says):
        use_mixprec_policy(accelerator, policy, dtype)
    assert accelerator.autocast == before
