"""Worker: run a batch of Lightning fits described in a JSON file and save what the tests compare.

Usage (under torchrun, 1 or 2 ranks): accumulation_fit.py CASES_JSON OUT_DIR
Each case: name, strategy, task, batch_size (per rank), accumulate, epochs, lr, and optional scheduler ("steps":
LambdaLR with lr = base * step), clip (gradient norm), precision, iterable (no __len__), sync_with_dataloader,
return_num_items, non_scalar_loss, expect_error. Rank 0 saves OUT_DIR/<name>.pt.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning.pytorch as pl  # noqa: E402
from accumulation_cases import item_loss, make_data, make_model, rank_batches  # noqa: E402

import lightspeed  # noqa: E402,F401  (registers ddp_exact)
from _support.trainers import quiet_trainer  # noqa: E402

REAL_ALL_REDUCE = dist.all_reduce  # the DDP gradient hook uses it directly; its calls are counted by the hook
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
)
DS_COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "all_gather_into_tensor",
    "allgather_fn",
    "all_to_all_single",
    "broadcast",
)


class ShardedIterable(IterableDataset):
    """Yields this rank's batches with no __len__, so Lightning cannot know the epoch's length in advance."""

    def __init__(self, tensors, batch_size: int) -> None:
        self.tensors, self.batch_size = tensors, batch_size

    def __iter__(self):
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        for idx in rank_batches(len(self.tensors[0]), world, rank, self.batch_size):
            yield tuple(t[idx] for t in self.tensors)


class CaseModule(pl.LightningModule):
    def __init__(self, case: dict) -> None:
        super().__init__()
        self.case = case
        self.model = make_model(case["task"])
        self.counts = {"optimizer_step": 0, "on_before_optimizer_step": 0, "optimizer_zero_grad": 0, "lr_step": 0}
        self.in_batch = False  # collectives are counted only inside training batches
        self.collectives: list[list[str]] = []  # per training batch: "op:dtype:numel" of torch.distributed calls
        self.stepped: list[bool] = []  # per training batch: whether the optimizer stepped
        self.hook_grads: list[dict] = []  # per optimizer step: the gradients on_before_optimizer_step sees

    def training_step(self, batch, batch_idx):
        loss_sum, items = item_loss(self.case["task"], self.model, batch)
        if self.case.get("non_scalar_loss"):
            return (self.model(batch[0]) - batch[1]).pow(2).squeeze(1)
        if self.case.get("return_num_items"):
            return {"loss": loss_sum, "num_items": items}
        return loss_sum / items  # mean over the batch's samples

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.case["lr"])
        if self.case.get("scheduler") == "steps":
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: float(step))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return optimizer

    def optimizer_step(self, *args, **kwargs):
        self.counts["optimizer_step"] += 1
        return super().optimizer_step(*args, **kwargs)

    def on_before_optimizer_step(self, optimizer):
        self.counts["on_before_optimizer_step"] += 1
        counting, self.in_batch = self.in_batch, False  # the reads' own collectives are not the strategy's
        self.hook_grads.append(self._visible_gradients())
        self.in_batch = counting

    def _visible_gradients(self) -> dict:
        """The gradients a user reads in on_before_optimizer_step: DeepSpeed's full gradient under ZeRO (a collective
        under ZeRO-3: every rank reads), ``.grad`` otherwise."""
        if not self.case["strategy"].startswith("zero"):
            return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        from deepspeed.utils import safe_get_full_grad

        grads = {n: safe_get_full_grad(p) for n, p in self.model.named_parameters()}
        return {n: g.detach().float().cpu().clone() for n, g in grads.items() if g is not None}

    def optimizer_zero_grad(self, *args, **kwargs):
        self.counts["optimizer_zero_grad"] += 1
        return super().optimizer_zero_grad(*args, **kwargs)

    def lr_scheduler_step(self, scheduler, metric):
        self.counts["lr_step"] += 1
        scheduler.step()

    def on_train_batch_start(self, batch, batch_idx):
        self.in_batch = True
        self.collectives.append([])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.in_batch = False
        self.stepped.append(self.counts["optimizer_step"] > sum(self.stepped))

    def on_train_start(self):
        # count DDP's gradient bucket all-reduces with a comm hook doing DDP's default (averaging) all-reduce
        from torch.nn.parallel import DistributedDataParallel

        self.grad_allreduces = 0
        ddp = self.trainer.strategy.model
        if isinstance(ddp, DistributedDataParallel):

            def counting_hook(state, bucket):
                self.grad_allreduces += 1
                tensor = bucket.buffer().div_(dist.get_world_size())
                work = REAL_ALL_REDUCE(tensor, async_op=True)
                return work.get_future().then(lambda fut: fut.value()[0])

            ddp.register_comm_hook(None, counting_hook)


def run_case(case: dict, out_dir: Path) -> None:
    torch.manual_seed(0)
    tensors = make_data(case["task"])
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if case.get("iterable"):
        loader = DataLoader(ShardedIterable(tensors, case["batch_size"]), batch_size=None)
    else:  # Lightning's own sampler would shuffle: shard in order, as the references do
        dataset = TensorDataset(*tensors)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=case["batch_size"], sampler=sampler)
    strategy = case["strategy"]
    if strategy == "ddp_exact" and "sync_with_dataloader" in case:
        from lightspeed.strategies.ddp_exact import DDPExactStrategy

        strategy = DDPExactStrategy(sync_with_dataloader=case["sync_with_dataloader"])
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=case["epochs"],
        accumulate_grad_batches=case["accumulate"],
        gradient_clip_val=case.get("clip"),
        precision=case.get("precision", "32-true"),
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    module = CaseModule(case)
    item_allreduces = 0
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def collective(*args, **kwargs):
            nonlocal item_allreduces
            if module.in_batch:
                item_allreduces += int(name == "all_reduce")
                tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
                module.collectives[-1].append(f"{name}:{str(tensor.dtype).replace('torch.', '')}:{tensor.numel()}")
            return real[name](*args, **kwargs)

        return collective

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    if case["strategy"].startswith("zero"):  # ZeRO-3 reaches torch through functions deepspeed.comm captured
        import deepspeed.comm as ds_comm

        for name in DS_COLLECTIVES:
            real[f"ds.{name}"] = getattr(ds_comm, name)
            setattr(ds_comm, name, counting(f"ds.{name}"))
    error = None
    try:
        trainer.fit(module, loader)
    except Exception as exc:  # recorded for the error-message tests
        if not case.get("expect_error"):
            raise
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for name, function in real.items():
            if name.startswith("ds."):
                import deepspeed.comm as ds_comm

                setattr(ds_comm, name[3:], function)
            else:
                setattr(dist, name, function)
    result = {
        # the models are tiny, so ZeRO-3 keeps every parameter whole (below its persistence threshold)
        "state_dict": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
        "counts": module.counts,
        "hook_grads": module.hook_grads,
        "global_step": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None,
        "grad_allreduces": getattr(module, "grad_allreduces", None),
        "item_allreduces": item_allreduces,  # torch.distributed.all_reduce calls inside batches
        "collectives": module.collectives,
        "stepped": module.stepped,
        "error": error,
    }
    if rank == 0:
        torch.save(result, out_dir / f"{case['name']}.pt")


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    for case in cases:
        run_case(case, out_dir)


if __name__ == "__main__":
    main()
