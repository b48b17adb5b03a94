"""Training fp16 parameters: torch's GradScaler refuses, mixprec.MasterWeights makes it work.

A PEFT-like model: a frozen fp16 base, an fp32 low-rank adapter and one trainable fp16 head.
``torch.amp.GradScaler`` raises "Attempting to unscale FP16 gradients"; mixprec's scaler raises
the same error naming the parameters and the fix; with ``mixprec.MasterWeights(optimizer)`` the
fp16 head trains through fp32 master copies, and a checkpoint round-trips.

Run: python examples/fp16_params.py
"""

from __future__ import annotations

import io

import torch
from torch.nn import functional as F

import mixprec


class PeftLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = torch.nn.Linear(16, 32).half().requires_grad_(False)
        self.lora_a = torch.nn.Linear(16, 4, bias=False)
        self.lora_b = torch.nn.Linear(4, 32, bias=False)
        self.head = torch.nn.Linear(32, 1).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.base(x) + self.lora_b(self.lora_a(x))))


def make() -> tuple[PeftLike, torch.optim.Optimizer]:
    model = PeftLike()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model, torch.optim.AdamW(trainable, lr=1e-2)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return F.mse_loss(model(x).float(), y)


def main(steps: int = 40) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    y = x[:, :3].sum(1, keepdim=True)

    for name, scaler in [
        ("torch.amp.GradScaler", torch.amp.GradScaler("cpu")),
        ("mixprec.GradScaler", mixprec.GradScaler()),
    ]:
        model, opt = make()
        scaler.scale(loss_of(model, x, y)).backward()
        try:
            scaler.step(opt)
        except ValueError as error:  # LowPrecisionGradError is a ValueError too
            print(f"{name} without master weights:\n  {error}\n")

    model, opt = make()
    masters = mixprec.MasterWeights(opt)
    scaler = mixprec.GradScaler()
    start = loss_of(model, x, y).item()
    for _ in range(steps):
        opt.zero_grad()
        scaler.scale(loss_of(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()
    print(f"with MasterWeights: loss {start:.3f} -> {loss_of(model, x, y).item():.3f}")
    print(
        f"  head stays {model.head.weight.dtype}; masters are fp32; extra memory "
        f"{masters.overhead_bytes()} bytes"
    )

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model2, opt2 = make()
    mixprec.MasterWeights(opt2)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])  # restores the fp32 masters and refreshes the model
    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    print(f"  checkpoint round trip: parameters identical = {same}")


if __name__ == "__main__":
    main()
