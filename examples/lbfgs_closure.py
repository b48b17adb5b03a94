"""LBFGS under fp16 autocast with mixprec's GradScaler: the closure is unscaled at every evaluation.

torch.amp.GradScaler refuses closures; mixprec unscales and checks each evaluation's gradients,
hands LBFGS the unscaled loss, and skips (restoring parameters and LBFGS's history) when an
evaluation overflows. The fp16 run converges like the fp32 one.

Run: python examples/lbfgs_closure.py
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

import mixprec


def fit(fp16: bool, data: tuple[torch.Tensor, torch.Tensor], steps: int = 5) -> float:
    """Least squares with LBFGS; returns the final fp32 loss."""
    a, b = data
    torch.manual_seed(1)
    model = torch.nn.Linear(a.shape[1], 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=10, line_search_fn="strong_wolfe")
    scaler = mixprec.GradScaler(enabled=fp16)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = F.mse_loss(model(a).float(), b)
        scaler.scale(loss).backward()
        return loss

    for step in range(steps):
        loss = scaler.step(opt, closure)  # None when an evaluation overflowed (step skipped)
        scaler.update()
        shown = "skipped" if loss is None else f"{loss.item():.3e}"
        print(f"  {'fp16' if fp16 else 'fp32'} step {step}: loss {shown}")
    with torch.no_grad():
        return F.mse_loss(model(a), b).item()


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(128, 16)
    b = a @ torch.randn(16, 1) + 0.01 * torch.randn(128, 1)
    fp32 = fit(False, (a, b))
    fp16 = fit(True, (a, b))
    print(f"final loss: fp32 {fp32:.3e}, fp16 autocast + GradScaler {fp16:.3e}")


if __name__ == "__main__":
    main()
