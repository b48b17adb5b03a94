"""Native autocast, the base of every region: which device and dtype, whether it turns itself on,
the thread-local state it switches, and the ops it casts.

**Device and dtype.** ``device_type=None`` is the device the user trains on: the current
accelerator reported by :mod:`torch.accelerator` (CUDA when available, also XPU, MPS, ...) when
autocast is available for it, and the CPU otherwise. The device types named in messages come from
the shared capability table (:func:`mixprec._src.devices.autocast_device_types`). The dtype follows
``torch.autocast``: with a device type and no dtype, the device's current autocast dtype
(``torch.get_autocast_dtype``: bfloat16 for the CPU, float16 for CUDA, or what an enclosing region
set); with no device either (the ``torch.cuda.amp.autocast()`` call form), float16.
``dtype=torch.float32`` turns the region off (the computation stays in float32); with
``enabled=False`` any dtype is accepted, as torch does.

**The state switch.** A region without a policy or a report does exactly what
``torch.autocast.__enter__`` and ``__exit__`` do to the thread-local autocast state (torch 2.13,
``torch/amp/autocast_mode.py``), in the same order, without building a ``torch.autocast`` object
per region (its constructor re-validates what the region validated already). Where torch's object
does more (a ``TorchFunctionMode`` is active, e.g. ``torch.export``'s pre-dispatch trace, which
records regions into the graph), the region builds one instead (:func:`push_state` says so). The
weight-cast cache decision (:func:`cache_for`) and the enable decision (:func:`native_decision`)
live here too.

**Op lists.** Which ops have a native ``Autocast<Device>`` kernel is read from the dispatcher at
run time. The *policy* of each kernel (lower precision, fp32, promote, ...) is not exposed by
torch, so mixprec keeps a table (``KNOWN_POLICIES``, for the installed release: the ops every
declared release registers and those only some do) and checks it against the dispatcher:
:func:`check_native_table` reports drift and the test suite fails loudly on it. Ops
the dispatcher registers but the table does not know are reported as ``"unknown"``, never guessed.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from mixprec._src import torch_compat
from mixprec._src.devices import autocast_device_types, caps
from mixprec._src.torch_compat import (
    autocast_object_enabled,
    backward_pass_autocast,
    mark_constant,
    set_backward_pass_autocast,
    skip_frames_of,
    torch_function_mode_active,
)
from mixprec.errors import ConfigError, UnsupportedDeviceError

# ---------------------------------------------------------------- device and dtype
#: The dtypes an autocast region can lower to.
LOW_PRECISION_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


#: Device-type strings already validated (the fast path of a region built every step).
VALIDATED_DEVICE_TYPES: set[object] = set()


_F = TypeVar("_F", bound=Callable[..., Any])


def default_device_type() -> str:
    """Return the device type a region uses when ``device_type`` is ``None``.

    The current accelerator (``torch.accelerator.current_accelerator()``: CUDA when available) when
    autocast is available for it, else ``"cpu"``.

    Example:
        >>> from mixprec._src.autocast import native as d
        >>> d.default_device_type() in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
        True

    Host sync: none.
    """
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.is_available():
        dev = accel.current_accelerator()
        if dev is not None and _autocast_available(dev.type):
            return dev.type
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _autocast_available(device_type: str) -> bool:
    try:
        return bool(torch.amp.is_autocast_available(device_type))
    except RuntimeError:
        return False


def _accepted_device_types() -> list[str]:
    return [d for d in autocast_device_types() if _autocast_available(d)]


def resolve_device_type(device_type: str | torch.device | None) -> str:
    """Turn a user's ``device_type`` into the device type native autocast expects.

    Accepts ``None`` (see :func:`default_device_type`), a device type (``"cuda"``), a device string
    with an index (``"cuda:0"``) or a :class:`torch.device`.

    Example:
        >>> import torch
        >>> from mixprec._src.autocast.native import resolve_device_type
        >>> resolve_device_type(torch.device("cpu"))
        'cpu'

    Raises:
        UnsupportedDeviceError: the device type is unknown or has no autocast support (also a
            ``RuntimeError``, as torch raises, and a ``ConfigError``); the message lists the
            accepted device types.
        ConfigError: ``device_type`` is not a string, a device or None.

    Host sync: none.
    """
    if device_type is None:
        return default_device_type()
    if isinstance(device_type, str) and device_type in VALIDATED_DEVICE_TYPES:
        return device_type  # validated before
    if isinstance(device_type, torch.device):
        name = device_type.type
    elif isinstance(device_type, str):
        name = device_type.split(":", 1)[0].strip()
    else:
        raise ConfigError(
            f"device_type must be a str, a torch.device or None, got {type(device_type).__name__} "
            f"{device_type!r}; accepted device types: {', '.join(_accepted_device_types())}"
        )
    if not _autocast_available(name):
        raise UnsupportedDeviceError(
            f"device_type {device_type!r} has no autocast support in this torch build; "
            f"accepted device types: {', '.join(_accepted_device_types())}"
        )
    if name == device_type:
        VALIDATED_DEVICE_TYPES.add(name)
    return name


def resolve_region_dtype(
    device: str, device_given: bool, dtype: object, enabled: bool
) -> tuple[torch.dtype, bool]:
    """The region's dtype and whether it casts at all, as ``torch.autocast`` decides them.

    Example:
        >>> import torch
        >>> resolve_region_dtype("cpu", True, None, True)
        (torch.bfloat16, True)
        >>> resolve_region_dtype("cpu", False, None, True)  # torch.cuda.amp.autocast() form
        (torch.float16, True)
        >>> resolve_region_dtype("cpu", True, torch.float32, True)  # float32: the region is off
        (torch.float32, False)

    Raises:
        ConfigError: ``dtype`` is not a torch dtype, or (when enabled) a dtype autocast cannot
            lower to other than float32 (float64, integers); the message lists the accepted ones.

    Host sync: none.
    """
    if dtype is None:
        return (torch.get_autocast_dtype(device) if device_given else torch.float16), enabled
    if dtype is torch.float16 or dtype is torch.bfloat16:
        return dtype, enabled
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"dtype must be a torch.dtype, got {type(dtype).__name__} {dtype!r}; "
            "accepted: torch.float16, torch.bfloat16 (torch.float32: autocast off)"
        )
    if dtype == torch.float32 or not enabled:
        return dtype, False
    raise ConfigError(
        f"dtype={dtype} is not a floating dtype autocast can lower to; accepted: torch.float16, "
        "torch.bfloat16, or torch.float32 (autocast off); with enabled=False any dtype is accepted"
    )


# ---------------------------------------------------------------- the state switch
Saved = tuple[bool, torch.dtype, bool]


def cache_for(requested: bool | None, device: str, dtype: torch.dtype) -> bool:
    """The weight-cast cache setting a region enters with.

    ``None``: off where a backward can follow (grad mode on), so that checkpoint recomputation
    dispatches the same casts as its forward; off in a nested region that switches to another low
    dtype (the native cache is keyed by the source tensor only); else the current setting, as
    torch.

    Example:
        >>> import torch
        >>> cache_for(None, "cpu", torch.bfloat16), cache_for(True, "cpu", torch.bfloat16)
        (False, True)

    Host sync: none.
    """
    if requested is not None:
        return requested
    if torch.is_grad_enabled():
        return False
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) != dtype:
        return False
    return torch.is_autocast_cache_enabled()


def push_state(
    device: str, enabled: bool, dtype: torch.dtype, requested: bool | None
) -> Saved | None:
    """Switch the native state as ``torch.autocast.__enter__`` does and return what to restore;
    None, touching nothing, where a ``torch.autocast`` object must do it (a function mode is
    active, e.g. ``torch.export``'s pre-dispatch trace, which records regions into the graph).

    Example:
        >>> import torch
        >>> saved = push_state("cpu", True, torch.bfloat16, None)
        >>> torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()
        (True, False)
        >>> pop_state("cpu", saved)
        >>> torch.is_autocast_enabled("cpu"), torch.is_autocast_cache_enabled()
        (False, True)

    Host sync: none.
    """
    if torch_function_mode_active():
        return None
    cache = cache_for(requested, device, dtype)
    saved = (
        torch.is_autocast_enabled(device),
        torch.get_autocast_dtype(device),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(device, enabled)
    torch.set_autocast_dtype(device, dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache)
    return saved


def pop_state(device: str, saved: Saved) -> None:
    """Restore as ``torch.autocast.__exit__`` does (the outermost exit clears the weight cache).

    Example:
        >>> import torch
        >>> pop_state("cpu", push_state("cpu", True, torch.float16, True))
        >>> torch.is_autocast_enabled("cpu")
        False

    Host sync: none.
    """
    if torch.autocast_decrement_nesting() == 0:
        torch.clear_autocast_cache()
    torch.set_autocast_enabled(device, saved[0])
    torch.set_autocast_dtype(device, saved[1])
    torch.set_autocast_cache_enabled(saved[2])


NATIVE: dict[tuple[str, torch.dtype], tuple[bool, tuple[tuple[str, type[Warning]], ...]]] = {}


def native_decision(device: str, dtype: torch.dtype) -> tuple[bool, tuple[Any, ...]]:
    """Whether ``torch.autocast(device, dtype)`` enables itself here, and the warnings it gives
    (e.g. CUDA requested on a machine without CUDA). Asked once per (device, dtype); torch's
    errors (CUDA bfloat16 on a GPU without it) propagate, at construction, as with torch.

    Example:
        >>> import torch
        >>> native_decision("cpu", torch.bfloat16)
        (True, ())

    Host sync: none.
    """
    found = NATIVE.get((device, dtype))
    if found is None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            native = torch.autocast(device, dtype=dtype, enabled=True)
        notes = tuple((str(w.message), w.category) for w in caught)
        found = NATIVE[(device, dtype)] = (autocast_object_enabled(native), notes)
    return found


# ---------------------------------------------------------------- compiled graphs
# Dynamo does not guard on an empty module hook dict (skip_nnmodule_hook_guards in its config),
# and mixprec's hooks are in torch only while a policy region runs: a graph compiled outside
# policy regions, so without mixprec's hooks, would be reused inside one, rules ignored (and a
# graph traced with the hooks outside). Dynamo does guard on whether autocast is enabled, for
# every device type, so a region with a policy marks itself there, entered and left with the
# region, on a device type no machine runs anymore (Graphcore's IPU: enabling its autocast
# changes nothing for tensors of other devices): graphs traced outside policy regions and inside
# them never mix. Why a borrowed flag and not a supported guard (#32): the guards Dynamo offers
# on state it does not read are its global-state guards (grad mode, autocast, default dtype, the
# torch-function mode stack); a mode pushed for the whole region would make every torch call of
# the region a Python call. Which rules a graph was traced for is guarded where rules are looked
# up (autocast/traced.py).
_MARK_DEVICE = "ipu"


def mark_policy_region() -> bool:
    """Mark the thread's autocast state as inside a policy region; return what to restore.

    Example:
        >>> saved = mark_policy_region(); torch.is_autocast_enabled("ipu")
        True
        >>> unmark_policy_region(saved); torch.is_autocast_enabled("ipu")
        False

    Host sync: none.
    """
    saved = torch.is_autocast_enabled(_MARK_DEVICE)
    torch.set_autocast_enabled(_MARK_DEVICE, True)
    return saved


def unmark_policy_region(saved: bool) -> None:
    """Undo :func:`mark_policy_region`. Host sync: none."""
    torch.set_autocast_enabled(_MARK_DEVICE, saved)


# ---------------------------------------------------------------- compiled backward
# AOTAutograd traces a compiled graph's backward under the autocast state of its forward
# (torch._functorch.config.backward_pass_autocast = "same_as_forward"), as if backward ran inside
# the region. Rules that turn autocast off in a subtree (fp32, keep, op rules) then get a backward
# that casts their fp32 gradients to the low dtype, which eager code, whose backward runs after the
# region, never does. While Dynamo traces a policy region the setting is "off" (eager's meaning),
# restored when the last thread that turned it off leaves its outermost region (the setting is
# process-wide, so who turned it off is per thread and the value to restore is shared).
class _TurnedOff(threading.local):
    def __init__(self) -> None:
        self.value = False  # this thread turned the setting off and has not restored it


_TURNED_OFF = _TurnedOff()
_BACKWARD_LOCK = threading.Lock()
_BACKWARD_SAVED: list[Any] = []  # [the setting before the first thread turned it off, threads]


def backward_autocast_off_while_tracing() -> None:
    """Run by Dynamo at trace time (marked below): compiled backwards of this region's graphs are
    traced without autocast, as eager backward runs after the region.

    Example:
        >>> backward_autocast_off_while_tracing(); restore_backward_autocast()

    Host sync: none.
    """
    if _TURNED_OFF.value:
        return
    with _BACKWARD_LOCK:
        if not _BACKWARD_SAVED:
            _BACKWARD_SAVED[:] = [backward_pass_autocast(), 0]
            set_backward_pass_autocast("off")
        _BACKWARD_SAVED[1] += 1
    _TURNED_OFF.value = True


mark_constant(backward_autocast_off_while_tracing)


def restore_backward_autocast() -> None:
    """Undo this thread's :func:`backward_autocast_off_while_tracing` (at its outermost region
    exit); the last thread to undo it restores the setting.

    Example:
        >>> restore_backward_autocast()

    Host sync: none.
    """
    if not _TURNED_OFF.value:
        return
    _TURNED_OFF.value = False
    with _BACKWARD_LOCK:
        _BACKWARD_SAVED[1] -= 1
        if _BACKWARD_SAVED[1] == 0:
            set_backward_pass_autocast(_BACKWARD_SAVED[0])
            _BACKWARD_SAVED.clear()


def never_compiled_alone(fn: _F) -> _F:
    """Mark a hook torch calls (a module hook, a mode's ``__torch_function__``): Dynamo never
    compiles a frame of it, nor of what it calls, on its own; it still inlines it into the code it
    traces (a compiled model's forward), where it takes its ``is_compiling()`` branch.

    Dynamo compiles each Python frame that runs while a compiled call is active and is not torch's
    own code: a hook called by a module's ``_call_impl`` that Dynamo skipped (``model.compile()``
    on a torch.nn container, the parts around a graph break) would otherwise be compiled by itself,
    take the traced branch outside of any graph, and keep one cache entry per module type it saw,
    until the recompile limit makes every later call reuse a stale one. Costs nothing outside a
    compiled call (it is a flag on the code object). Returns ``fn``.

    Example:
        >>> never_compiled_alone(len) is len
        True

    Host sync: none.
    """
    code = getattr(fn, "__code__", None)
    if code is not None:  # older torch (no per-code strategy): unmarked
        skip_frames_of(code)
    return fn


# ---------------------------------------------------------------- op lists
_CUDA_LOW = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d
conv_transpose2d.input conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv
linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell
_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention cudnn_convolution
cudnn_convolution_transpose"""
_CUDA_FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan
pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm
group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss
cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss
huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm
logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"""
_CUDA_SET_OPT = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm
linalg_matrix_norm linalg_matrix_norm.str_ord sum sum.dim_IntList"""
_CUDA_APPEND = "norm.Scalar norm.ScalarOpt_dim"
_CUDA_PROMOTE = """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot
scatter_add"""
_CPU_LOW = """conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated matmul conv_tbc
mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input prelu
scaled_dot_product_attention _native_multi_head_attention"""
_CPU_FP32 = """avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int quantile
quantile.scalar nanquantile nanquantile.scalar stft stft.center cdist grid_sampler_2d
_grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky_inverse
cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d max_unpool2d max_unpool3d
adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d
replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss
soft_margin_loss triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2 fft_ifft2
fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft
linalg_cond linalg_cond.p_str linalg_matrix_rank linalg_matrix_rank.tol_tensor
linalg_matrix_rank.atol_rtol_tensor linalg_matrix_rank.atol_rtol_float linalg_solve
linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product
linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info svd
triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh
linalg_lstsq linalg_inv_ex"""
_CPU_PROMOTE = "stack cat index_copy"


Release = tuple[int, int]

#: Ops that only some of the declared torch releases register natively: ``(device type, op,
#: policy, since, until)``, ``since`` the first release with it and ``until`` the first without it
#: (None: every declared release on that side). Each overload has its op's policy (torch's
#: ``autocast_mode.cpp`` lists them side by side); ``linalg_matrix_sqrth`` refuses fp16 and bf16
#: inputs, so fp32 is its only possible policy (the one CPU autocast shows).
_SOME_RELEASES: tuple[tuple[str, str, str, Release | None, Release | None], ...] = (
    ("cpu", "cholesky", "fp32", None, (2, 14)),
    ("cpu", "qr", "fp32", None, (2, 14)),
    ("cpu", "linalg_matrix_sqrth", "fp32", (2, 14), None),
    ("cuda", "linalg_matrix_sqrth", "fp32", (2, 14), None),
    # named-tensor overloads, no longer registered from torch 2.13 on
    ("cpu", "index_copy.dimname", "promote", None, (2, 13)),
    ("cpu", "prod.dim_Dimname", "fp32", None, (2, 13)),
    ("cuda", "prod.dim_Dimname", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "cumprod.dimname", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "cumsum.dimname", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "softmax.Dimname", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "log_softmax.Dimname", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "sum.dim_DimnameList", "fp32_set_opt_dtype", None, (2, 13)),
    ("cuda", "norm.names_ScalarOpt_dim", "fp32_append_dtype", None, (2, 13)),
)


def _table(groups: dict[str, str]) -> dict[str, str]:
    return {f"aten::{op}": policy for policy, ops in groups.items() for op in ops.split()}


def policies_for(release: Release, cudnn: bool) -> dict[str, dict[str, str]]:
    """Native autocast's policy per op, by device type, for a torch ``release`` (``(2, 14)``)
    built with or without cuDNN (a cuDNN build registers its RNN kernel, ``aten::_cudnn_rnn``,
    which casts to the lower precision).

    Example:
        >>> policies_for((2, 14), cudnn=False)["cpu"]["aten::linalg_matrix_sqrth"]
        'fp32'

    Host sync: none.
    """
    tables = {
        "cuda": _table(
            {
                "lower_precision_fp": _CUDA_LOW,
                "fp32": _CUDA_FP32,
                "fp32_set_opt_dtype": _CUDA_SET_OPT,
                "fp32_append_dtype": _CUDA_APPEND,
                "promote": _CUDA_PROMOTE,
                "banned": "binary_cross_entropy",
            }
        ),
        "cpu": _table({"lower_precision_fp": _CPU_LOW, "fp32": _CPU_FP32, "promote": _CPU_PROMOTE}),
    }
    for device_type, op, policy, since, until in _SOME_RELEASES:
        if (since is None or release >= since) and (until is None or release < until):
            tables[device_type][f"aten::{op}"] = policy
    if cudnn:
        tables["cuda"]["aten::_cudnn_rnn"] = "lower_precision_fp"
    return tables


#: Native autocast policy per op for the installed torch, by device type (checked against the
#: dispatcher by :func:`check_native_table`, on every declared release in CI).
KNOWN_POLICIES: dict[str, dict[str, str]] = policies_for(
    torch_compat.TORCH_RELEASE, torch.backends.cudnn.is_available()
)


@functools.cache
def registered_autocast_ops(device_type: str) -> frozenset[str]:
    """Names (``aten::op[.overload]``) with a native autocast kernel for ``device_type``.

    Read from the installed torch's dispatcher (``torch._C._dispatch_dump``).

    Example:
        >>> "aten::mm" in registered_autocast_ops("cpu")
        True

    Host sync: none.
    """
    key = caps(device_type).autocast_key
    if key is None:
        return frozenset()
    marker = f"\n{key}: registered at"
    found = set()
    for name in torch_compat.dispatch_op_names():
        if marker in "\n" + torch_compat.dispatch_dump(name):
            found.add(name)
    return frozenset(found)


def check_native_table(device_type: str) -> tuple[list[str], list[str]]:
    """Compare :data:`KNOWN_POLICIES` with the dispatcher.

    Returns:
        ``(missing, extra)``: ops the table lists that torch no longer registers, and ops torch
        registers that the table does not know.

    Example:
        >>> check_native_table("cpu")  # empty on every torch the package declares
        ([], [])

    Host sync: none.
    """
    table = KNOWN_POLICIES.get(device_type, {})
    registered = registered_autocast_ops(device_type)
    return sorted(set(table) - registered), sorted(registered - set(table))


def native_op_table(device_type: str) -> dict[str, str]:
    """Op -> native policy for the ops the installed torch registers for ``device_type``.

    Ops missing from mixprec's table map to ``"unknown"``; ops the table lists but torch does not
    register are left out.

    Example:
        >>> native_op_table("cpu")["aten::mm"]
        'lower_precision_fp'

    Host sync: none.
    """
    table = KNOWN_POLICIES.get(device_type, {})
    return {op: table.get(op, "unknown") for op in sorted(registered_autocast_ops(device_type))}
