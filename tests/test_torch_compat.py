"""Every entry of torch_compat's "kernels, scaling, fp8, devices" section, on the running torch.

Each check holds the private name to an independent reference written with public tensor ops
(or to the behaviour mixprec relies on), so a torch that renames, removes or changes one fails
here by name instead of deep inside a scaler or fp8 test. CI runs this file on the oldest
declared torch, the pinned one and the newest installable (``make test-torch TORCH=...``).
"""

from __future__ import annotations

import ast
import doctest
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mixprec._src import torch_compat as tc
from mixprec._src.autocast.native import policies_for

_INF, _NAN = float("inf"), float("nan")


def _grads() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(5, generator=g), torch.randn(3, 4, generator=g), torch.zeros(0)]


@pytest.mark.parametrize("bad", [None, _INF, -_INF, _NAN])
def test_amp_unscale_and_check_multiplies_and_flags_non_finite_inputs(bad: float | None) -> None:
    grads = _grads()
    if bad is not None:
        grads[1][2, 1] = bad
    expected = [g * 0.25 for g in grads]
    found = torch.zeros(())
    tc.amp_unscale_and_check_(grads, found, torch.tensor(0.25))
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert found.item() == (0.0 if bad is None else 1.0)


def test_amp_unscale_and_check_leaves_a_set_flag_set() -> None:
    found = torch.ones(())
    tc.amp_unscale_and_check_(_grads(), found, torch.tensor(1.0))
    assert found.item() == 1.0


def _rule(scale: float, tracker: int, found: bool, interval: int) -> tuple[float, int]:
    """torch.amp's documented update: halve and reset on overflow, double after ``interval``."""
    if found:
        return scale * 0.5, 0
    if tracker + 1 == interval:
        return scale * 2.0, 0
    return scale, tracker + 1


@pytest.mark.parametrize(("tracker", "found"), [(0, False), (1, False), (2, False), (1, True)])
def test_amp_update_scale_follows_the_documented_rule(tracker: int, found: bool) -> None:
    scale, growth = torch.tensor(1024.0), torch.tensor(tracker, dtype=torch.int32)
    tc.amp_update_scale_(scale, growth, torch.tensor(float(found)), 2.0, 0.5, 3)
    assert (scale.item(), growth.item()) == _rule(1024.0, tracker, found, 3)


def test_foreach_kernels_match_their_per_tensor_forms() -> None:
    grads = _grads()
    want_mul = [g * 3.0 for g in grads]
    want_clamp = [g.clamp(-0.5, 0.5) for g in want_mul]
    for p in (1.0, 2.0, math.inf):
        kept = grads if p != math.inf else grads[:2]  # (the inf-norm of nothing is refused)
        norms = tc.foreach_norm(kept, p)
        want = [torch.linalg.vector_norm(g, p) for g in kept]
        torch.testing.assert_close(torch.stack(norms), torch.stack(want), rtol=1e-6, atol=0)
    tc.foreach_mul_(grads, torch.tensor(3.0))
    assert all(torch.equal(g, w) for g, w in zip(grads, want_mul, strict=True))
    tc.foreach_clamp_min_(grads, -0.5)
    tc.foreach_clamp_max_(grads, 0.5)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_clamp, strict=True))
    low = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    tc.foreach_copy_(low, grads)
    assert all(torch.equal(lo, g.bfloat16()) for lo, g in zip(low, grads, strict=True))


def test_scaled_mm_takes_the_arguments_mixprec_passes() -> None:
    """Tensorwise e4m3 operands (exact small integers) and fp32 inverse scales, as
    fp8/kernels.py calls it; on the CPU this is oneDNN's reference kernel (tiny shapes only)."""
    a = torch.arange(-8, 8, dtype=torch.float32).reshape(16, 1).expand(16, 16).contiguous()
    b = torch.eye(16)[:, :16] * 2
    qa, qb = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    out = tc.scaled_mm(
        qa,
        qb,
        scale_a=torch.tensor(0.5),
        scale_b=torch.tensor(0.25),
        out_dtype=torch.float32,
        use_fast_accum=False,
    )
    torch.testing.assert_close(out, (a @ b) * 0.125, rtol=0, atol=0)


