"""Flat-storage fast path: detection (exact tiling only), the plan cache, and flatten_grads.

The fast path must give the same bits as the per-tensor path for unscale + check (an elementwise
product), must never read or write bytes that are not gradients, and must survive zero_grad.
"""

from __future__ import annotations

import math

import pytest
import torch

import mixprec
from mixprec._src.kernels import plan as plan_module
from mixprec._src.kernels.plan import flat_view, flat_views, plan_grads

CPU32 = (torch.device("cpu"), torch.float32)


def views(buf: torch.Tensor, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    return [buf[a:b] for a, b in spans]


def params_with(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g
        params.append(p)
    return params


def test_exact_tiling_in_any_order_is_flat():
    buf = torch.arange(20.0)
    grads = views(buf, [(8, 20), (0, 3), (3, 8)])
    flat = flat_view(grads)
    assert flat is not None
    assert flat.data_ptr() == buf.data_ptr() and flat.numel() == 20
    # A sub-range of a bigger buffer tiles too (the rest of the buffer is not touched).
    sub = flat_view(views(buf, [(2, 5), (5, 9)]))
    assert sub is not None and torch.equal(sub, buf[2:9])
    # Reshaped views and zero-element views are fine.
    shaped = [buf[0:6].view(2, 3), buf[6:6], buf[6:10].view(2, 2)]
    assert torch.equal(flat_view(shaped), buf[0:10])


def test_one_range_per_buffer_like_ddp_buckets():
    first, second = torch.arange(10.0), torch.arange(6.0)
    grads = [*views(second, [(0, 6)]), *views(first, [(4, 10), (0, 4)])]
    ranges = flat_views(grads)
    assert ranges is not None and sorted(v.numel() for v in ranges) == [6, 10]
    assert flat_view(grads) is None  # not a single range
    # Two bases sharing memory (detach() makes a new base): overlapping ranges are rejected.
    alias = first.detach()
    assert flat_views([first[0:6], alias[4:10]]) is None
    assert flat_views([first[0:4], alias[4:10]]) is not None  # adjacent, not overlapping


@pytest.mark.parametrize(
    "make",
    [
        lambda b: views(b, [(0, 3), (4, 8)]),  # a gap
        lambda b: views(b, [(0, 5), (4, 8)]),  # an overlap
        lambda b: views(b, [(0, 4), (0, 4)]),  # the same range twice
        lambda b: [b[0:4], torch.zeros(4)],  # foreign data
        lambda b: [b[0:4], b.clone()[4:8]],  # another buffer
        lambda b: [b[0:8:2], b[1:8:2]],  # interleaved (non-contiguous) views
        lambda b: [b[0:6].view(2, 3).t(), b[6:8]],  # a transposed view
        lambda b: [torch.zeros(4), torch.zeros(4)],  # autograd-style grads own their storage
    ],
)
def test_non_tiling_grads_are_not_flat(make):
    assert flat_view(make(torch.arange(20.0))) is None


def test_gap_bytes_are_never_touched_or_checked():
    """A gap holding inf: the per-tensor path must skip it, unscale the rest, and not overflow."""
    buf = torch.full((10,), 2.0)
    buf[4] = math.inf
    params = params_with(views(buf, [(0, 4), (5, 10)]))
    opt = torch.optim.SGD(params, lr=0.1)
    assert plan_grads(opt).flat == {}
    scaler = mixprec.GradScaler(init_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    assert buf[4] == math.inf and buf[:4].eq(1.0).all() and buf[5:].eq(1.0).all()
    scaler.step(opt)
    assert not scaler.last_step_skipped()
    norm_params = params_with(views(torch.full((10,), 2.0), [(0, 4), (5, 10)]))
    norm_params[0].grad._base[4] = math.nan
    opt = torch.optim.SGD(norm_params, lr=0.1)
    scaler.update()
    scaler.scale(torch.ones(()))
    assert torch.isfinite(scaler.clip_grad_norm_(opt, 1.0))


def test_flat_unscale_is_bit_identical_and_finds_inf():
    torch.manual_seed(0)
    shapes = [(30, 7), (7,), (5, 5, 2), (1,)]
    model_grads = [torch.randn(s) * 1024.0 for s in shapes]
    model_grads[2][1, 1, 1] = math.inf
    for inject in (False, True):
        ref = params_with([g.clone() for g in model_grads])
        mine = params_with([g.clone() for g in model_grads])
        if not inject:
            ref[2].grad[1, 1, 1] = mine[2].grad[1, 1, 1] = 3.0
        mixprec.flatten_grads(mine)
        t_opt, m_opt = torch.optim.SGD(ref, lr=0.1), torch.optim.SGD(mine, lr=0.1)
        assert CPU32 in plan_grads(m_opt).flat
        t_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        m_scaler = mixprec.GradScaler(init_scale=1024.0)
        for scaler, opt in ((t_scaler, t_opt), (m_scaler, m_opt)):
            scaler.scale(torch.ones(()))
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        assert m_scaler.get_scale() == t_scaler.get_scale()
        for a, b in zip(mine, ref, strict=True):
            assert torch.equal(a.grad, b.grad) or (inject and a.grad.isinf().any())
            assert torch.equal(a.detach(), b.detach())


@pytest.mark.parametrize("sequential_max", [1 << 22, 1000])
def test_large_flat_ranges_in_pieces_or_whole(monkeypatch, sequential_max):
    """CPU ranges up to SEQUENTIAL_MAX_NUMEL go to the kernels in 32768-element pieces."""
    monkeypatch.setattr(plan_module, "SEQUENTIAL_MAX_NUMEL", sequential_max)
    torch.manual_seed(1)
    ref = params_with([torch.randn(40_000) * 64.0, torch.randn(30_000) * 64.0])
    mine = params_with([p.grad.clone() for p in ref])
    mine[1].grad[-1] = ref[1].grad[-1] = math.nan
    mixprec.flatten_grads(mine)
    m_opt = torch.optim.SGD(mine, lr=0.1)
    pieces = plan_grads(m_opt).kernel_groups()[CPU32]
    assert len(pieces) == (3 if sequential_max > 70_000 else 1)
    t_scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    t_scaler.scale(torch.ones(()))
    t_scaler.unscale_(torch.optim.SGD(ref, lr=0.1))
    m_scaler = mixprec.GradScaler(init_scale=64.0)
    m_scaler.scale(torch.ones(()))
    m_scaler.unscale_(m_opt)
    assert m_scaler.step(m_opt) is None  # the NaN in the last piece was found
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)


def test_plan_is_cached_and_revalidated():
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    mixprec.flatten_grads(params)
    opt = torch.optim.SGD(params, lr=0.1)
    plan = plan_grads(opt)
    assert plan_grads(opt) is plan  # nothing changed: the cached plan
    params[1].grad = torch.ones(4)  # foreign data: rebuilt, not flat
    replanned = plan_grads(opt)
    assert replanned is not plan and replanned.flat == {}
    assert plan_grads(opt) is not replanned  # non-flat plans are not cached (memory)
    params[1].grad = None
    assert len(plan_grads(opt).missing) == 1


def model_pair():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))
    twin.load_state_dict(model.state_dict())
    return model, twin


