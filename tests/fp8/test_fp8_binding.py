"""Rules bound to the forward that runs them (#32 items 1, 3, 4): float32 regions, zero-sized
Linears, Fp8Stats by model and under reentrant checkpointing, other threads, nothing on modules.

The oracle is the recipe's casts written out (tests/fp8_oracle.py), independent of the code under
test."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from tests import fp8_oracle
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec.errors import ConfigError

BF16 = torch.bfloat16
RULES = ["fp8", "fp8:rowwise", "fp8:rowwise_gw_hp", "fp8:blockwise", "mxfp8", "nvfp4"]


def _recipe(rule: str) -> str:
    return mixprec.Rule(rule).recipe or ""


@pytest.mark.parametrize("rule", RULES)
def test_a_float32_region_runs_fp8_rules_with_float32_around(rule: str) -> None:
    """Decision (docs/autocast.md): in a dtype=torch.float32 region native autocast is off and
    fp8-family rules run, float32 around their matmuls; other rules do nothing there."""
    torch.manual_seed(0)
    lin, norm = nn.Linear(128, 128), nn.LayerNorm(128)
    x = torch.randn(4, 128)
    policy = f"nn.Linear={rule}, nn.LayerNorm=bf16"
    with mixprec.autocast("cpu", torch.float32, policy=policy):
        got = norm(lin(x))
    want = norm(fp8_oracle.linear(x, lin.weight, lin.bias, _recipe(rule), torch.float32))
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with mixprec.autocast("cpu", torch.float32):
        assert torch.equal(norm(lin(x)), norm(F.linear(x, lin.weight, lin.bias)))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", [(0, 32), (32, 0)])
def test_zero_sized_linears_are_served_or_refused_by_name(
    rule: str, shape: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(*shape))
    x = torch.randn(3, shape[0], requires_grad=True)
    try:
        with mixprec.autocast("cpu", BF16, policy=f"nn.Linear={rule}"):
            out = net(x)
    except ConfigError as error:
        assert "'0'" in str(error)  # names the module (a recipe whose blocks do not tile it)
        return
    want = F.linear(x.detach().bfloat16(), net[0].weight.bfloat16(), net[0].bias.bfloat16())
    assert out.dtype == BF16 and torch.equal(out, want)
    out.float().sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.zeros_like(x))
    assert net[0].bias.grad is not None and torch.equal(
        net[0].bias.grad, torch.full((shape[1],), 3.0)
    )


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(64, 64)
        self.head = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(x)))


class Critic(Net):
    pass


def test_two_models_with_the_same_names_keep_separate_labelled_records() -> None:
    gen, disc, student = Net(0), Critic(1), Net(2)
    x = torch.randn(8, 64)
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8"):
        fake = gen(x)
        score = disc(fake)
        distil = student(x)
    (score.float().sum() + distil.float().sum()).backward()
    assert sorted(stats.names) == sorted(
        f"{m}/{n}" for m in ("Net", "Critic", "Net#1") for n in ("fc", "head")
    )
    read = stats.read()
    alone = mixprec.Fp8Stats()
    with alone, mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8"):
        gen(x)
    assert read["Net/fc"].input == alone.read()["fc"].input  # the generator's own casts
    assert read["Critic/fc"].input != read["Net/fc"].input


@pytest.mark.parametrize("reentrant", [True, False])
def test_backward_after_the_block_records_checkpointed_casts(reentrant: bool) -> None:
    """The backward of a checkpointed forward runs after the stats block and the region exited:
    its casts are recorded into the forward's records, as without checkpointing."""
    counts = []
    for ckpt in (False, True):
        model, x = Net(0), torch.randn(8, 64, requires_grad=True)
        stats = mixprec.Fp8Stats()
        with stats, mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8:rowwise"):
            out = checkpoint(model, x, use_reentrant=reentrant) if ckpt else model(x)
        out.float().square().mean().backward()
        read = stats.read()
        counts.append(
            {
                k: (v.input.elements, v.weight.elements, v.grad_output.elements)
                for k, v in read.items()
            }
        )
    assert counts[0] == counts[1] and all(g > 0 for _, _, g in counts[1].values())


def test_threads_under_other_policies_do_not_leak_into_each_other() -> None:
    model = Net(0)
    x = torch.randn(8, 64)
    policies = ["nn.Linear=fp8", "nn.Linear=bf16", "fc=mxfp8, head=fp32"]
    want = {}
    for p in policies:
        with mixprec.autocast("cpu", BF16, policy=p):
            want[p] = model(x).detach()
    got: dict[str, list[bool]] = {p: [] for p in policies}

    def work(policy: str) -> None:
        for _ in range(20):
            with torch.no_grad(), mixprec.autocast("cpu", BF16, policy=policy):
                got[policy].append(torch.equal(model(x), want[policy]))

    threads = [threading.Thread(target=work, args=(p,)) for p in policies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(len(v) == 20 and all(v) for v in got.values()), got


def test_a_nested_region_binds_its_own_policy_inside_a_forward() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net(0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with mixprec.autocast("cpu", BF16, policy="nn.Linear=bf16"):
                inner = self.net.head(x[..., :64])
            return self.net(x) + inner

    model, x = Outer(), torch.randn(8, 64)
    with mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8"):
        got = model(x)
    net = model.net
    with torch.autocast("cpu", BF16, cache_enabled=False):
        inner = F.linear(x, net.head.weight, net.head.bias)
        h = torch.relu(fp8_oracle.linear(x, net.fc.weight, net.fc.bias, "tensorwise", BF16))
        want = fp8_oracle.linear(h, net.head.weight, net.head.bias, "tensorwise", BF16) + inner
    assert torch.equal(got, want)


def test_nothing_of_a_rule_is_stored_on_the_model() -> None:
    model = nn.Sequential(Net(0), nn.LayerNorm(64))
    before = {id(m): set(vars(m)) for m in model.modules()}
    with mixprec.autocast("cpu", BF16, policy="nn.Linear=fp8, nn.LayerNorm=fp32"):
        out = checkpoint(model, torch.randn(4, 64, requires_grad=True), use_reentrant=True)
    out.float().sum().backward()
    for m in model.modules():
        assert set(vars(m)) == before[id(m)], type(m).__name__
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_a_container_rule_reads_weights_in_time_linear_in_its_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fp8 mode reads module parameters a number of times linear in the modules under a
    container's rule (it re-read every followed module's subtree at every torch call: quadratic;
    counted here, not timed)."""
    reads = [0]
    named_modules = nn.Module.named_modules

    def counted(self: nn.Module, *args: object, **kwargs: object) -> object:
        reads[0] += 1
        return named_modules(self, *args, **kwargs)  # type: ignore[arg-type]

    counts = []
    for blocks in (4, 8):
        model = nn.Sequential(nn.Sequential(*[Net(i) for i in range(blocks)]))
        with torch.no_grad(), mixprec.autocast("cpu", BF16, policy="0=fp8"):
            model(torch.randn(2, 64))  # names and plans built
            monkeypatch.setattr(nn.Module, "named_modules", counted)
            reads[0] = 0
            model(torch.randn(2, 64))
            monkeypatch.setattr(nn.Module, "named_modules", named_modules)
        counts.append(reads[0])
    assert counts[1] <= 2.2 * counts[0], counts
