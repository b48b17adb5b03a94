"""Native autocast op lists: registrations read from the installed torch's dispatcher.

Which ops have a native ``Autocast<Device>`` kernel is read from the dispatcher at run time. The
*policy* of each kernel (lower precision, fp32, promote, ...) is not exposed by torch, so mixprec
keeps a table for torch 2.13 (``KNOWN_POLICIES``) and checks it against the dispatcher:
:func:`check_native_table` reports drift and the test suite fails loudly on it. Ops the dispatcher
registers but the table does not know are reported as ``"unknown"``, never guessed.
"""

from __future__ import annotations

import functools

import torch

from mixprec._src.devices import caps

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
_grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex cholesky cholesky_inverse
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
linalg_tensorinv linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd
triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig linalg_eigh
linalg_lstsq linalg_inv_ex"""
_CPU_PROMOTE = "stack cat index_copy"


def _table(groups: dict[str, str]) -> dict[str, str]:
    return {f"aten::{op}": policy for policy, ops in groups.items() for op in ops.split()}


#: Native autocast policy per op for torch 2.13, by device type (checked against the dispatcher).
KNOWN_POLICIES: dict[str, dict[str, str]] = {
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
    for name in torch._C._dispatch_get_all_op_names():
        if marker in "\n" + torch._C._dispatch_dump(name):
            found.add(name)
    return frozenset(found)


def check_native_table(device_type: str) -> tuple[list[str], list[str]]:
    """Compare :data:`KNOWN_POLICIES` with the dispatcher.

    Returns:
        ``(missing, extra)``: ops the table lists that torch no longer registers, and ops torch
        registers that the table does not know.

    Example:
        >>> check_native_table("cpu")  # empty on torch 2.13
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
