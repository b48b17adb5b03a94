"""Policies: each rule kind, checkpoint recomputation, nesting, exceptions, threads, bad input."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from tests.autocast_helpers import MLP, bitwise_equal, make, step
from torch import nn
from torch.utils.checkpoint import checkpoint

import mixprec
from mixprec import Policy, Rule
from mixprec.errors import ConfigError

BF16 = torch.bfloat16


class Probe(nn.Module):
    """Records the autocast state and input dtypes it runs under."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[tuple[bool, torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(
            (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), x.dtype)
        )
        return self.lin(x.float())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.probe = Probe()
        self.post = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(F.gelu(self.probe(self.pre(x))))


def run(policy: Policy | str, dtype: torch.dtype = BF16) -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    net = Net()
    with mixprec.autocast("cpu", dtype, policy=policy):
        out = net(torch.randn(2, 4))
    return net, out


# ------------------------------------------------------------------ module rules
def test_module_rule_fp32_by_class() -> None:
    net, out = run(Policy(modules={Probe: "fp32"}))
    assert net.probe.seen == [(False, BF16, torch.float32)]
    assert out.dtype == BF16  # post is outside the rule


def test_module_rule_keep_by_name_does_not_cast() -> None:
    net, _ = run(Policy(modules={"probe": "keep"}))
    assert net.probe.seen == [(False, BF16, BF16)]


def test_module_rule_other_low_dtype_and_output_cast() -> None:
    net, out = run(Policy(modules={"probe": Rule(torch.float16, output="fp32")}))
    assert net.probe.seen == [(True, torch.float16, BF16)]
    assert out.dtype == BF16
    with mixprec.autocast("cpu", BF16, policy=Policy(modules={Probe: Rule("fp16", "fp32")})):
        assert net.probe(torch.randn(2, 4)).dtype == torch.float32  # probe is the root here
    with mixprec.autocast("cpu", BF16, policy="probe=fp16@fp32"):
        assert net(torch.randn(2, 4)).dtype == BF16


def test_module_rule_low_inside_region() -> None:
    net, _ = run(Policy(modules={"probe": "low"}), dtype=torch.float16)
    assert net.probe.seen == [(True, torch.float16, torch.float16)]


def test_glob_rule_on_transformer_and_root_rule() -> None:
    model, x, _ = make("transformer")
    seen: list[str] = []
    for name, mod in model.named_modules():
        if name.endswith(".attn"):
            mod.register_forward_pre_hook(lambda m, a, n=name: seen.append((n, a[0].dtype)))
    with mixprec.autocast("cpu", BF16, policy=Policy(modules={"encoder.*.attn": "fp32"})):
        model(x)
    assert seen == [
        ("encoder.layers.0.attn", torch.float32),
        ("encoder.layers.1.attn", torch.float32),
    ]
    lin = nn.Linear(4, 4)
    with mixprec.autocast("cpu", BF16, policy="nn.Linear=fp32"):
        assert lin(torch.randn(2, 4).bfloat16()).dtype == torch.float32  # the root itself


def test_rules_inactive_outside_region_and_when_disabled() -> None:
    net, _ = run(Policy(modules={Probe: "fp32"}))
    net.probe.seen.clear()
    x = torch.randn(2, 4)
    net(x)
    with torch.autocast("cpu", dtype=BF16):
        net(x)
    with mixprec.autocast("cpu", BF16, enabled=False, policy=Policy(modules={Probe: "fp32"})):
        net(x)
    assert net.probe.seen == [
        (False, BF16, torch.float32),
        (True, BF16, BF16),
        (False, BF16, torch.float32),
    ]


def test_no_policy_after_policy_is_still_native() -> None:
    model, x, y = make("mlp")
    policy = Policy(modules={nn.LayerNorm: "fp32"}, ops={"aten::gelu": "fp32"})
    step(model, x, y, lambda: mixprec.autocast("cpu", BF16, policy=policy))
    native = step(model, x, y, lambda: torch.autocast("cpu", dtype=BF16))
    ours = step(model, x, y, lambda: mixprec.autocast("cpu", BF16))
    assert bitwise_equal([native[0], *native[1]], [ours[0], *ours[1]])


