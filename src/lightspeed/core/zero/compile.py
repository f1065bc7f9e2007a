"""``torch.compile`` under ZeRO, through DeepSpeed's own ``engine.compile()``.

A compile request comes from a strategy argument (``compile=True``, ``compile_kwargs={...}``) or from a model the
user compiled with ``torch.compile`` before handing it to the Trainer or to ``fabric.setup``; either way the engine
compiles the module it wraps (``engine.compile()``), so DeepSpeed's forward, its ZeRO-3 parameter hooks and its
backward hooks stay DeepSpeed's own, instead of Lightning compiling the LightningModule's methods (the Trainer
refuses that under DeepSpeed) or Fabric compiling the whole engine (``torch.compile(engine)``).

Measured on the CPU (2 gloo ranks, DeepSpeed 0.19.8, torch 2.13, fp32): stages 0-3, without offload and with the
optimizer (stage 1-3) and the parameters (stage 3) offloaded to the CPU or NVMe, compile with the default backend
(inductor) and end within 1e-7 of the uncompiled run.

ZeRO-3 and ``nn.MultiheadAttention``: the module reads its child ``out_proj``'s weight without calling ``out_proj``.
Eager ZeRO-3 gathers such a parameter when it is read; a compiled forward reads the empty partition and fails to
trace. Marked as a ZeRO-3 leaf module (DeepSpeed's ``set_z3_leaf_modules``: all its parameters are gathered when it is
entered) it compiles and trains as uncompiled; :func:`prepare_zero3_for_compile` marks them before the engine is
built. A model compiled with ``torch.compile`` before ``fabric.setup`` is seen only once the engine exists, too late
to mark them (the leaf flag decides how ZeRO-3 hooks the gradients at ``deepspeed.initialize``): that is refused
(:func:`check_zero3_module_compiles`).

Refused before any step (:func:`check_compile_supported`):

* DeepCompile (``"compile": {"deepcompile": true}`` in the DeepSpeed config) on the CPU: its op (``dc``) is CUDA
  code, and building it on the CPU fails half-way with a compiler error;
* DeepCompile at stage 0, which DeepCompile does not cover (DeepSpeed would silently compile without it);
* inductor on the CPU without a C++ compiler (inductor writes C++ for the CPU), a torch without ``torch.compile``,
  and a DeepSpeed without ``engine.compile()``.

No Lightning here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from lightspeed.core.errors import DeepSpeedConfigError
from lightspeed.core.zero.config import config_stage

__all__ = [
    "ZERO3_LEAF_CLASSES",
    "CompileRequest",
    "check_compile_supported",
    "check_zero3_module_compiles",
    "compile_engine",
    "compile_request",
    "prepare_zero3_for_compile",
    "request_from_dynamo_context",
    "request_from_kwargs",
    "uses_deepcompile",
]

#: torch modules that read a child's parameters without calling the child: ZeRO-3 leaf modules when compiled
ZERO3_LEAF_CLASSES: tuple[type[torch.nn.Module], ...] = (torch.nn.MultiheadAttention,)


@dataclasses.dataclass(frozen=True)
class CompileRequest:
    """What ``engine.compile()`` is called with: ``backend`` (None: DeepSpeed's default for the accelerator,
    ``"inductor"`` on CPU and CUDA) and the other ``torch.compile`` keyword arguments; ``source`` names where the
    request came from, for messages (``"ZeroStrategy(compile=True)"``, ``"torch.compile(model)"``)."""

    backend: Any = None
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    source: str = "compile=True"

    def describe(self) -> str:
        """The call as it runs, e.g. ``engine.compile(backend='inductor', compile_kwargs={'fullgraph': True})``."""
        backend = self.backend if self.backend is not None else "inductor"
        shown = backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)
        return f"engine.compile(backend={shown!r}, compile_kwargs={dict(self.kwargs)!r})"


def _torch_compile_keywords() -> frozenset[str]:
    return frozenset(name for name in inspect.signature(torch.compile).parameters if name != "model")


def request_from_kwargs(kwargs: Mapping[str, Any] | None, source: str) -> CompileRequest:
    """A request from ``torch.compile`` keyword arguments (``backend`` goes to ``engine.compile``'s own argument);
    an argument ``torch.compile`` does not take is an error naming it."""
    kwargs = dict(kwargs or {})
    unknown = sorted(set(kwargs) - _torch_compile_keywords())
    if unknown:
        raise DeepSpeedConfigError(
            f"{source}: {', '.join(map(repr, unknown))} "
            f"{'is not an argument' if len(unknown) == 1 else 'are not arguments'} of `torch.compile`, which takes "
            f"{', '.join(sorted(_torch_compile_keywords()))}."
        )
    backend = kwargs.pop("backend", None)
    return CompileRequest(backend=backend, kwargs=kwargs, source=source)


def compile_request(compile: bool, compile_kwargs: Mapping[str, Any] | None, owner: str) -> CompileRequest | None:
    """The request of a strategy's ``compile``/``compile_kwargs`` arguments (``compile_kwargs`` alone asks for
    compilation too), or None; ``owner`` is the strategy's class name, for messages."""
    if compile_kwargs is not None and not isinstance(compile_kwargs, Mapping):
        raise DeepSpeedConfigError(
            f"{owner}(compile_kwargs=...) takes a dict of `torch.compile` arguments, e.g. "
            f"{{'mode': 'max-autotune'}}; got {type(compile_kwargs).__name__}."
        )
    if not compile and compile_kwargs is None:
        return None
    source = f"{owner}(compile=True)" if compile else f"{owner}(compile_kwargs=...)"
    return request_from_kwargs(compile_kwargs, source)


