"""Where the scale is: the one owner of the scale and of everything derived from it.

:class:`ScaleState` holds the scale, the growth tracker, the overflow streak and the counters, and
every value derived from them: ``1/scale``, the copies of the scale on other devices, the host's
view and the number of the current iteration. Nothing else in mixprec stores any of them. They
change in exactly three ways, each a method here: the rule (:meth:`ScaleState.advance`), a scale
set by the user (:meth:`ScaleState.set_scale`) and a loaded checkpoint (:meth:`ScaleState.load`);
each ends in :meth:`ScaleState._changed`, which drops what was derived from the old values.

Before the first ``scale()`` the values are Python numbers. ``scale()`` creates tensors on the
device of its first output (:meth:`ScaleState.materialize`); from then on the tensors are the
truth and the host keeps a *view*:

* whenever the host knows the iteration's outcome, the rule runs on the host view (the host
  form, :func:`~mixprec._src.scaling.rule.advance`) and the view stays exact: always
  where tensors live in host memory (the CPU, see :mod:`mixprec._src.devices`: the flag is read
  from host memory for free), and on every device after a non-fused ``step``, which reads the
  flag anyway. The scale tensor is written when the scale changes (one ``fill_``, no sync); the
  tracker, streak and counters tensors only when something asks for them
  (:attr:`ScaleState.tensors`). A CUDA iteration with a non-fused optimizer therefore launches no
  kernel in ``update()`` unless the scale changes;
* otherwise (fused optimizers off the CPU, where nothing has read the flag) the rule runs on the
  device (:func:`~mixprec._src.scaling.rule.advance_`), the view is dropped and only a
  lower bound on the scale is kept, until something reads the tensors again
  (:meth:`ScaleState.values`). Reading gives the exact values, so it never changes the
  trajectory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mixprec._src.devices import caps
from mixprec._src.scaling.config import INT32_MAX, ScalerConfig, to_f32
from mixprec._src.scaling.rule import Tensors, Values, advance, advance_, uses_kernel
from mixprec.errors import ConfigError

# Backoff products are rounded to float32; shrinking the bound a little more keeps it a bound.
_ROUNDING_MARGIN = 1.0 - 2.0**-20


class ScaleState:
    """The scale, growth tracker, overflow streak and counters, and their derived values."""

    def __init__(self, values: Values) -> None:
        self._tensors: Tensors | None = None
        self._host_memory = True
        # On the host path the tracker, streak and counters tensors are written only when read
        # (``tensors``); the scale tensor is always current.
        self._behind = False
        # The host's exact view (None: unknown); before materialize() it is the truth.
        self._host: Values | None = values
        self._bound = values.scale  # the scale is known to be >= this
        self._below_one = values.scale < 1.0  # a bool for dynamo to guard on (see below)
        self._iterations: int | None = values.counters[0]
        self._inv: torch.Tensor | None = None
        self._copies: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ creating, reading

    @property
    def tensors(self) -> Tensors | None:
        """The device tensors, all current, or None before the first ``scale()``.

        Host sync: none.
        """
        if self._behind:
            self._catch_up()
        return self._tensors

    @property
    def scale(self) -> torch.Tensor | None:
        """The scale tensor (always current), or None before the first ``scale()``.

        Host sync: none.
        """
        return None if self._tensors is None else self._tensors.scale

    def _catch_up(self) -> None:
        """Write the host view into the tracker, streak and counters tensors."""
        assert self._tensors is not None and self._host is not None
        self._behind = False
        self._tensors.write(self._host)

    def materialize(self, device: torch.device) -> Tensors:
        """The tensors, created on ``device`` if they do not exist yet.

        Raises:
            ConfigError: ``device`` is the meta device (the scale would hold no data).

        Host sync: none.
        """
        if self._tensors is None:
            if device.type == "meta":
                raise ConfigError(
                    "scale() got a tensor on the 'meta' device, which holds no data: the scale "
                    "cannot live there. Materialize the model (e.g. model.to_empty(device=...) "
                    "and load its weights) before the first scale()."
                )
            assert self._host is not None  # exact until tensors exist
            self._tensors = Tensors.create(self._host, device)
            self._host_memory = caps(device).host_memory
        tensors = self.tensors
        assert tensors is not None
        return tensors

    def values(self) -> Values:
        """The exact values (read from the device when the host has lost track of them).

        Host sync: one when the host view is unknown and the tensors are not in host memory.
        """
        if self._host is None:
            tensors = self.tensors
            assert tensors is not None
            self._known(tensors.read(), changed=False)
            assert self._host is not None
        return self._host

    @property
    def host_view(self) -> Values | None:
        """The exact values if the host knows them without reading the device. Host sync: none."""
        return self._host

    def scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale on ``device`` (the scale itself on its own device; a cached copy elsewhere).

        Host sync: none.
        """
        copy = self._copies.get(device)
        if copy is None:
            scale = self.scale if self._tensors is not None else self.materialize(device).scale
            assert scale is not None
            copy = self._copies[device] = scale.to(device, non_blocking=True)
        return copy

    def inv_scale(self) -> torch.Tensor:
        """``float32(1 / float64(scale))`` as torch computes it, kept until the scale changes.

        Host sync: none.
        """
        if self._inv is None:
            scale = self.scale
            assert scale is not None
            self._inv = scale.to(caps(scale.device).wide_float).reciprocal().float()
        return self._inv

    @property
    def may_be_below_one(self) -> bool:
        """True unless the host can prove ``scale >= 1`` (then ``1/scale`` cannot overflow).

        Kept as a bool for code that torch.compile traces: dynamo guards on what it reads, and
        a bool has two values where the bound has one per scale (one recompile each).

        Host sync: none.
        """
        return self._below_one

    # ------------------------------------------------------------------ the three writers

    def advance(
        self,
        found_inf: torch.Tensor,
        overflow: bool | None,
        config: ScalerConfig,
        keep: bool,
        needed: Callable[[], bool],
    ) -> tuple[torch.Tensor, int, Values | None]:
        """Apply the rule for one iteration and count it.

        Args:
            found_inf: the iteration's combined overflow flag on the scale's device.
            overflow: the outcome, when the host already knows it (else None).
            config: the rule's settings.
            keep: return a copy of the old scale (for history) rather than the live tensor.
            needed: whether the iteration's number is needed (see :meth:`_count`).

        Returns:
            ``(the scale used during the iteration, the number of the update, the values after
            it if the host knows them without a read)``.

        Host sync: none (on the host path the flag is read from host memory).
        """
        compiling = torch.compiler.is_compiling()
        before = self._host
        if before is not None and not compiling and (overflow is not None or self._host_memory):
            if overflow is None:  # in host memory: reading the flag costs no sync
                overflow = bool(found_inf.item() != 0)
            tensors = self._tensors
            assert tensors is not None
            used = tensors.scale.clone() if keep else tensors.scale
            after = advance(before, overflow, config)
            changed = after.scale != before.scale
            if changed:
                tensors.scale.fill_(after.scale)
            self._behind = True
            self._known(after, changed)
            self._iterations = after.counters[0]  # (the host view counts the iterations too)
            return used, self._iterations, after
        tensors = self.tensors
        assert tensors is not None
        # The floor clamp is needed only when one backoff could take the scale near it.
        near_floor = self._bound * config.backoff_factor < 4 * config.floor
        used = tensors.scale.clone()
        overflow_ = found_inf != 0
        kernel = uses_kernel(config, used.device)
        advance_(tensors, found_inf, config, clamp=near_floor)
        if kernel:
            tensors.overflow_streak.clamp_(max=INT32_MAX - 1).add_(1).mul_(overflow_)
        grew, shrank = tensors.scale > used, tensors.scale < used
        tensors.counters.add_(torch.stack([torch.ones_like(overflow_), overflow_, grew, shrank]))
        self._follow(config, compiling)
        return used, self._count(compiling, needed), self._host

    def _follow(self, config: ScalerConfig, compiling: bool) -> None:
        """The host view after a device-side update.

        Under ``torch.compile`` the view neither reads the device (``tolist`` would break the
        graph) nor follows the rule on Python numbers (dynamo would guard on their values and
        recompile every iteration): it is dropped, keeping only the floor as a bound, until
        something outside the compiled region reads the device again. Elsewhere it is read where
        that is free (host memory) and dropped, keeping a bound, where it is not.
        """
        if compiling:
            self._unknown(config.floor)
        elif self._host_memory:
            tensors = self.tensors
            assert tensors is not None
            self._known(tensors.read(), changed=True)
        else:
            self._unknown(max(self._bound * config.backoff_factor * _ROUNDING_MARGIN, config.floor))

    def set_scale(self, value: float) -> None:
        """Set the scale (``update(new_scale)``), keeping the tracker, streak and counters.

        Rounded to float32 as ``fill_`` rounds it (as torch's ``copy_`` of a float64 tensor
        rounds). Call with a validated value.

        Host sync: none.
        """
        tensors = self.tensors  # current: the host view may be dropped below
        assert tensors is not None
        scale = to_f32(value)
        tensors.scale.fill_(scale)
        if self._host is None:
            self._unknown(scale)
        else:
            self._known(self._host._replace(scale=scale), changed=True)

    def load(self, values: Values) -> None:
        """Replace every value (a validated checkpoint). Host sync: none."""
        self._behind = False
        if self._tensors is not None:
            self._tensors.write(values)
        self._iterations = values.counters[0]
        self._known(values, changed=True)

    def cap_tracker(self, cap: int) -> None:
        """Lower the growth tracker to at most ``cap`` (a shortened growth interval).

        Host sync: none.
        """
        if self._tensors is not None:
            self._tensors.growth_tracker.clamp_(max=cap)
        if self._host is not None and self._host.growth_tracker > cap:
            self._host = self._host._replace(growth_tracker=cap)

    # ------------------------------------------------------------------ bookkeeping

    def _count(self, compiling: bool, needed: Callable[[], bool]) -> int:
        """The number of the update just applied (the counters already count it).

        Under ``torch.compile``, reading a Python counter makes dynamo guard on its value, which
        recompiles every iteration. When nobody needs the number there (``needed()`` False: no
        hook, no history), the host copy is dropped (``-1`` is returned) and re-read from the
        device counters by the next eager update (one host sync).
        """
        if compiling and not needed():
            self._iterations = None
            return -1
        if self._iterations is None:
            tensors = self.tensors
            assert tensors is not None
            self._iterations = int(tensors.counters[0].item()) - 1
        self._iterations += 1
        return self._iterations

    def _known(self, values: Values, changed: bool) -> None:
        self._host = values
        self._bound = values.scale
        self._below_one = not values.scale >= 1.0
        if changed:
            self._changed()

    def _unknown(self, bound: float) -> None:
        if self._behind:
            self._catch_up()
        self._host = None
        self._bound = bound
        self._below_one = not bound >= 1.0  # (NaN too)
        self._changed()

    def _changed(self) -> None:
        """The scale may have changed: drop everything derived from it."""
        self._inv = None
        self._copies.clear()

    def __getstate__(self) -> dict[str, Any]:
        """Only the values travel; tensors are re-created by the next ``scale()``."""
        return {"values": self.values()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["values"])  # type: ignore[misc]
