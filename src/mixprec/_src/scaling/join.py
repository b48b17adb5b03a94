"""Uneven inputs: shadow iterations for ``torch.distributed.algorithms.Join``, through the
scaler's ``_join`` and ``_shadow_iteration``."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.join import Joinable, JoinHook

from mixprec._src.dist.agree import comm_device, initialized, validate_group
from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec.errors import ConfigError


class JoinableScaler(Joinable):
    """Lets a GradScaler take part in ``torch.distributed.algorithms.Join`` (uneven inputs).

    Inside ``Join([model, JoinableScaler(s)])`` (the model first), each iteration a joined rank
    still runs while others train is a *shadow iteration*: the all-reduces of its last real
    iteration, with 0, then ``update()`` with the agreed flag, so the scale and counters stay
    identical on every rank (pytorch#90057); every iteration must check the same optimizers the
    same way. While joined, skips are agreed over the join's group (``docs/distributed.md``).

    Args:
        scaler: the :class:`~mixprec.GradScaler`.
        process_group: the join's group (the DDP model's); default: the scaler's
            ``process_group``, else the world.

    Raises:
        ConfigError: torch.distributed is not initialised, or ``scaler`` is not a mixprec
            GradScaler.

    Host sync: none at construction; a joined rank reads each shadow iteration's flag.
    """

    def __init__(self, scaler: Any, process_group: Any = None) -> None:
        super().__init__()
        import torch.distributed as dist

        if not initialized():
            raise ConfigError(
                "JoinableScaler needs torch.distributed: call "
                "torch.distributed.init_process_group(...) before wrapping the scaler."
            )
        if not isinstance(scaler, GradScaler):
            raise ConfigError(
                f"Expected a mixprec.GradScaler, got {type(scaler).__name__}. Build the scaler "
                "with mixprec.GradScaler(...) (it takes torch.amp.GradScaler's arguments)."
            )
        group = validate_group(process_group) or scaler.process_group or dist.group.WORLD
        self._scaler = scaler
        self._group = group
        scaler._join(self, group)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook that runs shadow iterations. Host sync: none."""
        return _ScalerJoinHook(self._scaler, self._group, self.join_device)

    @property
    def join_device(self) -> torch.device:
        """Where the join context's own all-reduces run. Host sync: none."""
        scale = self._scaler._get_scale_async()
        device = scale.device if scale is not None else torch.device("cpu")
        return comm_device(self._group, device)

    @property
    def join_process_group(self) -> Any:
        """The scaler's process group. Host sync: none."""
        return self._group


class _ScalerJoinHook(JoinHook):
    def __init__(self, scaler: GradScaler, group: Any, device: torch.device) -> None:
        self._scaler = scaler
        self._group = group
        self._device = device

    def main_hook(self) -> None:
        """One shadow iteration: the training ranks' all-reduces with 0, then ``update()``."""
        self._scaler._shadow_iteration(self._group, self._device)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Nothing to do: every shadow iteration already kept the state in step."""
