"""The rule that keeps torch's internals behind one door (``mixprec._src.torch_compat``).

:func:`door_uses` reads a module's source (``ast``) and returns each place it reaches into torch
past its public API, as ``"line: form name"``. The forms, found by rule and not from a list of
names:

- ``torch-private``: a ``_``-prefixed name under a name bound to torch (``torch._C.x``,
  ``nn.modules.conv._ConvNd``, ``aten._unsafe_view``), or an import of one.
- ``private-attr``: ``x._name`` on anything but ``self``/``cls``/a mixprec module, where mixprec
  itself never defines ``_name`` (``grad._values()``, ``func._schema``).
- ``private-str``: a string (not a docstring) that is a private name or mentions ``._name``
  (``"_orig_mod"``, ``setattr(f, "_get_raw", True)``, a message naming ``._orig_mod``), or an
  f-string that builds one (``f"_scaled_dot_product_flash_attention_for_cpu{x}"``).
- ``computed-attr``: ``getattr``/``setattr``/``hasattr``/``delattr`` whose name is neither a
  string nor a module constant (``setattr(owner, attr, fn)``), on anything but ``self``/``cls``.
- ``introspection``: reading another function's frames or closures (``frame.f_locals``,
  ``f.__closure__``, ``cell.cell_contents``): the layout of torch's Python code.
- ``layout``: a public-named attribute of one of torch's private classes that torch_compat hands
  out (FSDP2's ``FSDPParam``/``FSDPParamGroup``, the checkpoint's ``_CheckpointFrame``): the names
  are read from those classes' source, less the names public torch types and mixprec also use.

Private names mixprec defines itself (``def _x``, ``self._x = ``, ``_x = ``, a ``_mixprec...``
attribute it sets on a torch object) are its own, unless a public torch type also has them.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

import mixprec

SRC = Path(mixprec.__file__).resolve().parent
DOOR = SRC / "_src" / "torch_compat"  # a package: the door, split by concept

_PRIVATE = re.compile(r"^_(?!_\w*__$)[A-Za-z0-9]\w*$")  # _x and __x, not __x__
_MENTION = re.compile(r"(?<![\w.])\.(_(?!_)[A-Za-z]\w*)")  # "._x" inside a text
_PREFIX = re.compile(r"^_[A-Za-z]")  # the start of an f-string that builds a private name
ATTR_FUNCTIONS = {"getattr", "setattr", "hasattr", "delattr"}
INTROSPECTION = {"f_locals", "f_globals", "__closure__", "cell_contents", "__globals__"}
#: Private names of other libraries than torch, each with whose it is (never a torch name).
NOT_TORCH = {
    "_fields": "namedtuple's documented API (scaling/nested.py)",
    "_replace": "namedtuple's documented API (scaling/grad_scaler.py)",
    "_optimizers": "accelerate's Accelerator (integrations/accelerate.py)",
    "_owner": "torchtitan's model configs (integrations/torchtitan.py)",
}


def private(name: str) -> bool:
    return bool(_PRIVATE.match(name))


def _private_of_torch_types() -> set[str]:
    """The private names torch's everyday objects carry (never mixprec's own, even where a
    mixprec class uses the same name on ``self``). torch's GradScaler is not among them: mixprec's
    is its drop-in and defines its private API (``_get_scale_async``, ...) itself."""
    module, tensor = torch.nn.Linear(1, 1), torch.zeros(1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    objects: list[object] = [module, tensor, tensor.to_sparse(), optimizer, torch.ops.aten.mm]
    objects += [torch.ops.aten.mm.default, _custom_fwd_ctx()]
    return {n for o in objects for n in {*dir(o), *getattr(o, "__dict__", {})} if private(n)}


def _custom_fwd_ctx() -> object:
    """The ``ctx`` of a Function whose forward ``torch.amp.custom_fwd`` wraps."""
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            seen.append(ctx)
            return x.clone()

    Probe.apply(torch.zeros(1, requires_grad=True))
    return seen[0]


def _class_names(cls: type) -> set[str]:
    """The attributes ``cls`` defines: in its body and as ``self.x = `` in its methods."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    stored = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
        if isinstance(n.value, ast.Name) and n.value.id == "self"
    }
    return stored | set(vars(cls))