# ------------------------------------------------------------------ op rules
@pytest.mark.parametrize(
    ("key", "rule", "expected"),
    [
        (F.gelu, "fp32", torch.float32),
        ("aten::gelu", "low", BF16),
        ("F.gelu", torch.float16, torch.float16),
        ("Tensor.softmax", "keep", BF16),
    ],
)
def test_op_rules(key: object, rule: str, expected: torch.dtype) -> None:
    x = torch.randn(2, 4)
    with mixprec.autocast("cpu", BF16, policy=Policy(ops={key: rule})):
        h = torch.mm(x, x.t())  # bf16 under native autocast
        got = F.gelu(x) if "gelu" in str(key) else h.softmax(-1)
    assert got.dtype == expected


def test_op_rule_promote_and_matmul() -> None:
    a = torch.randn(3, 3)
    with mixprec.autocast("cpu", BF16, policy=Policy(ops={torch.addcmul: "promote"})):
        assert torch.addcmul(a.bfloat16(), a.bfloat16(), a.bfloat16()).dtype == BF16
        assert torch.addcmul(a.bfloat16(), a, a.half()).dtype == torch.float32
    with mixprec.autocast("cpu", BF16, policy=Policy(ops={torch.matmul: "fp32"})):
        assert (a @ a).dtype == torch.float32
        assert torch.matmul(a.bfloat16(), a).dtype == torch.float32
        assert torch.mm(a, a).dtype == BF16  # a different op keeps the native policy


def test_op_rule_grads_are_fp32_and_differentiable() -> None:
    w = torch.randn(4, 4, requires_grad=True)
    with mixprec.autocast("cpu", BF16, policy="F.gelu=fp32@input"):
        out = F.gelu(torch.randn(2, 4) @ w)
    assert out.dtype == BF16
    out.float().sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


# ------------------------------------------------------------------ checkpointing
class CkptNet(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.block = MLP(8)
        self.head = nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize(
    "policy",
    [
        Policy(modules={nn.LayerNorm: "fp32"}),
        Policy(modules={"block.fc2": torch.float16}),
        Policy(ops={"aten::gelu": "fp32", F.layer_norm: "fp32"}),
    ],
    ids=["module-fp32", "module-fp16", "op-rules"],
)
def test_rules_survive_checkpoint_recompute(reentrant: bool, policy: Policy) -> None:
    torch.manual_seed(0)
    net = CkptNet(reentrant)
    x = torch.randn(4, 8, requires_grad=reentrant)
    plain = CkptNet(reentrant)
    plain.load_state_dict(net.state_dict())
    plain.forward = lambda inp: plain.head(plain.block(inp))  # type: ignore[method-assign]
    grads = []
    for model in (net, plain):
        with mixprec.autocast("cpu", BF16, policy=policy):
            loss = model(x).float().square().mean()
        loss.backward()  # outside the region: recompute relies on the persistent hooks
        grads.append([p.grad for p in model.parameters()])
    assert bitwise_equal(grads[0], grads[1])


def test_report_shows_the_module_rule_inside_a_checkpoint() -> None:
    """The rule applies in the checkpointed forward (and the report attributes it by name)."""
    torch.manual_seed(0)
    net = CkptNet(False)
    with mixprec.autocast(
        "cpu", BF16, policy=Policy(modules={nn.LayerNorm: "fp32"}), report=True
    ) as ac:
        net(torch.randn(4, 8))
    assert ac.report is not None
    assert any(r.module == "block.norm" and r.output_dtype == "fp32" for r in ac.report.rows)


# ------------------------------------------------------------------ nesting, errors, threads
def test_nested_region_inherits_policy_with_its_own_dtype() -> None:
    torch.manual_seed(0)
    net = Net()
    policy = Policy(modules={"post": "low"})
    with mixprec.autocast("cpu", BF16, policy=policy):
        with mixprec.autocast("cpu", torch.float16):
            out = net(torch.randn(2, 4))
        assert torch.get_autocast_dtype("cpu") == BF16
    assert out.dtype == torch.float16


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_exception_inside_rule_module_restores_state() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Boom())
    for rule in ("fp32", torch.float16):  # fp16 turns the cache off in its subtree: restored?
        with mixprec.autocast("cpu", BF16, cache_enabled=True, policy=Policy(modules={Boom: rule})):
            with pytest.raises(RuntimeError, match="boom"):
                model(torch.randn(2, 4))
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == BF16
            assert torch.is_autocast_cache_enabled()
            assert model[0](torch.randn(2, 4)).dtype == BF16
    assert not torch.is_autocast_enabled("cpu")


