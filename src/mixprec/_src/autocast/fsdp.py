"""FSDP2's low-precision all-gather bound to the forward's resolver.

The mechanism (codes on the wire, scales, the gathered weight as a cache) is
:mod:`mixprec._src.fp8.gather`; what it needs of autocast is asked here, of the same places the
forward asks: which Linears get an fp8-family rule, and in which recipe (the tree plan of
:mod:`.tree`, one answer per module however many names it has), and which forward is running
(the region's outermost module call, :func:`.calls.outermost_call`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from mixprec._src.autocast.calls import outermost_call
from mixprec._src.autocast.policy import Policy
from mixprec._src.autocast.tree import tree_of
from mixprec._src.fp8.gather import LowPrecisionGather, set_up


def gather_low_precision(
    model: nn.Module, policy: Policy, *, recompute: bool = False
) -> LowPrecisionGather:
    """Make FSDP2 all-gather each Linear that ``policy`` runs in a low-precision recipe as its
    recipe's codes (scales exchanged once per forward), bit for bit the run without it.

    Call it once, after ``fully_shard`` and before the first forward; run the forwards inside
    ``mixprec.autocast(..., policy=policy)`` as without it. The parameters stay plain (sharded)
    tensors: the optimizer, ``state_dict`` and ``torch.distributed.checkpoint`` are unchanged,
    and changing them in place any way needs nothing more. The gathered codes are a cache: a
    forward under another policy (a ``Schedule``'s later phase) casts the weight itself where
    its rule wants another cast, and any other reader of the weight (a merge, a tied
    embedding, ``x @ w.t()``) gets the weight's own values, all-gathered for it (both counted
    on the handle).

    Args:
        model: the root module ``fully_shard`` was applied to.
        policy: the :class:`~mixprec.Policy` the forwards run under.
        recompute: the forward of a Linear whose recipe casts its weight along each dimension
            (rowwise, mxfp8) is recomputed in backward (activation checkpointing): its backward
            gather then carries both copies of the weight.

    Returns:
        A :class:`~mixprec.distributed.LowPrecisionGather` (what went on the wire).

    Raises:
        ConfigError: ``model`` is not a ``fully_shard`` root, has been run already, no Linear is
            ruled, a ruled weight is not sharded by FSDP2 (or offloaded, or sharded along
            ``in_features``), or its features do not fit its recipe's blocks.

    Example:
        >>> # doc: needs torch.distributed (see docs/distributed.md for a 2-process run)

    Host sync: none.
    """
    return set_up(model, _ruled_linears(model, policy), str(policy), outermost_call, recompute)


def _ruled_linears(model: nn.Module, policy: Policy) -> Iterator[tuple[str, nn.Linear, str]]:
    """``(name, Linear, recipe)`` of every Linear the forward's resolver gives an fp8-family
    rule under ``policy`` with ``model`` at the top of the region."""
    tree = tree_of(model)
    rules = tree.plan(model, policy).rules
    for module in model.modules():
        found = rules.get(id(module))
        if not isinstance(module, nn.Linear) or found is None:
            continue
        if found.rule.fp8_family and found.rule.recipe is not None:
            yield tree.names[id(module)][0], module, found.rule.recipe