class _Probe(torch.autograd.Function):
    seen: list[bool] = []  # noqa: RUF012 (a test's record)

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _Probe.seen.append(tc.running_backward())
        ctx.save_for_backward(x)  # (so that the non-reentrant form recomputes)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Probe.seen.append(tc.running_backward())
        (x,) = ctx.saved_tensors
        return grad * x


@pytest.mark.parametrize("reentrant", [True, False])
def test_running_backward_is_true_in_backward_and_in_a_recomputation(reentrant: bool) -> None:
    _Probe.seen = []
    x = torch.ones(3, requires_grad=True)
    y = checkpoint(_Probe.apply, x, use_reentrant=reentrant)
    y.sum().backward()
    assert _Probe.seen == [False, True, True]  # forward, recomputed forward, backward
    assert tc.running_backward() is False


def test_version_counter_counts_in_place_changes_only() -> None:
    t = torch.zeros(3)
    start = tc.version_counter(t)
    _ = t + 1
    assert tc.version_counter(t) == start
    t.add_(1)
    t[0] = 5
    assert tc.version_counter(t) == start + 2


def test_steps_with_amp_scaling_names_the_fused_optimizers() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert tc.steps_with_amp_scaling(torch.optim.Adam(params, fused=True))
    assert not tc.steps_with_amp_scaling(torch.optim.Adam(params))
    assert not tc.steps_with_amp_scaling(torch.optim.SGD(params, lr=0.1))
    assert not tc.steps_with_amp_scaling(object())


