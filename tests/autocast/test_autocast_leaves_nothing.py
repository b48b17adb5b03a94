"""A region leaves nothing behind in torch (#36 item 5).

After the last policy region exits, torch's global module hook dicts, its function and dispatch
mode stacks, the autocast state of every device type (the IPU flag a policy region borrows as a
marker included), the saved-tensor hooks and AOTAutograd's backward autocast setting are what
they were before it, whichever way the regions were left: normally, by an exception from the
body or from a module's forward, nested, in another thread, inside a generator closed early or
exhausted; as a property over random nestings of those. Per-thread state stays per thread.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import mixprec
from mixprec._src import torch_compat
from mixprec._src.autocast import custom, native

BF16 = torch.bfloat16
DEVICES = ("cpu", "cuda", "ipu", "xpu", "hpu", "mps")
HOOK_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def snapshot() -> dict[str, Any]:
    """What of torch's process and thread state a region could leave changed."""
    state: dict[str, Any] = {n: list(getattr(nn_module, n).items()) for n in HOOK_DICTS}
    state["function modes"] = list(torch.overrides._get_current_function_mode_stack())
    state["dispatch modes"] = list(_get_current_dispatch_mode_stack())
    for dev in DEVICES:
        state[dev] = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    state["cache"] = torch.is_autocast_cache_enabled()
    state["saved tensor hooks"] = torch_compat.top_saved_tensors_hooks()
    state["backward autocast"] = torch_compat.backward_pass_autocast()
    state["grad"] = torch.is_grad_enabled()
    state["pending"] = custom.has_pending()
    return state


class Boom(Exception):
    pass


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise Boom("from a module's forward")
        return self.norm(self.lin(x).relu())


POLICIES = [None, "nn.LayerNorm=fp32", "nn.Linear=fp8, nn.LayerNorm=fp32", "F.relu=fp32", "report"]
WAYS = ["with", "thread", "generator", "closed generator"]


def region(kind: str | None) -> mixprec.autocast:
    if kind == "report":
        return mixprec.autocast("cpu", BF16, report=True)
    return mixprec.autocast("cpu", BF16, policy=kind)


def nest(levels: list[tuple[Any, str, str]], depth: int, model: Model, x: torch.Tensor) -> None:
    """Enter ``levels[depth]`` its way, run the model, go deeper, fail where told."""
    if depth == len(levels):
        return
    kind, way, fail = levels[depth]

    def body() -> None:
        model.fail = fail == "module"
        try:
            model(x)
        finally:
            model.fail = False
        if fail == "body":
            raise Boom("from the body")
        nest(levels, depth + 1, model, x)

    if way == "with":
        with region(kind):
            body()
    elif way == "thread":
        inner: dict[str, Any] = {}

        def target() -> None:
            before = snapshot()
            try:
                with region(kind):
                    body()
            except Boom:
                pass
            inner["same"] = snapshot() == before

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        assert inner["same"], "the thread's own state changed"
    else:

        def gen() -> Iterator[None]:
            with region(kind):
                yield
                body()
                yield

        it = gen()
        next(it)
        if way == "closed generator":
            it.close()  # GeneratorExit at the yield: the region exits there
        else:
            next(it)
            assert next(it, "done") == "done"


LEVEL = st.tuples(
    st.sampled_from(POLICIES), st.sampled_from(WAYS), st.sampled_from(["no", "module", "body"])
)


@settings(max_examples=40, deadline=None)
@given(st.lists(LEVEL, min_size=1, max_size=3))
def test_a_region_leaves_nothing_behind_whichever_way_it_is_left(levels: list[Any]) -> None:
    model, x = Model(), torch.randn(2, 16)
    before = snapshot()
    with contextlib.suppress(Boom):
        nest(levels, 0, model, x)
    assert snapshot() == before