def request_from_dynamo_context(dynamo_ctx: Any, source: str = "torch.compile(model)") -> CompileRequest:
    """The request a ``torch.compile`` call made, read back from its dynamo context (what Lightning keeps of a
    compiled LightningModule): the backend with its mode and options, ``fullgraph`` and ``dynamic``."""
    from torch._dynamo.eval_frame import innermost_backend

    kwargs: dict[str, Any] = {}
    if getattr(dynamo_ctx, "fullgraph", False):
        kwargs["fullgraph"] = True
    dynamic = getattr(dynamo_ctx, "_dynamic", None)
    if dynamic is not None:
        kwargs["dynamic"] = dynamic
    backend: Any = innermost_backend(dynamo_ctx.callback)
    # torch.compile wraps its backend together with `mode`/`options`: unwrap it into torch.compile's arguments, so
    # that DeepCompile (which takes backend names only) sees "inductor"
    if type(backend).__name__ == "_TorchCompileInductorWrapper":
        options = dict(getattr(backend, "config", {}) or {})
        if options:
            kwargs["options"] = options
        backend = "inductor"
    elif type(backend).__name__ == "_TorchCompileWrapper":
        name = getattr(backend, "compiler_name", None)
        extra = dict(getattr(backend, "kwargs", {}) or {})
        kwargs.update(extra)
        backend = name if isinstance(name, str) and _is_registered_backend(name) else backend.compiler_fn
    return CompileRequest(backend=backend, kwargs=kwargs, source=source)


def _is_registered_backend(name: str) -> bool:
    return name in torch._dynamo.list_backends(exclude_tags=())


def uses_deepcompile(config: Mapping[str, Any]) -> bool:
    """Whether the DeepSpeed config turns DeepCompile on (``"compile": {"deepcompile": true}``)."""
    section = config.get("compile")
    return isinstance(section, Mapping) and bool(section.get("deepcompile", False))


