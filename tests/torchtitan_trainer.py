"""torchtitan's own trainer on the CPU with gloo, its llama3 debug model converted by mixprec.

tests/fp8/test_fsdp_gather_torchtitan.py runs this file under ``torch.distributed.run`` (2
ranks) in a folder holding the assets the debug config reads (a tokenizer and a ``c4_test``
data set, both made by the test), once without the low-precision gather
(``MIXPREC_TITAN_GATHER=0``) and once with it (``1``). Each rank runs ``torchtitan.train.main()``
as ``torchrun -m torchtitan.train --module torchtitan_trainer --config
llama3_debugmodel_mixprec`` would and saves what the run did to
``$MIXPREC_TITAN_OUT<gather>-<rank>.pt``. (One process per run: a second
``init_process_group`` on torchrun's store after ``destroy_process_group`` can hang.)

torchtitan 0.3.0 and torch 2.13.0 on a CPU-only machine need the stand-ins of
:func:`run_on_the_cpu`: each replaces a piece of torchtitan or torch that cannot run there with
one that computes the same values; torchtitan's trainer, model, optimizer, schedule, data loader,
activation checkpointing and FSDP2 set-up are its own.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

POLICY = "nn.Linear=fp8:rowwise, lm_head=bf16"


def llama3_debugmodel_mixprec() -> Any:
    """torchtitan's ``llama3_debugmodel`` config with mixprec's converter (``--config`` name).
    Its selective activation checkpointing recomputes the rowwise Linears: ``recompute=True``."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from mixprec.integrations.torchtitan import MixprecConverter

    config = llama3_debugmodel()
    gather = os.environ["MIXPREC_TITAN_GATHER"] == "1"
    converter = MixprecConverter.Config(policy=POLICY, gather=gather, recompute=True)
    config.model_spec = model_registry("debugmodel", converters=[converter])
    return config


# ---------------------------------------------------------------------- the CPU stand-ins
# The user's CPU example (examples/torchtitan_llama3.py) holds them, each with its reason; the
# suite runs the same ones, plus what gloo needs for two ranks.
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "torchtitan_llama3.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("mixprec_example_torchtitan", EXAMPLE)
    assert spec is not None and spec.loader is not None, EXAMPLE
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()
stand_in_triton = example.stand_in_triton


def run_on_the_cpu() -> None:
    """The example's stand-ins (``run_on_the_cpu`` there: triton, the CPU as the device module,
    FlexAttention's backward as SDPA, ``set_timeout``), and for gloo: torchtitan sets FSDP2's
    gradient divide factor to 1.0, which FSDP2 reduces with ``ReduceOp.PREMUL_SUM`` ("Cannot use
    ReduceOp.PREMUL_SUM with Gloo"): a SUM and a division by 1.0 instead
    (``set_force_sum_reduction_for_comms``), the same values."""
    from torch.distributed.fsdp import FSDPModule

    example.run_on_the_cpu()
    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_for_gloo(module: FSDPModule, factor: float) -> None:
        set_factor(module, factor)
        module.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_for_gloo  # type: ignore[assignment,method-assign]


# ---------------------------------------------------------------------- what each run did


def record(losses: list[torch.Tensor]) -> None:
    """Keep each step's loss and, when the trainer closes, save its model and gather."""
    import torch.distributed as dist
    from torchtitan.trainer import Trainer

    step, close = Trainer.forward_backward_step, Trainer.close

    def forward_backward_step(self: Any, **kwargs: Any) -> torch.Tensor:
        loss = step(self, **kwargs)
        losses.append(loss.detach().clone())
        return loss

    def save_then_close(self: Any) -> None:
        model = self.model_parts[0]
        handle = model.__dict__.get("_mixprec", {}).get("gather")
        out = {
            "losses": list(losses),
            "params": {k: v.full_tensor() for k, v in model.state_dict().items()},
            "class": type(model).__name__,
            "gathered": [] if handle is None else handle.names,
            "collectives": 0 if handle is None else handle.collectives,
        }
        gather = os.environ["MIXPREC_TITAN_GATHER"]
        torch.save(out, f"{os.environ['MIXPREC_TITAN_OUT']}{gather}-{dist.get_rank()}.pt")
        close(self)

    Trainer.forward_backward_step = forward_backward_step
    Trainer.close = save_then_close


def main() -> None:
    torch.set_num_threads(1)
    run_on_the_cpu()
    from torchtitan.train import main as train

    record([])
    train()
    # Leave without the interpreter's teardown, as tests/dist_worker.run_rank does: gloo's
    # threads destroyed in an unspecified order now and then abort a rank that has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