def test_hooks_are_in_torch_only_while_a_policy_region_runs() -> None:
    model, x = Model(), torch.randn(2, 16)
    before = snapshot()
    with mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32"):
        inside = snapshot()
        assert inside["_global_forward_pre_hooks"] != before["_global_forward_pre_hooks"]
        assert torch.is_autocast_enabled("ipu")  # the marker, entered with the region
        model(x)
    assert snapshot() == before
    with warnings.catch_warnings(record=True) as caught:  # it warns about any global hook
        warnings.simplefilter("always")
        with torch.compiler.set_stance("force_eager"):
            torch.compile(model)(x)
    assert not [w for w in caught if "global hooks" in str(w.message)]


def test_hooks_come_back_under_the_keys_of_their_first_registration() -> None:
    """Dynamo guards compiled graphs on the keys: fresh keys per region would recompile."""
    keys = []
    for _ in range(3):
        with mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32"):
            keys.append(
                (list(nn_module._global_forward_pre_hooks), list(nn_module._global_forward_hooks))
            )
    assert keys[0] == keys[1] == keys[2]


def test_a_thread_in_a_region_keeps_the_hooks_for_itself_when_another_leaves() -> None:
    model, x = Model(), torch.randn(2, 16)
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def other() -> None:
        with mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32"):
            inside.set()
            release.wait(30)
            seen["dtype"] = model(x).dtype  # this thread's rule still applies

    thread = threading.Thread(target=other)
    before = snapshot()
    thread.start()
    inside.wait(30)
    with mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32"):
        model(x)
    release.set()
    thread.join()
    assert seen["dtype"] == torch.float32
    assert snapshot() == before


def test_custom_fwd_calls_of_a_thread_are_that_threads() -> None:
    """A region exit in one thread binds its own pending calls, not another thread's (whose
    outputs may not have their grad_fn yet)."""

    class Fn(torch.autograd.Function):
        @staticmethod
        @mixprec.custom_fwd(device_type="cpu")
        def forward(a: torch.Tensor) -> torch.Tensor:
            return a * 2

        @staticmethod
        def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
            pass

        @staticmethod
        @mixprec.custom_bwd(device_type="cpu")
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return g * 2

    recorded, bound = threading.Event(), threading.Event()
    out: dict[str, Any] = {}

    def other() -> None:
        out["y"] = Fn.apply(torch.ones(2, requires_grad=True))
        out["pending"] = custom.has_pending()
        recorded.set()
        bound.wait(30)
        out["still"] = custom.has_pending()

    thread = threading.Thread(target=other)
    thread.start()
    recorded.wait(30)
    with mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32"):
        pass  # this exit binds this thread's calls only
    bound.set()
    thread.join()
    assert out["pending"] and out["still"]
    out["y"].sum().backward()  # its backward (here, another thread) finds its state


def test_backward_autocast_is_restored_by_the_last_thread_that_turned_it_off() -> None:
    original = torch_compat.backward_pass_autocast()
    first_off, second_done = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    def first() -> None:
        native.backward_autocast_off_while_tracing()
        first_off.set()
        second_done.wait(30)
        seen["while first"] = torch_compat.backward_pass_autocast()
        native.restore_backward_autocast()

    def second() -> None:
        first_off.wait(30)
        native.backward_autocast_off_while_tracing()
        native.restore_backward_autocast()
        second_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["while first"] == "off"
    assert torch_compat.backward_pass_autocast() == original


@pytest.mark.parametrize("kind", ["op mode", "recorder"])
def test_a_failed_entry_undoes_what_it_did(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry that fails half-way (here, the op rule mode or the report's recorder) leaves
    nothing of what it did before the failure."""
    from mixprec._src.autocast import region as region_module

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise Boom("entry failed")

    if kind == "op mode":
        monkeypatch.setattr(region_module.OpRuleMode, "__enter__", refuse)
        made = mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32, F.relu=fp32")
    else:
        monkeypatch.setattr(region_module.DtypeReport, "record", refuse)
        made = mixprec.autocast("cpu", BF16, policy="nn.LayerNorm=fp32", report=True)
    before = snapshot()
    with pytest.raises(Boom):
        made.__enter__()
    assert snapshot() == before