def test_without_dynamo_wrapper_runs_the_optimizer_without_importing_dynamo() -> None:
    """torch's wrapped methods import torch._dynamo at their first call, the unwrapped ones do not
    (a fresh interpreter, so that nothing else imported it first)."""
    code = (
        "import sys, torch\n"
        "from mixprec._src.torch_compat import without_dynamo_wrapper as plain\n"
        "class Plain(torch.optim.SGD):\n"
        "    add_param_group = plain(torch.optim.Optimizer.add_param_group)\n"
        "    zero_grad = plain(torch.optim.Optimizer.zero_grad)\n"
        "p = torch.nn.Parameter(torch.ones(2))\n"
        "opt = Plain([p], lr=0.5)\n"
        "p.grad = torch.ones(2)\n"
        "opt.zero_grad()\n"
        "print(p.grad is None, len(opt.param_groups), 'torch._dynamo' in sys.modules)\n"
        "torch.optim.SGD([p], lr=0.5)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "1", "False", "True"]


def test_tree_helpers_flatten_and_map_nested_containers() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    tree = {"x": [a, (b, 3)], "y": c}
    leaves, _spec = tc.tree_flatten(tree)
    assert [id(v) if torch.is_tensor(v) else v for v in leaves] == [id(a), id(b), 3, id(c)]
    mapped = tc.tree_map(lambda v: v + 1 if torch.is_tensor(v) else v, tree)
    assert mapped["x"][1][1] == 3 and torch.equal(mapped["y"], c + 1)
    assert isinstance(mapped["x"][1], tuple)


def test_torch_release_is_the_installed_version() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert (major, minor) == tc.TORCH_RELEASE


def test_native_policies_follow_the_release() -> None:
    """The ops only some releases register (autocast/native.py), seen from both sides of each
    boundary; the installed release's own table is checked against its dispatcher in
    test_autocast_report."""
    old, pinned, new = (policies_for(r, cudnn=False) for r in ((2, 12), (2, 13), (2, 14)))
    assert old["cuda"]["aten::sum.dim_DimnameList"] == "fp32_set_opt_dtype"
    assert "aten::sum.dim_DimnameList" not in pinned["cuda"]
    assert pinned["cpu"]["aten::qr"] == "fp32" and "aten::qr" not in new["cpu"]
    assert new["cuda"]["aten::linalg_matrix_sqrth"] == "fp32"
    assert "aten::linalg_matrix_sqrth" not in pinned["cuda"]
    assert set(pinned["cpu"]) - set(old["cpu"]) == set()
    assert "aten::_cudnn_rnn" in policies_for((2, 13), cudnn=True)["cuda"]
    assert "aten::_cudnn_rnn" not in pinned["cuda"]


def _entries() -> dict[str, tuple[str, str]]:
    """Each public name torch_compat defines -> (the comment heading its section, its own
    docstring and the comment above it)."""
    found: dict[str, tuple[str, str]] = {}
    for path in sorted(Path(tc.__file__).parent.glob("*.py")):  # the door's files
        found.update(_entries_of(path.read_text()))
    return found


def _entries_of(source: str) -> dict[str, tuple[str, str]]:
    lines, found, head = source.splitlines(), {}, ""
    starts = {k for k, line in enumerate(lines) if line.startswith("# " + "-" * 64)}
    for node in ast.parse(source).body:
        section = max((k for k in starts if k < node.lineno), default=None)
        if section is not None:
            k, head = section, ""
            while k < len(lines) and lines[k].startswith("#"):
                head, k = head + lines[k], k + 1
        k, own = node.lineno - 2, ast.get_docstring(node) if hasattr(node, "body") else ""
        while k >= 0 and lines[k].startswith("#"):
            own, k = f"{own} {lines[k]}", k - 1
        names = [getattr(node, "name", None), getattr(getattr(node, "target", None), "id", None)]
        names += [getattr(t, "id", None) for t in getattr(node, "targets", [])]
        found.update({n: (head, own or "") for n in names if n and not n.startswith("_")})
    return found


def test_every_entry_is_tested_and_says_which_torch_it_was_checked_on() -> None:
    """Each public name of torch_compat is used by a test here or in
    tests/autocast/test_autocast_torch_compat.py, and says (or its section says) the torch
    versions it was checked on."""
    entries = _entries()
    assert {"amp_update_scale_", "running_checkpoints", "public_attr", "COMPILED_INNER"} <= set(
        entries
    )
    root = Path(__file__).resolve().parent
    tests = (root / "test_torch_compat.py").read_text()
    tests += (root / "autocast" / "test_autocast_torch_compat.py").read_text()
    untested = [n for n in entries if not re.search(rf"\btc\.{n}\b|import [^\n]*\b{n}\b", tests)]
    assert untested == []
    unchecked = [n for n, texts in entries.items() if "hecked on" not in " ".join(texts)]
    assert unchecked == []


def test_the_examples_in_torch_compat_run() -> None:
    from mixprec._src.torch_compat import fsdp, module_hooks

    for door in (tc, fsdp, module_hooks):
        failures, tried = doctest.testmod(door, optionflags=doctest.ELLIPSIS)
        assert failures == 0 and (tried > 0 or door is fsdp), door.__name__


def test_tensor_base_is_the_tensor_viewed() -> None:
    x = torch.zeros(4, 3)
    assert tc.tensor_base(x) is None
    assert tc.tensor_base(x[1]) is x and tc.tensor_base(x.view(-1)) is x
    y = torch.ones(3, requires_grad=True)
    (y * 2).sum().backward()
    assert y.grad is not None and tc.tensor_base(y.grad) is None  # autograd's own grad


def test_norm_and_conv_bases_are_torchs() -> None:
    norms = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.InstanceNorm3d)
    assert all(issubclass(c, tc.NORM_BASE) for c in norms)
    assert not issubclass(torch.nn.LayerNorm, tc.NORM_BASE)
    convs = (torch.nn.Conv1d, torch.nn.Conv3d, torch.nn.ConvTranspose2d)
    assert all(issubclass(c, tc.CONV_BASE) for c in convs)
    assert not issubclass(torch.nn.Linear, tc.CONV_BASE)


def test_aten_unsafe_view_is_a_view_op() -> None:
    x = torch.arange(6.0)
    y = tc.aten_unsafe_view(x, [2, 3])
    assert y.shape == (2, 3) and torch.equal(y.reshape(-1), x)


