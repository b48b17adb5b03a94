"""Lightning: mixprec's GradScaler through Lightning's precision-plugin API.

The one-line recipe needs no code from this module, because Lightning calls its scaler by duck
typing (``scale``, ``unscale_``, ``step``, ``update``, ``state_dict``, ``load_state_dict``)::

    from lightning.pytorch.plugins import MixedPrecision  # or pytorch_lightning.plugins
    trainer = Trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=mixprec.GradScaler())])

:class:`MixprecPrecision` is that plugin plus what a constructor argument cannot give: LR
schedulers with ``interval="step"`` advance only on real updates (Lightning steps them after a
skipped step too), and ``last_step_skipped()``. :func:`fsdp_precision` works around Lightning's
``FSDPPrecision``, whose constructor rejects every scaler (it compares the precision before
assigning it).

Lightning ships as two packages with separate class hierarchies, ``lightning`` (imported as
``lightning.pytorch``) and ``pytorch-lightning`` (``pytorch_lightning``); a Trainer accepts only
plugins of its own. :func:`plugin_class` builds the plugin for either. ``MixprecPrecision(...)``
picks the package when it is called, not when it is imported: the one your program has imported
by then (so the import order does not matter). When both are imported it cannot tell which
Trainer the plugin is for and raises :class:`~mixprec.errors.ConfigError` naming the two
classes; when neither is, it imports the installed one (``lightning.pytorch`` first).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from typing import Any

import torch

from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.region import autocast
from mixprec._src.deps import require
from mixprec._src.scaling.grad_scaler import GradScaler
from mixprec.errors import ConfigError
from mixprec.integrations.schedulers import SkipAwareScheduler

__all__ = [
    "MixprecPrecision",
    "fsdp_precision",
    "plugin_class",
    "wrap_step_schedulers",
]

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_CLASSES: dict[str, type] = {}
_KEY = "MixprecPrecision"  # Lightning stores a plugin's state under its class's __qualname__
_STOCK_KEY = "MixedPrecision"


def _resolve(package: str | None) -> str:
    if package is not None:
        if package not in PACKAGES:
            raise ConfigError(f"package must be one of {PACKAGES}, got {package!r}.")
        return package
    imported = [name for name in PACKAGES if name in sys.modules]
    if len(imported) == 1:
        return imported[0]
    if imported:
        raise ConfigError(
            "Both lightning.pytorch and pytorch_lightning are imported, and a Trainer accepts "
            "only a plugin of its own package, so MixprecPrecision cannot tell which to build. "
            "Name it: mixprec.integrations.lightning.plugin_class('lightning.pytorch')(...) for "
            "lightning.pytorch.Trainer, plugin_class('pytorch_lightning')(...) for "
            "pytorch_lightning.Trainer."
        )
    for name in PACKAGES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return name
    raise ImportError(
        "mixprec.integrations.lightning needs Lightning, which is not installed. Install it "
        "with: pip install 'mixprec[lightning]' (pytorch-lightning) or pip install lightning"
    )


def wrap_step_schedulers(configs: list[Any], scaler: GradScaler) -> list[Any]:
    """Wrap each ``interval="step"`` scheduler of Lightning's configs in a
    :class:`~mixprec.integrations.SkipAwareScheduler` (in place; returns ``configs``).

    Epoch schedulers and ``ReduceLROnPlateau`` are left alone: one skipped batch should not
    cancel an epoch's step.

    Host sync: none.
    """
    for config in configs:
        if config.interval != "step" or config.reduce_on_plateau:
            continue
        if not isinstance(config.scheduler, SkipAwareScheduler):
            config.scheduler = SkipAwareScheduler(config.scheduler, scaler)
    return configs


def plugin_class(package: str | None = None) -> type:
    """The :class:`MixprecPrecision` class for ``package`` (``"lightning.pytorch"`` or
    ``"pytorch_lightning"``; default: see the module docstring).

    Host sync: none.
    """
    name = _resolve(package)
    if name not in _CLASSES:
        _CLASSES[name] = _build_plugin_class(name)
    return _CLASSES[name]


def _build_plugin_class(package: str) -> type:
    plugins = require(f"{package}.plugins", "lightning", "mixprec.integrations.lightning")
    base: Any = plugins.MixedPrecision

    class MixprecPrecision(base):
        """Lightning's ``MixedPrecision`` with a :class:`~mixprec.GradScaler` and skip-aware
        step schedulers.

        Args:
            precision: ``"16-mixed"`` (the only precision that uses a scaler).
            device: the device type for ``torch.autocast`` (``"cpu"``, ``"cuda"``, ...).
            scaler: the scaler (default: ``mixprec.GradScaler()``).
            skip_aware_schedulers: wrap ``interval="step"`` LR schedulers so that they do not
                advance after a skipped step (see :func:`wrap_step_schedulers`).
            policy: a :class:`mixprec.Policy` (or its string form) applied by the autocast
                region around ``training_step`` & co.; module names are relative to the
                outermost module called in the step (e.g. ``self.net``). None: plain autocast.

        Raises:
            ConfigError: ``precision`` is not ``"16-mixed"``, or ``skip_aware_schedulers`` with
                a scaler that cannot report skipped steps (torch's).

        Example:
            >>> from mixprec.integrations.lightning import MixprecPrecision
            >>> plugin = MixprecPrecision("16-mixed", "cpu")  # Trainer(plugins=[plugin])
            >>> plugin.scaler.get_scale()
            65536.0
        """

        def __init__(
            self,
            precision: str = "16-mixed",
            device: str = "cpu",
            scaler: GradScaler | None = None,
            *,
            skip_aware_schedulers: bool = True,
            policy: Policy | str | None = None,
        ) -> None:
            if precision != "16-mixed":
                raise ConfigError(
                    f"MixprecPrecision is for precision='16-mixed' (loss scaling), got "
                    f"{precision!r}. bf16 needs no scaler: use Trainer(precision='bf16-mixed')."
                )
            scaler = scaler if scaler is not None else GradScaler()
            if skip_aware_schedulers and not callable(getattr(scaler, "last_step_skipped", None)):
                raise ConfigError(
                    f"skip_aware_schedulers needs a scaler that reports skipped steps "
                    f"(last_step_skipped), got {type(scaler).__name__}. Pass a "
                    "mixprec.GradScaler, or skip_aware_schedulers=False."
                )
            super().__init__(precision, device, scaler=scaler)
            self.skip_aware_schedulers = skip_aware_schedulers
            self.policy = policy

        def autocast_context_manager(self) -> Any:
            """The fp16 region Lightning enters around each step: ``mixprec.autocast`` with
            this plugin's policy (Lightning's own settings: no weight cache).

            Host sync: none.
            """
            return autocast(self.device, torch.float16, cache_enabled=False, policy=self.policy)

        def connect(
            self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
        ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
            """Lightning's hook after ``configure_optimizers``: wraps the step schedulers.

            Host sync: none.
            """
            model, optimizers, lr_schedulers = super().connect(model, optimizers, lr_schedulers)
            if self.skip_aware_schedulers:
                wrap_step_schedulers(lr_schedulers, self.scaler)
            return model, optimizers, lr_schedulers

        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            """Also store the scaler under the stock plugin's key, ``"MixedPrecision"``, so
            that the checkpoint resumes with Lightning's own plugin too.

            Host sync: none (the state dict was read already).
            """
            super().on_save_checkpoint(checkpoint)
            if _KEY in checkpoint:
                checkpoint.setdefault(_STOCK_KEY, checkpoint[_KEY])

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            """Load the scaler from a checkpoint written with the stock plugin (key
            ``"MixedPrecision"``), e.g. by torch's GradScaler; Lightning loads our own key.

            Host sync: none.
            """
            super().on_load_checkpoint(checkpoint)
            if _KEY not in checkpoint and checkpoint.get(_STOCK_KEY):
                self.load_state_dict(checkpoint[_STOCK_KEY])

        def __reduce_ex__(self, protocol: Any) -> Any:
            """Pickle by package: the name ``MixprecPrecision`` is the picking facade.

            Host sync: none.
            """
            return (_rebuild, (package,), self.__getstate__())

        def last_step_skipped(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
            """``scaler.last_step_skipped(optimizer)``.

            Host sync: one; free on the CPU.
            """
            return bool(self.scaler.last_step_skipped(optimizer))

    MixprecPrecision.__module__ = __name__
    MixprecPrecision.__qualname__ = "MixprecPrecision"
    return MixprecPrecision


def _rebuild(package: str) -> Any:
    """An empty plugin of ``package``'s class, for unpickling (the state is set after)."""
    cls: Any = plugin_class(package)
    return cls.__new__(cls)


