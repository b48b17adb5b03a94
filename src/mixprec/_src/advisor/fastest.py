"""The search for ``objective="speed"``: the fastest policy on the GPU that meets the target.

Every module starts in its fastest option that gives finite figures (a candidate, or keeping
it: on a small layer the casts can cost more than fp8 saves, so keeping it in 16-bit is both
faster and more precise). With more kept modules than ``keep_at_most``, the ones that lose the
least time go to their fastest candidate. Then, while the predicted SQNR misses ``min_sqnr``,
the move (a module to a more precise option) that removes the most error per second added is
made; finally every move back to a faster option that keeps the target met is made, the one
saving the most time first. An option the GPU cannot run (NVFP4 on Hopper) is not taken.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mixprec._src.advisor.propose import Choice, Proposal, notes_for, predicted_db


def _allowed(c: Choice) -> list[int]:
    last = len(c.options) - 1
    return [
        i
        for i, o in enumerate(c.options)
        if math.isfinite(o.time) and (i == last or not math.isinf(o.ratio))
    ]


def _kept_count(choices: Sequence[Choice]) -> int:
    return sum(c.kept for c in choices)


def search_fastest(
    choices: list[Choice], region_ratio: float, min_sqnr: float | None, keep_at_most: int | None
) -> Proposal:
    """Choose an option per module for the fastest policy meeting the target; fills reasons."""
    limit = math.inf if keep_at_most is None else keep_at_most
    for c in choices:
        allowed = _allowed(c) or [len(c.options) - 1]
        c.index = c.start = min(allowed, key=lambda i: (c.options[i].time, c.options[i].ratio, i))
    _within_limit(choices, limit)
    if min_sqnr is not None:
        _upgrade(choices, region_ratio, min_sqnr, limit)
        _trim(choices, region_ratio, min_sqnr, limit)
    predicted = predicted_db(choices, region_ratio)
    kept = _kept_count(choices)
    met = (min_sqnr is None or predicted >= min_sqnr) and kept <= limit
    for c in choices:
        c.reason = _reason(c)
    notes = notes_for(predicted, region_ratio, kept, min_sqnr, limit, _forced(choices))
    return Proposal(choices, predicted, met, notes)


def _forced(choices: Sequence[Choice]) -> int:
    return sum(_allowed(c) in ([], [len(c.options) - 1]) for c in choices)


def _within_limit(choices: list[Choice], limit: float) -> None:
    while _kept_count(choices) > limit:
        best: tuple[float, Choice, int] | None = None
        for c in choices:
            if not c.kept:
                continue
            others = [i for i in _allowed(c) if i != len(c.options) - 1]
            if not others:
                continue
            i = min(others, key=lambda j: c.options[j].time)
            loss = c.options[i].time - c.current.time
            if best is None or loss < best[0]:
                best = (loss, c, i)
        if best is None:
            return
        best[1].index, best[1].moved = best[2], True


def _move_ok(c: Choice, i: int, choices: Sequence[Choice], limit: float) -> bool:
    becomes_kept = i == len(c.options) - 1 and not c.kept
    return not becomes_kept or _kept_count(choices) < limit


def _upgrade(choices: list[Choice], region_ratio: float, min_sqnr: float, limit: float) -> None:
    while predicted_db(choices, region_ratio) < min_sqnr:
        best: tuple[float, float, Choice, int] | None = None
        for c in choices:
            for i in _allowed(c):
                gain = c.current.ratio - c.options[i].ratio
                if gain <= 0 or not _move_ok(c, i, choices, limit):
                    continue
                cost = c.options[i].time - c.current.time
                score = math.inf if cost <= 0 else gain / cost
                if best is None or (score, gain) > (best[0], best[1]):
                    best = (score, gain, c, i)
        if best is None:
            return
        best[2].index, best[2].moved = best[3], True


def _trim(choices: list[Choice], region_ratio: float, min_sqnr: float, limit: float) -> None:
    while True:
        best: tuple[float, Choice, int] | None = None
        for c in choices:
            for i in _allowed(c):
                saved = c.current.time - c.options[i].time
                if saved <= 0 or not _move_ok(c, i, choices, limit):
                    continue
                old = c.index
                c.index = i
                fine = predicted_db(choices, region_ratio) >= min_sqnr
                c.index = old
                if fine and (best is None or saved > best[0]):
                    best = (saved, c, i)
        if best is None:
            return
        best[1].index, best[1].moved = best[2], True


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} µs" if math.isfinite(seconds) else "cannot run"


def _reason(c: Choice) -> str:
    cur = c.current
    word = "kept" if c.kept else cur.word
    if c.kept and all(math.isinf(o.ratio) for o in c.options[:-1]):
        return f"kept: {c.options[0].word} gives inf/NaN"
    usable = [o for i, o in enumerate(c.options) if i in _allowed(c) and o is not cur]
    faster = [o for o in usable if o.time < cur.time]
    if faster:
        quick = min(faster, key=lambda o: o.time)
        return f"{word}: for the target ({quick.word}: {_us(quick.time)}, {_db(quick.db)})"
    if not usable or cur.time == 0.0:
        return f"{word}: {_db(cur.db)} alone"
    other = min(usable, key=lambda o: o.time)
    return f"{word}: fastest ({_us(cur.time)}; {other.word}: {_us(other.time)})"


def _db(db: float) -> str:
    return "no error" if db == math.inf else ("inf/NaN" if db == -math.inf else f"{db:.1f} dB")
