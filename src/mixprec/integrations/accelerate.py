"""accelerate: mixprec's GradScaler inside ``accelerate.Accelerator``.

accelerate has no ``scaler=`` argument, but it calls its scaler by duck typing, so a scaler
assigned to ``accelerator.scaler`` before ``prepare()`` is used for ``backward``, ``clip_grad_*``,
the optimizer step and ``save_state``/``load_state``. :func:`use_mixprec_scaler` does that and
fixes what a bare assignment gets wrong:

* On the CPU, ``Accelerator(mixed_precision="fp16")`` silently trains in fp32 (accelerate 1.15
  sets ``native_amp=False`` and no scaler there). The helper turns fp16 autocast on.
* accelerate reports a skipped step (``optimizer.step_was_skipped``,
  ``accelerator.optimizer_step_was_skipped``, and ``AcceleratedScheduler`` that reads it) when
  the scaler did not call ``optimizer.step``. Fused optimizers (``fused=True``) skip inside their
  kernel, so their steps are always called: every skipped step after the first is reported as
  taken, and the LR schedule runs on. The helper answers from
  ``scaler.last_step_skipped(optimizer)`` instead, which is right for both kinds.

:func:`use_mixprec_policy` trains under a ``mixprec.Policy`` (per-module rules: fp8 recipes,
layers kept in 16-bit or fp32; the advisor's ``advice.policy``): ``with accelerator.autocast():``
enters ``mixprec.autocast(device, dtype, policy=policy)`` inside accelerate's own autocast, and
given a 🤗 ``Trainer`` (``use_mixprec_policy(trainer, advice.policy, advice.dtype)``) every loss
the Trainer computes runs in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from mixprec._src.deps import require
from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec.errors import ConfigError, ScalerStateError

__all__ = ["use_mixprec_policy", "use_mixprec_scaler"]

_PURPOSE = "mixprec.integrations.accelerate"
# Engines that scale the loss themselves.
_UNSUPPORTED = {
    "DEEPSPEED": "DeepSpeed scales the loss itself; configure its fp16 section instead.",
    "MEGATRON_LM": "Megatron-LM scales the loss itself.",
}


def use_mixprec_scaler(accelerator: Any, scaler: GradScaler | None = None) -> GradScaler:
    """Make ``accelerator`` use mixprec's ``scaler`` (on every device, the CPU included).

    Call it right after constructing the Accelerator, before ``prepare()``. Then ``backward``,
    ``clip_grad_norm_``, ``optimizer.step()``, ``save_state``/``load_state`` go through the
    scaler, and ``step_was_skipped`` (hence ``AcceleratedScheduler``) is right for fused
    optimizers too.

    Args:
        accelerator: an ``accelerate.Accelerator`` built with ``mixed_precision="fp16"``.
        scaler: the scaler (default: a ``mixprec.GradScaler`` with the settings of the
            accelerator's ``GradScalerKwargs`` handler, if any, which accelerate ignores on
            the CPU).

    Returns:
        The scaler now in use (also ``accelerator.scaler``).

    Raises:
        ConfigError: ``mixed_precision`` is not ``"fp16"``, a distributed engine that scales
            on its own (DeepSpeed, Megatron-LM), or FSDP1 with a scaler without
            ``process_group``.
        ScalerStateError: an optimizer was already prepared.

    Example:
        >>> from accelerate import Accelerator  # doctest: +SKIP
        >>> acc = Accelerator(mixed_precision="fp16", cpu=True)  # doctest: +SKIP
        >>> scaler = use_mixprec_scaler(acc)  # doctest: +SKIP
        >>> model, opt = acc.prepare(model, opt)  # doctest: +SKIP

    Host sync: none.
    """
    require("accelerate", "accelerate", _PURPOSE)
    _check_accelerator(accelerator)
    if scaler is None:
        handler = getattr(accelerator, "scaler_handler", None)
        scaler = GradScaler(**(handler.to_kwargs() if handler is not None else {}))
    _check_sharding(accelerator, scaler)
    accelerator.scaler = scaler
    accelerator.native_amp = True
    _patch_prepare_optimizer(accelerator)
    return scaler


_MIXED_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def use_mixprec_policy(target: Any, policy: Any, dtype: torch.dtype | None = None) -> Any:
    """Train under ``policy``: ``with accelerator.autocast():`` enters its region; given a 🤗
    ``Trainer``, so does every loss the Trainer computes (training and evaluation).

    The region is ``mixprec.autocast(accelerator.device.type, dtype, policy=policy)``, entered
    inside accelerate's own autocast. It must be entered before the model is called: module
    names in the policy are relative to the outermost module called in it (the names
    ``mixprec.advise`` reports for that model). So with accelerate alone write the forward as
    ``with accelerator.autocast(): loss = loss_fn(model, batch)``; the Trainer does this itself
    (its ``compute_loss_context_manager``). Call it before training, at any point around
    ``prepare()``.

    Args:
        target: an ``accelerate.Accelerator``, or a ``transformers.Trainer`` (its
            ``accelerator`` is the one used).
        policy: a ``mixprec.Policy`` or its string (``advice.policy``, ``str(advice.policy)``).
        dtype: the region's 16-bit dtype (``advice.dtype``). Default: the accelerator's
            ``mixed_precision`` (``"bf16"`` or ``"fp16"``); required when that is ``"no"``.

    Returns:
        The ``mixprec.Policy`` in use.

    Raises:
        ConfigError: a policy that does not parse, a ``dtype`` that is not a 16-bit float or
            disagrees with the accelerator's ``mixed_precision``, or accelerate's own fp8
            (which replaces the Linears).

    Host sync: none.
    """
    require("accelerate", "accelerate", _PURPOSE)
    from mixprec._src.autocast.policy import Policy

    accelerator = getattr(target, "accelerator", target)
    rules = policy if isinstance(policy, Policy) else Policy(policy)
    region = _policy_dtype(accelerator, dtype)
    _patch_autocast(accelerator, accelerator.device.type, region, rules)
    if target is not accelerator:  # the Trainer's loss context: its accelerator's autocast

        def autocast_smart_context_manager(cache_enabled: bool | None = True) -> Any:
            return accelerator.autocast()

        target.autocast_smart_context_manager = autocast_smart_context_manager
    return rules


def _policy_dtype(accelerator: Any, dtype: torch.dtype | None) -> torch.dtype:
    mixed = str(getattr(accelerator, "mixed_precision", "no"))
    if mixed not in ("no", *_MIXED_DTYPES):
        raise ConfigError(
            f"use_mixprec_policy with Accelerator(mixed_precision={mixed!r}): accelerate's fp8 "
            "replaces the Linears; use mixed_precision='bf16' and fp8 rules in the policy."
        )
    if dtype is not None and dtype not in _MIXED_DTYPES.values():
        raise ConfigError(f"dtype={dtype}: pass torch.bfloat16 or torch.float16 (advice.dtype)")
    own = _MIXED_DTYPES.get(mixed)
    if dtype is None and own is None:
        raise ConfigError(
            "use_mixprec_policy: Accelerator(mixed_precision='no') has no 16-bit dtype; pass "
            "dtype=advice.dtype (or build the Accelerator with mixed_precision='bf16')."
        )
    if dtype is not None and own is not None and dtype != own:
        raise ConfigError(
            f"use_mixprec_policy: dtype={dtype} but mixed_precision={mixed!r} "
            f"({own}): make them agree (mixed_precision='bf16' for an fp8 policy's advice)."
        )
    return dtype if dtype is not None else own  # type: ignore[return-value]


def _patch_autocast(accelerator: Any, device: str, dtype: torch.dtype, policy: Any) -> None:
    original = getattr(accelerator, "_mixprec_autocast", accelerator.autocast)

    @contextlib.contextmanager
    def autocast(autocast_handler: Any = None) -> Iterator[None]:
        import mixprec

        with original(autocast_handler), mixprec.autocast(device, dtype, policy=policy):
            yield

    accelerator._mixprec_autocast = original  # a second call replaces the policy
    accelerator.autocast = autocast


def _check_accelerator(accelerator: Any) -> None:
    mixed = getattr(accelerator, "mixed_precision", None)
    if mixed != "fp16":
        raise ConfigError(
            f"use_mixprec_scaler needs Accelerator(mixed_precision='fp16'), got "
            f"mixed_precision={mixed!r}. bf16 needs no loss scaling."
        )
    engine = getattr(accelerator.distributed_type, "name", str(accelerator.distributed_type))
    if engine in _UNSUPPORTED:
        raise ConfigError(
            f"use_mixprec_scaler does not support distributed_type={engine}: {_UNSUPPORTED[engine]}"
        )
    if getattr(accelerator, "_optimizers", None):
        raise ScalerStateError(
            f"use_mixprec_scaler was called after prepare(): {len(accelerator._optimizers)} "
            "optimizer(s) already hold accelerate's scaler. Call it right after "
            "Accelerator(...), before accelerator.prepare(...)."
        )


def _check_sharding(accelerator: Any, scaler: GradScaler) -> None:
    """FSDP1 shards gradients as plain tensors: the ranks agree on a skip only through the
    scaler's process group (FSDP2's DTensor gradients bring their own)."""
    fsdp1 = getattr(accelerator.distributed_type, "name", "") == "FSDP" and not getattr(
        accelerator, "is_fsdp2", False
    )
    if fsdp1 and getattr(scaler, "process_group", None) is None:
        raise ConfigError(
            "use_mixprec_scaler with FSDP1: every rank holds a different shard of the "
            "gradients, so the ranks must agree on each skip. Pass a scaler that all-reduces "
            "its overflow flag: use_mixprec_scaler(accelerator, mixprec.GradScaler("
            "process_group=torch.distributed.group.WORLD))."
        )


def _patch_prepare_optimizer(accelerator: Any) -> None:
    """Give each optimizer ``prepare()`` returns a ``step_was_skipped`` read from the scaler."""
    original = accelerator.prepare_optimizer
    if getattr(original, "_mixprec_patched", False):
        return

    def prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
        prepared = original(optimizer, device_placement=device_placement)
        cls = optimizer_class()
        if type(prepared) is not cls and isinstance(prepared.scaler, GradScaler):
            prepared.__class__ = cls
        return prepared

    prepare_optimizer._mixprec_patched = True  # type: ignore[attr-defined]
    accelerator.prepare_optimizer = prepare_optimizer


_CLASS: list[type] = []


def optimizer_class() -> type:
    """``accelerate.optimizer.AcceleratedOptimizer`` with ``step_was_skipped`` answered by
    ``scaler.last_step_skipped(optimizer)`` (read when asked, not on every step).

    Host sync: none to build it; one per ``step_was_skipped`` read (free on the CPU).
    """
    if not _CLASS:
        base: Any = require("accelerate.optimizer", "accelerate", _PURPOSE).AcceleratedOptimizer

        class MixprecAcceleratedOptimizer(base):
            @property
            def step_was_skipped(self) -> bool:
                """Whether the scaler skipped this optimizer's last step (fused ones too).

                Host sync: one; free on the CPU.
                """
                try:
                    return bool(self.scaler.last_step_skipped(self.optimizer))
                except ScalerStateError:
                    return False  # not stepped yet (accelerate's own default)

        MixprecAcceleratedOptimizer.__module__ = __name__
        MixprecAcceleratedOptimizer.__qualname__ = "MixprecAcceleratedOptimizer"
        _CLASS.append(MixprecAcceleratedOptimizer)
    return _CLASS[0]


def __getattr__(name: str) -> Any:
    if name == "MixprecAcceleratedOptimizer":  # lets pickle find the class by name
        return optimizer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
