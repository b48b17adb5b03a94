"""Lightning Trainer on the CPU with 16-mixed and mixprec's scaler (pytorch-lightning 2.6).

Differential: the stock plugin with torch's GradScaler is the oracle for parameters and scaler
state; the checkpoint tests compare a resumed run against an uninterrupted one.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import mixprec
from mixprec.errors import ConfigError
from mixprec.integrations import SkipAwareScheduler

pl = pytest.importorskip("pytorch_lightning", reason="needs the [lightning] extra")
from pytorch_lightning.plugins import MixedPrecision  # noqa: E402

from mixprec.integrations.lightning import (  # noqa: E402
    fsdp_precision,
    plugin_class,
)

MixprecPrecision = plugin_class("pytorch_lightning")
TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class TinyModule(pl.LightningModule):
    def __init__(self, scheduler_interval: str = "step") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
        )
        self.interval = scheduler_interval
        self.out_dtypes: list[torch.dtype] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        self.out_dtypes.append(out.dtype)
        return torch.nn.functional.mse_loss(out, y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


def loader() -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8, generator=gen)
    x[8:12] *= 1e5  # batch 2 of every epoch overflows in fp16: its step is skipped
    y = torch.randn(16, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def fit(
    plugin: Any, epochs: int, root: Path, ckpt: Path | None = None, logger: Any = False, **kw: Any
) -> Any:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        plugins=[plugin],
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    module = TinyModule(**kw)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*(num_workers|LeafSpec|lr_scheduler|logging interval).*"
        )
        trainer.fit(module, loader(), ckpt_path=str(ckpt) if ckpt else None)
    return trainer, module


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_recipe_matches_torch_scaler_bit_for_bit(tmp_path: Path) -> None:
    ref_trainer, ref = fit(MixedPrecision("16-mixed", "cpu"), 2, tmp_path)
    scaler = mixprec.GradScaler()
    trainer, ours = fit(MixedPrecision("16-mixed", "cpu", scaler=scaler), 2, tmp_path)
    assert isinstance(ref_trainer.scaler, torch.amp.GradScaler)
    assert trainer.scaler is scaler
    assert set(ours.out_dtypes) == {torch.float16}  # autocast fp16 ran on the CPU
    for a, b in zip(params(ref), params(ours), strict=True):
        assert torch.equal(a, b)
    ref_state, state = ref_trainer.scaler.state_dict(), scaler.state_dict()
    assert {k: state[k] for k in TORCH_KEYS} == {k: ref_state[k] for k in TORCH_KEYS}
    assert scaler.stats().steps_skipped >= 2  # at least batch 2 of each epoch


def test_plugin_steps_schedulers_only_on_real_updates(tmp_path: Path) -> None:
    stock_scaler = mixprec.GradScaler()
    stock_trainer, _ = fit(MixedPrecision("16-mixed", "cpu", scaler=stock_scaler), 2, tmp_path)
    plugin = MixprecPrecision("16-mixed", "cpu")
    trainer, _ = fit(plugin, 2, tmp_path)
    stats = plugin.scaler.stats()
    assert stats.iterations == 8 and stats.steps_skipped >= 2
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(sched, SkipAwareScheduler)
    assert sched.last_epoch == stats.steps_taken
    assert sched.skipped_steps == stats.steps_skipped
    assert sched.get_last_lr() == [pytest.approx(0.05 * 0.9**stats.steps_taken)]
    # Lightning's own behaviour, which the plugin corrects: one scheduler step per iteration.
    assert stock_trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8


def test_plugin_leaves_epoch_schedulers_alone(tmp_path: Path) -> None:
    trainer, _ = fit(MixprecPrecision("16-mixed", "cpu"), 2, tmp_path, scheduler_interval="epoch")
    sched = trainer.lr_scheduler_configs[0].scheduler
    assert not isinstance(sched, SkipAwareScheduler)
    assert sched.last_epoch == 2


def test_checkpoint_resume_gives_identical_scaler_state(tmp_path: Path) -> None:
    plugin_a = MixprecPrecision("16-mixed", "cpu")
    _, straight = fit(plugin_a, 2, tmp_path)

    plugin_b = MixprecPrecision("16-mixed", "cpu")
    trainer_b, _ = fit(plugin_b, 1, tmp_path)
    ckpt = tmp_path / "epoch1.ckpt"
    trainer_b.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["MixprecPrecision"] == plugin_b.scaler.state_dict()
    assert saved["MixedPrecision"] == saved["MixprecPrecision"]  # the stock plugin's key too

    plugin_c = MixprecPrecision("16-mixed", "cpu")
    loaded: list[dict[str, Any]] = []
    original = plugin_c.load_state_dict
    plugin_c.load_state_dict = lambda sd: (
        original(sd),
        loaded.append(plugin_c.scaler.state_dict()),
    )
    _, resumed = fit(plugin_c, 2, tmp_path, ckpt=ckpt)
    assert loaded == [saved["MixprecPrecision"]]
    assert plugin_c.scaler.state_dict() == plugin_a.scaler.state_dict()
    for a, b in zip(params(straight), params(resumed), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_moves_between_torch_scaler_and_plugin(tmp_path: Path) -> None:
    torch_trainer, _ = fit(MixedPrecision("16-mixed", "cpu"), 1, tmp_path)
    ckpt = tmp_path / "torch.ckpt"
    torch_trainer.save_checkpoint(ckpt)
    expected = torch_trainer.scaler.state_dict()
    assert "MixprecPrecision" not in torch.load(ckpt, weights_only=False)

    plugin = MixprecPrecision("16-mixed", "cpu")
    fit(plugin, 1, tmp_path, ckpt=ckpt)  # already at max_epochs: restores, trains nothing
    state = plugin.scaler.state_dict()
    assert {k: state[k] for k in TORCH_KEYS} == expected


def test_fsdp_precision_installs_a_scaler_the_stock_constructor_rejects() -> None:
    from pytorch_lightning.plugins.precision import FSDPPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    scaler = ShardedGradScaler(device="cpu")
    with pytest.raises(ValueError, match="does not use a scaler"):
        FSDPPrecision("16-mixed", scaler=scaler)  # Lightning 2.6's bug, see docs/lightning.md
    plugin = fsdp_precision(scaler, package="pytorch_lightning")
    assert isinstance(plugin, FSDPPrecision)
    assert plugin.scaler is scaler and plugin.precision == "16-mixed"
    with pytest.raises(ConfigError, match="16-mixed"):
        fsdp_precision(scaler, precision="bf16-mixed", package="pytorch_lightning")


def test_plugin_rejects_bf16_and_unknown_packages() -> None:
    with pytest.raises(ConfigError, match="bf16 needs no scaler"):
        MixprecPrecision("bf16-mixed", "cpu")
    with pytest.raises(ConfigError, match="package must be one of"):
        plugin_class("lightning_fabric")
    with pytest.raises(ConfigError, match="skip_aware_schedulers=False"):
        MixprecPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    torch_scaler = torch.amp.GradScaler("cpu")
    plugin = MixprecPrecision("16-mixed", "cpu", torch_scaler, skip_aware_schedulers=False)
    assert plugin.scaler is torch_scaler


def test_plugin_applies_a_mixprec_policy_inside_training_step(tmp_path: Path) -> None:
    # Module names are relative to the outermost module called in the step: self.net.
    policy = mixprec.Policy(modules={"2": "fp32"})
    _, with_policy = fit(MixprecPrecision("16-mixed", "cpu", policy=policy), 1, tmp_path)
    _, plain = fit(MixprecPrecision("16-mixed", "cpu"), 1, tmp_path)
    assert set(with_policy.out_dtypes) == {torch.float32}  # the last Linear ran in fp32
    assert set(plain.out_dtypes) == {torch.float16}


def test_metrics_hook_writes_the_scale_into_lightnings_logger(tmp_path: Path) -> None:
    import csv

    from pytorch_lightning.loggers import CSVLogger

    from mixprec.integrations import MetricsHook

    plugin = MixprecPrecision("16-mixed", "cpu", mixprec.GradScaler(history=16))
    logger = CSVLogger(tmp_path)
    MetricsHook(logger.log_metrics).attach(plugin.scaler)
    fit(plugin, 2, tmp_path, logger=logger)
    logger.finalize("success")
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("mixprec/scale")]
    history = plugin.scaler.history()
    after_update = [e.scale for e in history[1:]] + [plugin.scaler.get_scale()]
    assert [int(r["step"]) for r in rows] == [e.iteration for e in history]
    assert [float(r["mixprec/scale"]) for r in rows] == after_update
    assert [float(r["mixprec/skipped"]) for r in rows] == [float(e.skipped) for e in history]


def test_fabric_recipe_matches_a_hand_written_torch_loop() -> None:
    from lightning_fabric import Fabric
    from lightning_fabric.plugins import MixedPrecision as FabricMixedPrecision

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    batches = [(x, y) for x, y in loader()]
    scaler = mixprec.GradScaler()
    fabric = Fabric(
        accelerator="cpu", devices=1, plugins=[FabricMixedPrecision("16-mixed", "cpu", scaler)]
    )
    model, opt = fabric.setup(*make())
    for x, y in batches:
        fabric.backward(torch.nn.functional.mse_loss(model(x), y))
        fabric.clip_gradients(model, opt, max_norm=1.0, error_if_nonfinite=False)
        opt.step()
        opt.zero_grad()

    ref_model, ref_opt = make()
    ref = torch.amp.GradScaler("cpu")
    for x, y in batches:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ref_model(x), y)
        ref.scale(loss).backward()
        ref.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref.step(ref_opt)
        ref.update()
        ref_opt.zero_grad()

    assert scaler.stats().steps_skipped >= 1
    for a, b in zip(ref_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    state = scaler.state_dict()
    assert {k: state[k] for k in TORCH_KEYS} == {k: ref.state_dict()[k] for k in TORCH_KEYS}


def test_plugin_pickles_and_copies() -> None:
    """The class behind MixprecPrecision is built per package, so pickle goes by package."""
    import copy
    import pickle

    plugin = MixprecPrecision("16-mixed", "cpu", mixprec.GradScaler(init_scale=1024.0))
    for clone in (pickle.loads(pickle.dumps(plugin)), copy.deepcopy(plugin)):
        assert type(clone) is type(plugin) and clone is not plugin
        assert clone.scaler.get_scale() == 1024.0 and clone.skip_aware_schedulers
