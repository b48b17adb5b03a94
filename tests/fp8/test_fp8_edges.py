"""The cases where a low-precision rule used to do something wrong without a word (#24 item 6):
double backward, the empty batch, Fp8Stats left twice, a rowwise row holding an inf, torchao's
recipe spelling, one Fp8Stats around two recipes. Every recipe, old and new."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec._src.fp8.recipes import RECIPES, rule_word
from mixprec.errors import ConfigError

WORDS = [rule_word(r) for r in RECIPES]  # "fp8", "fp8:rowwise", ..., "mxfp8", "nvfp4"


def region(word: str) -> mixprec.autocast:
    return mixprec.autocast("cpu", torch.bfloat16, policy=f"nn.Linear={word}")


@pytest.mark.parametrize("word", WORDS)
def test_double_backward_is_refused_naming_it(word: str) -> None:
    """A gradient penalty through a low-precision Linear: its gradients come from cast
    operands, so differentiating them again would be wrong (rowwise gave exactly zero parameter
    gradients, tensorwise about 3x float32's): it raises, naming double backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 128))
    x = torch.randn(32, 128, requires_grad=True)
    with region(word):
        out = model(x)
    (grad_x,) = torch.autograd.grad(out.float().square().sum(), x, create_graph=True)
    with pytest.raises(ConfigError, match=r"double backward through Linear '\d' running recipe"):
        grad_x.square().sum().backward()


@pytest.mark.parametrize("word", WORDS)
def test_create_graph_alone_gives_the_first_order_gradients(word: str) -> None:
    """create_graph=True without differentiating the result again: the same gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128))
    x = torch.randn(32, 128, requires_grad=True)
    grads = []
    for create_graph in (False, True):
        torch.manual_seed(1)  # nvfp4's stochastic rounding draws from torch's generator
        with region(word):
            out = model(x)
        grads.append(torch.autograd.grad(out.float().sum(), x, create_graph=create_graph)[0])
    assert torch.equal(grads[0], grads[1].detach())


@pytest.mark.parametrize("word", WORDS)
@pytest.mark.parametrize("lead", [(0,), (4, 0)])
def test_an_empty_batch_gives_what_nn_linear_gives(word: str, lead: tuple[int, ...]) -> None:
    """An MoE expert routed no tokens: an empty output and zero gradients (it crashed in the
    amax: a bare RuntimeError in forward for tensorwise, an IndexError in backward for rowwise)."""
    lin = nn.Linear(128, 128)
    x = torch.randn(*lead, 128, requires_grad=True)
    stats = mixprec.Fp8Stats()
    with stats, region(word):
        out = lin(x)
    assert out.shape == (*lead, 128) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert torch.equal(lin.weight.grad, torch.zeros(128, 128))
    assert torch.equal(lin.bias.grad, torch.zeros(128))
    assert x.grad is not None and x.grad.shape == x.shape


def test_leaving_an_fp8stats_twice_is_a_config_error() -> None:
    stats = mixprec.Fp8Stats()
    with stats:
        pass
    with pytest.raises(ConfigError, match="left without being entered"):
        stats.__exit__(None, None, None)


@pytest.mark.parametrize("word", ["fp8:rowwise", "mxfp8", "fp8:blockwise"])
def test_a_block_holding_an_inf_counts_its_finite_elements_as_nonfinite_not_flushed(
    word: str,
) -> None:
    lin = nn.Linear(128, 128)
    x = torch.randn(4, 128)
    x[1, 3] = float("inf")
    stats = mixprec.Fp8Stats()
    with stats, region(word):
        lin(x)
    s = stats.read()[""].input
    assert s.nonfinite == 1
    assert s.flushed == 0  # the finite elements beside the inf are not "flushed"


def test_torchaos_spelling_of_rowwise_gw_hp_is_a_rule_word() -> None:
    policy = mixprec.Policy("nn.Linear=fp8:rowwise_with_gw_hp")
    assert str(policy) == "nn.Linear=fp8:rowwise_gw_hp"
    assert mixprec.Rule("fp8", recipe="rowwise_with_gw_hp") == mixprec.Rule("fp8:rowwise_gw_hp")


def test_one_record_per_module_and_recipe() -> None:
    """One Fp8Stats around a tensorwise and then a rowwise forward of the same model: two
    records, each with its own counts (they were merged under one recipe label)."""
    model = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(8, 64)
    stats = mixprec.Fp8Stats()
    with stats:
        with region("fp8"):
            model(x)
        with region("fp8:rowwise"):
            model(x * 1000)
    read = stats.read()
    assert sorted(read) == ["0:rowwise", "0:tensorwise"]
    assert read["0:tensorwise"].recipe == "tensorwise" and read["0:rowwise"].recipe == "rowwise"
    assert read["0:tensorwise"].input.amax == pytest.approx(x.abs().max().item(), rel=1e-2)
    assert read["0:rowwise"].input.amax > 100 * read["0:tensorwise"].input.amax
    assert read["0:tensorwise"].input.elements == read["0:rowwise"].input.elements == x.numel()
    assert stats.names == ["0:tensorwise", "0:rowwise"] and stats.tensor("0:rowwise").shape == (
        3,
        10,
    )


def test_block_statistics() -> None:
    """What matters for blocks: the spread of block scales, blocks whose scale underflows."""
    lin = nn.Linear(128, 64)
    x = torch.randn(8, 128)
    x[0] *= 1e-37  # a token far below the rest: its E8M0 block scales clamp at 2**-127
    x[1] *= 2**20
    stats = mixprec.Fp8Stats()
    with stats, mixprec.autocast("cpu", torch.bfloat16, policy="nn.Linear=mxfp8"):
        lin(x.float())
    s = stats.read()[""]
    assert s.path == "emulated"
    assert s.input.blocks == 8 * 128 // 32
    assert s.input.block_underflow == pytest.approx(4 / 32)  # the tiny token's 4 blocks
    assert s.input.spread > 20  # 2**20 apart at least
    assert s.weight.block_saturated == 0 and s.weight.block_underflow == 0
    assert "blk-under" in stats.summary()
