"""The causal-LM loss of a HuggingFace model computed over chunks of its tokens, so that the whole ``[tokens, vocab]``
logits never exist in a training forward with labels: each chunk's logits are made, turned into a summed
cross-entropy and dropped, then made again from the chunk's hidden states in the backward pass (``torch``'s
non-reentrant checkpoint). At long sequence lengths those logits (and their float32 log-softmax, kept for backward)
are the largest tensors of the step; tiled, about one chunk's worth exists at a time, at the cost of running the
output projection once more in the backward pass. (In bf16 the output projection's weight gradient is then the sum of
one bf16 gradient per chunk, so it can differ from the untiled one by an ulp or so.)

Why not DeepSpeed's ``TiledFusedLogitsLoss``: it runs the backward of every chunk inside the forward and rescales
only the hidden states' gradient by what the loss is multiplied with afterwards, so the output projection's weight
gradient would miss every later factor (the sequence-parallel ZeRO-3 factor, gradient accumulation, the fp16 loss
scale, a user's ``loss * c``). Here the chunks are ordinary autograd: the loss is an ordinary tensor.

Why all chunks run inside one call of the output projection (``lm_head``): ZeRO-3 gathers a module's weight in its
forward pre-hook and releases it in its post-hook (and again around its backward). One call with the targets as
keyword arguments (the hooks see only the positional hidden states) gathers the weight once in the forward and once
in the backward, and its gradient is accumulated once, however many chunks there are.

The causal LM's own ``forward`` runs unchanged without labels, under ``torch.no_grad()`` (evaluation: the logits are
returned as usual) or with ``logits_to_keep``. The model's ``loss_function`` stays the one that runs, so a wrapper
installed over it afterwards (sequence parallelism's whole-sequence loss, :mod:`.ulysses`) wraps the tiled loss:
undo that wrapper before undoing the tiling. Only the plain forward (base model, ``lm_head``, HuggingFace's loss,
read from its source) is accepted: a model that rescales or caps its logits, or adds a router loss, is refused.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightspeed.core.errors import SequenceParallelError

__all__ = ["tile_logits_loss"]

#: float32 logits in one chunk when no chunk size is given: about 1 GiB
CHUNK_BYTES = 1 << 30

#: decorators a plain causal-LM forward may carry (each keeps its arguments and its result as they are, except
#: ``can_return_tuple``, which the tiled forward applies too)
PLAIN_DECORATORS = frozenset({"auto_docstring", "can_return_tuple", "deprecate_kwarg"})

#: the statements between the base model's call and the logits, in HuggingFace's spellings
_SLICING = (
    "hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)",
    "slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep",
)
_HEAD_INPUTS = ("hidden_states", "hidden_states[:, slice_indices, :]")


def tile_logits_loss(lm: torch.nn.Module, tokens_per_chunk: int | None) -> Callable[[], None]:
    """Compute ``lm``'s loss (a HuggingFace ``*ForCausalLM``) over chunks of ``tokens_per_chunk`` tokens (None: about
    1 GiB of float32 logits per chunk) whenever it runs with labels and gradients; returns the function that undoes
    it. The model's output then has ``logits=None``: a training step that needs the logits must leave this off.

    Refused with a :class:`SequenceParallelError`: a model that is not a transformers ``PreTrainedModel``, one
    compiled with ``torch.compile``, output embeddings that are not exactly a ``torch.nn.Linear`` (an adapter, a
    quantized layer), a ``forward`` already set on the model or its output embeddings, a loss function other than
    HuggingFace's causal-LM cross-entropy, and a class forward that is not the plain one (read from its source)."""
    from transformers.utils.generic import can_return_tuple

    if tokens_per_chunk is not None and (
        isinstance(tokens_per_chunk, bool) or not isinstance(tokens_per_chunk, int) or tokens_per_chunk < 1
    ):
        raise SequenceParallelError(
            f"tiled_logits_loss takes the tokens per chunk as a whole number >= 1 (or None: about 1 GiB of float32 "
            f"logits per chunk), got {tokens_per_chunk!r}."
        )
    head: Any = _refuse_unless_plain(lm)
    shape = _read_forward(lm, head)
    model: Any = lm  # a transformers PreTrainedModel
    own_loss: Callable[..., torch.Tensor] = model.loss_function
    hidden_states_given = _Flag()

    def head_forward(
        self: torch.nn.Linear,
        hidden: torch.Tensor,
        targets: torch.Tensor | None = None,
        denominator: torch.Tensor | int | None = None,
        ignore_index: int = -100,
    ) -> torch.Tensor:
        if targets is None:
            return torch.nn.Linear.forward(self, hidden)
        return _chunked_loss(self, hidden, targets, denominator, ignore_index, tokens_per_chunk)

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if not hidden_states_given.on:  # the class forward ran: HuggingFace's loss on real logits
            return own_loss(
                logits,
                labels,
                vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if shift_labels is not None:
            targets = shift_labels
        else:  # as ForCausalLMLoss shifts them: token i predicts label i + 1, the last predicts nothing
            assert labels is not None
            targets = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        # HuggingFace's "mean": over the targets that count, unless the caller counted them over more (a window)
        denominator = num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum()
        return head(logits, targets=targets, denominator=denominator, ignore_index=ignore_index)

    def tiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.get_output_embeddings() is not head:
            raise SequenceParallelError(
                f"{type(self).__name__}'s output embeddings were replaced (now "
                f"{type(self.get_output_embeddings()).__name__}) after tiled_logits_loss was installed on it, and the "
                "tiled loss would still use the old ones: replace them (an adapter on lm_head, say) before the model "
                "is set up for training, or leave tiled_logits_loss off."
            )
        arguments = shape.signature.bind(self, *args, **kwargs)
        arguments.apply_defaults()
        given = arguments.arguments
        extra = dict(given.get(shape.var_keyword, {})) if shape.var_keyword else {}
        base = getattr(self, self.base_model_prefix)
        outputs = base(
            *(given[name] for name in shape.base_args),
            **{keyword: given[name] for keyword, name in shape.base_kwargs},
            **extra,
        )
        vocab_size = self
        for name in shape.vocab_size:
            vocab_size = getattr(vocab_size, name)
        hidden_states_given.on = True
        try:
            # the class forward hands its **kwargs to the loss as they are; the "logits" are the hidden states here
            loss = self.loss_function(logits=outputs[0], labels=given["labels"], vocab_size=vocab_size, **extra)
        finally:
            hidden_states_given.on = False
        fields = {field: getattr(outputs, attribute) for field, attribute in shape.output_fields}
        return shape.output(loss=loss, logits=None, **fields)

    tiled_with_return_dict = can_return_tuple(tiled)  # return_dict=False gives a tuple, as the class forward does

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            try:
                given = shape.signature.bind(self, *args, **kwargs).arguments
            except TypeError:  # the class forward says what is wrong with the arguments
                given = {}
            keep = given.get("logits_to_keep", 0)
            if given.get("labels") is not None and isinstance(keep, int) and keep == 0:
                return tiled_with_return_dict(self, *args, **kwargs)
        return type(self).forward(self, *args, **kwargs)

    head.forward = types.MethodType(head_forward, head)
    model.forward = types.MethodType(forward, model)
    model.loss_function = loss_function  # HuggingFace's setter: the instance's `_loss_function`

    def undo() -> None:
        vars(head).pop("forward", None)
        vars(lm).pop("forward", None)
        vars(lm).pop("_loss_function", None)

    return undo


class _Flag:
    """Whether the model's loss function is being given hidden states (the tiled forward) rather than logits."""

    on = False


def _chunked_loss(
    head: torch.nn.Linear,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    denominator: torch.Tensor | int | None,
    ignore_index: int,
    tokens_per_chunk: int | None,
) -> torch.Tensor:
    """``head``'s summed cross-entropy over chunks of ``hidden`` against ``targets``, divided by ``denominator``."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1).to(hidden.device)
    if targets.numel() != hidden.shape[0]:
        raise ValueError(
            f"the loss has {targets.numel()} targets for {hidden.shape[0]} positions: labels (or shift_labels) must "
            "have the shape of input_ids."
        )
    chunk = tokens_per_chunk or max(1, CHUNK_BYTES // (4 * head.out_features))
    total = torch.zeros((), device=hidden.device)
    for hidden_chunk, target_chunk in zip(hidden.split(chunk), targets.split(chunk), strict=True):
        part = checkpoint(
            _chunk_cross_entropy,
            hidden_chunk,
            target_chunk,
            head.weight,
            head.bias,
            ignore_index,
            use_reentrant=False,
            early_stop=False,
            preserve_rng_state=False,
        )
        total = total + part
    if denominator is None:
        return total
    if isinstance(denominator, torch.Tensor):
        denominator = denominator.to(total.device)
    return total / denominator


def _chunk_cross_entropy(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    # float32 like ForCausalLMLoss, which upcasts the logits before the cross-entropy
    logits = F.linear(hidden, weight, bias).float()
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


# ------------------------------------------------------------------------------------------------ the refusals
def _refuse_unless_plain(lm: torch.nn.Module) -> torch.nn.Linear:
    """``lm``'s output projection, after refusing every model whose loss the tiled forward would change."""
    from transformers import PreTrainedModel
    from transformers.loss.loss_utils import LOSS_MAPPING

    name = type(getattr(lm, "_orig_mod", lm)).__name__  # torch.compile(lm) holds the model as _orig_mod

    def refuse_compiled(what: str) -> NoReturn:
        raise SequenceParallelError(
            f"tiled_logits_loss replaces the forward of {name} and of its output embeddings, and {what} was compiled "
            "with torch.compile, which it has not been tested with: train without torch.compile, or leave "
            "tiled_logits_loss off."
        )

    if _compiled(lm):
        refuse_compiled(name)
    if not isinstance(lm, PreTrainedModel):
        raise SequenceParallelError(
            f"tiled_logits_loss computes the loss of a HuggingFace causal language model (a transformers "
            f"*ForCausalLM, e.g. LlamaForCausalLM), and {name} is not one: leave tiled_logits_loss off."
        )
    head = lm.get_output_embeddings()
    if _compiled(head):
        refuse_compiled(f"{name}'s output embeddings")
    if type(head) is not torch.nn.Linear:
        found = "None" if head is None else f"{type(head).__name__} (an adapter, quantized or custom layer)"
        raise SequenceParallelError(
            f"tiled_logits_loss computes the output projection chunk by chunk from a torch.nn.Linear's weight and "
            f"bias, and {name}'s output embeddings are {found}: leave tiled_logits_loss off for this model."
        )
    for module, what in ((lm, name), (head, f"{name}'s output embeddings")):
        if "forward" in vars(module):
            raise SequenceParallelError(
                f"tiled_logits_loss replaces the forward of {name} and of its output embeddings, and {what} already "
                "has a forward of its own set on the instance (another library's or an activation-checkpointing "
                "patch): leave tiled_logits_loss off, or do not replace that forward."
            )
    loss = lm.loss_function
    if "_loss_function" in vars(lm) or loss is not LOSS_MAPPING["ForCausalLM"]:
        raise SequenceParallelError(
            f"tiled_logits_loss computes HuggingFace's causal-LM cross-entropy (ForCausalLMLoss) chunk by chunk, and "
            f"{name} uses another loss function ({getattr(loss, '__qualname__', type(loss).__name__)}): leave "
            "tiled_logits_loss off, or give the model its default loss_function."
        )
    return head


def _compiled(module: torch.nn.Module) -> bool:
    if getattr(module, "_compiled_call_impl", None) is not None:  # module.compile()
        return True
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # torch.compile(module) imported it
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


@dataclass(frozen=True)
class _Forward:
    """What the class forward of a causal LM does, read from its source: how it calls its base model, the vocabulary
    size it gives the loss, and how it builds its output."""

    signature: inspect.Signature
    var_keyword: str | None  # its **kwargs, handed to the base model and the loss function
    base_args: tuple[str, ...]  # the parameters it passes to the base model by position
    base_kwargs: tuple[tuple[str, str], ...]  # (keyword, parameter) passed to the base model by name
    vocab_size: tuple[str, ...]  # the attributes of `self` the loss's vocab_size is read from
    output: Any  # the output class
    output_fields: tuple[tuple[str, str], ...]  # (field, attribute of the base model's output), loss and logits aside


def _read_forward(lm: torch.nn.Module, head: torch.nn.Module) -> _Forward:
    """The plain causal-LM forward of ``type(lm)`` (HuggingFace's ``LlamaForCausalLM.forward`` and its copies),
    statement by statement; anything else is refused."""
    cls = type(lm)
    function = inspect.unwrap(cls.forward)
    where = f"{cls.__name__}.forward"
    try:
        source = textwrap.dedent(inspect.getsource(function))
        definition = ast.parse(source).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        _not_plain(cls.__name__, f"{where} has no source to read")
    if not isinstance(definition, ast.FunctionDef):
        _not_plain(cls.__name__, f"{where} is not a plain function")
    signature = inspect.signature(function)
    parameters = signature.parameters
    var_keyword = next((p.name for p in parameters.values() if p.kind is p.VAR_KEYWORD), None)
    decorators = [_name(decorator) for decorator in definition.decorator_list]
    if "can_return_tuple" not in decorators or not set(decorators) <= PLAIN_DECORATORS:
        _not_plain(
            cls.__name__, f"{where} has decorators {decorators}, not the plain ones ({sorted(PLAIN_DECORATORS)})"
        )
    body = list(definition.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # its docstring
    statements = iter(body)

    def refuse(statement: ast.AST | None, expected: str) -> NoReturn:
        if statement is None:
            _not_plain(cls.__name__, f"{where} ends where the plain forward has {expected}")
        first = ast.unparse(statement).splitlines()[0]
        _not_plain(cls.__name__, f"{where} has `{first}` where the plain forward has {expected}")

    # outputs = self.<base model>(<parameters>, **kwargs)
    statement = next(statements, None)
    prefix = getattr(lm, "base_model_prefix", "")
    target, value = _assignment(statement)
    base_args: list[str] = []
    base_kwargs: list[tuple[str, str]] = []
    call_ok = isinstance(value, ast.Call) and _is_self_attribute(value.func, prefix) and target is not None
    if call_ok:
        assert isinstance(value, ast.Call)
        for argument in value.args:
            call_ok = call_ok and isinstance(argument, ast.Name) and argument.id in parameters
            base_args.append(getattr(argument, "id", ""))
        for keyword in value.keywords:
            if keyword.arg is None:
                call_ok = call_ok and isinstance(keyword.value, ast.Name) and keyword.value.id == var_keyword
            else:
                call_ok = call_ok and isinstance(keyword.value, ast.Name) and keyword.value.id in parameters
                base_kwargs.append((keyword.arg, getattr(keyword.value, "id", "")))
        call_ok = call_ok and not {"labels", "logits_to_keep"} & {*base_args, *(name for _, name in base_kwargs)}
    if not call_ok or target is None:
        refuse(statement, f"`outputs = self.{prefix}(<its parameters>, **kwargs)` first")
    outputs = target

    # hidden_states = outputs.last_hidden_state (or outputs[0]), the positions to keep, then logits = self.lm_head(...)
    statement = next(statements, None)
    sliced = f"hidden_states = slice_logits_to_keep({outputs}.last_hidden_state, logits_to_keep)"
    keeps = _matches(statement, sliced)
    if not keeps and not _matches(
        statement, f"hidden_states = {outputs}.last_hidden_state", f"hidden_states = {outputs}[0]"
    ):
        refuse(statement, f"`hidden_states = {outputs}.last_hidden_state`")
    statement = next(statements, None)
    if not keeps and _matches(statement, *_SLICING):
        keeps = True
        statement = next(statements, None)
    if keeps and "logits_to_keep" not in parameters:
        _not_plain(cls.__name__, f"{where} slices by logits_to_keep, which is not one of its parameters")
    head_names = [name for name, module in lm.named_children() if module is head]
    calls = [f"logits = self.{name}({argument})" for name in head_names for argument in _HEAD_INPUTS]
    if not _matches(statement, *calls):
        refuse(statement, "`logits = self.lm_head(hidden_states)`")

    # loss = None; if labels is not None: loss = self.loss_function(logits, labels, <vocab size>, **kwargs)
    statement = next(statements, None)
    if not _matches(statement, "loss = None"):
        refuse(statement, "`loss = None`")
    statement = next(statements, None)
    vocab_size = _loss_call(statement, var_keyword) if "labels" in parameters else None
    if vocab_size is None:
        refuse(statement, "`if labels is not None: loss = self.loss_function(logits=logits, labels=labels, ...)`")
    assert vocab_size is not None

    # return <Output>(loss=loss, logits=logits, <field>=outputs.<field>, ...)
    statement = next(statements, None)
    output, fields = _output(statement, outputs, function.__globals__)
    if output is None:
        refuse(statement, f"`return CausalLMOutputWithPast(loss=loss, logits=logits, <field>={outputs}.<field>...)`")
    statement = next(statements, None)
    if statement is not None:
        refuse(statement, "nothing after its return")
    return _Forward(
        signature=signature,
        var_keyword=var_keyword,
        base_args=tuple(base_args),
        base_kwargs=tuple(base_kwargs),
        vocab_size=vocab_size,
        output=output,
        output_fields=fields,
    )


def _not_plain(name: str, why: str) -> NoReturn:
    raise SequenceParallelError(
        f"tiled_logits_loss computes the loss of {name} without its logits, which keeps the loss exact only for the "
        f"plain causal-LM forward (the base model, the output projection, HuggingFace's loss, nothing done to the "
        f"logits and no other loss added), and {why}: leave tiled_logits_loss off for this model."
    )


def _name(node: ast.expr) -> str:
    """A decorator's name: ``auto_docstring`` for ``@auto_docstring`` and ``@deprecate_kwarg(...)`` alike."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ast.unparse(node)


def _assignment(statement: ast.stmt | None) -> tuple[str | None, ast.expr | None]:
    """``(name, value)`` of ``name = value`` or ``name: T = value``."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
        if isinstance(target, ast.Name):
            return target.id, statement.value
    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        return statement.target.id, statement.value
    return None, None


def _is_self_attribute(node: ast.expr, attribute: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attribute
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _matches(statement: ast.stmt | None, *sources: str) -> bool:
    """Whether ``statement`` is one of ``sources`` (compared as syntax trees: spacing and comments aside)."""
    if statement is None:
        return False
    if isinstance(statement, ast.AnnAssign) and statement.value is not None:  # `x: T = v` reads as `x = v`
        statement = ast.Assign(targets=[statement.target], value=statement.value, lineno=0)
    found = ast.dump(statement)
    return any(found == ast.dump(ast.parse(source).body[0]) for source in sources)


def _loss_call(statement: ast.stmt | None, var_keyword: str | None) -> tuple[str, ...] | None:
    """The attributes of ``self`` the vocabulary size is read from, if ``statement`` is ``if labels is not None:
    loss = self.loss_function(logits, labels, self.<...>, **kwargs)`` (by position or by name)."""
    if not (
        isinstance(statement, ast.If)
        and not statement.orelse
        and len(statement.body) == 1
        and ast.unparse(statement.test) == "labels is not None"
    ):
        return None
    target, call = _assignment(statement.body[0])
    if target != "loss" or not isinstance(call, ast.Call) or not _is_self_attribute(call.func, "loss_function"):
        return None
    given = dict(zip(("logits", "labels", "vocab_size"), call.args, strict=False))
    if len(call.args) > 3:
        return None
    spread = False
    for keyword in call.keywords:
        if keyword.arg is None:
            spread = isinstance(keyword.value, ast.Name) and keyword.value.id == var_keyword
        elif keyword.arg in given or keyword.arg not in ("logits", "labels", "vocab_size"):
            return None
        else:
            given[keyword.arg] = keyword.value
    if not spread or set(given) != {"logits", "labels", "vocab_size"}:
        return None
    if ast.unparse(given["logits"]) != "logits" or ast.unparse(given["labels"]) != "labels":
        return None
    path: list[str] = []
    node = given["vocab_size"]
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "self" and path):
        return None
    return tuple(path)


def _output(statement: ast.stmt | None, outputs: str, names: dict[str, Any]) -> tuple[Any, tuple[tuple[str, str], ...]]:
    """The output class and its fields taken from the base model's output, if ``statement`` is ``return
    Output(loss=loss, logits=logits, field=outputs.attribute, ...)``."""
    if not (isinstance(statement, ast.Return) and isinstance(statement.value, ast.Call)):
        return None, ()
    call = statement.value
    output = names.get(call.func.id) if isinstance(call.func, ast.Name) else None
    if not isinstance(output, type) or call.args:
        return None, ()
    fields: list[tuple[str, str]] = []
    named = set()
    for keyword in call.keywords:
        value = keyword.value
        if keyword.arg in ("loss", "logits") and isinstance(value, ast.Name) and value.id == keyword.arg:
            named.add(keyword.arg)
        elif (
            keyword.arg is not None
            and isinstance(value, ast.Attribute)
            and isinstance(value.value, ast.Name)
            and value.value.id == outputs
        ):
            fields.append((keyword.arg, value.attr))
        else:
            return None, ()
    if named != {"loss", "logits"}:
        return None, ()
    return output, tuple(fields)
