"""How each recipe's weight travels in an FSDP2 all-gather: codes as bytes, scales of the moment.

FSDP2 all-gathers every weight before the forward and, with ``reshard_after_forward=True``,
again in backward. :func:`set_up` makes it gather each ruled Linear's weight as
its recipe's codes instead of the parameter dtype, through FSDP2's extension
(``fsdp_pre_all_gather``/``fsdp_post_all_gather`` on the sharded local tensor, which stays a
plain tensor: the optimizer, ``state_dict`` and distributed checkpoints see ordinary
parameters).

* **Scales.** Before the first gather of every forward (however it was entered: ``model(x)``,
  a method FSDP2's ``register_fsdp_forward_method`` wraps, a module run alone), each rank
  computes the block maxima of the rows it holds, in the parameter dtype, and ONE
  ``all_gather_into_tensor`` over the mesh exchanges them for every ruled weight at once; each
  rank then combines them (a maximum: blocks that straddle shards, whole columns, the whole
  tensor) into the scales of the whole weight. A forward is told from the next by the region's
  outermost module call; where there is none (a gather before any module call, outside a region
  with module rules) the gathered group's scales are exchanged at each of its gathers. So the
  scales are those of the weights as they are, whatever changed them in place since (any
  optimizer, ``torch._foreach`` ops, ``copy_``, ``.data``, a checkpoint loaded into the shards:
  none of them is seen by a version counter of the sharded parameters); a backward gather, and
  a forward recomputed in backward, use their forward's.
* **Codes.** Each rank casts its rows with those scales (elementwise, so the codes are the
  unsharded cast's, bit for bit) and FSDP gathers them as ``uint8`` tensors of exactly the padded
  shard's shape (gloo has no float8 type; an uneven shard is padded like FSDP's own): one byte a
  value, NVFP4's two values a byte where the rows divide evenly.
* **Orientation.** Only the copies the phase needs travel (:func:`orientations`): square blocks
  (tensorwise, 128x128, NVFP4's 16x16) serve both matmuls, one copy; rowwise recipes gather the
  forward copy (scaled along ``in_features``) before the forward and the input-gradient copy
  (along ``out_features``) in backward, both at once where the weight stays unsharded from
  forward to backward (``reshard_after_forward=False``, FSDP's root) or is recomputed. FSDP2
  sizes its output buffers by a weight's first gather, so every gather of it carries the same
  number of copies of the same size. On a mesh of one rank FSDP2 issues no collective: it copies
  the FIRST all-gather input alone into its buffer and hands that to ``fsdp_post_all_gather``;
  there the copies a gather carries travel as one input, stacked along the rows.

The unsharded weight is a :class:`~.carrier.Gathered`: a cache of the cast, consumed by the
recipe's matmul when its rule wants that cast; any other reader gets the weight's own values.
Which Linears gather in which recipe is asked of the forward's resolver by the caller
(:mod:`mixprec._src.autocast.fsdp`: the tree plan), so the gather and the forward never
disagree on a rule; so is how one forward is told from the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mixprec._src import torch_compat
from mixprec._src.fp8.carrier import Gathered, Payload, pack_e2m1, unpack_e2m1
from mixprec._src.fp8.casts import Quantized, block_shape
from mixprec._src.fp8.formats import block_scales, e8m0_exponent, encode
from mixprec._src.fp8.recipes import E2M1, E4M3, Cast, Recipe, get_recipe
from mixprec._src.fp8.stats import active_stats
from mixprec.errors import ConfigError


def orientations(recipe: Recipe) -> tuple[tuple[Cast, int], ...]:
    """The weight's casts a gather may carry, ``(cast, contraction dim)``: the forward's (along
    ``in_features``), then the input gradient's unless the forward's serves it (square blocks).

    Example:
        >>> [(c.short, d) for c, d in orientations(get_recipe("rowwise"))]
        [('e4m3/row/pow2', 1), ('e4m3/row/pow2', 0)]
        >>> len(orientations(get_recipe("mxfp8"))), len(orientations(get_recipe("nvfp4")))
        (2, 1)

    Host sync: none.
    """
    assert recipe.w is not None and recipe.w_gi is not None
    if recipe.w == recipe.w_gi and recipe.w.square:
        return ((recipe.w, 1),)
    return ((recipe.w, 1), (recipe.w_gi, 0))


class _Weight:
    """One ruled, sharded weight: its geometry, the scales of its group's last forward gather,
    FSDP2's two hooks, and the way to its high-precision values."""

    def __init__(self, name: str, fsdp_param: Any, group: Any, recipe: Recipe, owner: Any):
        self.name, self.fsdp_param, self.group, self.recipe = name, fsdp_param, group, recipe
        self.owner = owner  # the LowPrecisionGather: settings and counters
        self.rank, self.world, self.pg = torch_compat.fsdp_shard_info(fsdp_param)
        shard = torch_compat.fsdp_padded_shard(fsdp_param)
        self.r_pad, self.cols = shard.shape
        self.rows = int(torch_compat.fsdp_sharded_param(fsdp_param).shape[0])
        self.orients = orientations(recipe)
        self.blocks = [block_shape((self.rows, self.cols), c, d) for c, d in self.orients]
        # fp4 codes two a byte where the rows divide evenly and every copy is fp4: FSDP2 sizes
        # its buffers by the first gather, so the forward's and the backward's copies must
        # travel in equal sizes (a rule per matmul may give them different element formats).
        even = self.r_pad * self.world == self.rows
        fp4 = all(cast.dtype == E2M1 for cast, _ in self.orients)
        self.packed = [even and fp4 for _ in self.orients]
        self.scales: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        casts = tuple(c for c, _ in self.orients)
        self.payload = Payload(name, casts, self.high, owner.count_recast)
        self.inner: dict[int, torch.Tensor] = {}  # NVFP4's unpacked codes, refilled in place
        self.both: bool | None = None  # both copies travel at every gather (set at the first)

    # ------------------------------------------------------------------ geometry
    def span(self, rank: int) -> tuple[int, int]:
        """The weight rows rank ``rank`` holds (FSDP2's chunks: the last ones may be short)."""
        lo = min(self.rows, rank * self.r_pad)
        return lo, min(self.rows, lo + self.r_pad)

    def touched(self, i: int, rank: int) -> tuple[int, int]:
        """The block rows of orientation ``i`` that rank ``rank``'s rows fall in."""
        lo, hi = self.span(rank)
        br = self.blocks[i][0]
        return (lo // br, -(-hi // br)) if hi > lo else (0, 0)

    def slots(self, i: int) -> int:
        return max(b1 - b0 for b0, b1 in (self.touched(i, k) for k in range(self.world)))

    def hp_shard(self) -> torch.Tensor:
        """This rank's padded rows in the parameter dtype (rounded first, as FSDP's cast does)."""
        shard = torch_compat.fsdp_padded_shard(self.fsdp_param)
        return shard.to(torch_compat.fsdp_param_dtype(self.fsdp_param))

    def high(self) -> torch.Tensor:
        """The whole weight in the parameter dtype, all-gathered from the shards: bit for bit
        the weight FSDP2's own gather gives (what a reader other than the recipe's matmul
        gets). One collective on the mesh's group, counted; the values are kept until the
        next gather of any ruled weight (at most one weight's at a time)."""
        self.owner.keep(self.payload)
        shard = self.hp_shard().contiguous()
        out = shard.new_empty(self.world * shard.numel())
        _all_gather(out, shard.view(-1), group=self.pg)
        self.owner.high_gathers += 1
        return out.view(self.world * self.r_pad, self.cols)[: self.rows]

    # ------------------------------------------------------------------ scales
    def partials(self) -> list[torch.Tensor]:
        """Per orientation, the maxima of this rank's part of each block row it touches
        (``(slots, cols / bc)``): fp32, or E8M0 exponents (uint8) for MXFP8."""
        x = self.hp_shard()
        lo, hi = self.span(self.rank)
        out = []
        for i, (cast, _) in enumerate(self.orients):
            br, bc = self.blocks[i]
            b0, b1 = self.touched(i, self.rank)
            rowmax = x[: hi - lo].abs().reshape(hi - lo, self.cols // bc, bc).amax(-1).float()
            part = torch.zeros(self.slots(i), self.cols // bc, device=x.device)
            for b in range(b0, b1) if br > self.r_pad else ():  # few blocks, each larger
                rows = rowmax[max(lo, b * br) - lo : min(hi, (b + 1) * br) - lo]
                part[b - b0] = rows.amax(0)
            if br <= self.r_pad and hi > lo:  # blocks no larger than a shard: one reduction
                buf = torch.zeros(self.slots(i) * br, part.shape[1], device=x.device)
                buf[lo - b0 * br : hi - b0 * br] = rowmax
                part = buf.view(-1, br, part.shape[1]).amax(1)
            out.append(e8m0_exponent(part, cast) if cast.scale == "e8m0" else part)
        return out

    def combine(self, parts: list[list[torch.Tensor]]) -> None:
        """Set the step's scales from every rank's ``partials`` (``parts[rank][i]``)."""
        self.scales = []
        for i, (cast, _) in enumerate(self.orients):
            br, bc = self.blocks[i]
            grid = torch.zeros_like(parts[0][i][:0]).new_zeros(self.rows // br, self.cols // bc)
            for k in range(self.world):
                b0, b1 = self.touched(i, k)
                grid[b0:b1] = torch.maximum(grid[b0:b1], parts[k][i][: b1 - b0])
            grid4 = grid.reshape(self.rows // br, 1, self.cols // bc, 1)
            if cast.scale == "e8m0":
                self.scales.append((grid4, None, grid4))
            else:
                scale, tensor_scale = block_scales(grid4, cast)
                self.scales.append((scale, tensor_scale, grid4))

    # ------------------------------------------------------------------ FSDP2's extension
    def carried(self) -> tuple[int, ...]:
        """The orientations this gather carries: as many at every gather, since FSDP2 sizes its
        buffers by the first; so whether both travel is settled then, and kept."""
        if len(self.orients) == 1:
            return (0,)
        keeps = torch_compat.fsdp_keeps_unsharded(self.group)
        if self.both is None:
            self.both = self.owner.recompute or keeps
        elif keeps and not self.both:
            raise ConfigError(
                f"Linear {self.name!r}: its FSDP2 group keeps the weight unsharded from forward "
                "to backward now (set_reshard_after_forward(False)), but its first "
                "low-precision gather carried one copy at a time, and FSDP2 keeps each gather "
                "that size: call set_reshard_after_forward before the first forward, or pass "
                "recompute=True to gather_low_precision (both copies in every gather)"
            )
        if self.both:
            return (0, 1)
        return (1,) if torch_compat.running_backward() else (0,)

    def codes(self, i: int) -> torch.Tensor:
        """This rank's padded rows cast per orientation ``i``, as uint8 bytes for the wire."""
        cast = self.orients[i][0]
        br, bc = self.blocks[i]
        scale, tensor_scale, _ = self.scales[i]
        lo, _ = self.span(self.rank)
        index = torch.arange(lo, lo + self.r_pad, device=scale.device) // br
        row_scale = scale[index.clamp_(max=scale.shape[0] - 1)]
        x4 = self.hp_shard().reshape(self.r_pad, 1, self.cols // bc, bc).to(torch.float32)
        codes = encode(x4, row_scale, tensor_scale, cast).reshape(self.r_pad, self.cols)
        return pack_e2m1(codes) if self.packed[i] else codes.view(torch.uint8)

    def pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
        self.owner.before_gather(self)
        carried = self.carried()
        inputs = tuple(self.codes(i) for i in carried)
        if self.world == 1 and len(inputs) > 1:  # FSDP2 copies only the first: one, stacked
            inputs = (torch.cat(inputs),)
        nbytes = sum(t.numel() for t in inputs)
        self.owner.count_gather(nbytes)
        stats = active_stats()
        if stats is not None:
            slot = stats.slot(self.name, inputs[0].device, self.recipe.name, self.owner.model)
            slot.gathered += nbytes
        return inputs, carried

    def post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        carried: tuple[int, ...],
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        copies = {}
        if self.world == 1:  # the carried copies stacked along the rows (pre_all_gather)
            outputs = outputs[0].chunk(len(carried))
        for raw, i in zip(outputs, carried, strict=True):
            codes = self._codes_of(i, raw[: self.rows])
            scale, tensor_scale, amax = self.scales[i]
            copies[i] = Quantized(codes, scale, tensor_scale, amax, self.blocks[i])
        self.payload.refill(copies)
        if out is not None:
            return None
        device = outputs[0].device
        weight = Gathered(self.payload, (self.rows, self.cols), param_dtype, device)
        return weight, list(self.inner.values())

    def _codes_of(self, i: int, raw: torch.Tensor) -> torch.Tensor:
        if not self.packed[i]:
            return raw.view(E4M3)
        if i not in self.inner:
            self.inner[i] = unpack_e2m1(raw)
        else:
            with torch_compat.preserve_version_counter(self.inner[i]):
                self.inner[i].copy_(unpack_e2m1(raw))
        return self.inner[i]


class LowPrecisionGather:
    """What :func:`set_up` set up: the ruled weights, and what went on the wire.

    Attributes:
        names: the Linears whose weights gather in their recipe's format.
        recipes: the recipe each of them gathers in (by name), as the forward's resolver rules
            them under the policy given.
        recompute: both copies of a rowwise weight travel in every gather.
        collectives: the scale collectives issued (one per forward run in a region with module
            rules; else one per gather of an FSDP2 group of ruled weights outside backward).
        scale_bytes: bytes this rank put into them.
        gathers: the weights' all-gathers (one per weight per gather).
        gather_bytes: bytes this rank put into them (each goes to ``world - 1`` ranks).
        recasts: matmuls whose rule wanted another cast than the gathered one (a forward under
            another policy): they cast the weight's own values instead.
        high_gathers: all-gathers of a weight's high-precision values, for a reader other than
            its rule's matmul (at most one per weight per gather).

    Host sync: none.
    """

    def __init__(self, model: nn.Module, recompute: bool, forward: Callable[[], object]) -> None:
        self.model, self.recompute = model, recompute
        self.running = forward  # the forward now running (None: unknown)
        self.weights: list[_Weight] = []
        self.groups: dict[int, list[_Weight]] = {}  # by FSDP2 group, in its gather order
        #: Ruled Linears gathered in the parameter dtype: their recipe reads the weight in
        #: high precision in fprop or dgrad (a rule per matmul such as ``"bf16/fp8/fp8"``).
        self.high_precision: list[str] = []
        self.collectives = self.scale_bytes = self.gathers = self.gather_bytes = 0
        self.recasts = self.high_gathers = 0
        self.forward: object = None  # the forward the scales were last exchanged for
        self.kept: Payload | None = None  # the one payload holding its weight's own values

    @property
    def names(self) -> list[str]:
        """The ruled Linears, in model order. Host sync: none."""
        return [w.name for w in self.weights]

    @property
    def recipes(self) -> dict[str, str]:
        """The recipe each ruled Linear gathers in. Host sync: none."""
        return {w.name: w.recipe.name for w in self.weights}

    def count_gather(self, nbytes: int) -> None:
        """Count one weight all-gather of ``nbytes`` from this rank. Host sync: none."""
        self.gathers += 1
        self.gather_bytes += nbytes

    def count_recast(self) -> None:
        """Count one matmul that cast the weight's own values. Host sync: none."""
        self.recasts += 1

    def keep(self, payload: Payload) -> None:
        """Let ``payload`` hold its weight's own values, the payload that held some drop them.

        Host sync: none.
        """
        if self.kept is not None and self.kept is not payload:
            self.kept.high = None
        self.kept = payload

    def before_gather(self, weight: _Weight) -> None:
        """Refresh the scales before the first gather of each forward outside backward (a
        backward gather and a recomputed forward use the forward's): of every ruled weight
        once per forward where the region tells one forward from the next (its outermost
        module call), else of the gathered group at each of its gathers.

        Host sync: none (the collective is queued on the mesh's group).
        """
        self.keep(weight.payload)  # any other weight's own values are dropped at each gather
        group = self.groups[id(weight.group)]
        if weight is not group[0]:
            return
        if torch_compat.running_backward():
            if not weight.scales:
                self.refresh(group)
            return
        forward = self.running()
        if forward is None or forward is not self.forward:
            self.refresh(group if forward is None else self.weights)
        self.forward = forward  # held, so that no later call can take its id

    def refresh(self, weights: list[_Weight]) -> None:
        """Recompute the scales of ``weights`` from the shards as they are, with one collective
        (each rank calls it at the same gather).

        Host sync: none (the collective is queued on the mesh's group).
        """
        parts = [w.partials() for w in weights]
        flat, layout = _pack(parts)
        world = weights[0].world
        everyone = flat.new_empty(world * flat.numel())
        _all_gather(everyone, flat, group=weights[0].pg)
        self.collectives += 1
        self.scale_bytes += flat.numel()
        ranks = [_unpack(row, layout, parts) for row in everyone.view(world, -1)]
        for j, w in enumerate(weights):
            w.combine([r[j] for r in ranks])

    def __repr__(self) -> str:
        return (
            f"LowPrecisionGather({len(self.weights)} weights, collectives={self.collectives}, "
            f"gather_bytes={self.gather_bytes}, scale_bytes={self.scale_bytes}, "
            f"recasts={self.recasts}, high_gathers={self.high_gathers})"
        )


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor`` before)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _pack(parts: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Every partial as bytes in one flat uint8 tensor (fp32 ones first, 4-aligned)."""
    items = [p for ps in parts for p in ps]
    order = sorted(range(len(items)), key=lambda j: items[j].dtype != torch.float32)
    chunks, layout, at = [], [(0, 0)] * len(items), 0
    for j in order:
        raw = items[j].contiguous().view(-1).view(torch.uint8)
        layout[j] = (at, raw.numel())
        chunks.append(raw)
        at += raw.numel()
    chunks.append(torch.zeros(-at % 4, dtype=torch.uint8, device=chunks[0].device))
    return torch.cat(chunks), layout


def _unpack(
    row: torch.Tensor, layout: list[tuple[int, int]], like: list[list[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    out, j = [], 0
    for ps in like:
        got = []
        for p in ps:
            at, n = layout[j]
            got.append(row[at : at + n].view(p.dtype).view(p.shape))
            j += 1
        out.append(got)
    return out


def set_up(
    model: nn.Module,
    ruled: Iterable[tuple[str, nn.Linear, str]],
    rules: str,
    forward: Callable[[], object],
    recompute: bool,
) -> LowPrecisionGather:
    """Make FSDP2 all-gather the weight of each ``(name, Linear, recipe)`` of ``ruled`` (read
    after the checks) in its recipe's codes: what ``mixprec.distributed.gather_low_precision``
    does once it asked the forward's resolver (the fp8 package does not import autocast).

    Args:
        model: the root module ``fully_shard`` was applied to.
        ruled: the Linears with an fp8-family rule, as the forward's resolver rules them.
        rules: the policy, as the messages name it.
        forward: the forward now running (a new object for each forward, None where unknown).
        recompute: both copies of a rowwise weight travel in every gather.

    Returns:
        A :class:`LowPrecisionGather` (what went on the wire).

    Raises:
        ConfigError: ``model`` is not a ``fully_shard`` root, has been run already, no Linear is
            ruled, a ruled weight is not sharded by FSDP2 (or offloaded, or sharded along
            ``in_features``, or resharded to fewer ranks after forward), or its features do
            not fit its recipe's blocks.

    Host sync: none.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ConfigError(
            f"gather_low_precision needs the root module fully_shard was applied to, got "
            f"{type(model).__name__}: call fully_shard(model) on the root first"
        )
    handle = LowPrecisionGather(model, recompute, forward)
    torch_compat.fsdp_lazy_init(model)
    by_id = {id(m): (name, get_recipe(r)) for name, m, r in ruled}
    high = [by_id.pop(key)[0] for key, (_, r) in list(by_id.items()) if not _weight_low(r)]
    handle.high_precision = sorted(high)
    if not by_id:
        why = f" (those ruled read their weight in high precision: {high[:5]})" if high else ""
        raise ConfigError(
            f"no Linear of the model is ruled by a low-precision recipe in {rules}{why}"
        )
    _collect(handle, by_id)
    if by_id:
        names = sorted(name for name, _ in by_id.values())
        raise ConfigError(f"ruled Linears not sharded by fully_shard: {names}; shard them first")
    _attach(handle)
    return handle


def _collect(handle: LowPrecisionGather, ruled: dict[int, tuple[str, Recipe]]) -> None:
    """Take each ruled Linear's weight out of ``ruled`` into ``handle``, by FSDP2 group (a
    weight shared by several ruled Linears gathers in the first one's recipe)."""
    from torch.distributed.fsdp import FSDPModule

    for module in handle.model.modules():
        group = torch_compat.fsdp_param_group(module) if isinstance(module, FSDPModule) else None
        for fsdp_param in torch_compat.fsdp_params(group) if group is not None else ():
            owners = torch_compat.fsdp_param_owners(fsdp_param)
            found = [ruled.pop(id(o)) for o, attr in owners if attr == "weight" and id(o) in ruled]
            if found:
                name, recipe = found[0]
                _check(name, fsdp_param, recipe)
                _check_reshard(name, fsdp_param, group)
                weight = _Weight(name, fsdp_param, group, recipe, handle)
                handle.weights.append(weight)
                handle.groups.setdefault(id(group), []).append(weight)


def _weight_low(recipe: Recipe) -> bool:
    """Whether both matmuls that read the weight (fprop, dgrad) cast it: a recipe put together
    per matmul with either in high precision needs the weight in the parameter dtype, which is
    what FSDP gathers without this."""
    return recipe.w is not None and recipe.w_gi is not None


def _check(name: str, fsdp_param: Any, recipe: Recipe) -> None:
    shape = tuple(torch_compat.fsdp_sharded_param(fsdp_param).shape)
    _, k, n = recipe.multiples()
    where = f"Linear {name!r} (out_features={shape[0]}, in_features={shape[1]})"
    if shape[1] % k or shape[0] % n:
        raise ConfigError(
            f"{where} cannot run recipe {recipe.name!r}: its blocks need in_features a multiple "
            f"of {k} and out_features a multiple of {n}; keep it in bf16 or pad its features"
        )
    if not torch_compat.fsdp_extension_ready(fsdp_param):
        raise ConfigError(f"{where} was all-gathered already: call gather_low_precision first")
    if torch_compat.fsdp_unsupported(fsdp_param):
        raise ConfigError(
            f"{where}: the low-precision gather needs a weight sharded along out_features "
            "(Shard(0)) on one mesh dimension, without CPU offload"
        )


def _check_reshard(name: str, fsdp_param: Any, group: Any) -> None:
    """Refuse resharding to fewer ranks after forward: FSDP2 keeps a slice of the gathered
    bytes as the parameter then, and gathers that slice in backward past the extension."""
    shards = torch_compat.fsdp_post_forward_shards(group)
    world = torch_compat.fsdp_shard_info(fsdp_param)[1]
    if shards is not None and shards != world:
        raise ConfigError(
            f"Linear {name!r}: its FSDP2 group reshards to {shards} of {world} ranks after "
            f"forward (reshard_after_forward={shards}), which the low-precision gather cannot "
            "carry: pass reshard_after_forward=True or False to its fully_shard"
        )


def _attach(handle: LowPrecisionGather) -> None:
    groups = {id(w.pg) for w in handle.weights}
    if len(groups) != 1:
        raise ConfigError("the ruled weights are sharded over different process groups")
    for w in handle.weights:
        torch_compat.fsdp_attach_extension(w.fsdp_param, w.pre_all_gather, w.post_all_gather)
