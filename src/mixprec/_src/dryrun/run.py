"""``mixprec.dry_run``: a training step of a meta copy of the model, routed as a GPU would.

The copy's parameters and the batch are meta tensors (no data, no memory, no GPU; the user's
model is untouched). Every matmul a policy rule serves takes the path it would take on the GPU
named (:func:`mixprec._src.fp8.kernels.routed_as`): its hardware kernel where that GPU's compute
capability has one, emulation where not. Each kernel call is recorded and checked
(:mod:`.rules`) instead of run; the answer per module and matmul is ``native``, ``emulated``
(why) or ``would fail`` (the rule broken and the fix). The same pass counts the bytes each module
saves for backward (:mod:`.memory`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.speed.gpus import get_gpu
from mixprec._src.autocast.region import autocast
from mixprec._src.dryrun import rules
from mixprec._src.dryrun.memory import SavedBytes, count_saved
from mixprec._src.dryrun.table import render
from mixprec._src.fp8.kernels import DryRunGpu, KernelCall, routed_as, to_blocked
from mixprec.errors import ConfigError, MixprecError

NATIVE, EMULATED, FAILS, HIGH = "native", "emulated", "would fail", "high precision"


@dataclass(frozen=True)
class Row:
    """One matmul of one module, as the GPU would run it.

    Attributes:
        module: the module's name. matmul: ``fprop``, ``dgrad`` or ``wgrad``.
        recipe: the recipe (or dtype) of that matmul. verdict: :data:`NATIVE`, :data:`EMULATED`,
        :data:`FAILS` or :data:`HIGH`. detail: the kernel, why emulated, or the rules broken
        with their fixes. mkn: the matmul's (M, K, N). call: the kernel call, if one was made.
    """

    module: str
    matmul: str
    recipe: str
    verdict: str
    detail: str
    mkn: tuple[int, int, int]
    call: KernelCall | None = None


@dataclass(frozen=True)
class DryRun:
    """What a training step would do on one GPU (:func:`dry_run`).

    Attributes:
        gpu: the GPU's word (``"h100"``). capability: its compute capability.
        rows: one per ruled matmul call, in the order they ran.
        saved: bytes saved for backward per module, beside bf16 autocast's and torchao's.
        error: the error that stopped the pass (a ConfigError's message), if any.
    """

    gpu: str
    capability: tuple[int, int]
    rows: tuple[Row, ...]
    saved: tuple[SavedBytes, ...]
    error: str | None = None

    @property
    def ok(self) -> bool:
        """No call would fail and the pass completed. Host sync: none."""
        return self.error is None and all(r.verdict != FAILS for r in self.rows)

    def verdicts(self) -> dict[tuple[str, str], str]:
        """``{(module, matmul): verdict}`` (the worst over repeated calls). Host sync: none."""
        order = (HIGH, NATIVE, EMULATED, FAILS)
        out: dict[tuple[str, str], str] = {}
        for r in self.rows:
            key = (r.module, r.matmul)
            if key not in out or order.index(r.verdict) > order.index(out[key]):
                out[key] = r.verdict
        return out

    def table(self, width: int = 100) -> str:
        """The matmuls and the memory as text at most ``width`` columns wide. Host sync: none."""
        return render(self, width)


def _launch(found: DryRunGpu, call: KernelCall) -> torch.Tensor:
    if call.a.device.type != "meta":  # a real tensor met inside the step: run it
        return call.run()
    out, broken = rules.check(call, found.capability)
    for blocks in (call.blocks_a, call.blocks_b):
        if blocks is not None:
            content = _swizzle_ok(blocks)
            if content is not None:
                broken.append(content)
    found.calls.append((found.site, "kernel", (call, broken)))
    return out


_SWIZZLE_SEEN: dict[tuple[int, int], rules.Broken | None] = {}


def _swizzle_ok(blocks: tuple[int, int]) -> rules.Broken | None:
    """mixprec's swizzle of a block-scale matrix of this shape, against cuBLAS's formula."""
    if blocks not in _SWIZZLE_SEEN:
        logical = torch.arange(blocks[0] * blocks[1], dtype=torch.float32).reshape(blocks)
        _SWIZZLE_SEEN[blocks] = rules.check_swizzle(logical, to_blocked(logical))
    return _SWIZZLE_SEEN[blocks]


def _kernel_row(site: tuple[str, str, str], call: KernelCall, broken: list[rules.Broken]) -> Row:
    mkn = (call.a.shape[0], call.a.shape[1], call.b.shape[1])
    api = "torch._scaled_mm" if not call.recipe_a else "F.scaled_mm " + "+".join(call.recipe_a)
    module, matmul, recipe = site
    if broken:
        return Row(module, matmul, recipe, FAILS, "; ".join(map(str, broken)), mkn, call)
    return Row(module, matmul, recipe, NATIVE, api, mkn, call)


def _rows(found: DryRunGpu, gpu: str) -> tuple[Row, ...]:
    out = []
    for (module, matmul, recipe), kind, detail in found.calls:
        if kind == "kernel":
            out.append(_kernel_row((module, matmul, recipe), *detail))
        elif kind == "high":
            dtype, mkn = detail
            text = f"{str(dtype).removeprefix('torch.')} matmul"
            out.append(Row(module, matmul, recipe, HIGH, text, mkn))
        else:
            routed, mkn = detail
            why = _why_emulated(routed, mkn, recipe, gpu)
            out.append(Row(module, matmul, recipe, EMULATED, why, mkn))
    return tuple(out)


def _why_emulated(routed: bool, mkn: tuple[int, int, int], recipe: str, gpu: str) -> str:
    if not routed:
        return f"no {recipe} kernel on {gpu} (fix: a recipe it runs, or bf16)"
    m, k, n = mkn
    return f"{m}x{k}x{n} not multiples of 16 (fix: pad tokens to a multiple of 16)"


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (ties kept; no data
    copied; ``model`` untouched). Host sync: none."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _to_meta(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.detach().to("meta").requires_grad_(batch.requires_grad)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_meta(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _to_meta(v) for k, v in batch.items()}
    return batch


def dry_run(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    policy: Any,
    gpu: str = "h100",
    dtype: torch.dtype = torch.bfloat16,
) -> DryRun:
    """What one training step under ``policy`` would run on ``gpu``, checked on the CPU.

    ``loss_fn(model, batch)`` runs on a meta copy of ``model`` inside
    ``mixprec.autocast(dtype=dtype, policy=policy)``, then its backward; each matmul a rule
    serves is routed as ``gpu`` (``"h100"``, ``"h200"``, ``"b200"``, ``"b300"``...) would route
    it, and each hardware kernel call is checked by torch's meta kernel and by the CUDA rules
    meta lacks (:mod:`mixprec._src.dryrun.rules`). Nothing runs on a GPU and ``model`` is not
    touched.

    Example:
        >>> import mixprec
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64))
        >>> def loss_fn(m, x):
        ...     return m(x).float().sum()
        >>> run = mixprec.dry_run(model, torch.randn(32, 64), loss_fn, "0=mxfp8", gpu="b200")
        >>> sorted(set(run.verdicts().values()))
        ['native']

    Raises:
        ConfigError: an unknown GPU (the message lists the known ones).

    Host sync: none (everything runs on the meta device).
    """
    card = get_gpu(gpu)
    copied, meta_batch = meta_copy(model), _to_meta(batch)
    found = DryRunGpu(card.capability, launch=_launch)
    error = None
    with routed_as(found), count_saved(copied) as saved:
        try:
            with autocast("cpu", dtype=dtype, policy=policy):
                loss = loss_fn(copied, meta_batch)
            loss.backward()
        except (ConfigError, MixprecError) as err:
            error = str(err)
    rows = _rows(found, card.word)
    return DryRun(card.word, card.capability, rows, saved.result(rows), error)
