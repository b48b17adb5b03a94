"""``mixprec.autocast``: native ``torch.autocast`` underneath, plus policies and a dtype report.

A region without a policy or a report is native autocast's state switch and nothing else
(:mod:`.native`). A full region (a policy, a report, or nested in one) adds, after native entry:
a :class:`~.modules.Frame` (its device, dtype and policy, read by the module hooks), the
process-wide module hooks when it has module rules or a report, the op rule mode when it has op
rules, and a recorder for a report. Its exit undoes exactly what its entry did and, for a strict
policy, refuses name rules that matched no module run in the region.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec._src.autocast import fp8
from mixprec._src.autocast.custom import bind_pending, has_pending
from mixprec._src.autocast.modules import (
    TLS,
    Frame,
    acquire_global_hooks,
    forget_roots,
    names_run,
    release_global_hooks,
)
from mixprec._src.autocast.native import (
    cache_for,
    mark_policy_region,
    native_decision,
    pop_state,
    push_state,
    resolve_device_type,
    resolve_region_dtype,
    restore_backward_autocast,
    unmark_policy_region,
)
from mixprec._src.autocast.ops import OpRuleMode
from mixprec._src.autocast.policy import Policy, coerce_policy
from mixprec._src.autocast.report import DtypeReport
from mixprec._src.caller import warn_at_caller
from mixprec._src.torch_compat import autocast_object_enabled, disable_dynamo
from mixprec.errors import ConfigError, RegionStateError

F = TypeVar("F", bound=Callable[..., Any])


def _check_bool(name: str, value: object, allow_none: bool = False) -> None:
    if isinstance(value, bool) or (allow_none and value is None):
        return
    accepted = "True, False or None" if allow_none else "True or False"
    raise ConfigError(f"{name} must be {accepted}, got {value!r}")


_COMPILE_MSG = (
    "mixprec.autocast with a policy or a report (or nested in a region that has one) cannot be "
    "entered inside a torch.compile'd function; enter it around the compiled call instead: "
    "`with mixprec.autocast(policy=p): out = compiled_model(x)`"
)


_PRECONSTRUCTED_MSG = (
    "a mixprec.autocast object created outside a torch.compile'd function cannot be entered "
    "inside it (Dynamo cannot trace an explicit enter of native autocast); write "
    "`with mixprec.autocast(...):` inside the function, or enter the region around the call"
)


@disable_dynamo
def _refuse_while_compiling(message: str) -> None:
    # Dynamo runs this eagerly (a graph break), so the error reaches the user instead of being
    # absorbed by tracing.
    raise ConfigError(message)


class Entered:
    """What one ``__enter__`` of a full region did, so that ``__exit__`` can undo exactly that.

    Host sync: none.
    """

    __slots__ = ("frame", "hooks", "marked", "mode", "native", "recorder", "reporting")

    def __init__(self, native: torch.autocast) -> None:
        self.native = native
        self.frame: Frame | None = None
        self.hooks = False  # acquired the module hooks
        self.reporting = False  # counted in the thread's reporting regions
        self.marked: bool | None = None  # what mark_policy_region saved
        self.mode: OpRuleMode | None = None
        self.recorder: Any = None  # set when the region records a report


def _enter_policy(
    entered: Entered,
    device: str,
    dtype: torch.dtype,
    policy: Policy | None,
    report: DtypeReport | None,
    fp32_region: bool = False,
) -> None:
    """Push the region's frame and enter its hooks, op mode and recorder (after native entry).

    A region without a policy inherits the enclosing region's. In a float32 region
    (``fp32_region``) fp8-family rules run, with float32 around their matmuls. Host sync: none.
    """
    tls = TLS
    if policy is None and tls.frames:
        policy = tls.frames[-1].policy
    enabled = autocast_object_enabled(entered.native)
    frame = Frame(device, dtype, enabled, policy, fp8_on=enabled or fp32_region)
    frame.calls_len = len(tls.calls)
    tls.frames.append(frame)
    tls.current = None  # the first module of this frame records its root in it
    entered.frame, frame.entered = frame, entered
    try:
        if policy is not None:
            entered.marked = mark_policy_region()
        reporting = report is not None
        if (policy is not None and policy.has_module_rules) or reporting:
            acquire_global_hooks()
            entered.hooks = True
            tls.reporting += reporting
            entered.reporting = reporting
        if policy is not None and policy.op_rules and enabled:
            mode = OpRuleMode(policy._op_table, device, key=policy)
            mode.__enter__()
            entered.mode = mode
        if report is not None:
            recorder = report.record("forward")
            recorder.__enter__()
            entered.recorder = recorder
    except BaseException:
        _leave(entered)
        raise


def _leave(entered: Entered) -> None:
    """Undo what :func:`_enter_policy` did (all of it, or the part it did before it failed):
    the recorder, the op mode, the hooks, the mark and the frame. Host sync: none."""
    tls = TLS
    frame = entered.frame
    assert frame is not None
    try:
        if entered.recorder is not None:
            entered.recorder.__exit__(None, None, None)
        if entered.mode is not None:
            entered.mode.__exit__(None, None, None)
    finally:
        tls.reporting -= entered.reporting
        if entered.hooks:
            release_global_hooks()
        if entered.marked is not None:
            unmark_policy_region(entered.marked)
        del tls.frames[tls.frames.index(frame) :]
        del tls.calls[frame.calls_len :]
        tls.current = None
        if not tls.frames:
            forget_roots()
            restore_backward_autocast()


def _exit_policy(entered: Entered, own_policy: Policy | None, clean: bool) -> None:
    """Undo :func:`_enter_policy` (before native exit); the outermost exit also drops the
    region's references to the models it ran.

    Raises:
        ConfigError: ``clean`` (no exception left the region), the region's own policy is
            strict, and one of its name rules matched no module of the models that ran in it.

    Host sync: none.
    """
    frame = entered.frame
    assert frame is not None
    _leave(entered)
    policy = frame.policy
    strict = clean and policy is not None and policy is own_policy and policy.strict
    if strict and policy is not None and policy.name_rules and frame.roots:
        error = policy._unmatched_error(names_run(frame), "of the models that ran in the region")
        if error is not None:
            raise error
    if strict and policy is not None and frame.fp8_on and frame.roots:
        error = fp8.check_class_reach(policy, frame.ran, frame.served, frame.roots)
        if error is not None:
            raise error


def _close_inner(entered: Entered | None) -> bool:
    """Before a region exits: close the regions of this thread entered after it and still open,
    innermost first, as their own exits would (a region exited out of order: a generator
    suspended inside a region and closed inside another, explicit ``__exit__`` calls), so that
    everything is undone in the reverse order it was done in; their own exits later do nothing.
    ``entered`` None: a region without a frame (native autocast's switch, entered outside any
    full region), so every open frame is inner. False when ``entered`` itself was closed so
    already. Host sync: none.
    """
    frames = TLS.frames
    at = (
        -1
        if entered is None
        else next((i for i, f in enumerate(frames) if f is entered.frame), None)
    )
    if at is None:
        return False
    for inner in reversed(frames[at + 1 :]):
        try:
            _leave(inner.entered)
        finally:
            inner.entered.native.__exit__(None, None, None)
    return True


class autocast:
    """Context manager and decorator: a mixed-precision region on any device.

    Enters native ``torch.autocast`` (C++ casts, the weight cache, autograd and ``torch.compile``
    support). Without a policy and a report it behaves exactly like ``torch.autocast``. With a
    :class:`mixprec.Policy`, module rules apply to every module run inside the region and op rules
    to matching torch function calls; both keep working in checkpoint recomputation. Re-entrant,
    nestable and thread-local like the native region (new threads must enter their own region).

    Args:
        device_type: ``"cpu"``, ``"cuda"``, ``"cuda:0"``, a ``torch.device``, or ``None`` for the
            device the user trains on (the current accelerator when there is one, else the CPU).
        dtype: the low-precision dtype, ``torch.float16`` or ``torch.bfloat16``. ``None``: torch's
            default for the device (``torch.get_autocast_dtype``: bfloat16 on the CPU, float16
            on CUDA, or what an enclosing region set); float16 when ``device_type`` is ``None``
            too (the ``torch.cuda.amp.autocast()`` call form). ``torch.float32`` means "compute in
            float32": the region is off, without a warning. Other dtypes (float64, integers) raise
            :class:`ConfigError`, unless ``enabled=False``, which accepts any dtype as torch does.
        enabled: whether the region casts at all; when ``False`` no rule applies either. Native
            autocast may turn itself off (CUDA requested on a machine without it): the warning
            points at the line that built the region, and :attr:`enabled` says ``False``.
        cache_enabled: the native weight-cast cache. ``None``: off where a backward can follow
            (grad mode enabled at entry), so that checkpoint recomputation, selective
            checkpointing included, dispatches the same casts as its forward (with the cache, a
            weight cast in one checkpointed region and reused in another breaks selective
            checkpointing, pytorch#193338); otherwise (inference) the current setting, as torch,
            except that a nested region switching to a different low dtype turns it off (the
            native cache is not keyed by dtype). ``True`` gives torch's cache everywhere.
        policy: optional :class:`mixprec.Policy` or policy string. A nested region without a policy
            inherits the enclosing region's policy.
        report: record a :class:`DtypeReport` of the forward ops into :attr:`report` (slow: an
            observing dispatch mode; eager only).

    Example:
        >>> import torch
        >>> import mixprec
        >>> lin = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu"):
        ...     y = lin(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
        >>> with mixprec.autocast(torch.device("cpu"), torch.float16):
        ...     lin(torch.randn(2, 4)).dtype
        torch.float16
        >>> policy = mixprec.Policy("nn.Linear=fp32")
        >>> with mixprec.autocast("cpu", torch.bfloat16, policy=policy):
        ...     lin(torch.randn(2, 4)).dtype
        torch.float32

    Raises:
        UnsupportedDeviceError: a device type without autocast support (a ``ConfigError`` and
            a ``RuntimeError``); the message lists the accepted ones.
        ConfigError: a dtype autocast cannot lower to, a non-bool flag, a bad policy; at exit,
            with a strict policy, a module name rule that matched no module run in the region.
        RegionStateError: ``__exit__`` without a matching ``__enter__``.

    Host sync: none.
    """

    def __new__(
        cls,
        device_type: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
        report: bool = False,
    ) -> Any:
        # While Dynamo traces, a plain region *is* torch.autocast, which Dynamo models natively
        # (one graph, correct state across graph breaks inside the region).
        if torch.compiler.is_compiling():
            if policy is not None or report or TLS.frames:
                obj = object.__new__(cls)
                obj.__dict__["_traced"] = True  # _enter_full (run eagerly by Dynamo) refuses
                return obj
            device = resolve_device_type(device_type)
            if dtype is None and device_type is not None:  # torch's own default, traced natively
                return torch.autocast(device, enabled=enabled, cache_enabled=cache_enabled)
            fast, on = resolve_region_dtype(device, device_type is not None, dtype, enabled)
            return torch.autocast(device, dtype=fast, enabled=on, cache_enabled=cache_enabled)
        return object.__new__(cls)

    def __init__(
        self,
        device_type: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        *,
        policy: Policy | str | None = None,
        report: bool = False,
    ) -> None:
        _check_bool("enabled", enabled)
        _check_bool("cache_enabled", cache_enabled, allow_none=True)
        _check_bool("report", report)
        self.device = resolve_device_type(device_type)
        self.fast_dtype, on = resolve_region_dtype(
            self.device, device_type is not None, dtype, enabled
        )
        if on:  # as torch.autocast: it may turn itself off here (and say so, at this line)
            on, notes = native_decision(self.device, self.fast_dtype)
            for message, category in notes:
                warn_at_caller(message, category)
        self.enabled = on
        # dtype=torch.float32: native autocast is off, fp8-family rules run (docs/autocast.md)
        self._fp32_region = enabled and self.fast_dtype == torch.float32
        self.cache_enabled = cache_enabled
        self.policy = coerce_policy(policy)
        self.report: DtypeReport | None = DtypeReport() if report else None
        # One entry per active ``__enter__`` (re-entrant); like torch.autocast, one instance must
        # not be entered from two threads at once (the decorator form makes a fresh one per call).
        self._stack: list[Any] = []

    def _native(self) -> torch.autocast:
        if torch.compiler.is_compiling():
            _refuse_while_compiling(_PRECONSTRUCTED_MSG)
        cache = cache_for(self.cache_enabled, self.device, self.fast_dtype)
        return torch.autocast(
            self.device, dtype=self.fast_dtype, enabled=self.enabled, cache_enabled=cache
        )

    def __enter__(self) -> autocast:
        if self.policy is None and self.report is None and not TLS.frames:
            # The thin path: native autocast's state switch and nothing else.
            if torch.compiler.is_compiling():
                _refuse_while_compiling(_PRECONSTRUCTED_MSG)
            saved = push_state(self.device, self.enabled, self.fast_dtype, self.cache_enabled)
            if saved is None:
                native = self._native()
                native.__enter__()
                self._stack.append(native)
            else:
                self._stack.append(saved)
            return self
        if torch.compiler.is_compiling():
            _enter_full_eagerly(self)
        else:
            self._enter_full()
        return self

    def _enter_full(self) -> None:
        # Never traced: inside a compiled function Dynamo runs this frame eagerly (the policy
        # machinery installs hooks and modes); around a compiled call, rules trace into the graph.
        if self.__dict__.get("_traced"):
            raise ConfigError(_COMPILE_MSG)
        native = self._native()
        native.__enter__()
        entered = Entered(native)
        self._stack.append(entered)
        try:
            _enter_policy(
                entered,
                self.device,
                self.fast_dtype,
                self.policy,
                self.report,
                self.__dict__.get("_fp32_region", False),
            )
        except BaseException:
            self._stack.pop()
            native.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._stack:
            raise RegionStateError(
                f"{self!r} was exited without being entered (or more often than entered); "
                "use it as `with mixprec.autocast(...):` or pair each __enter__ with one __exit__"
            )
        if has_pending():  # custom_fwd outputs: bound to their grad_fn now, not kept
            bind_pending()
        top = self._stack[-1]
        if not isinstance(top, Entered) and TLS.frames:
            _close_inner(None)  # full regions entered inside this thin one: closed first
        if type(top) is tuple:
            pop_state(self.device, self._stack.pop())
            return
        if not isinstance(top, Entered):
            self._stack.pop().__exit__(exc_type, exc, tb)
            return
        if torch.compiler.is_compiling():
            _exit_full_eagerly(self, exc_type, exc, tb)
        else:
            self._exit_full(exc_type, exc, tb)

    def _exit_full(self, exc_type: Any, exc: Any, tb: Any) -> None:
        entered = self._stack.pop()
        if not _close_inner(entered):
            return  # closed already, by a region entered before it and exited first
        try:
            _exit_policy(entered, self.policy, exc_type is None)
        finally:
            entered.native.__exit__(exc_type, exc, tb)

    def __call__(self, func: F) -> F:
        """Use the region as a decorator: each call enters a fresh region with these settings.

        Example:
            >>> import torch
            >>> import mixprec
            >>> @mixprec.autocast("cpu", torch.bfloat16)
            ... def f(a, b):
            ...     return a @ b
            >>> f(torch.ones(2, 2), torch.ones(2, 2)).dtype
            torch.bfloat16

        Raises:
            TypeError: ``func`` is not callable (``autocast(...)(tensor)``), as with torch.

        Host sync: none.
        """
        if not callable(func):
            raise TypeError(
                f"mixprec.autocast(...)(func) needs a callable, got {type(func).__name__}. "
                "To run code in the region, use it as a context manager: "
                "`with mixprec.autocast(...): output = model(input)`"
            )

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self._clone():
                return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    def _clone(self) -> Any:
        thin = self.policy is None and self.report is None and not TLS.frames
        if thin and torch.compiler.is_compiling():
            return torch.autocast(
                self.device,
                dtype=self.fast_dtype,
                enabled=self.enabled,
                cache_enabled=self.cache_enabled,
            )
        new = object.__new__(autocast)
        new.__dict__.update(self.__dict__)
        new._stack = []
        return new

    def __repr__(self) -> str:
        extra = f", policy={self.policy!r}" if self.policy is not None else ""
        return (
            f"mixprec.autocast({self.device!r}, {self.fast_dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}{extra})"
        )


# Dynamo must not trace the policy machinery (hooks, modes): while compiling, enter and exit run
# eagerly through these (only then: a disabled frame is dearer than a plain call). torch's own
# lazy form of torch.compiler.disable is used: the eager one would import torch._dynamo (and
# sympy) at `import mixprec`, for users who never compile.
_enter_full_eagerly = disable_dynamo(autocast._enter_full)
_exit_full_eagerly = disable_dynamo(autocast._exit_full)
