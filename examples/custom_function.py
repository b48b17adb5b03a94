"""A custom ``torch.autograd.Function`` inside autocast: ``mixprec.custom_fwd``/``custom_bwd``.

Autocast does not see inside a custom Function. Decorate ``forward`` with ``custom_fwd`` and
``backward`` with ``custom_bwd``:

* ``custom_fwd(cast_inputs=torch.float32)`` runs ``forward`` in float32 (inputs cast, autocast
  off inside), for an op that float16 cannot handle;
* ``custom_fwd`` alone runs ``forward`` under the caller's autocast state;
* ``custom_bwd`` runs ``backward`` under the same autocast state as ``forward``.

(The same as ``torch.amp.custom_fwd/custom_bwd``; ``device_type`` is optional here.)

    python examples/custom_function.py
"""

from __future__ import annotations

import torch

import mixprec

device = "cuda" if torch.cuda.is_available() else "cpu"


class LogSumExpSquared(torch.autograd.Function):
    """log(sum(exp(x**2))): overflows in float16, so it always runs in float32."""

    @staticmethod
    @mixprec.custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, x):
        assert x.dtype == torch.float32  # cast by custom_fwd
        ctx.save_for_backward(x)
        return torch.logsumexp(x * x, dim=-1)

    @staticmethod
    @mixprec.custom_bwd
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        weights = torch.softmax(x * x, dim=-1)
        return grad.unsqueeze(-1) * weights * 2 * x


class ScaledMatmul(torch.autograd.Function):
    """a @ b * 0.5, run in the autocast dtype (float16 here) like a native matmul."""

    @staticmethod
    @mixprec.custom_fwd
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.mm(a, b) * 0.5  # autocast is on: torch.mm runs in float16

    @staticmethod
    @mixprec.custom_bwd
    def backward(ctx, grad):
        a, b = ctx.saved_tensors  # the same autocast state as forward
        return torch.mm(grad, b.t()) * 0.5, torch.mm(a.t(), grad) * 0.5


torch.manual_seed(0)
weight = torch.randn(16, 8, device=device, requires_grad=True)
optimizer = torch.optim.SGD([weight], lr=1e-3)
scaler = mixprec.GradScaler()
x = torch.randn(32, 16, device=device)

for _ in range(5):
    optimizer.zero_grad()
    with mixprec.autocast(device, dtype=torch.float16):
        hidden = ScaledMatmul.apply(x, weight)
        assert hidden.dtype == torch.float16
        out = LogSumExpSquared.apply(hidden)  # would be inf in float16 (exp(x**2) > 65504)
        assert out.dtype == torch.float32
        loss = out.mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

skipped = scaler.stats().steps_skipped
print(f"loss {loss.item():.3f} (finite), {skipped} step(s) skipped while the scale calibrated")
assert torch.isfinite(loss)
