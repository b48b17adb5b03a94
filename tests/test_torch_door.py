"""One door to torch's internals: outside ``mixprec._src.torch_compat`` the package reaches torch
through its public API only, found by the rule of ``tests/torch_door.py`` (not by a list of
names); and the torch range pyproject.toml declares is the range CI tests."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tests.torch_door import (
    LAYOUT,
    NOT_TORCH,
    OWN,
    SRC,
    door_source,
    door_uses,
    in_door,
    package_uses,
    private,
)

ROOT = Path(__file__).resolve().parent.parent

# Uses in files another engineer is rewriting, each with who moves it. The test fails when one is
# no longer needed, so the table only shrinks.
PENDING: dict[str, str] = {}

# One snippet per form the rule finds, each as the package wrote it before issue #36 moved it
# behind the door (ops.py's checkpoint, gather.py's FSDP2 params, report.py's op name,
# speed/model.py's flop formulas, unscale.py/telemetry.py's sparse grads, calls.py/arguments.py's
# compiled wrapper) and the forms found besides (a private torch name, a computed name on torch).
FORMS = {
    "reentrant ctx from frames": (
        "def f(frame):\n    return frame.f_locals.get('ctx')",
        "introspection f_locals",
    ),
    "checkpoint frame in closure cells": (
        "for cell in hooks[0].__closure__:\n    frame = cell.cell_contents",
        "introspection __closure__",
    ),
    "closure by getattr": (
        "cells = getattr(hook, '__closure__', None)",
        "introspection __closure__",
    ),
    "recompute function rewritten": (
        "def f(owner, attr, fn):\n    setattr(owner, attr, fn)",
        "computed-attr setattr(owner, ...)",
    ),
    "FSDPParam.sharded_param": ("rows = fsdp_param.sharded_param.shape[0]", "layout sharded_param"),
    "FSDPParamGroup.fsdp_params": ("for p in group.fsdp_params:\n    pass", "layout fsdp_params"),
    "checkpoint frame layout": ("fn = frame.recompute_fn", "layout recompute_fn"),
    "OpOverload._schema": ("schema = getattr(func, '_schema', None)", "private-str _schema"),
    "OpOverload._overloadname": ("name = func._overloadname", "private-attr _overloadname"),
    "flop_counter's flag": ("setattr(fn, '_get_raw', True)", "private-str _get_raw"),
    "private op built by an f-string": (
        "op = getattr(aten, f'_scaled_dot_product_flash_attention_for_cpu{name}', None)",
        "private-str f'_scaled_dot_product_flash_attention_for_cpu'...",
    ),
    "sparse grad values": ("values = grad._values()", "private-attr _values"),
    "_orig_mod in a string": ("ok = '_orig_mod' in children", "private-str _orig_mod"),
    "_orig_mod in a message": (
        "msg = f'{what} is named under ._orig_mod'",
        "private-str _orig_mod",
    ),
    "private attribute of a field": (
        "class A:\n    def f(self):\n        return self.model._forward_hooks",
        "private-attr _forward_hooks",
    ),
    "computed name set on a field": (
        "class A:\n    def f(self, n):\n        setattr(self.model, n, None)",
        "computed-attr setattr(self.model, ...)",
    ),
    "private name through a constant": (
        "from mixprec._src.torch_compat import COMPILED_INNER\nm = getattr(model, COMPILED_INNER)",
        "private-str _orig_mod",
    ),
    "private torch chain": ("import torch\nx = torch._C._get_tracing_state()", "torch-private"),
    "private torch import": ("from torch.utils._pytree import tree_map", "torch-private"),
    "private torch module": ("import torch._dynamo", "torch-private torch._dynamo"),
    "computed name on torch": (
        "import torch\ndef f(n):\n    return getattr(torch, n)",
        "computed-attr getattr(torch, ...)",
    ),
    "computed name on an alias": (
        "import torch\naten = torch.ops.aten\ndef f(n):\n    return hasattr(aten, n)",
        "computed-attr hasattr(aten, ...)",
    ),
}

# What the rule leaves alone: an object's own private state, mixprec's own names and constants,
# public names, a docstring, and the door's functions.
CLEAN = [
    "class A:\n    _y = 0\n\n    def f(self):\n        return self._x, type(self)._y\n",
    "_REPLAYS = '_mixprec_replays'\ndef f(fn):\n    return getattr(fn, _REPLAYS, ())\n",
    "def f(o):\n    setattr(o, '_mixprec_flag', 1)\n    o._mixprec_inner = 2\n",
    "def f(o):\n    for n in ('__deepcopy__', '__reduce_ex__'):\n        setattr(o, n, None)\n",
    "import torch\nx = torch.__version__, torch.nn.functional.linear, getattr(torch, 'cuda')\n",
    "def f():\n    '''Reads ``._orig_mod`` and ``_values()``.'''\n",
    "from mixprec._src import torch_compat\nv = torch_compat.sparse_values(g)\n",
    "import sys\nf = sys._getframe(1)\n",
    "def f(stats, key):\n    return getattr(stats, key)\n",
]


@pytest.mark.parametrize("form", FORMS)
def test_the_rule_finds_each_form(form: str) -> None:
    source, found = FORMS[form]
    uses = door_uses(source)
    assert any(u.split(": ", 1)[1].startswith(found) for u in uses), uses


@pytest.mark.parametrize("source", CLEAN)
def test_the_rule_leaves_public_and_own_names(source: str) -> None:
    assert door_uses(source) == []


def test_the_package_reaches_torch_only_through_the_door() -> None:
    uses = package_uses()
    assert {f: u for f, u in uses.items() if f not in PENDING} == {}
    assert [f for f in PENDING if f not in uses] == [], "remove these from PENDING"


def test_the_door_holds_what_the_rule_finds() -> None:
    """The rule sees the door's own private uses (it is not blind to the forms it holds)."""
    uses = " ".join(door_uses(door_source()))
    for form in ("torch-private", "private-attr", "introspection", "layout", "computed-attr"):
        assert form in uses


