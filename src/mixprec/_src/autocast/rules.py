"""One precision rule: what a module or op computes in, and how its output is cast.

A rule is a value: ``Rule("fp32", output="input")``, or in its string form ``"fp32@input"``.
The compute part is a *kind* word, optionally with a recipe (``"kind:recipe"``), or a
low-precision dtype. The kinds live in one table, :data:`KINDS`, which says where each kind is
accepted (module rules, op rules) and which recipes it takes; a new kind with recipes is one
entry there plus the code that applies it.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

import torch

from mixprec._src.autocast.native import LOW_PRECISION_DTYPES
from mixprec._src.fp8.recipes import MATMULS, canonical, get_recipe, rule_word
from mixprec._src.fp8.recipes import WORDS as FP8_WORDS
from mixprec.errors import ConfigError


@dataclass(frozen=True)
class ComputeKind:
    """What one compute word means for the parser and the policy.

    Attributes:
        word: the word as written and printed (``"fp32"``).
        modules: accepted as a module rule.
        ops: accepted as an op rule.
        recipes: the recipes accepted after ``"word:"``; the first is the default, used when
            none is written (and then not printed). Empty: the word takes no recipe.

    Host sync: none.
    """

    word: str
    modules: bool = True
    ops: bool = True
    recipes: tuple[str, ...] = ()


#: Every compute kind, by word. Low-precision dtypes (``"bf16"``, ``torch.float16``) are rules
#: too; they are not kinds.
KINDS: dict[str, ComputeKind] = {
    k.word: k
    for k in (
        ComputeKind("fp32"),  # inputs cast to fp32, autocast off inside
        ComputeKind("low"),  # the region's low-precision dtype
        ComputeKind("keep"),  # autocast off, no casts
        ComputeKind("promote", modules=False),  # ops: the widest floating input dtype
        # the fp8 family ("fp8", "mxfp8", "nvfp4"; #14, #24): the module's own matmuls in a
        # low-precision recipe of the fp8 package, the region's dtype around them
        *(ComputeKind(word, ops=False, recipes=names) for word, names in FP8_WORDS.items()),
    )
}

#: A rule per matmul (``"mxfp8/mxfp8/nvfp4"``): each of a module's matmuls in its own format.
PER_MATMUL = ComputeKind("per-matmul", ops=False)

_DTYPE_WORDS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}
_FP32_WORDS = ("fp32", "float32", "float")
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


def accepted_compute(target: str | None = None) -> str:
    """The compute rules accepted for ``target`` (``"modules"``, ``"ops"`` or both), for messages.

    Example:
        >>> '"promote"' in accepted_compute("ops"), '"promote"' in accepted_compute("modules")
        (True, False)

    Host sync: none.
    """
    words = []
    for kind in KINDS.values():
        if target is None or getattr(kind, target):
            text = f'"{kind.word}"' + (" (the region's dtype)" if kind.word == "low" else "")
            if len(kind.recipes) > 1:
                text += " (" + ", ".join(f'"{kind.word}:{r}"' for r in kind.recipes) + ")"
            words.append(text)
    return ", ".join([*words, 'torch.float16 / "fp16"', 'torch.bfloat16 / "bf16"'])


def did_you_mean(text: str, options: list[str] | tuple[str, ...]) -> str:
    """``"did you mean 'nvfp4'? "`` for the options close to ``text`` (none close: "").

    Example:
        >>> did_you_mean("nvpf4", ["fp8", "mxfp8", "nvfp4"])
        "did you mean 'nvfp4'? "

    Host sync: none.
    """
    close = difflib.get_close_matches(text.strip().lower(), list(options), 3, 0.6)
    return f"did you mean {' or '.join(map(repr, close))}? " if close else ""


def _compute_words() -> list[str]:
    words = [*KINDS, *_DTYPE_WORDS, *_FP32_WORDS]
    words += [f"{k.word}:{r}" for k in KINDS.values() if len(k.recipes) > 1 for r in k.recipes]
    return words


@functools.lru_cache(maxsize=256)
def _parse_word(text: str) -> tuple[str | torch.dtype, str | None]:
    """``"kind[:recipe]"`` or a dtype word -> (word or dtype, the recipe as written or None)."""
    word, sep, recipe = text.strip().lower().partition(":")
    word = "fp32" if word.strip() in _FP32_WORDS else word.strip()
    if word not in KINDS:
        if word in _DTYPE_WORDS and not sep:
            return _DTYPE_WORDS[word], None
        hint = did_you_mean(text, _compute_words())
        raise ConfigError(f"unknown precision rule {text!r}; {hint}accepted: {accepted_compute()}")
    if sep and not recipe.strip():
        raise ConfigError(f"precision rule {text!r} has an empty recipe after ':'")
    return word, recipe.strip() or None


@functools.lru_cache(maxsize=256)
def _parse_matmuls(text: str) -> tuple[str, str]:
    """``"fprop/dgrad/wgrad"``, each an fp8-family word or a dtype word -> (the rule's compute
    text, its recipe's name); three equal recipes give that recipe's own rule."""
    parts = text.split("/")
    if len(parts) != len(MATMULS):
        raise ConfigError(
            f"a rule per matmul names {len(MATMULS)} formats, {'/'.join(MATMULS)}, e.g. "
            f"'mxfp8/mxfp8/nvfp4'; got {text!r}"
        )
    names = []
    for part, matmul in zip(parts, MATMULS, strict=True):
        word, name = _parse_compute(part, None)
        if isinstance(word, torch.dtype) or word == "fp32":
            names.append(format_dtype(word) if isinstance(word, torch.dtype) else "fp32")
        elif word in FP8_WORDS and name is not None:
            names.append(name)
        else:
            raise ConfigError(
                f"the {matmul} part {part.strip()!r} of rule {text!r} is not a format: each "
                "matmul takes a low-precision recipe ('fp8', 'fp8:rowwise', 'mxfp8', 'nvfp4', "
                "...) or 'bf16', 'fp16', 'fp32'"
            )
    recipe = get_recipe("/".join(names))
    if not recipe.parts:
        return rule_word(recipe.name).partition(":")[0], recipe.name
    words = [n if n in ("bf16", "fp16", "fp32") else rule_word(n) for n in recipe.parts]
    return "/".join(words), recipe.name


def _parse_compute(value: object, recipe: object) -> tuple[str | torch.dtype, str | None]:
    """The compute word (or dtype) and its recipe: written, given as ``recipe=``, or the default."""
    if isinstance(value, torch.dtype) and value == torch.float32:
        value = "fp32"
    word: str | torch.dtype
    if isinstance(value, str) and "/" in value:
        if recipe is not None:
            raise ConfigError(f"rule {value!r} names a format per matmul; it takes no recipe=")
        return _parse_matmuls(value)
    if isinstance(value, torch.dtype) and value in LOW_PRECISION_DTYPES:
        word, written = value, None
    elif isinstance(value, str):
        word, written = _parse_word(value)
    else:
        raise ConfigError(f"unknown precision rule {value!r}; accepted: {accepted_compute()}")
    if recipe is not None and not isinstance(recipe, str):
        raise ConfigError(f"recipe must be a string or None, got {recipe!r}")
    given = canonical(recipe) if recipe is not None else None
    written = canonical(written) if written is not None else None  # torchao's spellings too
    if written is not None and given is not None and written != given:
        raise ConfigError(f"rule {value!r} names recipe {written!r} but recipe={recipe!r}")
    chosen = written or given
    kind = KINDS.get(word) if isinstance(word, str) else None
    if kind is None or not kind.recipes:
        if chosen is not None:
            raise ConfigError(f"precision rule {value!r} takes no recipe (got {chosen!r})")
        return word, None
    if chosen is None:
        return word, kind.recipes[0]
    if chosen not in kind.recipes:
        raise ConfigError(
            f"unknown recipe {chosen!r} for {word!r}; "
            + did_you_mean(f"{word}:{chosen}", [f"{word}:{r}" for r in kind.recipes])
            + "accepted: "
            + ", ".join(f'"{word}:{r}"' for r in kind.recipes)
        )
    return word, chosen


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
    hint = (
        did_you_mean(value, ["input", "low", *_FP32_WORDS, *_DTYPE_WORDS])
        if isinstance(value, str)
        else ""
    )
    raise ConfigError(f"unknown output cast {value!r}; {hint}accepted: {_ACCEPTED_OUTPUT}")


@dataclass(frozen=True, init=False)
class Rule:
    """A precision rule for a module or an op: an immutable, hashable value.

    Args:
        compute: ``"fp32"`` (inputs cast up, autocast off inside), ``"low"`` (the region's
            low-precision dtype), ``"keep"`` (autocast off, no casts), ``"promote"`` (ops only: the
            widest floating input dtype) or a low-precision torch dtype. The string form
            ``"compute@output"`` is accepted too (``Rule(str(rule)) == rule``).
        output: optional cast of the result: ``None`` (no cast), ``"input"`` (the dtype of the
            first floating input), ``"low"`` (the region's dtype) or a floating torch dtype.
        recipe: the recipe of a compute kind that takes one, as ``"kind:recipe"`` would give it
            (the default recipe is used when none is given). ``"fp8"`` (modules only) takes
            ``"tensorwise"`` (the default), ``"rowwise"``, ``"rowwise_gw_hp"`` (also spelled
            ``"rowwise_with_gw_hp"``) or ``"blockwise"``; ``"mxfp8"`` and ``"nvfp4"`` are
            recipes of their own: the module's own matmuls on low-precision operands with
            dynamic scales (docs/fp8.md).

    Attributes:
        compute: the compute word (``"fp32"``, ...) or a low-precision dtype.
        recipe: the recipe of a compute kind that takes one (``"kind:recipe"``), else None.
        output: the output cast, or None.

    Example:
        >>> import torch
        >>> from mixprec import Rule
        >>> Rule("fp32", output="input")
        Rule('fp32', output='input')
        >>> Rule(torch.bfloat16).compute
        torch.bfloat16
        >>> Rule("fp32@input") == Rule("fp32", output="input")
        True

    Raises:
        ConfigError: an unknown compute rule, recipe or output cast; the message lists what is
            accepted.

    Host sync: none.
    """

    compute: str | torch.dtype
    output: str | torch.dtype | None
    recipe: str | None

    def __init__(
        self, compute: object, output: object = None, *, recipe: str | None = None
    ) -> None:
        if isinstance(compute, str) and "@" in compute:
            compute, _, written = compute.partition("@")
            if "/" in written:
                raise ConfigError(
                    f"rule {compute}@{written}: the output cast goes after the whole rule, "
                    f"after its last matmul's format (e.g. 'mxfp8/mxfp8/nvfp4@fp32')"
                )
            if output is not None:
                raise ConfigError(
                    f"rule {compute}@{written} gives the output cast twice (also output={output!r})"
                )
            output = written.strip() or None
        word, chosen = _parse_compute(compute, recipe)
        object.__setattr__(self, "compute", word)
        object.__setattr__(self, "recipe", chosen)
        object.__setattr__(self, "output", _parse_output(output))

    @classmethod
    def coerce(cls, value: RuleLike) -> Rule:
        """Return ``value`` as a :class:`Rule` (a rule, a word or a dtype).

        Example:
            >>> Rule.coerce("keep")
            Rule('keep')

        Host sync: none.
        """
        if isinstance(value, Rule):
            return value
        try:
            return _cached_rule(value)  # rules are values: equal inputs share one instance
        except TypeError:  # unhashable: let the constructor say what is wrong
            return cls(value)

    @property
    def fp8_family(self) -> bool:
        """Whether the rule runs a module's matmuls in a low-precision recipe (``"fp8"``,
        ``"fp8:<recipe>"``, ``"mxfp8"``, ``"nvfp4"``).

        Example:
            >>> Rule("nvfp4").fp8_family, Rule("bf16").fp8_family
            (True, False)

        Host sync: none.
        """
        return isinstance(self.compute, str) and (self.compute in FP8_WORDS or "/" in self.compute)

    @property
    def kind(self) -> ComputeKind | None:
        """The :class:`ComputeKind` of the compute word (None for a dtype rule). Host sync: none."""
        if not isinstance(self.compute, str):
            return None
        return PER_MATMUL if "/" in self.compute else KINDS.get(self.compute)

    @property
    def matmuls(self) -> tuple[str, str, str] | None:
        """An fp8-family rule's format per matmul (fprop, dgrad, wgrad), each a rule word;
        None for other rules.

        Example:
            >>> Rule("mxfp8/mxfp8/nvfp4").matmuls, Rule("fp8:rowwise").matmuls
            (('mxfp8', 'mxfp8', 'nvfp4'), ('fp8:rowwise', 'fp8:rowwise', 'fp8:rowwise'))

        Host sync: none.
        """
        if not self.fp8_family:
            return None
        assert isinstance(self.compute, str)
        if "/" in self.compute:
            fprop, dgrad, wgrad = self.compute.split("/")
            return fprop, dgrad, wgrad
        word = self._compute_text()
        return word, word, word

    def with_matmuls(
        self, fprop: str | None = None, dgrad: str | None = None, wgrad: str | None = None
    ) -> Rule:
        """This fp8-family rule with some matmuls in other formats (a recipe word or a dtype
        word each; None keeps the matmul's); the output cast is kept.

        Example:
            >>> Rule("nvfp4").with_matmuls(fprop="bf16")
            Rule('bf16/nvfp4/nvfp4')

        Raises:
            ConfigError: the rule is not of the fp8 family, or a format is unknown.

        Host sync: none.
        """
        own = self.matmuls
        if own is None:
            raise ConfigError(
                f"rule {self} is not a low-precision recipe: only fp8-family rules have matmuls "
                "of their own formats"
            )
        given = (fprop, dgrad, wgrad)
        parts = [own[i] if new is None else new for i, new in enumerate(given)]
        return Rule("/".join(parts), output=self.output)

    def accepted_for(self, target: str) -> bool:
        """Whether this rule may be given to ``"modules"`` or ``"ops"``.

        Example:
            >>> Rule("promote").accepted_for("modules")
            False

        Host sync: none.
        """
        kind = self.kind
        return kind is None or bool(getattr(kind, target))

    def _compute_text(self) -> str:
        if not isinstance(self.compute, str):
            return format_dtype(self.compute)
        kind = self.kind
        if self.recipe is None or kind is None or not kind.recipes:
            return self.compute
        if self.recipe == kind.recipes[0]:
            return self.compute
        return f"{self.compute}:{self.recipe}"

    def __str__(self) -> str:
        text = self._compute_text()
        if self.output is not None:
            out = self.output if isinstance(self.output, str) else format_dtype(self.output)
            text += f"@{out}"
        return text

    def __repr__(self) -> str:
        comp = self._compute_text()
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
        return compute_dtype(self.compute, low)

    def output_dtype(self, low: torch.dtype, input_dtype: torch.dtype | None) -> torch.dtype | None:
        """The dtype the result is cast to (None: no cast).

        Example:
            >>> import torch
            >>> Rule("fp32", output="input").output_dtype(torch.float16, torch.float16)
            torch.float16

        Host sync: none.
        """
        return output_dtype(self.output, low, input_dtype)


def compute_dtype(compute: str | torch.dtype, low: torch.dtype) -> torch.dtype | None:
    """:meth:`Rule.compute_dtype` of a rule's ``compute`` part (plain values, so traced code can
    use it on what a compiled graph keeps of a rule).

    Example:
        >>> compute_dtype("fp32", torch.bfloat16), compute_dtype("keep", torch.bfloat16)
        (torch.float32, None)

    Host sync: none.
    """
    if isinstance(compute, torch.dtype):
        return compute
    if compute == "fp32":
        return torch.float32
    return low if compute == "low" else None


def output_dtype(
    output: str | torch.dtype | None, low: torch.dtype, input_dtype: torch.dtype | None
) -> torch.dtype | None:
    """:meth:`Rule.output_dtype` of a rule's ``output`` part (plain values, as above).

    Example:
        >>> output_dtype("input", torch.bfloat16, torch.float16)
        torch.float16

    Host sync: none.
    """
    if output is None or isinstance(output, torch.dtype):
        return output
    return low if output == "low" else input_dtype


@functools.lru_cache(maxsize=256)
def _cached_rule(value: object) -> Rule:
    return Rule(value)


RuleLike = Rule | str | torch.dtype
