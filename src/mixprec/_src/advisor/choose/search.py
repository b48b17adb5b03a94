"""The search: which option each measured module takes, for one of two objectives.

The prediction treats the low-precision errors of different modules as independent noise: the
whole-model gradient error power of a policy is the error of the region itself (the ops between
the measured modules) plus the sum of the errors each module causes on its own in its chosen
option. Each module's options are its candidates (cheapest first in the cost order of
:mod:`.cost`; with a GPU, only those that GPU runs in hardware) and keeping it, last. The order
of the modules does not matter: the search walks them by name.

``"fewest_kept"``, in order of what matters: meet the target, keep as few modules as possible,
use the cheapest candidates. A module with no finite candidate is kept from the start. The
fewest kept modules that can reach the target (everything else in its most precise candidate)
are the most sensitive ones, taken in order; then every other module starts in its cheapest
finite candidate and, while the target is not met, the single move (one module to its next,
more precise candidate) that removes the most error is made.

``"speed"``: every module starts in its fastest option with finite figures (keeping it can be
the fastest: on a small layer the casts cost more than fp8 saves). With more kept modules than
``keep_at_most``, the ones that lose the least time go to their fastest candidate. Then, while
the target is missed, the move that removes the most error per second added is made; finally
every move back to a faster option that keeps the target met, the one saving most first.

``"sqnr"``: the most precise policy within a time budget (``max_time``, the modules' seconds
together): from the fastest options, the move that removes the most error per second added,
while the budget allows one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mixprec._src.advisor.measure.metrics import ratio_to_db

OBJECTIVES = ("fewest_kept", "speed", "sqnr")


@dataclass
class Option:
    """One precision a module can run in: its rule word, its error power ratio alone, and its
    predicted time on the target GPU (seconds; 0 without a GPU or a GEMM)."""

    word: str
    ratio: float
    db: float
    time: float = 0.0


@dataclass
class Choice:
    """A module's options (cheapest first, the kept precision last) and where it stands.

    ``detail``: why the cheapest candidate is not finite, if it is not; ``no_option``: why no
    candidate is an option at all (with a GPU: none it runs in hardware), if none is.
    """

    name: str
    options: list[Option]
    detail: str | None = None
    no_option: str | None = None
    index: int = 0
    start: int = 0  # where the search began
    moved: bool = False
    reason: str = ""

    @property
    def current(self) -> Option:
        return self.options[self.index]

    @property
    def kept(self) -> bool:
        return self.index == len(self.options) - 1

    @property
    def last(self) -> int:
        return len(self.options) - 1


@dataclass(frozen=True)
class Target:
    """What the search aims for: the least predicted SQNR, the most kept, the objective and,
    for ``"sqnr"``, the most seconds the searched modules may take together."""

    min_sqnr: float | None = None
    keep_at_most: int | None = None
    objective: str = "fewest_kept"
    max_time: float | None = None

    @property
    def limit(self) -> float:
        return math.inf if self.keep_at_most is None else self.keep_at_most


@dataclass
class Proposal:
    """The search's result."""

    choices: list[Choice]
    predicted: float
    met: bool
    notes: list[str] = field(default_factory=list)


def search(choices: list[Choice], region_ratio: float, target: Target) -> Proposal:
    """Choose an option per module for ``target``; fills each choice's ``reason``.

    The result does not depend on the order of ``choices``: the search walks them by name
    (ties between equal moves go to the first name, sums add in that order); the proposal lists
    them in the order given.
    """
    ordered = sorted(choices, key=lambda c: c.name)
    if target.objective == "speed":
        _fastest(ordered, region_ratio, target)
    elif target.objective == "sqnr":
        _most_precise(ordered, target)
    else:
        _fewest(ordered, region_ratio, target)
    predicted = predicted_db(ordered, region_ratio)
    kept = sum(c.kept for c in ordered)
    met = (target.min_sqnr is None or predicted >= target.min_sqnr) and kept <= target.limit
    met = met and (target.max_time is None or total_time(ordered) <= target.max_time)
    for c in ordered:
        c.reason = _reason(c, target.objective)
    return Proposal(choices, predicted, met, _notes(ordered, predicted, region_ratio, target))


def predicted_db(choices: Sequence[Choice], region_ratio: float) -> float:
    """The predicted whole-model gradient SQNR of the choices as they stand."""
    return ratio_to_db(region_ratio + sum(c.current.ratio for c in choices))


def _finite(c: Choice) -> list[int]:
    """The candidates with finite figures (keeping the module not counted)."""
    return [i for i, o in enumerate(c.options[:-1]) if not math.isinf(o.ratio)]


def _allowed(c: Choice) -> list[int]:
    """The finite candidates and keeping the module."""
    return [*_finite(c), c.last]