def fsdp_precision(
    scaler: Any = None, precision: str = "16-mixed", package: str | None = None
) -> Any:
    """Lightning's ``FSDPPrecision`` with ``scaler`` installed, which its constructor refuses.

    ``FSDPPrecision(precision, scaler=...)`` raises for every scaler in Lightning 2.6 (the check
    reads ``self.precision`` before assigning it), and its default ``ShardedGradScaler()`` is a
    CUDA scaler that disables itself without CUDA. This builds the plugin without a scaler and
    assigns ``scaler`` afterwards. Under FSDP the gradients are shards: the ranks must agree on
    each skip. ``ShardedGradScaler(device=...)`` does, and so does
    ``mixprec.GradScaler(process_group=group)``; a mixprec scaler without a group does not.

    Raises:
        ConfigError: ``precision`` is not ``"16-mixed"`` or ``scaler`` is None.

    Host sync: none.
    """
    if precision != "16-mixed" or scaler is None:
        raise ConfigError(
            f"fsdp_precision installs a scaler, which only precision='16-mixed' uses; got "
            f"precision={precision!r}, scaler={scaler!r}. For other precisions use "
            "FSDPPrecision(precision) directly."
        )
    name = _resolve(package)
    plugins = require(f"{name}.plugins.precision", "lightning", "mixprec.integrations.lightning")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA is not available.*")
        plugin = plugins.FSDPPrecision(precision)
    plugin.scaler = scaler
    return plugin


class _PickedWhenCalled(type):
    """``isinstance(plugin, MixprecPrecision)`` holds for the plugin of either package."""

    def __instancecheck__(cls, obj: object) -> bool:
        return any(isinstance(obj, built) for built in _CLASSES.values())

    def __subclasscheck__(cls, sub: type) -> bool:
        return any(issubclass(sub, built) for built in _CLASSES.values())


class MixprecPrecision(metaclass=_PickedWhenCalled):
    """Lightning's ``MixedPrecision`` plugin with a :class:`~mixprec.GradScaler` and skip-aware
    step schedulers, for the Lightning package the program imported (see the module docstring;
    ``plugin_class(package)`` names it). Arguments: see :func:`plugin_class`'s class.

    Raises:
        ConfigError: both ``lightning.pytorch`` and ``pytorch_lightning`` are imported (name
            the package with :func:`plugin_class`), or a bad argument.

    Example:
        >>> from mixprec.integrations.lightning import MixprecPrecision
        >>> plugin = MixprecPrecision("16-mixed", "cpu")  # Trainer(plugins=[plugin])
        >>> plugin.scaler.get_scale()
        65536.0

    Host sync: none.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return plugin_class()(*args, **kwargs)
