"""fp32 master weights for fp16/bf16 trainable parameters (apex's O2, for any torch optimizer).

Loss scaling cannot unscale fp16 gradients in place without flushing small values to zero, and an
optimizer that updates fp16 weights directly loses every update smaller than half a unit in the
last place. :class:`MasterWeights` converts an existing optimizer in place so that it works on
float32 copies ("masters") of its low-precision parameters:

* each low-precision parameter's gradient, as soon as autograd has accumulated it, is added into
  the master's fp32 ``.grad`` and the low-precision ``.grad`` is freed (a
  ``register_post_accumulate_grad_hook``), so gradient accumulation over micro-batches sums in fp32.
  In its place the parameter keeps a zero placeholder (a broadcast scalar: no memory), so that
  clearing it, ``model.zero_grad()`` with or without ``set_to_none``, is seen at the next
  backward (a pre-hook of the parameter's ``AccumulateGrad`` node) and clears the master's
  gradient too: the model and the optimizer may be zeroed either way;
* the scaler unscales and checks the fp32 master gradients (mixprec's or torch's scaler alike);
* the optimizer steps the masters (its state is fp32 too);
* after every ``optimizer.step()`` the low-precision parameters are refreshed from the masters (a
  step post-hook), so the model always runs with the masters rounded to its dtype; with a
  closure (LBFGS, SAM), also before every evaluation of the closure, since those optimizers move
  the masters mid-step.

Memory: for each low-precision element, 4 bytes of master and 4 bytes of master gradient, while the
2-byte low-precision gradient is freed as it arrives: +6 bytes per element over fp16 parameters
with fp16 gradients (optimizer state is fp32, as it would be for an fp32 model). fp32 parameters
of the same optimizer are left alone and cost nothing.

Parameter groups added later (``optimizer.add_param_group``) are converted as they are added.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from mixprec._src import torch_compat
from mixprec._src.optim import MASTERS, masters_of, split_closure
from mixprec.errors import ConfigError

_Optimizer = torch.optim.Optimizer
_STATE_KEY = "mixprec_master_weights"
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MasterWeights:
    """Give ``optimizer`` fp32 master copies of its fp16/bf16 parameters (converted in place).

    The optimizer stays the same object (LR schedulers, hooks and ``isinstance`` checks keep
    working); its ``param_groups`` now hold the fp32 masters in place of the low-precision
    parameters, in the same positions. ``optimizer.state_dict()`` carries the masters (under
    ``"mixprec_master_weights"``) and ``optimizer.load_state_dict()`` restores them and refreshes
    the model; a checkpoint without them (e.g. saved before wrapping) re-seeds the masters from
    the model's current parameters. Clip the gradients of :meth:`parameters` (the masters hold
    them), not of ``model.parameters()``: after a backward, a converted parameter's ``.grad`` is
    a read-only zero placeholder; zeroing it (``model.zero_grad()``) clears its master's gradient.
    Groups added with ``optimizer.add_param_group`` are converted too.

    Args:
        optimizer: any ``torch.optim.Optimizer``; convert it before its first step.
        dtypes: the parameter dtypes that get masters (default fp16 and bf16).

    Raises:
        ConfigError: ``optimizer`` is not an optimizer, or it was already converted, or (from
            ``add_param_group``) a parameter is already in it.

    Example:
        >>> import torch, mixprec
        >>> model = torch.nn.Linear(4, 1).half()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> masters = mixprec.MasterWeights(opt)
        >>> scaler = mixprec.GradScaler()
        >>> loss = model(torch.randn(8, 4).half()).float().pow(2).mean()
        >>> scaler.scale(loss).backward()
        >>> scaler.step(opt)
        >>> scaler.update()
        >>> model.weight.dtype, opt.param_groups[0]["params"][0].dtype
        (torch.float16, torch.float32)

    Host sync: none (construction copies the parameters on their device).
    """

    def __init__(
        self, optimizer: _Optimizer, *, dtypes: Iterable[torch.dtype] = _LOW_PRECISION
    ) -> None:
        if not isinstance(optimizer, _Optimizer):
            raise ConfigError(
                f"MasterWeights needs a torch.optim.Optimizer, got {type(optimizer).__name__}. "
                "Build the optimizer over the model's parameters first, then wrap it."
            )
        if masters_of(optimizer) is not None:
            raise ConfigError("This optimizer already has master weights; wrap it only once.")
        self.optimizer = optimizer
        self.dtypes = tuple(dtypes)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (low precision, master)
        self._links: list[_GradLink] = []
        for group in optimizer.param_groups:
            self._convert(group)
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_state_dict_post_hook(self._add_to_state_dict)
        optimizer.register_load_state_dict_pre_hook(self._take_from_state_dict)
        setattr(optimizer, MASTERS, self)
        # with a closure (LBFGS, SAM) the masters move mid-step: refresh before each evaluation.
        # Bound methods, as LR schedulers expect (they re-bind ``optimizer.step.__func__``).
        optimizer._mixprec_inner_step = optimizer.step  # type: ignore[attr-defined]
        optimizer.step = types.MethodType(_step_refreshing, optimizer)  # type: ignore[method-assign]
        optimizer.add_param_group = types.MethodType(  # type: ignore[method-assign]
            _add_group_converting, optimizer
        )
        # torch drops instance attributes and hooks when copying an optimizer: refuse loudly
        for name in ("__deepcopy__", "__reduce_ex__"):
            setattr(optimizer, name, types.MethodType(_refuse_copy, optimizer))

    def _after_step(self, optimizer: _Optimizer, args: Any, kwargs: Any) -> None:
        self.refresh()

    def _convert(self, group: dict[str, Any]) -> None:
        """Put masters in place of the group's low-precision trainable parameters."""
        converted = {id(low) for low, _ in self.pairs}
        for i, param in enumerate(group["params"]):
            if param.dtype not in self.dtypes or not param.requires_grad:
                continue
            if id(param) in converted:
                raise ConfigError(
                    f"A parameter of shape {tuple(param.shape)} is already in this optimizer "
                    "(as its fp32 master); add each parameter to one group only."
                )
            master = param.detach().float().requires_grad_(True)
            group["params"][i] = master
            if param.grad is not None:  # a gradient accumulated before the conversion
                master.grad = param.grad.float()
            self._move_state(param, master)
            self.pairs.append((param, master))
            self._links.append(_GradLink(param, master))

    def _move_state(self, param: torch.Tensor, master: torch.Tensor) -> None:
        state = self.optimizer.state.pop(param, None)
        if state:
            self.optimizer.state[master] = {
                k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in state.items()
            }

    def parameters(self) -> Iterator[torch.Tensor]:
        """Every parameter the optimizer steps (masters in place of low-precision ones).

        Host sync: none.
        """
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the masters into the low-precision parameters (done after every step).

        Host sync: none.
        """
        if self.pairs:
            low, masters = zip(*self.pairs, strict=True)
            torch_compat.foreach_copy_(list(low), list(masters))

    @torch.no_grad()
    def reseed(self) -> None:
        """Copy the low-precision parameters into the masters (after loading model weights
        without the optimizer's checkpoint).

        Host sync: none.
        """
        for low, master in self.pairs:
            master.copy_(low)

    def overhead_bytes(self) -> int:
        """Extra memory over low-precision parameters with low-precision grads, in bytes:
        master and master grad (fp32) minus the freed low-precision grad, per element.

        Host sync: none.
        """
        return sum(low.numel() * (8 - low.element_size()) for low, _ in self.pairs)

    def _add_to_state_dict(self, _: _Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[_STATE_KEY] = [master.detach().clone() for _, master in self.pairs]
        return state_dict

    def _take_from_state_dict(self, _: _Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        if saved is not None and len(saved) != len(self.pairs):
            raise ConfigError(
                f"The checkpoint holds {len(saved)} master weight(s) but this optimizer has "
                f"{len(self.pairs)} low-precision parameter(s). Load a checkpoint saved from the "
                "same model and optimizer."
            )
        with torch.no_grad():
            if saved is None:
                self.reseed()
            else:
                for (_low, master), value in zip(self.pairs, saved, strict=True):
                    master.copy_(value)
        self.refresh()
        return state_dict


class _GradLink:
    """Moves a low-precision parameter's gradient into its master as autograd accumulates it.

    After each accumulation the parameter's ``.grad`` becomes a zero placeholder (a scalar zero
    broadcast to its shape: no memory). Before the next accumulation (a pre-hook of the
    parameter's ``AccumulateGrad`` node, which ``torch.autograd.grad`` does not run), a
    placeholder that was cleared or zeroed in place means the model's grads were zeroed: the
    master's gradient is cleared too. The placeholder is then removed, so autograd stores the
    new gradient instead of adding into it.
    """

    def __init__(self, low: torch.Tensor, master: torch.Tensor) -> None:
        self.low = low
        self.master = master
        self.placeholder = torch.zeros((), dtype=low.dtype, device=low.device).expand(low.shape)
        self.version = torch_compat.version_counter(self.placeholder)
        with torch.enable_grad():  # the node is reached through a view's graph
            view = low.view_as(low)
        assert view.grad_fn is not None
        node = view.grad_fn.next_functions[0][0]
        assert node is not None
        self.node = node
        self.handles: list[RemovableHandle] = [
            self.node.register_prehook(self._before),
            low.register_post_accumulate_grad_hook(self._after),
        ]
        low.grad = self.placeholder if master.grad is not None else None

    def _before(self, grad_outputs: Any) -> None:
        current = self.low.grad
        changed = torch_compat.version_counter(self.placeholder) != self.version
        if current is not self.placeholder or changed:
            self.master.grad = None  # the model's grad was cleared, zeroed or replaced
        if current is self.placeholder:
            self.low.grad = None

    def _after(self, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        with torch.no_grad():
            if self.master.grad is None:
                self.master.grad = grad.float()
            else:
                self.master.grad.add_(grad)
        param.grad = self.placeholder
        self.version = torch_compat.version_counter(self.placeholder)


def _add_group_converting(optimizer: _Optimizer, param_group: dict[str, Any]) -> None:
    """``add_param_group`` of a converted optimizer: the new group gets masters too."""
    type(optimizer).add_param_group(optimizer, param_group)
    masters = masters_of(optimizer)
    assert masters is not None
    masters._convert(optimizer.param_groups[-1])


def _step_refreshing(optimizer: _Optimizer, *args: Any, **kwargs: Any) -> Any:
    """``step`` of a converted optimizer: a closure sees the model refreshed from the masters."""
    step = optimizer._mixprec_inner_step  # type: ignore[attr-defined]
    masters = masters_of(optimizer)
    call = split_closure(args, kwargs)
    if call is None or masters is None:
        return step(*args, **kwargs)

    def refreshed() -> Any:
        masters.refresh()
        return call.closure()

    return call.invoke_with(step, refreshed)


def _refuse_copy(optimizer: _Optimizer, *args: Any) -> Any:
    raise ConfigError(
        f"This {type(optimizer).__name__} was converted by mixprec.MasterWeights and cannot be "
        "deep-copied or pickled: torch would drop the hooks that feed and refresh the masters, "
        "and the copy would silently stop training the low-precision parameters. Checkpoint "
        "with optimizer.state_dict() (it carries the fp32 masters) and load it into a freshly "
        "converted optimizer."
    )