@pytest.mark.parametrize("set_to_none", [True, False])
def test_flatten_grads_survives_zero_grad_and_trains_like_torch(set_to_none):
    model, twin = model_pair()
    flat = mixprec.flatten_grads(model)
    buffer = flat.buffers[CPU32]
    assert buffer.numel() == sum(p.numel() for p in model.parameters())
    m_opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    t_opt = torch.optim.Adam(twin.parameters(), lr=1e-2)
    m_scaler = mixprec.GradScaler(init_scale=2.0**10)
    t_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(2)
    for it in range(4):
        x = torch.randn(5, 6, generator=gen)
        for mod, opt, scaler in ((model, m_opt, m_scaler), (twin, t_opt, t_scaler)):
            opt.zero_grad(set_to_none=set_to_none)
            scaler.scale(mod(x).pow(2).mean()).backward()
            if it == 2:
                mod[2].bias.grad[0] = math.inf
            scaler.step(opt)
            scaler.update()
        assert CPU32 in plan_grads(m_opt).flat
        for p, view in flat.views:
            assert p.grad is view and p.grad.data_ptr() >= buffer.data_ptr()
    assert m_scaler.get_scale() == t_scaler.get_scale() == 2.0**9
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())
        assert torch.equal(a.grad, b.grad)


def test_flatten_grads_options_and_errors():
    model, _ = model_pair()
    model[0].weight.requires_grad_(False)
    model[0].weight.grad = None
    params = list(model.parameters())
    flat = mixprec.flatten_grads([{"params": params[1:3]}, params[3]])
    assert len(flat.views) == 3 and "3 parameters" in repr(flat)
    assert model[0].weight.grad is None
    flat.remove()
    with pytest.raises(mixprec.errors.ConfigError, match="twice"):
        mixprec.flatten_grads([params[1], params[1]])
    with pytest.raises(mixprec.errors.ConfigError, match="module or parameters"):
        mixprec.flatten_grads([1.0])


def test_flatten_keeps_existing_grads_and_after_remove_detaches():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    flat = mixprec.flatten_grads([p])
    assert p.grad._base is flat.buffers[CPU32] and p.grad.tolist() == [1.0, 2.0, 3.0]
    flat.remove()
    p.grad = None
    (p * 2).sum().backward()
    assert p.grad._base is None  # no longer re-attached


def test_ddp_bucket_views_take_the_flat_path():
    """DDP with gradient_as_bucket_view=True (1 process, gloo) lays grads out flat."""
    dist = pytest.importorskip("torch.distributed")
    if dist.is_initialized():
        pytest.skip("another test left a default process group in this process; DDP needs its own")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = mixprec.GradScaler()
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(ddp(torch.randn(3, 4)).sum()).backward()
            plan = plan_grads(opt)
            assert CPU32 in plan.flat
            covered = sum(v.numel() for v in plan.flat[CPU32])
            assert covered == sum(p.numel() for p in model.parameters())
            assert torch.isfinite(scaler.clip_grad_norm_(opt, 1.0))
            scaler.step(opt)
            scaler.update()
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # on purpose
def test_flatten_leaves_grads_with_a_graph_alone():
    """backward(create_graph=True) gives grads with a graph: they are not copied into the buffer."""
    p = torch.nn.Parameter(torch.ones(3))
    flat = mixprec.flatten_grads([p])
    p.grad = None
    (p**3).sum().backward(create_graph=True)
    assert p.grad.requires_grad and p.grad._base is not flat.buffers[CPU32]
    p.grad = None
    (p**3).sum().backward()
    assert p.grad._base is flat.buffers[CPU32] and p.grad.tolist() == [3.0, 3.0, 3.0]