def test_threads_each_apply_their_own_policy() -> None:
    results: dict[str, torch.dtype] = {}
    barrier = threading.Barrier(2)

    def worker(tag: str, policy: Policy) -> None:
        torch.manual_seed(0)
        net = Net()
        with mixprec.autocast("cpu", BF16, policy=policy):
            barrier.wait()
            results[tag] = net(torch.randn(2, 4)).dtype

    threads = [
        threading.Thread(target=worker, args=("fp32", Policy(modules={"post": "fp32"}))),
        threading.Thread(target=worker, args=("low", Policy(modules={"post": torch.float16}))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"fp32": torch.float32, "low": torch.float16}


# ------------------------------------------------------------------ construction and bad input
def test_string_form_round_trips_and_reads() -> None:
    p = Policy(
        modules={nn.LayerNorm: "fp32", "encoder.*.attn": BF16, "router": "keep"},
        ops={F.softmax: "fp32", "aten::gelu": "low", torch.matmul: Rule("fp32", output="input")},
    )
    text = str(p)
    assert text == (
        "nn.LayerNorm=fp32, encoder.*.attn=bf16, router=keep, F.softmax=fp32, aten::gelu=low, "
        "torch.matmul=fp32@input"
    )
    assert Policy(text) == p
    assert repr(p) == f"Policy({text!r})"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"modules": {"x": torch.float64}}, 'accepted: "fp32"'),
        ({"modules": {"x": "promote"}}, "ops only"),
        ({"modules": {int: "fp32"}}, "Accepted: an nn.Module subclass"),
        ({"ops": {"aten::not_an_op": "fp32"}}, "unknown op 'aten::not_an_op'"),
        ({"ops": {"F.sofmax": "fp32"}}, "did you mean softmax"),
        ({"ops": {len: "fp32"}}, "not a torch function"),
        ({"ops": {"aten::gelu_backward": "fp32"}}, "no public Python function"),
        ({"ops": {F.softmax: "fp32", "Tensor.softmax": "low"}}, "conflicting op rules"),
        ({"spec": "x=fp32@sideways"}, "unknown output cast"),
    ],
)
def test_bad_policies_raise_config_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Policy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["nn.NoSuchLayer=fp32", "nn.functional=fp32", "just-a-word"])
def test_bad_policy_strings(spec: str) -> None:
    with pytest.raises(ConfigError):
        Policy(spec)


def test_name_rule_matching_nothing_raises_listing_names() -> None:
    net = Net()
    policy = Policy(modules={"encoder.*": "fp32"})
    match = r"'encoder\.\*'.*'pre', 'probe', 'probe\.lin'"
    with pytest.raises(ConfigError, match=match), mixprec.autocast("cpu", BF16, policy=policy):
        net(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")
    with mixprec.autocast("cpu", BF16, policy=Policy(modules={"encoder.*": "fp32"}, strict=False)):
        net(torch.randn(2, 4))
    with pytest.raises(ConfigError, match="matched no module"):
        Policy(modules={"nope": "keep"}).resolve(net)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": torch.float64}, "accepted: torch.float16, torch.bfloat16"),
        ({"dtype": torch.int32}, "accepted: torch.float16, torch.bfloat16"),
        ({"dtype": "bf16"}, "must be a torch.dtype"),
        ({"device_type": "tpu9"}, "accepted device types: cpu"),
        ({"device_type": 3}, "accepted device types"),
        ({"enabled": 1}, "enabled must be True or False"),
        ({"policy": 42}, "policy must be a mixprec.Policy"),
    ],
)
def test_bad_region_arguments(kwargs: dict[str, object], match: str) -> None:
    kwargs.setdefault("device_type", "cpu")
    with pytest.raises(ConfigError, match=match):
        mixprec.autocast(**kwargs)  # type: ignore[arg-type]