def test_layout_names_are_read_from_torchs_private_classes() -> None:
    assert {"sharded_param", "fsdp_params", "recompute_fn", "mesh_info"} <= LAYOUT
    assert not {"device", "modules", "weight", "shape", "dtype"} & LAYOUT  # public types' names


def test_own_and_other_libraries_names_are_no_torch_names() -> None:
    """A private name counts as mixprec's own only if no everyday torch object has it, and each
    name granted to another library is still used (the table only shrinks)."""
    assert all(private(n) for n in OWN)
    torchs = {"_version", "_modules", "_parameters", "_values", "_schema", "_base", "_dtype"}
    assert not (torchs | {"_fwd_used_autocast"}) & OWN
    source = "\n".join(p.read_text() for p in SRC.rglob("*.py") if not in_door(p))
    assert [n for n in NOT_TORCH if not re.search(rf"\b{n}\b", source)] == []


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_the_declared_torch_range_is_the_tested_one() -> None:
    """pyproject.toml declares ``torch>=<oldest>,<next after newest>`` for the Makefile's
    TORCH_OLDEST and TORCH_NEWEST (what CI's ``make test-torches`` runs), and the pinned torch
    of constraints.txt lies inside."""
    declared = re.search(
        r'^dependencies = \["torch>=([\d.]+),<([\d.]+)"\]$',
        (ROOT / "pyproject.toml").read_text(),
        re.M,
    )
    make = (ROOT / "Makefile").read_text()
    oldest = re.search(r"^TORCH_OLDEST := (\S+)$", make, re.M)
    newest = re.search(r"^TORCH_NEWEST := (\S+)$", make, re.M)
    pinned = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), re.M)
    assert declared and oldest and newest and pinned
    floor, ceiling = _version(declared[1]), _version(declared[2])
    assert floor == _version(oldest[1])[:2]
    major, minor = _version(newest[1])[:2]
    assert ceiling == (major, minor + 1)
    assert floor <= _version(pinned[1].split("+")[0])[:2] < ceiling