def _cpp_compiler_problem() -> str | None:
    """Why inductor cannot build C++ here (the CPU backend's code), or None."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch layout: let inductor speak for itself
        return None
    try:
        get_cpp_compiler()
    except Exception as err:  # torch raises InvalidCxxCompiler, which has moved between versions
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else 'no C++ compiler'}"
    return None


def check_compile_supported(request: CompileRequest, config: Mapping[str, Any], device_kind: str) -> None:
    """Refuse, before any step, a compile request that DeepSpeed cannot carry out for this ``config`` on
    ``device_kind`` (``"cpu"``/``"cuda"``); the message names the stage and device and what to use instead. A config
    without a stage yet (``zero_auto`` before its choice) is checked for everything but the stage."""
    zero = config.get("zero_optimization")
    stage = config_stage(dict(config)) if isinstance(zero, Mapping) and "stage" in zero else None  # None: zero_auto
    device = "the CPU" if device_kind == "cpu" else "CUDA"
    where = f"ZeRO stage {stage} on {device}" if stage is not None else device
    if not hasattr(torch, "compile"):
        raise DeepSpeedConfigError(
            f"{request.source}: torch {torch.__version__} has no `torch.compile`. Install torch >= 2.1, or train "
            "without compile."
        )
    from deepspeed import DeepSpeedEngine, __version__

    if not hasattr(DeepSpeedEngine, "compile"):
        raise DeepSpeedConfigError(
            f"{request.source}: DeepSpeed {__version__} has no `engine.compile()`, which compiles under ZeRO. "
            "Install DeepSpeed >= 0.14, or train without compile."
        )
    if uses_deepcompile(config):
        if device_kind == "cpu":
            raise DeepSpeedConfigError(
                f'{request.source} with DeepCompile (`"compile": {{"deepcompile": true}}` in the DeepSpeed '
                f"config) cannot run under {where}: DeepCompile's op is CUDA code. Remove `deepcompile` from the "
                "config (engine.compile() then compiles the model with torch.compile, which works at every ZeRO "
                "stage on the CPU), or train on accelerator='cuda'."
            )
        if stage == 0:
            raise DeepSpeedConfigError(
                f'{request.source} with DeepCompile (`"compile": {{"deepcompile": true}}`) cannot run under '
                f"{where}: DeepCompile covers ZeRO stages 1-3 (DeepSpeed would compile without it). Use stage 1, 2 "
                "or 3, or remove `deepcompile` from the config."
            )
        if request.backend not in (None, "inductor", "eager"):
            raise DeepSpeedConfigError(
                f"{request.source} with DeepCompile takes backend 'inductor' or 'eager', not {request.backend!r}. "
                "Drop the backend, or remove `deepcompile` from the config."
            )
    if device_kind == "cpu" and request.backend in (None, "inductor"):
        problem = _cpp_compiler_problem()
        if problem is not None:
            raise DeepSpeedConfigError(
                f"{request.source} under {where}: torch.compile's default backend (inductor) writes C++ for the "
                f"CPU, but no C++ compiler works here ({problem}). Install g++ (or point $CXX at one), or compile "
                "with another backend: compile_kwargs={'backend': 'aot_eager'}."
            )


def compile_engine(engine: Any, request: CompileRequest) -> None:
    """``engine.compile()`` as ``request`` asks (a no-op for an engine already compiled)."""
    if engine.is_compiled:
        return
    arguments: dict[str, Any] = {"compile_kwargs": dict(request.kwargs)}
    if request.backend is not None:
        arguments["backend"] = request.backend
    engine.compile(**arguments)


def _unmarked_leaf_candidates(module: torch.nn.Module) -> list[str]:
    from deepspeed.utils import z3_leaf_module

    return [
        name or type(module).__name__
        for name, sub in module.named_modules()
        if isinstance(sub, ZERO3_LEAF_CLASSES) and not z3_leaf_module(sub)
    ]


def prepare_zero3_for_compile(module: torch.nn.Module, config: Mapping[str, Any]) -> list[str]:
    """Before ``deepspeed.initialize`` of a ZeRO-3 engine that will be compiled: mark the modules of
    :data:`ZERO3_LEAF_CLASSES` as ZeRO-3 leaf modules; returns their names (empty at other stages)."""
    if config_stage(dict(config)) != 3:
        return []
    names = _unmarked_leaf_candidates(module)
    if names:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(module, list(ZERO3_LEAF_CLASSES), raise_if_not_found=False)
    return names


def check_zero3_module_compiles(
    request: CompileRequest, module: torch.nn.Module, config: Mapping[str, Any], instead: str
) -> None:
    """For a ZeRO-3 engine already built: refuse to compile a module whose attention layers were not marked as leaf
    modules before the engine was built (see the module docstring); ``instead`` says how to compile it."""
    if config_stage(dict(config)) != 3:
        return
    names = _unmarked_leaf_candidates(module)
    if not names:
        return
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    classes = ", ".join(f"torch.nn.{cls.__name__}" for cls in ZERO3_LEAF_CLASSES)
    raise DeepSpeedConfigError(
        f"{request.source} under ZeRO stage 3: {classes} modules ({shown}) read a child's parameters without "
        "calling the child, which a compiled ZeRO-3 forward cannot gather. Such modules have to be ZeRO-3 leaf "
        f"modules before the engine is built, and this compile request came after. {instead}"
    )
