"""What the front end (the Trainer and the LightningModule, or Fabric) decides, in plain types, so config resolution
needs no Lightning."""

from __future__ import annotations

from dataclasses import dataclass

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
FP16_PRECISIONS = frozenset({"16-mixed", "16-true"})
BF16_PRECISIONS = frozenset({"bf16-mixed", "bf16-true"})


def front_end_in_prose(front_end: str) -> str:
    """How a sentence names the front end: "the Trainer", or "Fabric" (a name without an article)."""
    return "the Trainer" if front_end == "Trainer" else front_end


@dataclass(frozen=True)
class OptimizerFacts:
    """The LightningModule's optimizer, for filling "auto" values in the DeepSpeed ``optimizer`` section."""

    type_name: str
    lr: float
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay: float | None = None


@dataclass(frozen=True)
class TrainingFacts:
    """The Trainer's (or Fabric's) settings a DeepSpeed config must agree with.

    ``micro_batch_size`` is the per-device batch size of the train dataloader (None: unknown);
    ``gradient_clip_val`` None or 0 means no clipping; ``precision`` is Lightning's precision string;
    ``total_steps`` counts optimizer steps of the whole run; ``front_end`` (``"Trainer"`` or ``"Fabric"``) is whose
    arguments the error messages name; ``device`` is the device kind the engine trains on (``"cuda"``, ``"cpu"``),
    None for the one DeepSpeed's accelerator runs on in this process (which lightspeed's strategies set per rank).
    """

    world_size: int
    micro_batch_size: int | None
    accumulate_grad_batches: int
    gradient_clip_val: float | None
    precision: str
    hidden_size: int | None
    optimizer: OptimizerFacts | None = None
    total_steps: int | None = None
    front_end: str = "Trainer"
    device: str | None = None

    def __post_init__(self) -> None:
        from lightspeed.core.errors import DeepSpeedConfigError

        if self.precision not in PRECISIONS:
            raise DeepSpeedConfigError(
                f"{self.argument('precision', repr(self.precision))} cannot be used with DeepSpeed. Use one of "
                + ", ".join(repr(p) for p in PRECISIONS)
                + "."
            )
        for name in ("world_size", "accumulate_grad_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingFacts.{name} must be a whole number >= 1, got {value!r}")
        for name in ("micro_batch_size", "hidden_size", "total_steps"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TrainingFacts.{name} must be None or a whole number >= 1, got {value!r}")
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise ValueError(f"TrainingFacts.device must be None or a device kind such as 'cuda', got {self.device!r}")
        if self.gradient_clip_val is not None and self.gradient_clip_val < 0:
            raise ValueError(f"TrainingFacts.gradient_clip_val must be None or >= 0, got {self.gradient_clip_val!r}")

    def device_kind(self) -> str:
        """``device``, or the device DeepSpeed's accelerator runs on in this process when it is None."""
        if self.device is not None:
            return self.device
        from deepspeed.accelerator import get_accelerator

        return str(get_accelerator().device_name()).split(":")[0]

    def argument(self, name: str, value: object) -> str:
        """How the user wrote ``name=value``: ``Trainer(accumulate_grad_batches=4)`` or ``Fabric(precision=...)``."""
        return f"{self.front_end}({name}={value})"
