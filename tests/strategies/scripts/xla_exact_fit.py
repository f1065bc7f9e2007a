"""Worker script for tests/strategies/test_xla_exact.py: ``xla_exact`` runs that fork XLA workers.

It runs in its own process because ``xmp.spawn`` only forks while the XLA runtime has not started in the launching
process (the pytest process starts it in other tests). Usage: ``python xla_exact_fit.py OUT_DIR``.

Case ``fork32``: 32-true, accumulate_grad_batches=3 over 10 batches, a model that refuses to be pickled; the worker
records its pid, the address of the first weight's CPU storage before moving to the device, its per-micro-batch
losses and the batch index of every gradient all-reduce (``xm.reduce_gradients``).
Case ``notebook``: the example ``examples/xla_notebook.py`` (model built outside ``train``) in bf16-true.
Case ``one_of_two``: ``xla_exact`` on one device of a host with two (``CPU_NUM_DEVICES=2``), the path where
``xmp.spawn(nprocs=1)`` would run in the calling process; fitted twice (two Trainers) to show the parent can launch
again. Runs last: it changes ``CPU_NUM_DEVICES`` in this process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402

import lightspeed  # noqa: E402,F401
from lightspeed.plugins import XLAPrecision  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xla_model  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


class NoPickleModule(xla_model.XLATestModule):
    """Fails loudly if anything pickles it (Lightning's XLA launcher would, through xmp.spawn's process pool)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduce_batch_indices: list[int] = []
        self.setup_info: dict = {}

    def __getstate__(self) -> dict:
        raise RuntimeError("the model was pickled")

    def setup(self, stage: str) -> None:
        # called in the worker before the strategy moves the model to the XLA device
        self.setup_info = {"pid": os.getpid(), "weight_ptr": self.net.hidden.weight.data_ptr()}


class WriteWorkerResults(L.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: L.Trainer, pl_module: NoPickleModule) -> None:
        pl_module.on_train_end()  # make sure the losses are collected before writing
        if trainer.global_rank == 0:
            self.path.write_text(
                json.dumps(
                    {
                        **pl_module.setup_info,
                        "world_size": trainer.world_size,
                        "losses": pl_module.step_losses,
                        "reduce_batch_indices": pl_module.reduce_batch_indices,
                    }
                )
            )


def fork32(out: Path) -> None:
    model = NoPickleModule()
    real_reduce = xm.reduce_gradients

    def counting_reduce(optimizer, *args, **kwargs):  # inherited by the forked worker
        model.reduce_batch_indices.append(model.trainer.fit_loop.epoch_loop.batch_idx)
        return real_reduce(optimizer, *args, **kwargs)

    xm.reduce_gradients = counting_reduce
    parent = {"pid": os.getpid(), "weight_ptr": model.net.hidden.weight.data_ptr()}
    trainer = L.Trainer(
        strategy="xla_exact",
        plugins=[XLAPrecision("32-true")],
        callbacks=[WriteWorkerResults(out / "fork32_worker.json")],
        use_distributed_sampler=False,  # one worker: keep the loader's order (the sampler would shuffle)
        **xla_model.trainer_kwargs(str(out / "fork32")),
    )
    trainer.fit(model, xla_model.make_loader())
    xm.reduce_gradients = real_reduce
    parent["runtime_started_in_parent"] = bool(__import__("torch_xla")._XLAC._xla_runtime_is_initialized())
    (out / "fork32_parent.json").write_text(json.dumps(parent))
    torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, out / "fork32_state.pt")


def notebook(out: Path) -> None:
    spec = importlib.util.spec_from_file_location("xla_notebook", REPO / "examples" / "xla_notebook.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # type: ignore[union-attr]
    model = example.build_model()
    model_id = id(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    acc_before = example.accuracy(model)
    example.train(model, precision="bf16-true", epochs=2, root=str(out / "notebook"))
    after = model.state_dict()
    (out / "notebook.json").write_text(
        json.dumps(
            {
                "same_object": id(model) == model_id,
                "dtypes": sorted({str(v.dtype) for v in after.values()}),
                "changed": all(not torch.equal(before[k].to(after[k].dtype), after[k]) for k in before),
                "accuracy_before": acc_before,
                "accuracy_after": example.accuracy(model),
            }
        )
    )


def one_of_two(out: Path) -> None:
    os.environ["CPU_NUM_DEVICES"] = "2"
    parent = {"pid": os.getpid()}
    for fit in ("first", "second"):
        model = NoPickleModule()
        parent[f"{fit}_weight_ptr"] = model.net.hidden.weight.data_ptr()
        trainer = L.Trainer(
            strategy="xla_exact",
            callbacks=[WriteWorkerResults(out / f"one_of_two_{fit}_worker.json")],
            use_distributed_sampler=False,
            **xla_model.trainer_kwargs(str(out / f"one_of_two_{fit}"), devices=1),
        )
        trainer.fit(model, xla_model.make_loader())
        parent[f"{fit}_state"] = {k: v.tolist() for k, v in model.net.state_dict().items()}
        parent[f"runtime_started_after_{fit}"] = bool(__import__("torch_xla")._XLAC._xla_runtime_is_initialized())
    (out / "one_of_two_parent.json").write_text(json.dumps(parent))


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    fork32(out_dir)
    notebook(out_dir)
    one_of_two(out_dir)
