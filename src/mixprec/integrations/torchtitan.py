"""torchtitan: a model converter that runs the model under a mixprec policy, weights gathered low.

torchtitan (0.3) converts models through their config tree before they are built
(``ModelConfigConverter``, the extension point of its float8, MX and NVFP4 converters).
:class:`MixprecConverter` replaces the root model config with one whose model, once built, runs
every forward inside ``mixprec.autocast(device, dtype, policy=policy)`` and, when torchtitan's
``parallelize_fn`` has applied ``fully_shard`` to it, calls
:func:`mixprec.distributed.gather_low_precision` on itself right before its first forward (before
FSDP2's own hooks run), so FSDP2 gathers each ruled Linear's weight in its recipe's format. The
Linear modules, their parameters and state dicts are torchtitan's own: checkpoints and
``state_dict_adapter`` are unchanged. Where there is no FSDP2 (one process, DDP, TP only) the
policy still applies and nothing is gathered.

Example (a config function's lines; docs/torchtitan.md has the command line, and
examples/torchtitan_llama3.py trains torchtitan's debug model with it on a CPU)::

    from torchtitan.models.llama3 import model_registry
    from mixprec.integrations.torchtitan import MixprecConverter

    spec = model_registry("debugmodel", converters=[
        MixprecConverter.Config(policy="nn.Linear=fp8:rowwise, lm_head=bf16")])
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields
from typing import Any

import torch

from mixprec._src.torch_compat import public_attr

__all__ = ["MixprecConverter", "mixprec_model_class"]

try:  # imported by name: torchtitan is not a dependency (nor in the type checker's path)
    ModelConfigConverter: Any = importlib.import_module(
        "torchtitan.protocols.model"
    ).ModelConfigConverter
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"mixprec.integrations.torchtitan needs torchtitan >= 0.3 ({exc}): pip install "
        "torchtitan (on a CPU-only machine also triton, which torchtitan 0.3 imports)"
    ) from exc

_CLASSES: dict[type, type] = {}


def mixprec_model_class(parent: type) -> type:
    """The subclass of torchtitan model class ``parent`` whose calls run under the policy of its
    config (and set up the low-precision gather once sharded); cached per class.

    Host sync: none.
    """
    if parent in _CLASSES:
        return _CLASSES[parent]
    base_config = parent.Config  # type: ignore[attr-defined]

    class MixprecModel(parent):
        @dataclass(kw_only=True, slots=True)
        class Config(base_config):  # type: ignore[misc, valid-type]
            mixprec_policy: str = "nn.Linear=fp8"
            mixprec_dtype: str = "bfloat16"
            mixprec_gather: bool = True
            mixprec_recompute: bool = False

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            import mixprec
            from mixprec.distributed import gather_low_precision

            state = self.__dict__.setdefault("_mixprec", {})
            config = state.get("config") or self._mixprec_config()
            state["config"] = config
            policy, dtype, gather, recompute = config
            if gather and "gather" not in state and _is_fsdp_root(self):
                state["gather"] = gather_low_precision(self, policy, recompute=recompute)
            device = _device_of(self)
            with mixprec.autocast(device, dtype, policy=policy):
                return super().__call__(*args, **kwargs)

        def _mixprec_config(self) -> tuple[Any, torch.dtype, bool, bool]:
            import mixprec

            cfg = self.config  # torchtitan keeps the config it was built from
            dtype = public_attr(torch, cfg.mixprec_dtype)
            policy = mixprec.Policy(cfg.mixprec_policy)
            return policy, dtype, cfg.mixprec_gather, cfg.mixprec_recompute

    MixprecModel.__name__ = MixprecModel.__qualname__ = f"Mixprec{parent.__name__}"
    _CLASSES[parent] = MixprecModel
    return MixprecModel


def _is_fsdp_root(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _device_of(module: torch.nn.Module) -> str:
    for p in module.parameters():
        return p.device.type
    return "cpu"


class MixprecConverter(ModelConfigConverter):
    """torchtitan model converter: the model runs under a mixprec policy (``"nn.Linear=fp8"``,
    ``"nn.Linear=mxfp8, lm_head=bf16"``, ...), its ruled weights gathered by FSDP2 in their
    recipe's format (``gather``). Apply it after torchtitan's own converters.

    Host sync: none.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        policy: str = "nn.Linear=fp8"
        """A mixprec policy string (module rules by class or qualified-name glob)."""
        dtype: str = "bfloat16"
        """The region's dtype around the low-precision matmuls (bfloat16 or float16)."""
        gather: bool = True
        """Gather the ruled weights in their recipe's format under FSDP2."""
        recompute: bool = False
        """Activation checkpointing recomputes rowwise-family Linears (both copies travel)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        import mixprec

        mixprec.Policy(config.policy)  # refuse a bad policy now, not at the first forward
        if config.dtype not in ("bfloat16", "float16"):
            from mixprec.errors import ConfigError

            raise ConfigError(f"dtype={config.dtype!r}: pass 'bfloat16' or 'float16'")
        self.config = config

    def convert(self, model_config: Any) -> Any:
        """The root config, replaced by the mixprec model's (the same fields, plus the policy).
        Host sync: none."""
        owner = type(model_config)._owner
        cls = mixprec_model_class(owner)
        values = {f.name: getattr(model_config, f.name) for f in fields(model_config) if f.init}
        return cls.Config(  # type: ignore[attr-defined]
            **values,
            mixprec_policy=self.config.policy,
            mixprec_dtype=self.config.dtype,
            mixprec_gather=self.config.gather,
            mixprec_recompute=self.config.recompute,
        )
