"""The proposal: which precision each measured module gets, and the policy that says it.

The prediction treats the low-precision errors of different modules as independent noise: the
whole-model gradient error power of a policy is the error of the region itself (the ops between
the measured modules) plus the sum of the errors each module causes on its own in its chosen
precision (none for float32). Measured on a small GPT with fp8 this predicted the all-fp8 and
the kept-two SQNRs within 0.1 dB.

The search, in order of what matters: meet the target, keep as few modules as possible, use the
cheapest candidates. A module with no finite candidate is kept from the start. The fewest kept
modules that can reach the target (everything else in its most precise candidate) are the most
sensitive ones, taken in order; then every other module starts in its cheapest finite candidate
and, while the target is not met, the single move (one module to its next, more precise
candidate) that removes the most error is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import nn

from mixprec._src.advisor.metrics import ratio_to_db
from mixprec._src.autocast.policy import Policy
from mixprec.errors import ConfigError


@dataclass
class Option:
    """One precision a module can run in: its rule word, its error power ratio alone, and its
    predicted time on the target GPU (seconds; 0 without a target or a GEMM, inf where the
    target cannot run it)."""

    word: str
    ratio: float
    db: float
    time: float = 0.0


@dataclass
class Choice:
    """A module's options (cheapest first, the kept precision last) and where it stands."""

    name: str
    options: list[Option]
    detail: str | None = None  # why the cheapest option is not finite, if it is not
    index: int = 0
    start: int = 0  # the cheapest finite option, where the search began
    moved: bool = False
    reason: str = ""

    @property
    def current(self) -> Option:
        return self.options[self.index]

    @property
    def kept(self) -> bool:
        return self.index == len(self.options) - 1


@dataclass
class Proposal:
    """The greedy search's result."""

    choices: list[Choice]
    predicted: float
    met: bool
    notes: list[str] = field(default_factory=list)


def search(
    choices: list[Choice],
    region_ratio: float,
    min_sqnr: float | None,
    keep_at_most: int | None,
) -> Proposal:
    """Choose an option per module for the target; fills each choice's ``reason``."""
    for c in choices:
        finite = [i for i, o in enumerate(c.options[:-1]) if not math.isinf(o.ratio)]
        c.index = c.start = finite[0] if finite else len(c.options) - 1
    limit = math.inf if keep_at_most is None else keep_at_most
    forced = [c for c in choices if c.kept]
    free = [c for c in choices if not c.kept]
    if min_sqnr is None:
        ranked = sorted(free, key=lambda c: -c.current.ratio)
        extra = [c for c in ranked if c.current.ratio > c.options[-1].ratio]
        _keep(extra[: max(0, (keep_at_most or 0) - len(forced))])
    elif ratio_to_db(region_ratio + _kept_noise(forced)) >= min_sqnr:  # else out of reach
        _keep(_fewest_kept(free, region_ratio + _kept_noise(forced), min_sqnr, limit - len(forced)))
        _upgrade(choices, region_ratio, min_sqnr)
    predicted = predicted_db(choices, region_ratio)
    kept = sum(c.kept for c in choices)
    met = (min_sqnr is None or predicted >= min_sqnr) and kept <= limit
    for c in choices:
        c.reason = _reason(c)
    notes = notes_for(predicted, region_ratio, kept, min_sqnr, limit, len(forced))
    return Proposal(choices, predicted, met, notes)


def predicted_db(choices: Sequence[Choice], region_ratio: float) -> float:
    """The predicted whole-model gradient SQNR of the choices as they stand."""
    return ratio_to_db(region_ratio + sum(c.current.ratio for c in choices))


def _kept_noise(choices: Sequence[Choice]) -> float:
    return sum(c.options[-1].ratio for c in choices)


def _best(c: Choice) -> float:
    """The least error among the module's candidates (not counting keeping it)."""
    return min(o.ratio for o in c.options[:-1])


def _keep(choices: Sequence[Choice]) -> None:
    for c in choices:
        c.index, c.moved = len(c.options) - 1, True


def _fewest_kept(free: list[Choice], base: float, min_sqnr: float, room: float) -> list[Choice]:
    """The fewest modules to keep (at most ``room``) so that, with the others in their most
    precise candidates, the target is reachable: the largest errors first. When even ``room``
    of them do not suffice, as many as allowed."""
    order = sorted((c for c in free if c.options[-1].ratio < _best(c)), key=lambda c: -(_best(c)))
    count = 0
    while count < min(room, len(order)):
        rest = sum(_best(c) for c in free if c not in order[:count])
        if ratio_to_db(base + rest + _kept_noise(order[:count])) >= min_sqnr:
            break
        count += 1
    return order[:count]


