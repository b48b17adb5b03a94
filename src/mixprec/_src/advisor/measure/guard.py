"""Leave the user's model as it was: gradients, buffers, RNG state and training flags.

The advisor runs many forward and backward passes on the user's own model (not a copy, so that a
loss function that reaches the model through a closure measures the same object). :class:`Guard`
takes the state those passes touch before the first one, resets it before every pass (so each
pass sees the same buffers and the same random numbers, e.g. dropout masks) and puts everything
back when it exits, also after an error. The modules' training flags are part of that state: a
loss function that calls ``model.train()`` leaves an eval-mode model in eval mode afterwards.
"""

from __future__ import annotations

import random
from types import TracebackType
from typing import Any

import torch
from torch import nn

from mixprec._src import torch_compat
from mixprec.errors import ConfigError


class Guard:
    """Snapshot, per-pass reset and restore of the state a forward/backward pass changes.

    Host sync: none on entry; restoring copies the buffers back (device copies only).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.params = [p for p in model.parameters()]
        self.tied = _tied(model)
        self._grads: list[torch.Tensor | None] = []
        self._buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self._versions: list[int] = []
        self._rng: tuple[Any, ...] = ()
        self._modes: list[tuple[nn.Module, bool]] = []

    def __enter__(self) -> Guard:
        self._grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self._versions = [torch_compat.version_counter(p) for p in self.params]
        for mod in self.model.modules():
            for name, buf in mod.named_buffers(recurse=False):
                self._buffers.append((mod, name, buf, buf.detach().clone()))
        self._rng = _rng_state(self.device)
        self._modes = [(m, m.training) for m in self.model.modules()]
        return self

    def reset(self) -> None:
        """Before a pass: no gradients, the buffers, training flags and RNG state of the
        snapshot."""
        for p in self.params:
            p.grad = None
        self._restore_buffers()
        self._restore_modes()
        _set_rng_state(self.device, self._rng)

    def _restore_modes(self) -> None:
        for module, training in self._modes:
            module.training = training

    def take_grads(self) -> list[torch.Tensor | None]:
        """After a pass: the parameters' gradients (removed from the parameters)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.check_parameters()
        return grads

    def check_parameters(self) -> None:
        """Raise if a pass modified a parameter in place (the advisor cannot undo that)."""
        for p, version in zip(self.params, self._versions, strict=True):
            if torch_compat.version_counter(p) != version:
                name = next(n for n, q in self.model.named_parameters() if q is p)
                raise ConfigError(
                    f"the loss function modified parameter {name!r} in place during a forward "
                    "or backward pass; the advisor measures models whose passes leave the "
                    "parameters unchanged (no optimizer step inside the loss function)"
                )

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for mod, name, buf, saved in self._buffers:
                if getattr(mod, name, None) is not buf:
                    torch_compat.set_public_attr(mod, name, buf)  # the pass replaced it
                buf.copy_(saved)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for p, g in zip(self.params, self._grads, strict=True):
            p.grad = g
        self._restore_buffers()
        self._restore_modes()
        _set_rng_state(self.device, self._rng)


def _tied(model: nn.Module) -> set[int]:
    """The ids of ``model``'s modules that hold a parameter another module holds too (a head
    tied to the embedding)."""
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    return {id(m) for mods in owners.values() if len(mods) > 1 for m in mods}


def _device_rng(device: torch.device) -> Any:
    """The accelerator module whose generator ``device`` uses (``torch.cuda``, ``torch.xpu``,
    ``torch.mps``, ...), or None: the CPU's is torch's default generator."""
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device.type)
    except (RuntimeError, AttributeError):  # a device type without a module
        return None
    if not hasattr(module, "get_rng_state"):
        return None
    initialized = getattr(module, "is_initialized", None)
    return module if initialized is None or initialized() else None


def _rng_state(device: torch.device) -> tuple[Any, ...]:
    module = _device_rng(device)
    dev_state = None if module is None else module.get_rng_state(device)
    return (torch.get_rng_state(), dev_state, random.getstate())


def _set_rng_state(device: torch.device, state: tuple[Any, ...]) -> None:
    if not state:
        return
    cpu, dev_state, py = state
    torch.set_rng_state(cpu)
    if dev_state is not None:
        torch.get_device_module(device.type).set_rng_state(dev_state, device)
    random.setstate(py)