def _kept_count(choices: Sequence[Choice]) -> int:
    return sum(c.kept for c in choices)


def _move(c: Choice, index: int) -> None:
    c.index, c.moved = index, True


# --- fewest kept -----------------------------------------------------------------------------


def _fewest(choices: list[Choice], region_ratio: float, target: Target) -> None:
    for c in choices:
        finite = _finite(c)
        c.index = c.start = finite[0] if finite else c.last
    forced = [c for c in choices if c.kept]
    free = [c for c in choices if not c.kept]
    base = region_ratio + sum(c.options[-1].ratio for c in forced)
    if target.min_sqnr is None:
        ranked = sorted(free, key=lambda c: -c.current.ratio)
        extra = [c for c in ranked if c.current.ratio > c.options[-1].ratio]
        for c in extra[: max(0, (target.keep_at_most or 0) - len(forced))]:
            _move(c, c.last)
    elif ratio_to_db(base) >= target.min_sqnr:  # else out of reach
        room = target.limit - len(forced)
        for c in _fewest_kept(free, base, target.min_sqnr, room):
            _move(c, c.last)
        _upgrade_greedy(choices, region_ratio, target.min_sqnr)


def _best(c: Choice) -> float:
    """The least error among the module's candidates (not counting keeping it)."""
    return min(o.ratio for o in c.options[:-1])


def _fewest_kept(free: list[Choice], base: float, min_sqnr: float, room: float) -> list[Choice]:
    """The fewest modules to keep (at most ``room``) so that, with the others in their most
    precise candidates, the target is reachable: the largest errors first. When even ``room``
    of them do not suffice, as many as allowed."""
    order = sorted((c for c in free if c.options[-1].ratio < _best(c)), key=lambda c: -(_best(c)))
    count = 0
    while count < min(room, len(order)):
        rest = sum(_best(c) for c in free if c not in order[:count])
        kept = sum(c.options[-1].ratio for c in order[:count])
        if ratio_to_db(base + rest + kept) >= min_sqnr:
            break
        count += 1
    return order[:count]


def _upgrade_greedy(choices: list[Choice], region_ratio: float, min_sqnr: float) -> None:
    """From the cheapest candidates, make the move that removes the most error until the
    target is met (kept modules stay kept)."""
    while predicted_db(choices, region_ratio) < min_sqnr:
        best: tuple[float, Choice, int] | None = None
        for c in choices:
            nxt = None if c.kept else _next_better(c)
            gain = 0.0 if nxt is None else c.current.ratio - c.options[nxt].ratio
            if nxt is not None and gain > (0.0 if best is None else best[0]):
                best = (gain, c, nxt)
        if best is None:
            return
        _move(best[1], best[2])


def _next_better(c: Choice) -> int | None:
    """The next candidate with less error (keeping the module is not a move here)."""
    ratio = c.current.ratio
    return next((i for i in range(c.index + 1, c.last) if c.options[i].ratio < ratio), None)


# --- speed -----------------------------------------------------------------------------------


def _fastest(choices: list[Choice], region_ratio: float, target: Target) -> None:
    for c in choices:
        c.index = c.start = min(_allowed(c), key=lambda i: (c.options[i].time, c.options[i].ratio))
    _within_limit(choices, target.limit)
    if target.min_sqnr is not None:
        _upgrade_per_second(choices, region_ratio, target.min_sqnr, target.limit)
        _trim(choices, region_ratio, target.min_sqnr, target.limit)


def _within_limit(choices: list[Choice], limit: float) -> None:
    while _kept_count(choices) > limit:
        best: tuple[float, Choice, int] | None = None
        for c in choices:
            others = _finite(c) if c.kept else []
            if not others:
                continue
            i = min(others, key=lambda j: c.options[j].time)
            loss = c.options[i].time - c.current.time
            if best is None or loss < best[0]:
                best = (loss, c, i)
        if best is None:
            return
        _move(best[1], best[2])


def _move_ok(c: Choice, i: int, choices: Sequence[Choice], limit: float) -> bool:
    becomes_kept = i == c.last and not c.kept
    return not becomes_kept or _kept_count(choices) < limit


def _upgrade_per_second(
    choices: list[Choice], region_ratio: float, min_sqnr: float, limit: float
) -> None:
    while predicted_db(choices, region_ratio) < min_sqnr:
        move = _best_per_second(choices, limit, math.inf)
        if move is None:
            return
        _move(*move)


def _best_per_second(choices: list[Choice], limit: float, room: float) -> tuple[Choice, int] | None:
    """The move that removes the most error per second added (a move that adds none first),
    among those that add at most ``room`` seconds."""
    best: tuple[float, float, Choice, int] | None = None
    for c in choices:
        for i in _allowed(c):
            gain = c.current.ratio - c.options[i].ratio
            cost = c.options[i].time - c.current.time
            if gain <= 0 or cost > room or not _move_ok(c, i, choices, limit):
                continue
            score = math.inf if cost <= 0 else gain / cost
            if best is None or (score, gain) > (best[0], best[1]):
                best = (score, gain, c, i)
    return None if best is None else (best[2], best[3])


