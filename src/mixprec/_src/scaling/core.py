"""The scaler's settings and state: construction, lazy tensors, getters, setters, checkpoints.

:class:`ScalerCore` holds every attribute the GradScaler shell uses; the iteration protocol
(``scale``/``unscale_``/``step``/``update``) lives in
:mod:`mixprec._src.scaling.grad_scaler` and the
signals users read (skip flags, stats, history, hooks) in :mod:`mixprec._src.scaling.signals`.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mixprec._src.dist.agree import DistState, validate_group
from mixprec._src.scaling import diagnostics
from mixprec._src.scaling.args import bind_constructor_args, parse_device
from mixprec._src.scaling.config import ScalerConfig
from mixprec._src.scaling.phases import OptState, PhaseTable
from mixprec._src.scaling.rule import ScaleState
from mixprec._src.scaling.state import LoadedState, export_state, parse_state_dict
from mixprec._src.scaling.telemetry import History, HostMirror, UpdateEvent
from mixprec.errors import ConfigError, ScalerStateError


class ScalerCore:
    """Settings, device state and checkpointing of a GradScaler (see :class:`GradScaler`)."""

    # An OrderedDict because torch's RemovableHandle keeps a weak reference to it.
    _hooks: OrderedDict[int, Callable[[Any, UpdateEvent], None]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind_constructor_args(args, kwargs)
        enabled = bound.pop("enabled")
        if not isinstance(enabled, bool):
            raise ConfigError(f"enabled must be a bool, got {enabled!r}.")
        device = parse_device(bound.pop("device"))
        # Not a rule setting: kept out of the config, the state dict and pickles.
        self._dist = DistState(validate_group(bound.pop("process_group")))
        history = bound.pop("history")
        if isinstance(history, bool) or not isinstance(history, int) or history < 0:
            raise ConfigError(f"history must be an int >= 0 (entries kept), got {history!r}.")
        self._config = ScalerConfig(**bound)
        self._enabled = enabled
        self._device = device.type if device is not None else None
        self._state: ScaleState | None = None
        self._pending = LoadedState(self._config, self._config.init_scale, 0, 0, [0, 0, 0, 0])
        self._phases = PhaseTable()
        self._mirror = HostMirror(self._config.init_scale, 0, 0)
        self._per_device_cache: dict[torch.device, torch.Tensor] = {}
        # 1/scale, kept while the scale does not change (every writer of the scale resets it).
        self._inv_scale: torch.Tensor | None = None
        self._history = History(history)
        self._hooks = OrderedDict()
        self._iteration: int | None = 0  # None: only the device counters know (see below)
        self._step_skips: dict[int, torch.Tensor] = {}
        self._last_iteration_skip: torch.Tensor | None = None
        self._warned: set[str] = set()

    def _lazy_init(self, device: torch.device) -> ScaleState:
        if self._state is None:
            if device.type == "meta":  # the scale would hold no data: nothing could read it
                raise ConfigError(
                    "scale() got a tensor on the 'meta' device, which holds no data: the scale "
                    "cannot live there. Materialize the model (e.g. model.to_empty(device=...) "
                    "and load its weights) before the first scale()."
                )
            pending = self._pending
            self._state = ScaleState.create(
                pending.scale,
                pending.growth_tracker,
                pending.overflow_streak,
                device,
                pending.counters,
            )
            self._device = device.type
        return self._state

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale tensors on ``dev`` now (torch's private hook, used by accelerate).

        Host sync: none.
        """
        self._lazy_init(torch.device(dev))

    def _require_state(self, method: str) -> ScaleState:
        if self._state is None:
            raise ScalerStateError(diagnostics.no_scale_message(method))
        return self._state

    def reset_iteration(self) -> None:
        """Abandon the current iteration after an exception: every optimizer is READY again.

        Use it when something raised between ``scale()`` and ``update()`` (the loss, a clipping
        function, ``optimizer.step``) and the batch is to be skipped: the scale, the growth
        tracker and the counters are left as they were, as if the iteration never happened.
        The gradients are not touched: zero them (``optimizer.zero_grad()``) before the next
        backward, since they may be scaled, unscaled or half-stepped. Call ``update()`` instead
        to count the iteration. A no-op between iterations and when disabled.

        Example:
            >>> import torch, mixprec
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> scaler = mixprec.GradScaler()
            >>> scaler.scale(model(torch.ones(1, 2)).sum()).backward()
            >>> scaler.unscale_(opt)
            >>> scaler.reset_iteration()  # e.g. in an ``except`` around the training step
            >>> opt.zero_grad()

        Host sync: none.
        """
        self._end_iteration()

    def _next_iteration(self, state: ScaleState) -> int:
        """The number of the update being applied (``state.counters`` already counts it).

        Under ``torch.compile``, reading a Python counter makes dynamo guard on its value, which
        recompiles every iteration. When no hook or history needs the number there, the host
        copy is dropped (``-1`` is returned, seen by nobody) and re-read from the device
        counters by the next eager update.
        """
        if torch.compiler.is_compiling() and not self._hooks and not self._history.capacity:
            self._iteration = None
            return -1
        if self._iteration is None:
            self._iteration = int(state.counters[0].item()) - 1
        self._iteration += 1
        return self._iteration

    def _get_inv_scale(self) -> torch.Tensor:
        """``float32(1 / float64(scale))`` as torch computes it, kept until the scale changes."""
        if self._inv_scale is None:
            scale = self._require_state("unscale_").scale
            if scale.device.type == "mps":  # no float64 on MPS
                self._inv_scale = scale.reciprocal()
            else:
                self._inv_scale = scale.double().reciprocal().float()
        return self._inv_scale

    def _end_iteration(self) -> None:
        self._dist.end_iteration()
        self._phases.clear()
        self._per_device_cache.clear()

    # ------------------------------------------------------------------ getters / setters

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled).

        Host sync: one, when the scale lives on an accelerator.
        """
        if not self._enabled:
            return 1.0
        if self._state is None:
            return self._pending.scale
        return self._mirror.resync(self._state).scale

    def _get_scale_async(self) -> torch.Tensor | None:
        """The scale tensor, or None before the first ``scale()``. Host sync: none."""
        return None if self._state is None else self._state.scale

    def _get_growth_tracker(self) -> int:
        """Clean iterations since the last growth or overflow. Host sync: one off the CPU."""
        if not self._enabled:
            return 0
        if self._state is None:
            return self._pending.growth_tracker
        return self._mirror.resync(self._state).growth_tracker

    @property
    def _scale(self) -> torch.Tensor | None:
        return self._get_scale_async()

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return None if self._state is None else self._state.growth_tracker

    def get_growth_factor(self) -> float:
        """The growth factor. Host sync: none."""
        return self._config.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the growth factor (> 1). Raises ConfigError otherwise. Host sync: none."""
        self._config = self._config.with_(growth_factor=new_factor)

    def get_backoff_factor(self) -> float:
        """The backoff factor. Host sync: none."""
        return self._config.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the backoff factor (in (0, 1)). Raises ConfigError otherwise. Host sync: none."""
        self._config = self._config.with_(backoff_factor=new_factor)

    def get_growth_interval(self) -> int:
        """The growth interval. Host sync: none."""
        return self._config.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the growth interval (an int >= 1). Raises ConfigError otherwise.

        Clean iterations already counted beyond the new interval are capped at one short of it,
        so the scale grows at the next clean iteration (torch's kernel compares with ``==`` and
        would not grow again for 2**31 iterations).

        Host sync: none.
        """
        self._config = self._config.with_(growth_interval=new_interval)
        cap = self._config.growth_interval - 1
        if self._state is not None:
            self._state.growth_tracker.clamp_(max=cap)
        if self._mirror.exact is not None and self._mirror.exact.growth_tracker > cap:
            self._mirror.exact = dataclasses.replace(self._mirror.exact, growth_tracker=cap)
        if self._pending.growth_tracker > cap:
            self._pending = dataclasses.replace(self._pending, growth_tracker=cap)

    def is_enabled(self) -> bool:
        """Whether this scaler scales. Host sync: none."""
        return self._enabled

    @property
    def process_group(self) -> Any:
        """The group the grads are sharded over, whose ranks agree on every skip and over which
        ``clip_grad_norm_`` sums norms (None: no agreement unless the grads are DTensors; DDP
        needs none). Not saved in state dicts or pickles: set it again after unpickling.

        Raises:
            ConfigError: (setter) not None or a ``torch.distributed.ProcessGroup``.

        Host sync: none.
        """
        return self._dist.group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self._dist.group = validate_group(group)

    @property
    def config(self) -> ScalerConfig:
        """The current settings (frozen; change them through the setters). Host sync: none."""
        return self._config

    # ------------------------------------------------------------------ state

    def _current_values(self) -> LoadedState:
        if self._state is None:
            return self._pending
        exact = self._mirror.resync(self._state)
        return LoadedState(
            self._config,
            exact.scale,
            exact.growth_tracker,
            exact.overflow_streak,
            [int(c) for c in self._state.counters.tolist()],
        )

    def state_dict(self) -> dict[str, Any]:
        """torch's five keys (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) plus mixprec's own; ``{}`` when disabled.

        Loads into ``torch.amp.GradScaler`` too (torch ignores the extra keys). Call it after
        ``update()``.

        Host sync: one, when the scale lives on an accelerator.
        """
        if not self._enabled:
            return {}
        return export_state(self._config, self._current_values())

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` or from ``torch.amp.GradScaler``.

        Everything is validated before anything changes. Works before the first ``scale()``
        (the values seed the tensors created then). A no-op when disabled.

        Raises:
            ConfigError: empty dict, missing keys, or values of the wrong type or range.
            ScalerStateError: an optimizer was unscaled or stepped in this iteration: its
                gradients were scaled with the old scale (torch silently mixes the two). Call
                ``update()`` or :meth:`reset_iteration` first.

        Host sync: none (values are written into existing tensors with ``fill_``).
        """
        if not self._enabled:
            return
        loaded = parse_state_dict(state_dict, self._config)
        if any(r.stage is not OptState.READY for r in self._phases.records()):
            raise ScalerStateError(
                "load_state_dict() was called mid-iteration (an optimizer was already unscaled "
                "or stepped with the current scale). Load checkpoints between iterations: call "
                "scaler.update() or scaler.reset_iteration() first."
            )
        self._config = loaded.config
        self._pending = loaded
        self._mirror = HostMirror(loaded.scale, loaded.growth_tracker, loaded.overflow_streak)
        self._iteration = loaded.counters[0]
        if self._state is not None:
            self._state.scale.fill_(loaded.scale)
            self._inv_scale = None
            self._state.growth_tracker.fill_(loaded.growth_tracker)
            self._state.overflow_streak.fill_(loaded.overflow_streak)
            self._state.counters.copy_(torch.tensor(loaded.counters, dtype=torch.int64))
        self._end_iteration()

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled and len(self._phases):
            raise ScalerStateError(
                "A GradScaler can only be pickled or copied at the beginning of an iteration or "
                "after update(); this one is mid-iteration (an optimizer was unscaled or "
                "stepped). Call scaler.update() first."
            )
        values = self._current_values() if self._enabled else self._pending
        state = dict(self.__dict__)
        state.update(_state=None, _pending=values, _per_device_cache={}, _inv_scale=None)
        # Hooks may be lambdas and the skip flags are keyed by object ids of this process.
        state.update(_hooks=OrderedDict(), _step_skips={}, _last_iteration_skip=None)
        state.update(_dist=DistState())  # process groups do not pickle; set it again
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