def _public_names() -> set[str]:
    module, tensor = torch.nn.Linear(1, 1), torch.zeros(1)
    return {n for o in (module, tensor, torch.nn.Module) for n in {*dir(o), *vars(module)}}


def _sources() -> Iterator[tuple[str, ast.Module]]:
    yield from SOURCES


DOOR_NAME = str(DOOR.relative_to(SRC))


def in_door(path: Path | str) -> bool:
    """Whether ``path`` (absolute, or relative to ``SRC``) is one of the door's files."""
    return Path(path).is_relative_to(DOOR) or Path(path).is_relative_to(DOOR_NAME)


def door_source() -> str:
    """The door's source, its files joined."""
    return "\n".join(p.read_text() for p in sorted(DOOR.rglob("*.py")))


SOURCES = [(str(p.relative_to(SRC)), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def _defined(tree: ast.AST) -> set[str]:
    """The names ``tree`` defines: functions, classes, arguments, variables, ``self.x``/``cls.x``
    (imports are not definitions: ``from torch... import _x`` is torch's)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                found.add(node.attr)
        elif isinstance(node, ast.Dict):  # a key mixprec writes ({"_counters": ...})
            found.update(k.value for k in node.keys if isinstance(k, ast.Constant))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            found.add(getattr(node.slice, "value", None))  # obj.__dict__["_traced"] = True
    return {n for n in found if isinstance(n, str)}


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """The module-level names ``tree`` binds to a string (``MASTERS = "_mixprec_..."``)."""
    return {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        if isinstance(node.value.value, str)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _own_names() -> set[str]:
    """The private names mixprec defines, outside the door (whose names wrap torch's)."""
    defined = set().union(*(_defined(t) for f, t in _sources() if not in_door(f)))
    return {n for n in defined if private(n)} - TORCH_PRIVATE


def _layout_names(own: Iterable[str]) -> set[str]:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.utils.checkpoint import _CheckpointFrame

    names = set().union(*(_class_names(c) for c in (FSDPParam, FSDPParamGroup, _CheckpointFrame)))
    mixprecs = set().union(*(_defined(t) for f, t in _sources() if not in_door(f)))
    return {n for n in names if not private(n)} - _public_names() - mixprecs - set(own)


TORCH_PRIVATE = _private_of_torch_types()
OWN = _own_names()
LAYOUT = _layout_names(OWN)
CONSTANTS = {k: v for _, t in _sources() for k, v in _string_constants(t).items()}


def _is_own(name: str, local: set[str]) -> bool:
    return name.startswith("_mixprec") or name in OWN or name in local or name in NOT_TORCH


class _Scan(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.found: set[str] = set()
        self.torch: set[str] = set()  # names bound to torch modules and objects by import
        self.mixprec: set[str] = set()  # names bound to mixprec modules and objects by import
        self.other: set[str] = set()  # names bound to other modules (sys, warnings) by import
        self.constants = {**CONSTANTS, **_string_constants(tree)}  # names bound to a string
        self.own = {n for n in _defined(tree) if private(n)} - TORCH_PRIVATE
        self.docstrings: set[int] = set()
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
                self.docstrings.add(id(body[0].value))
        self.inner: set[int] = set()

    def add(self, node: ast.AST, form: str, name: str) -> None:
        self.found.add(f"{getattr(node, 'lineno', 0)}: {form} {name}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            root = alias.name.split(".")[0]
            bound = alias.asname or root
            self._bind(root, bound)
            if root == "torch" and any(private(p) for p in alias.name.split(".")):
                self.add(node, "torch-private", alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = (node.module or "").split(".")
        root = "mixprec" if node.level else module[0]
        for alias in node.names:
            bound = alias.asname or alias.name
            if root == "torch":
                self.torch.add(bound)
                if any(private(p) for p in [*module, alias.name]):
                    self.add(node, "torch-private", f"{node.module}.{alias.name}")
            else:
                self._bind(root, bound)

    def _bind(self, root: str, bound: str) -> None:
        kinds = {"torch": self.torch, "mixprec": self.mixprec}
        kinds.get(root, self.other).add(bound)

    def visit_Assign(self, node: ast.Assign) -> None:
        root, _ = self._root(node.value)
        if root in self.torch:  # aten = torch.ops.aten
            self.torch.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        items = getattr(node.iter, "elts", None)
        constant = items and all(isinstance(i, ast.Constant) for i in items)
        if constant and isinstance(node.target, ast.Name):  # for name in ("a", "b"): a constant
            self.constants = {**self.constants, node.target.id: ""}
        self.generic_visit(node)

    @staticmethod
    def _root(node: ast.expr) -> tuple[str | None, list[str]]:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return (node.id if isinstance(node, ast.Name) else None), parts[::-1]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        outer = id(node) not in self.inner  # the whole chain, not a part of a longer one
        self.inner.add(id(node.value))
        root, parts = self._root(node)
        if root in self.torch:
            if outer and any(private(p) for p in parts):
                self.add(node, "torch-private", ".".join([root, *parts]))
        elif not self._owned(node.value) and self._foreign(node.attr):
            self.add(node, "private-attr", node.attr)
        if node.attr in INTROSPECTION:
            self.add(node, "introspection", node.attr)
        if node.attr in LAYOUT and self._root(node.value) != ("torch_compat", []):
            self.add(node, "layout", node.attr)  # the door's own functions may share the name
        self.generic_visit(node)

    def _owned(self, receiver: ast.expr) -> bool:
        """Whether ``receiver`` is the object's own (``self``, ``cls``: not ``self.model``) or an
        imported module or object that is not torch's."""
        root, parts = self._root(receiver)
        return (root in ("self", "cls") and not parts) or root in (*self.mixprec, *self.other)

    def _foreign(self, name: str) -> bool:
        """Whether ``name`` is private and not mixprec's own (nor another library's)."""
        return private(name) and not _is_own(name, self.own)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.docstrings:
            text = node.value
            names = [text] if private(text) or text in INTROSPECTION else _MENTION.findall(text)
            for name in names:
                if name in INTROSPECTION:
                    self.add(node, "introspection", name)
                elif not _is_own(name, self.own):
                    self.add(node, "private-str", name)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        first = node.values[0] if node.values else None
        if isinstance(first, ast.Constant) and _PREFIX.match(str(first.value)):
            self.add(node, "private-str", f"f{first.value!r}...")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ATTR_FUNCTIONS and len(node.args) > 1:
            target, name = node.args[0], node.args[1]
            constant = isinstance(name, ast.Constant) or (
                isinstance(name, ast.Name) and name.id in self.constants
            )
            value = self.constants.get(getattr(name, "id", None) or "", "")
            if value and self._foreign(value):  # a constant naming a private attribute
                self.add(node, "private-str", value)
            root, _ = self._root(target)
            reads = func.id in ("getattr", "hasattr")
            if not constant and (root in self.torch if reads else not self._owned(target)):
                self.add(node, "computed-attr", f"{func.id}({ast.unparse(target)}, ...)")
        self.generic_visit(node)


def door_uses(source: str) -> list[str]:
    """Where ``source`` reaches into torch past its public API (``"line: form name"``)."""
    tree = ast.parse(source)
    scan = _Scan(tree)
    scan.visit(tree)
    return sorted(scan.found, key=lambda s: (int(s.split(":")[0]), s))


def package_uses() -> dict[str, list[str]]:
    """:func:`door_uses` of each module of the package but the door itself."""
    return {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if not in_door(path) and (uses := door_uses(path.read_text()))
    }