def _trim(choices: list[Choice], region_ratio: float, min_sqnr: float, limit: float) -> None:
    while True:
        best: tuple[float, Choice, int] | None = None
        noise = region_ratio + sum(c.current.ratio for c in choices)
        for c in choices:
            for i in _allowed(c):
                saved = c.current.time - c.options[i].time
                if saved <= 0 or not _move_ok(c, i, choices, limit):
                    continue
                fine = ratio_to_db(noise - c.current.ratio + c.options[i].ratio) >= min_sqnr
                if fine and (best is None or saved > best[0]):
                    best = (saved, c, i)
        if best is None:
            return
        _move(best[1], best[2])


def total_time(choices: Sequence[Choice]) -> float:
    """The predicted seconds of the choices as they stand."""
    return sum(c.current.time for c in choices)


def _most_precise(choices: list[Choice], target: Target) -> None:
    for c in choices:
        c.index = c.start = min(_allowed(c), key=lambda i: (c.options[i].time, c.options[i].ratio))
    _within_limit(choices, target.limit)
    budget = math.inf if target.max_time is None else target.max_time
    while move := _best_per_second(choices, target.limit, budget - total_time(choices)):
        _move(*move)


# --- words -----------------------------------------------------------------------------------


def _reason(c: Choice, objective: str) -> str:
    word = "kept" if c.kept else c.current.word
    if c.no_option is not None:
        return f"kept: {c.no_option}"
    if c.kept and not _finite(c):
        lead = f"{c.options[0].word} gives inf/NaN" + (f" ({c.detail})" if c.detail else "")
        return f"kept: {lead}"
    if objective in ("speed", "sqnr"):
        return _speed_reason(c, word)
    first, cur = c.options[0], c.current
    if c.index == 0:
        return f"{first.word}: {_db(first.db)} alone"
    if not c.moved:  # no finite option before the one it started with
        lead = f"{first.word} gives inf/NaN" + (f" ({c.detail})" if c.detail else "")
        return f"{cur.word}: {lead}"
    return f"{word}: for the target ({c.options[c.start].word} alone: {_db(c.options[c.start].db)})"


def _speed_reason(c: Choice, word: str) -> str:
    cur = c.current
    usable = [c.options[i] for i in _allowed(c) if i != c.index]
    faster = [o for o in usable if o.time < cur.time]
    if faster:
        quick = min(faster, key=lambda o: o.time)
        return f"{word}: for the target ({quick.word}: {_us(quick.time)}, {_db(quick.db)})"
    if not usable or cur.time == 0.0:
        return f"{word}: {_db(cur.db)} alone"
    other = min(usable, key=lambda o: o.time)
    return f"{word}: fastest ({_us(cur.time)}; {other.word}: {_us(other.time)})"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs"


def _db(db: float) -> str:
    if math.isnan(db):
        return "not measured"
    return "no error" if db == math.inf else ("inf/NaN" if db == -math.inf else f"{db:.1f} dB")


def _notes(
    choices: Sequence[Choice], predicted: float, region_ratio: float, target: Target
) -> list[str]:
    """What the report says about the search's outcome."""
    notes = []
    kept, limit, min_sqnr = _kept_count(choices), target.limit, target.min_sqnr
    if kept > limit:
        nan = sum(c.no_option is None and not _finite(c) for c in choices)
        none = sum(c.no_option is not None for c in choices)
        why = [f"{nan} give inf/NaN in every candidate"] if nan else []
        why += [f"{none} have no candidate the GPU runs in hardware"] if none else []
        notes.append(
            f"{kept} modules kept, more than keep_at_most={int(limit)}: {' and '.join(why)}"
        )
    budget, spent = target.max_time, total_time(choices)
    if budget is not None and spent > budget:
        notes.append(
            f"the speed target is out of reach: the fastest options of the measured modules "
            f"take {_us(spent)}, {_us(max(budget, 0.0))} would meet it"
        )
    if min_sqnr is not None and predicted < min_sqnr:
        region_db = ratio_to_db(region_ratio)
        if region_db < min_sqnr:
            notes.append(
                f"the target {_db(min_sqnr)} is out of reach: the ops outside the measured "
                f"modules alone give {_db(region_db)} (module rules cannot change them)"
            )
        else:
            within = f" within keep_at_most={int(limit)}" if math.isfinite(limit) else ""
            notes.append(
                f"the target {_db(min_sqnr)} is not met{within}: predicted {_db(predicted)}"
            )
    return notes