def test_wrapper_subclass_and_disabled_torch_function() -> None:
    class Empty(torch.Tensor):
        __torch_function__ = tc.disabled_torch_function  # type: ignore[assignment]

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return torch.zeros(2, 3)

    seen: list[Any] = []
    t = tc.wrapper_subclass(Empty, (2, 3), torch.bfloat16, torch.device("cpu"))
    assert type(t) is Empty and t.shape == (2, 3) and t.dtype == torch.bfloat16
    t.neg()  # no torch_function layer: straight to dispatch
    assert seen == [torch.ops.aten.neg.default]


def test_preserve_version_counter_keeps_the_count() -> None:
    x = torch.zeros(3)
    before = tc.version_counter(x)
    with tc.preserve_version_counter(x):
        x.add_(1)
    assert tc.version_counter(x) == before and x.sum().item() == 3.0


def test_dynamo_disable_runs_eagerly_under_compile() -> None:
    calls = []

    @tc.dynamo_disable
    def eager(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x + 1

    out = torch.compile(lambda x: eager(x) * 2, backend="eager")(torch.ones(2))
    assert torch.equal(out, torch.full((2,), 4.0)) and calls == [False]


def test_compiled_runs_eagerly_while_entered_only() -> None:
    """Compiled code (a module compiled in place, a compiled function) runs its eager Python
    inside the context, and compiled again once it is left."""
    seen: list[bool] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.compiler.is_compiling())
            return x + 1

    module = Probe()
    module.compile(backend="eager")
    function = torch.compile(Probe().forward, backend="eager")
    for run in (module, function):
        with tc.compiled_runs_eagerly():
            run(torch.ones(2))
        run(torch.ones(2))
    assert seen == [False, True, False, True]


