"""Shared test settings: small thread count so the suite behaves the same on 2 cores."""

from __future__ import annotations

import torch

torch.set_num_threads(1)