def test_device_forms_are_accepted() -> None:
    assert mixprec.autocast(torch.device("cpu")).device == "cpu"
    assert mixprec.autocast("cpu:0").device == "cpu"


class Dynamic(nn.Module):
    """Creates a throwaway module in forward; the named submodules around it keep their names."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.Identity()(self.fc1(x)))


def test_names_survive_throwaway_modules_and_direct_submodule_calls() -> None:
    net = Dynamic()
    policy = Policy(modules={"fc2": "fp32"})
    with mixprec.autocast("cpu", BF16, policy=policy, report=True) as ac:
        assert net(torch.randn(2, 4)).dtype == torch.float32
        assert net.fc2(torch.randn(2, 4)).dtype == torch.float32  # still "fc2" within net
        nn.functional.cross_entropy(net.fc1(torch.randn(2, 4)), torch.tensor([0, 1]))
    assert ac.report is not None
    assert {r.module for r in ac.report.rows} >= {"fc1", "fc2"}


def test_report_only_region_after_a_policy_region_applies_no_rule() -> None:
    net, _ = run(Policy(modules={Probe: "fp32"}))
    net.probe.seen.clear()
    with mixprec.autocast("cpu", BF16, report=True):
        net(torch.randn(2, 4))
    assert net.probe.seen == [(True, BF16, BF16)]


def test_equal_policies_share_bindings() -> None:
    a = mixprec.autocast("cpu", policy=Policy(modules={nn.LayerNorm: "fp32"}))
    b = mixprec.autocast("cpu", policy=Policy(modules={nn.LayerNorm: "fp32"}))
    c = mixprec.autocast("cpu", policy="nn.LayerNorm=fp32")
    assert a.policy is b.policy is c.policy
    d = mixprec.autocast("cpu", policy=Policy(modules={nn.LayerNorm: "fp32"}, strict=False))
    assert d.policy is not a.policy


def test_a_raising_user_pre_hook_does_not_unbalance_rule_state() -> None:
    net = Net()
    calls = {"n": 0}

    def flaky(module: nn.Module, args: tuple[object, ...]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("user hook")

    # Registered first, so it runs before mixprec's instance pre-hook on `post`.
    net.post.register_forward_pre_hook(flaky, prepend=True)
    policy = Policy(modules={"probe": torch.float16, "post": "fp32"})
    with mixprec.autocast("cpu", BF16, policy=policy):
        with pytest.raises(ValueError, match="user hook"):
            net(torch.randn(2, 4))
        assert torch.get_autocast_dtype("cpu") == BF16 and torch.is_autocast_enabled("cpu")
        assert net(torch.randn(2, 4)).dtype == torch.float32
        assert net.probe.seen[-1] == (True, torch.float16, BF16)


def test_op_rules_alone_hook_no_module() -> None:
    """Op rules replay through the checkpoint, so a policy with op rules only costs no module
    hook at all (module rules and reports need the process-wide discovery hooks)."""
    from torch.nn.modules import module as nn_module

    from mixprec._src.autocast import modules

    net = Net()
    before = len(nn_module._global_forward_pre_hooks)
    with mixprec.autocast("cpu", BF16, policy=Policy(ops={F.gelu: "fp32"})):
        assert len(nn_module._global_forward_pre_hooks) == before
        net(torch.randn(2, 4))
    assert all(not m._forward_pre_hooks for m in net.modules())
    with mixprec.autocast("cpu", BF16, policy=Policy(modules={Probe: "fp32"})):
        # the module hooks: registered once, then kept (Dynamo guards on the hook dicts' keys)
        hooks = list(nn_module._global_forward_pre_hooks.values())
        assert hooks.count(modules._global_pre) == 1
