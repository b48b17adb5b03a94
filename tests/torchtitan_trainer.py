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

import importlib.machinery
import importlib.util
import os
import sys
import types
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


KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"


def _kernel(name: str) -> Any:
    if name.startswith("__"):  # __file__, __path__...: absent, as on a plain module
        raise AttributeError(name)

    def launch(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{KERNELS}.{name} called: triton is not installed")

    return launch


def stand_in_triton() -> None:
    """torchtitan imports triton at module level for its MoE all-to-all kernels
    (``import triton`` in ``torchtitan/distributed/minimal_async_ep/kernels.py``, reached from
    ``torchtitan.models.common.token_dispatcher`` for dense models too); the CPU torch wheel
    does not bring triton. Where it is missing, that one module is replaced by one whose
    kernels raise if called (a dense model calls none). triton itself stays absent: a stand-in
    ``triton`` module would make torch's inductor believe it is installed."""
    if importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(KERNELS)
    module.__spec__ = importlib.machinery.ModuleSpec(KERNELS, None)
    module.__getattr__ = _kernel  # type: ignore[method-assign]
    sys.modules[KERNELS] = module


class _CpuModule:
    """``torch.cpu`` plus what torchtitan's trainer asks of an accelerator module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def set_device(self, device: Any) -> None: ...
    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=1 << 30)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None: ...
    def empty_cache(self) -> None: ...
    def synchronize(self, device: Any = None) -> None: ...


def _flex_as_sdpa(
    self: Any, q: Any, k: Any, v: Any, *, attention_masks: Any, scale: Any = None, **kw: Any
) -> torch.Tensor:
    """FlexAttention's forward as SDPA with the mask its BlockMask's ``mask_mod`` gives every
    (query, key) pair: the same attention (FlexAttention has no backward on the CPU)."""
    from torch.nn.attention.flex_attention import create_mask

    assert kw.get("score_mod") is None and kw.get("out_transform") is None
    mask = create_mask(attention_masks.mask_mod, q.shape[0], None, q.shape[1], k.shape[1], "cpu")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=kw.get("enable_gqa", False)
    )
    return out.transpose(1, 2)


def run_on_the_cpu() -> None:
    """What torchtitan 0.3.0 on torch 2.13.0 needs on a CPU with gloo (each fails without):

    * triton (import): :func:`stand_in_triton`.
    * ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` without an accelerator,
      and the trainer calls ``torch.cuda.set_device`` ("module 'torch._C' has no attribute
      '_cuda_setDevice'"), then the memory monitor's ``get_device_name``: the CPU instead.
    * FlexAttention, the llama3 models' only CPU-capable attention backend, has no backward
      on the CPU: :func:`_flex_as_sdpa`.
    * torchtitan sets FSDP2's gradient divide factor to 1.0, which FSDP2 reduces with
      ``ReduceOp.PREMUL_SUM`` ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): a SUM and a
      division by 1.0 instead (``set_force_sum_reduction_for_comms``), the same values.
    * ``torch.distributed.set_timeout`` (torch >= 2.14) after the first step: torch 2.13's
      ``_set_pg_timeout``.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    stand_in_triton()
    import torchtitan.tools.utils as utils

    # before any other torchtitan module copies them (``from ... import device_type``)
    utils.device_type, utils.device_module = "cpu", _CpuModule()
    from torchtitan.models.common import attention

    attention.FlexAttention.forward = _flex_as_sdpa
    set_factor = FSDPModule.set_gradient_divide_factor

    def set_factor_for_gloo(module: FSDPModule, factor: float) -> None:
        set_factor(module, factor)
        module.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_factor_for_gloo  # type: ignore[assignment,method-assign]
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda t, group=None: dist.distributed_c10d._set_pg_timeout(t, group)  # type: ignore[attr-defined]


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
