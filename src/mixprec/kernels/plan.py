"""Gradients of an optimizer, grouped by (device, dtype) for one kernel launch per group."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from mixprec.errors import ConfigError

__all__ = ["GradPlan", "ParamRef", "iter_params", "plan_grads"]

GroupKey = tuple[torch.device, torch.dtype]


@dataclass(frozen=True)
class ParamRef:
    """Where a parameter sits in an optimizer, for messages that name it."""

    group: int
    index: int
    name: str | None
    param: torch.Tensor

    def describe(self) -> str:
        """``'encoder.weight'`` when the optimizer knows names, else group, index and shape."""
        if self.name is not None:
            return self.name
        shape = "x".join(str(s) for s in self.param.shape) or "scalar"
        return f"param_groups[{self.group}]['params'][{self.index}] (shape {shape})"


@dataclass
class GradPlan:
    """One optimizer's gradients, ready for the unscale kernels.

    Attributes:
        dense: dense grads grouped by (device, dtype).
        sparse: parameters with a sparse grad (their values join ``dense`` at unscale time).
        low_precision: parameters whose dense grad is float16.
        missing: parameters without a grad.
    """

    dense: dict[GroupKey, list[torch.Tensor]] = field(default_factory=dict)
    sparse: list[ParamRef] = field(default_factory=list)
    low_precision: list[ParamRef] = field(default_factory=list)
    missing: list[ParamRef] = field(default_factory=list)

    @property
    def devices(self) -> set[torch.device]:
        """Every device that holds at least one grad."""
        devs = {key[0] for key in self.dense}
        devs.update(ref.param.grad.device for ref in self.sparse if ref.param.grad is not None)
        return devs

    def all_grads(self) -> Iterator[torch.Tensor]:
        """Every dense grad, group after group."""
        for grads in self.dense.values():
            yield from grads


def iter_params(optimizer: torch.optim.Optimizer) -> Iterator[ParamRef]:
    """Every parameter of ``optimizer`` with its position and (if known) name.

    Raises:
        ConfigError: a ``params`` entry is not a tensor.
    """
    for g, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        for i, param in enumerate(group["params"]):
            if not isinstance(param, torch.Tensor):
                raise ConfigError(
                    f"optimizer.param_groups[{g}]['params'][{i}] is a {type(param).__name__}, "
                    "not a torch.Tensor. Build the optimizer from model.parameters() or "
                    "model.named_parameters()."
                )
            name = names[i] if names is not None and i < len(names) else None
            yield ParamRef(g, i, name, param)


def plan_grads(optimizer: torch.optim.Optimizer) -> GradPlan:
    """Group the optimizer's grads by (device, dtype).

    Host sync: none.
    """
    plan = GradPlan()
    for ref in iter_params(optimizer):
        grad = ref.param.grad
        if grad is None:
            plan.missing.append(ref)
            continue
        if grad.dtype == torch.float16:
            plan.low_precision.append(ref)
        if grad.is_sparse:
            plan.sparse.append(ref)
        else:
            plan.dense.setdefault((grad.device, grad.dtype), []).append(grad)
    return plan
