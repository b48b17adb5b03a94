"""torchtitan's own trainer on the CPU: its llama3 debug model under a mixprec fp8 policy.

What a torchtitan user writes is ``llama3_debugmodel_mixprec`` below: a config function (as in
torchtitan's ``config_registry.py``) that adds mixprec's converter to the model spec. On GPUs
it runs as is (docs/torchtitan.md)::

    torchrun --nproc_per_node 8 -m torchtitan.train \\
        --module torchtitan_llama3 --config llama3_debugmodel_mixprec

Here it runs on the CPU in this one process (a world of one rank): ``python
examples/torchtitan_llama3.py`` trains ``MIXPREC_EXAMPLE_STEPS`` steps (default 10) of 2
sequences of 64 tokens through ``torchtitan.train.main``, with torchtitan's data loader, AdamW,
warm-up schedule, gradient clipping and selective activation checkpointing, and the stand-ins of
:func:`run_on_the_cpu`, each of which replaces a piece of torchtitan 0.3.0 or torch 2.13 that
cannot run on a CPU-only machine with one that computes the same values. The debug config reads
a tokenizer and a data set from torchtitan's repository, which its wheel does not ship:
:func:`write_assets` makes small ones in a temporary folder (the working directory of the run).

Needs ``pip install torchtitan`` (0.3.0; the Makefile's ``.venv`` has it). On a GPU none of the
stand-ins is needed: drop ``run_on_the_cpu`` and launch with the command above.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import socket
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

import mixprec

#: lm_head in bf16: torchtitan's ChunkedLossWrapper applies it in the loss, outside the model's
#: forward and so outside the policy (docs/torchtitan.md); under a low-precision rule the gather
#: would carry its weight as codes that no matmul reads.
POLICY = "nn.Linear=fp8:rowwise, lm_head=bf16"


def llama3_debugmodel_mixprec() -> Any:
    """torchtitan's ``llama3_debugmodel`` config with mixprec's converter (the ``--config``
    name). Its selective activation checkpointing recomputes the rowwise Linears:
    ``recompute=True``."""
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from mixprec.integrations.torchtitan import MixprecConverter

    config = llama3_debugmodel()
    converter = MixprecConverter.Config(
        policy=POLICY, dtype="bfloat16", gather=True, recompute=True
    )
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
    """Why: torchtitan imports triton at module level for its MoE all-to-all kernels
    (``torchtitan/distributed/minimal_async_ep/kernels.py``, reached from
    ``torchtitan.models.common.token_dispatcher`` for dense models too), and the CPU torch wheel
    does not bring triton ("No module named 'triton'"). That one module is replaced by one whose
    kernels raise if called (a dense model calls none); ``pip install triton`` also fixes it."""
    if importlib.util.find_spec("triton") is not None:
        return
    module = types.ModuleType(KERNELS)
    module.__spec__ = importlib.machinery.ModuleSpec(KERNELS, None)
    module.__getattr__ = _kernel  # type: ignore[method-assign]
    sys.modules[KERNELS] = module


class _CpuModule:
    """Why: ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` without an
    accelerator, and the trainer calls ``torch.cuda.set_device`` ("module 'torch._C' has no
    attribute '_cuda_setDevice'"), then the memory monitor's ``get_device_name``: ``torch.cpu``
    plus what the trainer asks of an accelerator module."""

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
    """Why: FlexAttention, the llama3 models' only attention backend that runs on a CPU, has no
    backward there ("FlexAttention does not support backward on CPU"). The same attention as
    SDPA, with the mask its BlockMask's ``mask_mod`` gives every (query, key) pair."""
    from torch.nn.attention.flex_attention import create_mask

    assert kw.get("score_mod") is None and kw.get("out_transform") is None
    mask = create_mask(attention_masks.mask_mod, q.shape[0], None, q.shape[1], k.shape[1], "cpu")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=kw.get("enable_gqa", False)
    )
    return out.transpose(1, 2)


def run_on_the_cpu() -> None:
    """The stand-ins above, installed before torchtitan's trainer is imported; the BlockMask
    built without compiling; and torch 2.13's
    ``_set_pg_timeout`` for ``torch.distributed.set_timeout`` (torch >= 2.14), which torchtitan
    calls after the first step ("module 'torch.distributed' has no attribute 'set_timeout'")."""
    import torch.distributed as dist

    stand_in_triton()
    import torchtitan.tools.utils as utils

    # before any other torchtitan module copies them (``from ... import device_type``)
    utils.device_type, utils.device_module = "cpu", _CpuModule()
    from torchtitan.models.common import attention

    attention.FlexAttention.forward = _flex_as_sdpa
    # Not an error, the time: torchtitan builds each step's BlockMask with a torch.compile'd
    # create_block_mask, whose compilation takes most of a short CPU run; the stand-in above
    # reads only the mask's mask_mod, and torch's create_block_mask makes the same mask eagerly.
    from torch.nn.attention.flex_attention import create_block_mask

    attention._compiled_create_block_mask = create_block_mask
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda t, group=None: dist.distributed_c10d._set_pg_timeout(t, group)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------- the run


def write_assets(root: Path) -> None:
    """What the debug config reads from ``./tests/assets`` of torchtitan's repository: a
    byte-level BPE tokenizer under the debug model's 2048 tokens and a ``c4_test`` json data
    set, small and made here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    gen = torch.Generator().manual_seed(0)
    words = ("alpha", "beta", "gamma", "delta", "model", "train", "shard", "gather", "layer")
    texts = [
        " ".join(words[int(i)] for i in torch.randint(0, len(words), (300,), generator=gen))
        for _ in range(32)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|end_of_text|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe = trainers.BpeTrainer(vocab_size=300, special_tokens=special, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(texts, bpe)
    (root / "tests/assets/tokenizer").mkdir(parents=True)
    (root / "tests/assets/c4_test").mkdir(parents=True)
    tokenizer.save(str(root / "tests/assets/tokenizer/tokenizer.json"))
    config = {"bos_token": special[0], "eos_token": special[1]}
    (root / "tests/assets/tokenizer/tokenizer_config.json").write_text(json.dumps(config))
    lines = (json.dumps({"text": t}) for t in texts)
    (root / "tests/assets/c4_test/data.json").write_text("\n".join(lines) + "\n")


def one_rank_world() -> None:
    """What ``torchrun --nproc_per_node 1`` would set: a world of one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    os.environ.update({**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


def main() -> None:
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("this example needs torchtitan: pip install torchtitan")
    steps = os.environ.get("MIXPREC_EXAMPLE_STEPS", "10")
    run_on_the_cpu()
    from torchtitan.train import main as train

    sys.modules.setdefault("torchtitan_llama3", sys.modules[__name__])  # the --module name
    root = Path(tempfile.mkdtemp(prefix="mixprec-torchtitan-"))
    write_assets(root)
    os.chdir(root)  # the config reads ./tests/assets and writes ./outputs
    one_rank_world()
    sys.argv = [sys.argv[0], "--module", "torchtitan_llama3", "--config"]
    sys.argv += ["llama3_debugmodel_mixprec", "--training.steps", steps, "--debug.seed", "0"]
    sys.argv += ["--training.seq-len", "64", "--training.local-batch-size", "2"]
    # the default ("full_dtensor") refuses FSDP2's plain parameters on torch 2.13
    sys.argv += ["--parallelism.spmd-backend", "partial_dtensor"]
    stats = mixprec.Fp8Stats()  # what ran in fp8, per Linear (costs a few casts: a check)
    with stats:
        train()
    recipes = {name: s.recipe for name, s in stats.read().items()}
    print(f"fp8 Linears: {len(recipes)}, recipes {sorted(set(recipes.values()))}")
    # the six blocks' five Linears; lm_head runs in torchtitan's loss, outside the policy
    assert len(recipes) == 30 and not any("lm_head" in n for n in recipes), recipes


if __name__ == "__main__":
    main()
