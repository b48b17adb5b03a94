"""``Schedule``: the policy of each phase of training, one call per step.

Low precision does not hurt every phase of training alike: the NVFP4 pretraining recipe (arXiv
2509.25149, Appendix D) recovers most of its loss gap by running only the forward matmuls in
bf16 for the last part of training. A schedule holds such phases, each from its first step on;
``at(step)`` returns the same :class:`~mixprec.Policy` object for every step of a phase, and a
compiled model (whose guard takes an equal policy for the same one) compiles once per distinct
policy and never again when a phase comes back. :class:`mixprec.Watch` can add a phase at a
step boundary (``apply=True``).
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from mixprec._src.autocast.policy import Policy
from mixprec.errors import ConfigError

PolicyLike = Policy | str | None


def _policy(value: object, where: str) -> Policy | None:
    if value is None or isinstance(value, Policy):
        return value
    if isinstance(value, str):
        return Policy(value)
    raise ConfigError(
        f"{where}: a phase's policy is a mixprec.Policy, a policy string or None, got "
        f"{type(value).__name__}"
    )


class Schedule:
    """Policies over training steps: :meth:`at` gives the step's policy.

    Args:
        phases: the policy of each phase by the step it starts at: a mapping (or a sequence of
            pairs) from a step (an int >= 0) or a fraction of ``total_steps`` (a float in
            ``[0, 1)``) to a :class:`~mixprec.Policy`, a policy string or None (no policy). A
            single policy is one phase from step 0. The first phase starts at step 0.
        total_steps: the number of training steps; needed where a phase starts at a fraction.

    Steps are the training loop's own count from 0 (the step whose forward runs next).

    Example:
        >>> import mixprec
        >>> p = mixprec.Policy("nn.Linear=nvfp4")
        >>> s = mixprec.Schedule({0: p, 0.85: p.with_matmuls(fprop="bf16")}, total_steps=100)
        >>> str(s.at(84)), str(s.at(85))
        ('nn.Linear=nvfp4', 'nn.Linear=bf16/nvfp4/nvfp4')
        >>> s.at(0) is s.at(50)
        True

    Raises:
        ConfigError: no phase at step 0, a fraction without ``total_steps``, a negative or
            duplicate start, or a policy that is not one.

    Host sync: none.
    """

    def __init__(
        self,
        phases: Mapping[object, PolicyLike] | Sequence[tuple[object, PolicyLike]] | PolicyLike,
        *,
        total_steps: int | None = None,
    ) -> None:
        if total_steps is not None and (
            isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1
        ):
            raise ConfigError(f"total_steps must be an int >= 1 or None, got {total_steps!r}")
        self.total_steps = total_steps
        if phases is None or isinstance(phases, (Policy, str)):
            pairs: list[tuple[object, object]] = [(0, phases)]
        elif isinstance(phases, Mapping):
            pairs = list(phases.items())
        elif isinstance(phases, Sequence):
            pairs = [_pair(p) for p in phases]
        else:
            raise ConfigError(
                f"phases must be a policy, a mapping of start step to policy or a list of "
                f"(start, policy) pairs, got {type(phases).__name__}"
            )
        starts = [self._start(s) for s, _ in pairs]
        policies = [
            _policy(p, f"the phase from step {s}") for s, (_, p) in zip(starts, pairs, strict=True)
        ]
        for i, start in enumerate(starts):
            if start in starts[:i]:
                given = [repr(s) for (s, _), at in zip(pairs, starts, strict=True) if at == start]
                raise ConfigError(
                    f"two phases start at step {start} (given as {' and '.join(given)}; a "
                    f"fraction is rounded to a step of total_steps={total_steps})"
                )
        if 0 not in starts:
            raise ConfigError(
                f"the first phase must start at step 0 (got phases from {sorted(starts)})"
            )
        order = sorted(range(len(starts)), key=starts.__getitem__)
        self._starts = [starts[i] for i in order]
        self._policies = [policies[i] for i in order]

    def _start(self, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"a phase starts at a step or a fraction, got {value!r}")
        if isinstance(value, numbers.Integral):
            if value < 0:
                raise ConfigError(f"a phase cannot start at a negative step ({value})")
            return self._within(int(value), value)
        if not 0.0 <= float(value) < 1.0:
            raise ConfigError(
                f"a phase starting at {value!r}: a float is a fraction of total_steps in [0, 1)"
            )
        if self.total_steps is None:
            raise ConfigError(
                f"the phase starting at {value!r} of the steps needs total_steps= (the number "
                "of training steps)"
            )
        return self._within(round(float(value) * self.total_steps), value)

    def _within(self, start: int, given: object) -> int:
        """``start``, refused when training ends before it (the phase would never run)."""
        if self.total_steps is not None and start >= self.total_steps:
            raise ConfigError(
                f"a phase starting at {given!r} (step {start}) never runs: training has "
                f"total_steps={self.total_steps} (steps 0 to {self.total_steps - 1})"
            )
        return start

    def at(self, step: int) -> Policy | None:
        """The policy of training step ``step`` (the same object for every step of a phase).

        Raises:
            ConfigError: a negative or non-integer step.

        Host sync: none.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        return self._policies[bisect.bisect_right(self._starts, int(step)) - 1]

    def switch(self, step: int, policy: PolicyLike) -> None:
        """From ``step`` on, ``policy``, up to the next phase planned after it (which keeps its
        own policy); a phase that started at ``step`` is replaced. What
        :class:`mixprec.Watch` does with ``apply=True``.

        Raises:
            ConfigError: a negative step or a policy that is not one.

        Host sync: none.
        """
        start = self._start(step)
        found = _policy(policy, f"the phase from step {start}")
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            self._policies[i] = found
        else:
            self._starts.insert(i, start)
            self._policies.insert(i, found)

    @property
    def phases(self) -> tuple[tuple[int, Policy | None], ...]:
        """``(first step, policy)`` of each phase, in order. Host sync: none."""
        return tuple(zip(self._starts, self._policies, strict=True))

    def state_dict(self) -> dict[str, Any]:
        """The phases as plain data (policy strings), for a checkpoint. Host sync: none."""
        return {
            "phases": [
                (s, None if p is None else str(p), p is not None and p.strict)
                for s, p in self.phases
            ],
            "total_steps": self.total_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s phases (what ``switch`` added included).

        Raises:
            ConfigError: not a schedule's state.

        Host sync: none.
        """
        try:
            rows = [
                (int(s), None if p is None else Policy(p, strict=bool(strict)))
                for s, p, strict in state["phases"]
            ]
            total = state["total_steps"]
        except ConfigError:
            raise  # a policy that does not read back (a class that cannot be imported): its fix
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"not a Schedule.state_dict(): {err!r}") from None
        loaded = Schedule(rows, total_steps=total)
        self.total_steps, self._starts, self._policies = total, loaded._starts, loaded._policies

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.phases == other.phases and self.total_steps == other.total_steps

    __hash__ = None  # type: ignore[assignment]  # mutable (switch)

    def __repr__(self) -> str:
        inner = ", ".join(f"{s}: {str(p) if p is not None else None!r}" for s, p in self.phases)
        return f"Schedule({{{inner}}})"


def _pair(item: object) -> tuple[object, object]:
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ConfigError(f"a phase is a (start, policy) pair, got {item!r}")
    return item[0], item[1]