def _upgrade(choices: list[Choice], region_ratio: float, min_sqnr: float) -> None:
    """From the cheapest candidates, make the move that removes the most error until the
    target is met (kept modules stay kept)."""
    while predicted_db(choices, region_ratio) < min_sqnr:
        best: tuple[Choice, int] | None = None
        best_gain = 0.0
        for c in choices:
            if c.kept:
                continue
            nxt = _next_better(c)
            if nxt is None:
                continue
            gain = c.current.ratio - c.options[nxt].ratio
            if gain > best_gain:
                best, best_gain = (c, nxt), gain
        if best is None:
            return
        best[0].index, best[0].moved = best[1], True


def _next_better(c: Choice) -> int | None:
    """The next candidate with less error (keeping the module is not a move here)."""
    ratio = c.current.ratio
    return next(
        (i for i in range(c.index + 1, len(c.options) - 1) if c.options[i].ratio < ratio), None
    )


def _reason(c: Choice) -> str:
    first = c.options[0]
    cur = c.current
    if c.index == 0:
        return f"{first.word}: {_db(first.db)} alone"
    if not c.moved:  # no finite option before the one it started with
        lead = f"{first.word} gives inf/NaN" + (f" ({c.detail})" if c.detail else "")
        return f"kept: {lead}" if c.kept else f"{cur.word}: {lead}"
    start = c.options[c.start]
    word = "kept" if c.kept else cur.word
    return f"{word}: for the target ({start.word} alone: {_db(start.db)})"


def _db(db: float) -> str:
    return "no error" if db == math.inf else f"{db:.1f} dB"


def notes_for(
    predicted: float,
    region_ratio: float,
    kept: int,
    min_sqnr: float | None,
    limit: float,
    forced: int,
) -> list[str]:
    """What the report says about the search's outcome (``forced``: modules kept because every
    candidate gave inf/NaN)."""
    notes = []
    if kept > limit:
        notes.append(
            f"{forced} modules give inf/NaN in every candidate and are kept: {kept} kept, more "
            f"than keep_at_most={int(limit)}"
        )
    if min_sqnr is not None and predicted < min_sqnr:
        region_db = ratio_to_db(region_ratio)
        if region_db < min_sqnr:
            notes.append(
                f"the target {min_sqnr:g} dB is out of reach: the ops outside the measured "
                f"modules alone give {_db(region_db)} (module rules cannot change them)"
            )
        else:
            within = f" within keep_at_most={int(limit)}" if math.isfinite(limit) else ""
            notes.append(
                f"the target {min_sqnr:g} dB is not met{within}: predicted {_db(predicted)}"
            )
    return notes


def build_policy(
    model: nn.Module, choices: dict[str, str], region_word: str, measured: Sequence[str]
) -> Policy:
    """The policy for ``choices`` (module name -> rule word) in a region of ``region_word``.

    Modules in the region's own dtype need no rule. When every module of a torch.nn class in the
    model is measured and most of them share a rule, one class rule plus exceptions is written
    (``nn.Linear=fp8, lm_head=bf16``); otherwise one name rule per module.
    """
    rules: dict[object, str] = {}
    named = dict(model.named_modules())
    handled: set[str] = set()
    measured_set = set(measured)
    for cls in _nn_classes([named[n] for n in measured]):
        members = [n for n, m in named.items() if isinstance(m, cls) and n]
        if not members or not set(members) <= measured_set:
            continue
        words = [choices[n] for n in members]
        common = max(sorted(set(words)), key=words.count)
        exceptions = [n for n in members if choices[n] != common]
        plain = sum(w != region_word for w in words)
        if common == region_word or words.count(common) < 2 or 1 + len(exceptions) >= plain:
            continue
        rules[cls] = common
        rules.update({_exact(n): choices[n] for n in exceptions})
        handled |= set(members)
    for n in measured:
        if n not in handled and choices[n] != region_word:
            rules[_exact(n)] = choices[n]
    return _round_tripped(rules)


def _exact(name: str) -> str:
    """A name glob that matches exactly ``name`` (glob characters in it are escaped)."""
    return "".join(f"[{ch}]" if ch in "*?[" else ch for ch in name)


def _nn_classes(modules: Sequence[nn.Module]) -> list[type[nn.Module]]:
    seen: list[type[nn.Module]] = []
    for m in modules:
        cls = type(m)
        if getattr(nn, cls.__name__, None) is cls and cls not in seen:
            seen.append(cls)
    return seen


def _round_tripped(rules: dict[object, str]) -> Policy:
    policy = Policy(modules=rules)
    try:
        same = Policy(str(policy)) == policy
    except ConfigError:
        same = False
    if not same:
        raise ConfigError(
            f"the proposed policy {str(policy)!r} does not survive its string form: a module "
            "name contains a character the policy syntax uses (',', ';' or a line break); "
            "rename the module, or leave it out with modules=[...]"
        )
    return policy
