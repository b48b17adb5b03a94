"""One precision rule: what compute dtype a module or op gets, and how its output is cast."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixprec._src.autocast._devices import LOW_PRECISION_DTYPES
from mixprec.errors import ConfigError

_COMPUTE_WORDS = ("fp32", "low", "keep", "promote")
_DTYPE_WORDS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_FP32_WORDS = ("fp32", "float32", "float")
_ACCEPTED_COMPUTE = (
    '"fp32", "low" (the region\'s dtype), "keep", "promote", torch.float16 / "fp16", '
    'torch.bfloat16 / "bf16"'
)
_ACCEPTED_OUTPUT = 'None, "input", "fp32", "low", torch.float32, torch.float16, torch.bfloat16'

_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def format_dtype(dtype: torch.dtype) -> str:
    """Return the short name of a dtype (``fp16``, ``bf16``, ``fp32``; else torch's name).

    Example:
        >>> import torch
        >>> format_dtype(torch.bfloat16)
        'bf16'

    Host sync: none.
    """
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _parse_compute(value: object) -> str | torch.dtype:
    if isinstance(value, torch.dtype):
        if value == torch.float32:
            return "fp32"
        if value in LOW_PRECISION_DTYPES:
            return value
    elif isinstance(value, str):
        word = value.strip().lower()
        if word in _FP32_WORDS:
            return "fp32"
        if word in _COMPUTE_WORDS:
            return word
        if word in _DTYPE_WORDS:
            return _DTYPE_WORDS[word]
    raise ConfigError(f"unknown precision rule {value!r}; accepted: {_ACCEPTED_COMPUTE}")


def _parse_output(value: object) -> str | torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype) and (value == torch.float32 or value in LOW_PRECISION_DTYPES):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in ("input", "low"):
            return word
        if word in _FP32_WORDS:
            return torch.float32
        if word in _DTYPE_WORDS:
            return _DTYPE_WORDS[word]
    raise ConfigError(f"unknown output cast {value!r}; accepted: {_ACCEPTED_OUTPUT}")


@dataclass(frozen=True, init=False)
class Rule:
    """A precision rule for a module or an op.

    Args:
        compute: ``"fp32"`` (inputs cast up, autocast off inside), ``"low"`` (the region's
            low-precision dtype), ``"keep"`` (autocast off, no casts), ``"promote"`` (ops only: the
            widest floating input dtype) or a low-precision torch dtype.
        output: optional cast of the result: ``None`` (no cast), ``"input"`` (the dtype of the
            first floating input), ``"low"`` (the region's dtype) or a floating torch dtype.

    Example:
        >>> import torch
        >>> from mixprec import Rule
        >>> Rule("fp32", output="input")
        Rule('fp32', output='input')
        >>> Rule(torch.bfloat16).compute
        torch.bfloat16

    Raises:
        ConfigError: an unknown compute rule or output cast; the message lists what is accepted.

    Host sync: none.
    """

    compute: str | torch.dtype
    output: str | torch.dtype | None

    def __init__(self, compute: object, output: object = None) -> None:
        object.__setattr__(self, "compute", _parse_compute(compute))
        object.__setattr__(self, "output", _parse_output(output))

    @classmethod
    def coerce(cls, value: RuleLike) -> Rule:
        """Return ``value`` as a :class:`Rule` (a rule, a word or a dtype).

        Example:
            >>> Rule.coerce("keep")
            Rule('keep')

        Host sync: none.
        """
        return value if isinstance(value, Rule) else cls(value)

    def __str__(self) -> str:
        text = self.compute if isinstance(self.compute, str) else format_dtype(self.compute)
        if self.output is not None:
            out = self.output if isinstance(self.output, str) else format_dtype(self.output)
            text += f"@{out}"
        return text

    def __repr__(self) -> str:
        comp = self.compute if isinstance(self.compute, str) else format_dtype(self.compute)
        if self.output is None:
            return f"Rule({comp!r})"
        out = self.output if isinstance(self.output, str) else format_dtype(self.output)
        return f"Rule({comp!r}, output={out!r})"

    def compute_dtype(self, low: torch.dtype) -> torch.dtype | None:
        """The dtype inputs are cast to, given the region's low dtype (None: no cast).

        Example:
            >>> import torch
            >>> Rule("low").compute_dtype(torch.bfloat16)
            torch.bfloat16

        Host sync: none.
        """
        if isinstance(self.compute, torch.dtype):
            return self.compute
        return {"fp32": torch.float32, "low": low}.get(self.compute)

    def output_dtype(self, low: torch.dtype, input_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the result is cast to (None: no cast).

        Example:
            >>> import torch
            >>> Rule("fp32", output="input").output_dtype(torch.float16, torch.float16)
            torch.float16

        Host sync: none.
        """
        if self.output is None or isinstance(self.output, torch.dtype):
            return self.output
        return low if self.output == "low" else input_dtype


RuleLike = Rule | str | torch.dtype
