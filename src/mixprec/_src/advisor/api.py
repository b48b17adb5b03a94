"""``mixprec.advise``: measure every module in every candidate precision, propose the policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from mixprec._src.advisor.candidates import Candidate, parse_candidates, region_dtype
from mixprec._src.advisor.checks import (
    check_args,
    check_float32,
    check_loss_signature,
    check_served,
    device_of,
)
from mixprec._src.advisor.engine import Engine, Job, Progress, Target
from mixprec._src.advisor.flow import Goal, run
from mixprec._src.advisor.gpus import get_gpu
from mixprec._src.advisor.report import Advice
from mixprec._src.advisor.select import select
from mixprec._src.advisor.state import Guard
from mixprec.errors import ConfigError

LossFn = Callable[[nn.Module, Any], torch.Tensor]


def advise(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    candidates: Sequence[str] | str | None = None,
    min_sqnr: float | None = None,
    keep_at_most: int | None = None,
    modules: Sequence[str | type[nn.Module]] | None = None,
    more_batches: Sequence[Any] = (),
    check: bool = False,
    progress: Progress | None = None,
    gpu: str | None = None,
    objective: str = "fewest_kept",
) -> Advice:
    """Measure each module's error in each candidate precision and propose a :class:`Policy`.

    Runs a float32 reference forward+backward (``loss_fn(model, batch).backward()``), then one
    pass per module and candidate with only that module in the candidate precision, and one
    pass of the region with every measured module in float32 (the error of the ops between
    them); around fp8, each kept module is also measured in the region's dtype. Per module it
    reports the SQNR of the output, of the input and weight gradients and of the whole model's
    gradient, for float16 the values out of range and the gradients that flush to zero with and
    without loss scaling, for fp8 the saturated and flushed fractions of each operand. The
    proposal keeps the most sensitive modules out of the candidates until the predicted
    whole-model gradient SQNR meets ``min_sqnr`` (or keeps the ``keep_at_most`` most sensitive
    ones). The model's parameters, buffers, ``.grad`` and torch's RNG state are left as they
    were.

    Args:
        model: the model, on the device to measure on.
        batch: one batch, passed to ``loss_fn`` as is.
        loss_fn: ``loss_fn(model, batch)`` returns the scalar loss (it calls the model).
        candidates: rule words, cheapest first: ``"fp16"``, ``"bf16"``, fp8 recipes
            (``"fp8"``, ``"fp8:rowwise"``, ``"fp8:rowwise_gw_hp"``; they serve ``nn.Linear``)
            (default: torch's autocast dtype for the device, e.g. bf16 on the CPU, fp16 on CUDA).
        min_sqnr: the target: the least whole-model gradient SQNR in dB.
        keep_at_most: the most modules to keep out of every candidate. Without ``min_sqnr``,
            the ``keep_at_most`` most sensitive modules are kept. With neither, only modules
            whose every candidate gives inf/NaN are kept.
        modules: what to measure: qualified-name globs or ``nn.Module`` classes (default: every
            leaf module with trainable parameters except norms and embeddings).
        more_batches: a list of further batches; every pass runs over all of them.
        check: apply the proposal and measure its real SQNR (one more pass).
        progress: called as ``progress(done, total, label)`` after every pass.
        gpu: a GPU for the speed model (``"h100"``, ``"h200"``, ``"h200-nvl"``,
            ``"b200"``, ``"b300"``): each module's predicted time per candidate (its three
            GEMMs and casts, for the shapes of ``batch``) and the step's predicted speedup
            against bf16 (docs/advisor.md says how it is modelled).
        objective: what the search minimises once ``min_sqnr`` is met: ``"fewest_kept"``
            (default: the fewest modules kept, the cheapest candidates) or ``"speed"`` (the
            fastest policy on ``gpu``; needs a ``gpu``).

    Returns:
        An :class:`~mixprec.types.Advice`: the policy, the region dtype, a suggested
        ``GradScaler`` ``init_scale``, the prediction and the per-module figures, with
        ``table()``, ``plot()`` and ``to_json()``.

    Raises:
        ConfigError: a bad argument (before any pass), a model with 16-bit parameters, a loss
            function that cannot be called as ``loss_fn(model, batch)`` or does not return a
            scalar loss that requires grad, a float32 reference with inf/NaN gradients.

    Example:
        >>> import torch, mixprec
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> x, y = torch.randn(16, 8), torch.randn(16, 1)
        >>> loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1])
        >>> advice = mixprec.advise(model, (x, y), loss, candidates=["fp16"], keep_at_most=1)
        >>> advice.kept_precision, len(advice.kept)
        ('fp32', 1)
        >>> mixprec.Policy(str(advice.policy)) == advice.policy
        True

    Host sync: many (every pass reads its figures back to the host).
    """
    check_args(model, loss_fn, (min_sqnr, keep_at_most), (check, more_batches, progress), objective)
    spec = None if gpu is None else get_gpu(gpu)
    if objective == "speed" and spec is None:
        raise ConfigError('objective="speed" needs a GPU to predict for, e.g. gpu="h100"')
    check_float32(model)
    check_loss_signature(loss_fn, model, batch)
    device = device_of(model)
    cands = parse_candidates(candidates, device.type)
    chosen = select(model, modules)
    check_served(cands, chosen)
    job = Job(model, [batch, *more_batches], loss_fn, device, cands, region_dtype(cands), progress)
    job.total_passes = _count_passes(cands, chosen, check)
    goal = Goal(min_sqnr, keep_at_most, objective, spec, check)
    with Guard(model, device) as guard:
        return run(Engine(job, guard), _targets(chosen, guard.params), goal)


def _targets(chosen: list[tuple[str, nn.Module]], params: list[nn.Parameter]) -> list[Target]:
    position = {id(p): i for i, p in enumerate(params)}
    return [
        Target(name, mod, sorted({position[id(p)] for p in mod.parameters()}))
        for name, mod in chosen
    ]


def _count_passes(cands: list[Candidate], chosen: list[tuple[str, nn.Module]], check: bool) -> int:
    """The reference, the isolated passes, the region, the cheapest policy and the check (kept
    modules measured in bf16 around fp8 add more; a check of the cheapest policy, one fewer)."""
    isolated = sum(c.serves(m) for c in cands for _, m in chosen)
    return 1 + isolated + 2 + int(check)
