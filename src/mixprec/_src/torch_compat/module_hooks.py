"""The process-wide module hooks and in-place compilation, as torch keeps them in private state.

Part of the door (:mod:`mixprec._src.torch_compat`), re-exported from there: torch's global hook
dicts (``torch.nn.modules.module._global_forward_*``) and a module's ``_compiled_call_impl``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# ---------------------------------------------------------------- module hooks
# Checked on 2.13.0; CI runs them on 2.12.1 and 2.14.1.


class GlobalModuleHooks:
    """A process-wide forward pre-hook and always-called forward hook, added and removed as a pair
    under the keys torch gave them at their first registration (torch's public
    ``register_module_forward_pre_hook``/``register_module_forward_hook``); re-added by writing
    torch's global hook dicts (``torch.nn.modules.module._global_forward_pre_hooks``,
    ``_global_forward_hooks``, ``_global_forward_hooks_always_called``). Why the same keys: Dynamo
    guards a graph that traced the hooks on the keys of those dicts, so fresh keys at each add
    would recompile every compiled model at every region. Checked on 2.13.0.

    Example:
        >>> hooks = GlobalModuleHooks(lambda m, a: None, lambda m, a, o: None)
        >>> hooks.add(); hooks.added()
        True
        >>> hooks.remove(); hooks.added()
        False

    Host sync: none.
    """

    __slots__ = ("keys", "post", "pre")

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self.pre, self.post = pre, post
        self.keys: tuple[int, int] | None = None

    def add(self) -> None:
        """Add both hooks (at the end of torch's dicts). Host sync: none."""
        from torch.nn.modules import module as nn_module

        if self.keys is None:
            pre = nn_module.register_module_forward_pre_hook(self.pre)
            post = nn_module.register_module_forward_hook(self.post, always_call=True)
            self.keys = (pre.id, post.id)
            return
        nn_module._global_forward_pre_hooks[self.keys[0]] = self.pre
        nn_module._global_forward_hooks[self.keys[1]] = self.post
        nn_module._global_forward_hooks_always_called[self.keys[1]] = True

    def remove(self) -> None:
        """Remove both hooks (nothing where they are not added). Host sync: none."""
        from torch.nn.modules import module as nn_module

        if self.keys is None:
            return
        nn_module._global_forward_pre_hooks.pop(self.keys[0], None)
        nn_module._global_forward_hooks.pop(self.keys[1], None)
        nn_module._global_forward_hooks_always_called.pop(self.keys[1], None)

    def added(self) -> bool:
        """Whether both hooks are in torch's dicts now. Host sync: none."""
        from torch.nn.modules import module as nn_module

        pre = self.keys is not None and self.keys[0] in nn_module._global_forward_pre_hooks
        return pre and self.keys is not None and self.keys[1] in nn_module._global_forward_hooks


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` compiled the module in place (its private
    ``_compiled_call_impl`` is set). Checked on 2.13.0.

    Example:
        >>> compiled_in_place(torch.nn.Linear(2, 2))
        False

    Host sync: none.
    """
    return module.__dict__.get("_compiled_call_impl") is not None
