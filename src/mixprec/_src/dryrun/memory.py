"""Bytes saved for backward, per module: counted exactly with
``torch.autograd.graph.saved_tensors_hooks`` (on any device, meta included), beside what bf16
autocast and torchao's recipe save for a Linear of the same shape.

Parameters and views of them are not counted (they live anyway); a tensor saved twice by one
module counts once. The meta device has no autocast: in a dry run, modules without a
low-precision rule run in fp32, so their bytes are fp32's (a low-precision rule casts its input
to the region's dtype itself, so its bytes are the GPU's).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec._src import torch_compat

#: mixprec's recipes and torchao.float8's recipe names for the same casts.
TORCHAO = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}


@dataclass(frozen=True)
class SavedBytes:
    """Bytes one module saves for backward in one pass.

    Attributes:
        module: its name. rule: the recipe its matmuls ran (``"-"`` unruled).
        mixprec: bytes mixprec's rule saved. bf16: bf16 autocast's for a Linear of the same
        shape (fp32 weight). torchao: torchao.float8's for the same recipe (bf16 weight),
        None where torchao has no such recipe or is not installed. mkn: the output matmul's
        (tokens, in, out), None for modules without one.
    """

    module: str
    rule: str
    mixprec: int
    bf16: int | None = None
    torchao: int | None = None
    mkn: tuple[int, int, int] | None = None


class _Counter:
    def __init__(self, model: nn.Module) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.stack: list[str] = []
        self.seen: dict[str, dict[int, int]] = {}
        self.keep: list[torch.Tensor] = []  # ids stay unique while the pass lasts
        self.modules = dict(model.named_modules())

    def enter(self, name: str) -> Any:
        def pre(module: nn.Module, args: Any) -> None:
            self.stack.append(name)

        return pre

    def leave(self, module: nn.Module, args: Any, out: Any) -> None:
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        base = torch_compat.tensor_base(t)
        of_param = id(t) in self.params or (base is not None and id(base) in self.params)
        if self.stack and not of_param:
            self.seen.setdefault(self.stack[-1], {})[id(t)] = t.numel() * t.element_size()
            self.keep.append(t)
        return t

    def result(self, rows: Sequence[Any]) -> tuple[SavedBytes, ...]:
        """Per module that saved something, with the references for its shape."""
        rules: dict[str, dict[str, str]] = {}
        shapes: dict[str, tuple[int, int, int]] = {}
        for r in rows:
            rules.setdefault(r.module, {})[r.matmul] = r.recipe
            if r.matmul == "fprop":
                shapes.setdefault(r.module, r.mkn)
        out = []
        for name, saved in self.seen.items():
            parts = list(rules.get(name, {}).values())
            rule = "-" if not parts else parts[0] if len(set(parts)) == 1 else "/".join(parts)
            mkn = shapes.get(name)
            mod = self.modules.get(name)
            bias = isinstance(mod, nn.Linear) and mod.bias is not None
            refs: tuple[int | None, int | None] = (None, None)
            if mkn is not None:
                refs = (reference_bytes(mkn, "bf16", bias), reference_bytes(mkn, rule, bias))
            out.append(SavedBytes(name, rule, sum(saved.values()), *refs, mkn))
        return tuple(out)


@contextlib.contextmanager
def count_saved(model: nn.Module) -> Iterator[_Counter]:
    """Count the bytes each module of ``model`` saves for backward while inside.
    Host sync: none."""
    counter = _Counter(model)
    handles = []
    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(counter.enter(name)))
        handles.append(mod.register_forward_hook(counter.leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            yield counter
    finally:
        for h in handles:
            h.remove()


_CACHE: dict[tuple[tuple[int, int, int], str, bool], int | None] = {}


def reference_bytes(mkn: tuple[int, int, int], mode: str, bias: bool) -> int | None:
    """Bytes a lone Linear (``in=K``, ``out=N``) saves for backward on ``M`` bf16 tokens:
    ``mode`` ``"bf16"`` (bf16 autocast, fp32 weight, on fake CPU tensors) or a mixprec recipe
    name (torchao.float8's same recipe, emulated, bf16 weight, on meta tensors); None where
    torchao has no such recipe or is not installed. Host sync: none."""
    key = (mkn, mode, bias)
    if key not in _CACHE:
        _CACHE[key] = _bf16_bytes(mkn, bias) if mode == "bf16" else _torchao_bytes(mkn, mode, bias)
    return _CACHE[key]


def _saved_by(model: nn.Module, x: torch.Tensor, region: Any) -> int:
    with count_saved(model) as counter, region:
        model(x)
    return sum(sum(s.values()) for s in counter.seen.values())


def _bf16_bytes(mkn: tuple[int, int, int], bias: bool) -> int:
    m, k, n = mkn
    with torch_compat.fake_tensor_mode():
        lin = nn.Sequential(nn.Linear(k, n, bias=bias))
        x = torch.empty(m, k, dtype=torch.bfloat16).requires_grad_()
        return _saved_by(lin, x, torch.autocast("cpu", torch.bfloat16))


def _torchao_bytes(mkn: tuple[int, int, int], recipe: str, bias: bool) -> int | None:
    if recipe not in TORCHAO:
        return None
    try:
        from torchao.float8 import (  # type: ignore[import-untyped]
            Float8LinearConfig,
            convert_to_float8_training,
        )
    except ImportError:
        return None
    m, k, n = mkn
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(TORCHAO[recipe]), emulate=True)
    lin = nn.Sequential(nn.Linear(k, n, bias=bias, device="meta", dtype=torch.bfloat16))
    convert_to_float8_training(lin, config=config)
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta").requires_grad_()
    return _saved_by(lin, x, contextlib.nullcontext())