def test_fsdp2_entries_on_a_one_rank_world() -> None:
    """The FSDP2 accessors fp8/gather.py uses, on a real (one-rank gloo) fully_shard."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fully_shard(model[0], reshard_after_forward=True)
        fully_shard(model)
        tc.fsdp_lazy_init(model)
        group = tc.fsdp_param_group(model[0])
        weight, _bias = tc.fsdp_params(group)
        assert tc.fsdp_param_owners(weight) == [(model[0], "weight")]
        assert tc.fsdp_sharded_param(weight) is model[0].weight  # sharded between gathers
        assert tc.fsdp_shard_info(weight)[:2] == (0, 1)
        assert tc.fsdp_padded_shard(weight).shape == (3, 4)
        assert tc.fsdp_param_dtype(weight) == torch.float32
        assert not tc.fsdp_unsupported(weight) and tc.fsdp_extension_ready(weight)
        assert not tc.fsdp_keeps_unsharded(group)  # resharded after forward
        assert tc.fsdp_post_forward_shards(group) == 1  # over the mesh's one rank
        assert tc.fsdp_post_forward_shards(tc.fsdp_param_group(model)) is None
        assert tc.fsdp_keeps_unsharded(tc.fsdp_param_group(model))  # the root keeps its own
        assert "cpu" in tc.process_group_device_types(dist.group.WORLD)  # gloo reduces there
        seen = []

        def pre(mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any) -> Any:
            seen.append("pre")
            return (tc.fsdp_padded_shard(weight),), None

        def post(outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None) -> Any:
            seen.append("post")
            return outputs[0], ()

        tc.fsdp_attach_extension(weight, pre, post)
        model(torch.ones(1, 4)).sum().backward()
        assert "pre" in seen and "post" in seen
    finally:
        dist.destroy_process_group()


def test_sparse_values_are_the_stored_values_uncoalesced_too() -> None:
    indices = torch.tensor([[0, 2, 0]])  # index 0 twice: uncoalesced
    grad = torch.sparse_coo_tensor(indices, torch.tensor([1.0, 2.0, 3.0]), (4,))
    assert not grad.is_coalesced()
    values = tc.sparse_values(grad)
    assert torch.equal(values, torch.tensor([1.0, 2.0, 3.0]))
    values.mul_(2)  # a view: the scaler unscales the grad through it
    assert torch.equal(grad.to_dense(), torch.tensor([8.0, 0.0, 4.0, 0.0]))
    assert torch.equal(tc.sparse_values(grad.coalesce()), grad.coalesce().values())


def test_public_attr_reaches_public_names_only() -> None:
    assert tc.public_attr(torch, "bfloat16") is torch.bfloat16
    assert tc.public_attr(torch.nn, "Linear", None) is torch.nn.Linear
    assert tc.public_attr(torch, "no_such_name", None) is None
    assert tc.public_attr(torch, "_C", None) is None  # exists, but private
    with pytest.raises(AttributeError, match="'_C' is private"):
        tc.public_attr(torch, "_C")
    assert tc.has_public_attr(torch, "cuda") and not tc.has_public_attr(torch, "_C")
    module = torch.nn.BatchNorm1d(2)
    tc.set_public_attr(module, "running_mean", torch.ones(2))
    assert torch.equal(module.running_mean, torch.ones(2)) and "running_mean" in dict(
        module.named_buffers()
    )
    with pytest.raises(AttributeError, match="private"):
        tc.set_public_attr(module, "_buffers", {})


def test_aten_op_finds_aten_names_underscored_too() -> None:
    assert tc.aten_op("mm") is torch.ops.aten.mm
    assert tc.aten_op("_softmax") is torch.ops.aten._softmax
    assert tc.aten_op("no_such_op") is None


def test_cpu_flash_attention_formulas_count_with_the_tensors() -> None:
    """FlopCounterMode gives the formulas the kernels' tensors (the ``_get_raw`` flag) and counts
    what they return; the CPU's sdpa runs these kernels (forward and backward)."""
    from torch.utils.flop_counter import FlopCounterMode

    seen: list[str] = []

    def forward(q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
        seen.append("forward" if isinstance(q, torch.Tensor) else "shapes")
        return 1000

    def backward(g: Any, q: Any, k: Any, v: Any, *args: Any, out_val: Any = None, **kw: Any) -> int:
        seen.append("backward" if isinstance(q, torch.Tensor) else "shapes")
        return 10

    mapping = tc.cpu_flash_attention_formulas(forward, backward)
    assert len(mapping) == 2
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    assert seen == ["forward", "backward"] and counter.get_total_flops() == 1010


def test_compiled_inner_holds_the_eager_module() -> None:
    module = torch.nn.Linear(2, 2)
    compiled = torch.compile(module, backend="eager")
    assert tc.is_compiled_module(compiled) and not tc.is_compiled_module(module)
    assert getattr(compiled, tc.COMPILED_INNER) is module
    assert [n for n, _ in compiled.named_modules()] == ["", tc.COMPILED_INNER]


def test_global_module_hooks_come_and_go_under_their_first_keys() -> None:
    """GlobalModuleHooks: added, the hooks run on every module call; removed, torch's global
    hook dicts are what they were; re-added, under the keys torch gave at the first add."""
    from torch.nn.modules import module as nn_module

    seen: list[str] = []
    hooks = tc.GlobalModuleHooks(
        lambda m, a: seen.append("pre"), lambda m, a, o: seen.append("post")
    )
    before = (
        dict(nn_module._global_forward_pre_hooks),
        dict(nn_module._global_forward_hooks),
        dict(nn_module._global_forward_hooks_always_called),
    )
    hooks.add()
    keys = hooks.keys
    torch.nn.Linear(2, 2)(torch.ones(1, 2))
    assert seen == ["pre", "post"] and hooks.added()
    hooks.remove()
    after = (
        dict(nn_module._global_forward_pre_hooks),
        dict(nn_module._global_forward_hooks),
        dict(nn_module._global_forward_hooks_always_called),
    )
    assert after == before and not hooks.added()
    hooks.add()
    assert hooks.keys == keys and hooks.added()
    hooks.remove()


def test_compiled_in_place_tells_module_compile_from_a_wrapper() -> None:
    plain, in_place = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    in_place.compile(backend="eager")
    wrapped = torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert [tc.compiled_in_place(m) for m in (plain, in_place)] == [False, True]
    assert not tc.compiled_in_place(wrapped)


def test_fake_tensor_mode_makes_tensors_without_data_that_keep_their_device() -> None:
    with tc.fake_tensor_mode():
        x = torch.empty(4, 3)
        y = x @ x.t()
    assert y.shape == (4, 4) and y.device.type == "cpu"
    assert type(y).__name__ == "FakeTensor"
