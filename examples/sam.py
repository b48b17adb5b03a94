"""SAM (sharpness-aware minimisation, two gradient passes per step) with fp16 loss scaling.

The first pass is unscaled with ``scaler.unscale_``, the second runs in the closure given to
``scaler.step``: both passes are checked, one overflow in either skips the whole step (the
perturbation is undone), and ``update()`` runs once per iteration. An overflow is injected into
the second pass of iteration 3 to show it.

Run: python examples/sam.py
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

import mixprec


class SAM(torch.optim.Optimizer):
    """SAM as in davda54/sam: ``step(closure)`` perturbs with the gradients already present,
    evaluates the closure at the perturbed point, restores and steps the base optimizer."""

    def __init__(
        self, params: Any, base: type[torch.optim.Optimizer], rho: float = 0.05, **kw: Any
    ) -> None:
        super().__init__(params, dict(rho=rho, **kw))
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        assert closure is not None, "SAM needs a closure for its second pass"
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["e_w"] = e_w = p.grad * (group["rho"] / (norm + 1e-12))
                    p.add_(e_w)
        self.zero_grad()
        with torch.enable_grad():
            closure()
        for group in self.param_groups:
            for p in group["params"]:
                if "e_w" in self.state[p]:
                    p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


def main(iterations: int = 20, inject_at: int = 3) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = torch.sin(x[:, :1]) + 0.1 * x[:, 1:2]
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.1, momentum=0.9)
    scaler = mixprec.GradScaler()

    def loss_fn() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return F.mse_loss(model(x).float(), y)

    for it in range(iterations):
        loss = loss_fn()
        scaler.scale(loss).backward()  # first pass
        scaler.unscale_(opt)

        def closure(it: int = it) -> torch.Tensor:
            second = loss_fn()
            if it == inject_at:
                second = second * float("inf")  # simulate an fp16 overflow in the second pass
            scaler.scale(second).backward()
            return second

        scaler.step(opt, closure)
        skipped = scaler.last_step_skipped()
        scaler.update()
        opt.zero_grad()
        if skipped or it % 5 == 0 or it == iterations - 1:
            note = "  <- skipped, parameters restored" if skipped else ""
            print(f"iter {it:2d}: loss {loss.item():.4f}, scale {scaler.get_scale():g}{note}")
    print(scaler.stats())


if __name__ == "__main__":
    main()
