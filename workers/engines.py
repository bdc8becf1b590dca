"""The clipping engines by name, and the fast engine: per-example norms by book-keeping, one weighted pass.

``ENGINES`` maps each engine's name to its function and ``clipped_sum``
dispatches by name: "fast" (``fast_clipped_sum``, below) and "vmap"
(``workers.vmap_engine.per_example_clipped_sum``, the torch.func reference).
Both take the same arguments and give the same result.

The fast engine, for each chunk of at most ``max_physical_batch`` examples:

1. One forward pass over the whole chunk records, for every layer with
   trainable parameters, its input, and (by a hook on its output) the gradient
   of the summed per-example losses at its output. The parameters are plain
   tensors that do not require grad, so the one backward pass computes output
   gradients only: no weight gradients, and no input gradient for a first layer.
2. The rule registered for the layer's type (``workers.layer_rules``,
   ``workers.sequence_rules``, ``workers.transformer_rules``) turns (input,
   output gradient) into the per-example squared norm of each of its
   parameters' gradients.
3. Per-parameter norms add up to each example's total norm and clip factor;
   each parameter's clipped sum is then the weight-gradient half of a backward
   pass in which example i's loss is weighted by its clip factor, formed from
   what step 2 kept (a weighted contraction, or a weighted sum of the
   instantiated per-example gradients).

With precision "bf16" the forward and backward passes of step 1 run under
bfloat16 autocast, and every recorded input and output gradient is cast to
float32 before step 2: each example's norm and its clipped contribution are
then taken from the same float32 tensors, as in "fp32", so its contribution
has norm at most C to float32 rounding.

Layer types without a rule, and modules holding parameters of their own that
are not a registered layer type (``nn.MultiheadAttention``, custom modules),
fall back to ``torch.func.vmap`` over that one module's per-example gradients.
Models the per-layer view cannot serve (tied parameters, a fallback module
that draws random numbers, a recorded input changed in place afterwards, a
layer applied to a table shared by all examples, a rule that raises) run on
the vmap engine whole, with a warning saying why.

Assumption shared with Opacus: every module with trainable parameters sees the
examples along dimension 0 of its tensor inputs and outputs (for
``nn.MultiheadAttention``, the dimension its ``batch_first`` says). It is not
taken on trust: which tensors carry the batch is tracked from the model's
input through every operation (``_BatchTracker``), and before any call is
served, the rules are checked per model and example schema on synthetic
examples (``settle_plan``), against each example's gradient taken alone; a
model whose examples mix is refused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

# sequence_rules and transformer_rules are imported for their rules, which they register with layer_rules' registry.
from workers import clipping, sequence_rules, transformer_rules  # noqa: F401
from workers.layer_rules import (
    LayerCall,
    LayerRule,
    OutputSlot,
    ParameterGradients,
    WholeModelFallback,
    attention_rule,
    rule_for,
    tied_embedding_gradients,
    tied_embedding_pair,
    vmap_rule,
)
from workers.losses import per_example_losses
from workers.models import flat_parameters
from workers.validation import UnsupportedModuleError, keeps_buffers, unchanged_buffers
from workers.vmap_engine import per_example_clipped_sum


# ---------------------------------------------------------------------------
# Recording one forward and backward pass


@dataclass(frozen=True)
class _Unit:
    """A module whose trainable parameters (``names``, relative to it) one rule covers."""

    prefix: str
    layer: nn.Module
    rule: LayerRule
    names: tuple[str, ...]
    # Each of ``names`` as the model's own (deduplicated) parameter list names it: a tied parameter's first name.
    canonical: tuple[str, ...]

    def canonical_name(self, name: str) -> str:
        """The name the model's parameter list, the flat vector and the gradients give the parameter ``name``."""
        return self.canonical[self.names.index(name)]

    @property
    def title(self) -> str:
        """The layer's name and type, as the run log shows it."""
        return f"{self.prefix or '(model)'} ({type(self.layer).__name__})"


def _units(model: nn.Module) -> list[_Unit]:
    units: list[_Unit] = []
    first_name = {id(parameter): name for name, parameter in reversed(list(model.named_parameters()))}

    def visit(prefix: str, module: nn.Module) -> None:
        owned = [(name, parameter) for name, parameter in module.named_parameters() if parameter.requires_grad]
        if not owned:
            return
        rule = rule_for(module)
        owns_parameters = any(p.requires_grad for p in module.parameters(recurse=False))
        if rule is not None or owns_parameters:
            units.append(_Unit(prefix, module, rule or vmap_rule, tuple(name for name, _ in owned),
                               tuple(first_name[id(parameter)] for _, parameter in owned)))
            return
        for child_name, child in module.named_children():
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)

    visit("", model)
    return units


def _unsupported_reason(model: nn.Module, units: list[_Unit]) -> str | None:
    names_of: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if parameter.requires_grad:
            names_of.setdefault(id(parameter), []).append(name)
    users: dict[str, list[_Unit]] = {}
    for unit in units:
        for name in unit.names:
            users.setdefault(unit.canonical_name(name), []).append(unit)
    tied = [" = ".join(names) for names in names_of.values()
            if len(names) > 1 and not tied_embedding_pair(users.get(names[0], []))]
    if tied:
        return f"parameter {'; '.join(tied)} is tied to several modules"
    for unit in units:
        if isinstance(unit.layer, nn.MultiheadAttention) and unit.rule is vmap_rule:
            return f"{unit.prefix or 'the model'} (nn.MultiheadAttention) uses attention dropout in training mode"
    return None


class _GradientTap(torch.autograd.Function):
    """Identity on a first layer's output (which needs no grad) that gives it a place in the backward pass.

    The backward pass is asked for the gradient of ``anchor``, the one leaf
    that requires grad; on the way each tap records the gradient at its output.
    """

    @staticmethod
    def forward(ctx, output: Tensor, anchor: Tensor, slot: OutputSlot) -> Tensor:
        ctx.slot = slot
        # detach() aliases the storage without copying and without making a view
        # autograd tracks, so later in-place operations on the result are allowed.
        return output.detach()

    @staticmethod
    def backward(ctx, gradient: Tensor) -> tuple[None, Tensor, None]:
        ctx.slot.keep(gradient)
        return None, gradient.new_zeros(()), None


class _BatchTracker(TorchFunctionMode):
    """Knows which tensors are computed from the model's input batch, through every operation of the forward.

    The result of an operation carries the batch when one of its tensor
    arguments does (an in-place operation marks the tensor it writes).
    Parameters, buffers and constants made in ``forward`` (a shared table,
    ``torch.arange(T)``) do not, whatever their shape: a layer rule never has
    to guess from a size that happens to equal the number of examples.
    Tensors are known by weak reference, so the tracker keeps none alive.
    """

    # Operations whose result is made fresh, of a size given as numbers, whatever tensor they are called on.
    FRESH = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})

    def __init__(self, inputs: Tensor) -> None:
        super().__init__()
        self._batched: dict[int, weakref.ref] = {}
        self.mark(inputs)

    def mark(self, tensor: Tensor) -> None:
        """Note that ``tensor`` carries the batch."""
        self._batched[id(tensor)] = weakref.ref(tensor)

    def carries(self, value: Any) -> bool:
        """Whether ``value`` is a tensor computed from the input batch."""
        known = self._batched.get(id(value)) if isinstance(value, Tensor) else None
        return known is not None and known() is value

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if _operation_name(func) not in self.FRESH and any(
            self.carries(leaf) for leaf in tree_flatten((args, kwargs))[0]
        ):
            for leaf in tree_flatten(result)[0]:
                if isinstance(leaf, Tensor):
                    self.mark(leaf)
        return result


def _recorder(calls: list[LayerCall], anchor: Tensor, tracker: _BatchTracker) -> Callable:
    def record(layer: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        leaves, spec = tree_flatten(output)
        slots: list[OutputSlot | None] = []
        tapped = False
        for index, leaf in enumerate(leaves):
            if not (isinstance(leaf, Tensor) and leaf.is_floating_point()):
                slots.append(None)
                continue
            slot = OutputSlot(leaf.shape, leaf.dtype, leaf.device, tracker.carries(leaf))
            if leaf.requires_grad:
                # A hook registered before any in-place change of the output
                # receives the gradient at the value the layer produced.
                leaf.register_hook(slot.keep)
            else:
                leaves[index] = _GradientTap.apply(leaf, anchor, slot)
                if slot.batched:
                    tracker.mark(leaves[index])
                tapped = True
            slots.append(slot)
        versions = tuple(t._version for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor))
        calls.append(LayerCall(args, kwargs, slots, versions, tuple(tracker.carries(arg) for arg in args),
                               {name: tracker.carries(value) for name, value in kwargs.items()}))
        return tree_unflatten(leaves, spec) if tapped else None

    return record


# Reading a parameter's metadata, or a detached copy of it, carries no gradient.
GRADIENT_FREE_OPERATIONS = frozenset({
    ".dtype", ".shape", ".device", ".requires_grad", ".is_cuda", ".ndim", ".layout", ".is_sparse",
    "size", "dim", "numel", "detach", "is_floating_point", "is_complex",
})


class _ParameterUseTracker(TorchFunctionMode):
    """Notes every trainable parameter that an operation uses while the unit whose rule covers it is not running.

    Such a use (``h @ self.emb.weight.T`` in a model's forward, a weight read by
    a sibling module) contributes gradient that no rule sees. ``owners`` maps
    id() of each parameter tensor given to ``functional_call`` to the indices of
    the units whose rules cover it (two for a tied embedding).
    """

    def __init__(self, owners: dict[int, tuple[int, ...]], names: dict[int, str]) -> None:
        super().__init__()
        self.owners = owners
        self.names = names
        self.running = [0] * (max((max(units) for units in owners.values()), default=-1) + 1)
        self.in_model = False
        self.outside: dict[str, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _operation_name(func)
        if self.in_model and name not in GRADIENT_FREE_OPERATIONS:
            for leaf in tree_flatten((args, kwargs))[0]:
                units = self.owners.get(id(leaf)) if isinstance(leaf, Tensor) else None
                if units is not None and not any(self.running[unit] for unit in units):
                    self.outside.setdefault(self.names[id(leaf)], name)
        return func(*args, **kwargs)

    def watch(self, model: nn.Module, units: list[_Unit]) -> list:
        """Hooks that keep ``running`` and ``in_model`` up to date; returns their handles."""

        def entering(index: int) -> Callable:
            def pre_hook(*_):
                self.running[index] += 1
            return pre_hook

        def leaving(index: int) -> Callable:
            def hook(*_):
                self.running[index] -= 1
            return hook

        def set_in_model(value: bool) -> Callable:
            def hook(*_):
                self.in_model = value
            return hook

        handles = [model.register_forward_pre_hook(set_in_model(True)),
                   model.register_forward_hook(set_in_model(False))]
        for index, unit in enumerate(units):
            handles.append(unit.layer.register_forward_pre_hook(entering(index)))
            handles.append(unit.layer.register_forward_hook(leaving(index)))
        return handles


def _operation_name(func: Callable) -> str:
    """A torch operation's name; a property such as ``Tensor.T`` is named by the property."""
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        return f".{getattr(getattr(func, '__self__', None), '__name__', 'attribute')}"
    return name


def _record(
    model: nn.Module, units: list[_Unit], params: dict[str, Tensor], inputs: Tensor, labels: Tensor,
    loss_fn: clipping.LossFunction, tracker: _ParameterUseTracker | None = None, precision: str = "fp32",
) -> list[list[LayerCall]]:
    """Run the forward and the one backward pass; return each unit's recorded calls.

    With a ``tracker``, the forward runs under it, which notes parameters used
    outside their units. The forward runs under ``precision``'s autocast
    (``workers.clipping.autocast_for``): with "bf16", the recorded tensors
    are those of a bfloat16 pass, which ``_in_float32`` casts for the rules.
    """
    calls: list[list[LayerCall]] = [[] for _ in units]
    anchor = torch.zeros((), dtype=torch.float32, device=inputs.device, requires_grad=True)
    batch = _BatchTracker(inputs)
    handles = [unit.layer.register_forward_hook(_recorder(calls[i], anchor, batch), with_kwargs=True)
               for i, unit in enumerate(units)]
    if tracker is not None:
        handles += tracker.watch(model, units)
    try:
        with (torch.enable_grad(), tracker or contextlib.nullcontext(), batch,
              clipping.autocast_for(precision, inputs.device)):
            loss = per_example_losses(loss_fn, functional_call(model, params, (inputs,)), labels).sum()
    finally:
        for handle in handles:
            handle.remove()
    if loss.requires_grad:
        torch.autograd.grad(loss, anchor)
    for unit, unit_calls in zip(units, calls, strict=True):
        for call in unit_calls:
            now = tuple(t._version for t in tree_flatten((call.args, call.kwargs))[0] if isinstance(t, Tensor))
            if now != call.versions:
                raise WholeModelFallback(
                    f"an input of {unit.prefix or 'the model'} ({type(unit.layer).__name__}) is changed in place "
                    "after the layer has run"
                )
    return calls


def _in_float32(calls: list[list[LayerCall]]) -> list[list[LayerCall]]:
    """The recorded calls with every floating-point input and output gradient of a narrower type cast to float32.

    After a bfloat16 pass, the rules then take each example's norm and its
    clipped contribution from the same float32 tensors, so that the
    contribution scaled to "norm C" has norm C to float32 rounding; float32
    and float64 tensors are left as they are.
    """

    def widened(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point() and value.element_size() < 4:
            return value.to(torch.float32)
        return value

    def slot_in_float32(slot: OutputSlot | None) -> OutputSlot | None:
        if slot is None:
            return None
        dtype = slot.dtype if slot.dtype.itemsize >= 4 else torch.float32
        return OutputSlot(slot.shape, dtype, slot.device, slot.batched, widened(slot.grad))

    return [
        [dataclasses.replace(call, args=tree_map(widened, call.args), kwargs=tree_map(widened, call.kwargs),
                             outputs=[slot_in_float32(slot) for slot in call.outputs])
         for call in unit_calls]
        for unit_calls in calls
    ]


def _rule_gradients(
    units: list[_Unit], calls: list[list[LayerCall]], params: Mapping[str, Tensor], batch_size: int
) -> dict[str, ParameterGradients]:
    """Every rule's ParameterGradients for the recorded calls, by qualified parameter name."""
    uses: dict[str, list[tuple[_Unit, list[LayerCall], ParameterGradients]]] = {}
    for unit, unit_calls in zip(units, calls, strict=True):
        if unit_calls:
            local = {name: params[unit.canonical_name(name)] for name in unit.names}
            for name, parameter_gradients in _unit_gradients(unit, local, unit_calls, batch_size).items():
                uses.setdefault(unit.canonical_name(name), []).append((unit, unit_calls, parameter_gradients))
    gradients: dict[str, ParameterGradients] = {}
    for canonical, parameter_uses in uses.items():
        if len(parameter_uses) == 1:
            gradients[canonical] = parameter_uses[0][2]
            continue
        # A tied embedding (``_unsupported_reason`` lets no other tie reach the rules): its two uses' gradients
        # add up, and so do their clipped sums; the norm needs their inner product too.
        (embedding, embedding_calls, of_embedding), (_, linear_calls, of_linear) = sorted(
            parameter_uses, key=lambda use: not isinstance(use[0].layer, nn.Embedding))
        gradients[canonical] = tied_embedding_gradients(embedding.layer, embedding_calls, linear_calls, batch_size,
                                                        of_embedding, of_linear)
    return gradients


def _unit_gradients(
    unit: _Unit, params: Mapping[str, Tensor], calls: list[LayerCall], batch_size: int
) -> dict[str, ParameterGradients]:
    """One unit's rule on its calls; any failure of the rule becomes a WholeModelFallback naming the unit.

    A book-keeping rule reads its first argument as the examples' inputs:
    given one that is not computed from the batch (a layer applied to a
    shared table), its output gradient mixes every example's, and no rule can
    separate them. The per-module vmap rules check every argument themselves.
    """
    if unit.rule is not vmap_rule and unit.rule is not attention_rule:
        for call in calls:
            if call.args and not call.batched_args[0]:
                given = (f"a tensor of shape {tuple(call.input.shape)}" if isinstance(call.input, Tensor)
                         else f"a {type(call.input).__name__}")
                raise WholeModelFallback(
                    f"{unit.title} is applied to {given} that is not computed from the batch (a table or constant "
                    "shared by all examples)"
                )
    try:
        return unit.rule(unit.layer, params, calls, batch_size)
    except WholeModelFallback as fallback:
        raise WholeModelFallback(f"{unit.title}: {fallback}") from fallback
    except Exception as error:  # noqa: BLE001 - any failure of a rule hands the model to the vmap engine
        raise WholeModelFallback(f"the rule for {unit.title} failed ({_first_line(error)})") from error


def _first_line(error: Exception) -> str:
    """An exception's type and the first line of its message, for a warning."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# ---------------------------------------------------------------------------
# The check, once per model and shape of example


RULE_CHECK_TOLERANCE = 1e-5
# Synthetic examples the check runs on: several, since mixing across a batch needs at least two to show.
RULE_CHECK_EXAMPLES = 4
# The synthetic examples are not secret and not drawn from the data: a fixed seed makes every check the same.
SYNTHETIC_EXAMPLES_SEED = 20_241_126
# Per-example gradient entries the vmap fallback holds at once (see fallback_physical_batch).
VMAP_FALLBACK_GRADIENT_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class ExampleSchema:
    """What one example looks like: the shape and dtype of its input and of its label, never their values.

    The fast engine settles one plan per model and schema; the rule check
    runs on synthetic examples of this schema (``synthetic_examples``).
    """

    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    label_shape: tuple[int, ...]
    label_dtype: torch.dtype

    @classmethod
    def of(cls, inputs: Tensor, labels: Tensor) -> ExampleSchema:
        """The schema of a batch's examples, from the tensors' shapes and dtypes alone."""
        return cls(tuple(inputs.shape[1:]), inputs.dtype, tuple(labels.shape[1:]), labels.dtype)


@dataclass(frozen=True)
class EnginePlan:
    """How the fast engine computes one model's clipped sums, decided by ``check_rules``.

    ``fallback`` is the reason the whole model runs on the vmap engine, or
    None; ``layers`` pairs each layer's title with how its gradients are
    computed: "fast (ghost)", "fast (per-example)" or "vmap (fallback: why)".
    """

    fallback: str | None
    layers: tuple[tuple[str, str], ...]

    def describe(self) -> list[str]:
        """One line per layer, for the run log."""
        return [f"{title}: {how}" for title, how in self.layers]


_PlanKey = tuple[ExampleSchema, Callable]
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[_PlanKey, EnginePlan]] = weakref.WeakKeyDictionary()


def engine_plan(model: nn.Module) -> EnginePlan | None:
    """The plan the fast engine settled on last for ``model`` (for any schema), or None before it settled one."""
    plans = _PLANS.get(model)
    return next(reversed(plans.values())) if plans else None


def _keep_plan(model: nn.Module, key: _PlanKey, plan: EnginePlan) -> None:
    plans = _PLANS.setdefault(model, {})
    plans.pop(key, None)  # the latest plan is the one engine_plan reports
    plans[key] = plan


def _whole_model_fallback(units: list[_Unit], reason: str) -> EnginePlan:
    return EnginePlan(reason, tuple((unit.title, f"vmap (fallback: {reason})") for unit in units))


def _mismatch(actual: Tensor, expected: Tensor, scale: float) -> bool:
    return (actual - expected).norm().item() > RULE_CHECK_TOLERANCE * max(expected.norm().item(), 1e-6 * scale)


def synthetic_examples(model: nn.Module, schema: ExampleSchema, count: int) -> tuple[Tensor, Tensor]:
    """``count`` distinct made-up examples of ``schema`` on the model's device: never rows of the data.

    Floating-point inputs are standard normal; integer inputs (token ids)
    lie below the smallest vocabulary of the model's embeddings (0 or 1
    without one). Integer labels lie below every non-batch dimension of the
    model's output on these inputs, which keeps them valid class indices
    wherever the class dimension is; floating-point labels lie in [0, 1).
    """
    generator = torch.Generator().manual_seed(SYNTHETIC_EXAMPLES_SEED)
    inputs = _synthetic_values((count, *schema.input_shape), schema.input_dtype, _index_range(model), generator)
    inputs = inputs.to(clipping.device_of(model))
    classes = 2
    if not schema.label_dtype.is_floating_point and schema.label_dtype != torch.bool:
        random_state = _random_state()
        try:
            with torch.no_grad(), _DropoutOff():
                outputs = copy.deepcopy(model)(inputs)
        finally:
            _restore_random_state(random_state)
        classes = min(outputs.shape[1:], default=2) if isinstance(outputs, Tensor) else 2
    labels = _synthetic_values((count, *schema.label_shape), schema.label_dtype, max(1, classes), generator)
    return inputs, labels.to(inputs.device)


class ModelDoesNotFitData(ValueError):
    """A model that fails a plain forward pass and loss on synthetic examples of the data's schema.

    That is the model's fault (a first layer of another size, an output the
    loss does not take), not the engine's: no engine would run it, so it is
    refused, never handed to another engine. An engine falls back only where
    it cannot show each example's own gradient on a model that runs.
    """


def plain_pass(model: nn.Module, schema: ExampleSchema, loss_fn: clipping.LossFunction,
               count: int) -> tuple[Tensor, Tensor]:
    """``count`` synthetic examples of ``schema``, once a plain forward pass and loss of (a copy of) ``model`` ran
    on them, without gradients; the generator and the model are left as they were.

    Raises ModelDoesNotFitData with the error when either fails, or when
    the loss broadcasts an output and labels of different sizes.
    """
    random_state = _random_state()
    try:
        inputs, labels = synthetic_examples(model, schema, count)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="Using a target size")
            loss_fn(copy.deepcopy(model)(inputs), labels)
    except UnsupportedModuleError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's model or loss raised, named in one message
        dtype = str(schema.input_dtype).removeprefix("torch.")
        raise ModelDoesNotFitData(
            f"the model fails a plain forward pass and loss on synthetic examples of the data's shape (input "
            f"{list(schema.input_shape)} {dtype}): {_first_line(error)}; make the model take inputs of this shape "
            "and give an output the loss takes") from error
    finally:
        _restore_random_state(random_state)
    return inputs, labels


def _index_range(model: nn.Module) -> int:
    sizes = [module.num_embeddings for module in model.modules() if isinstance(module, (nn.Embedding, nn.EmbeddingBag))]
    return min(sizes, default=2)


def _synthetic_values(
    shape: tuple[int, ...], dtype: torch.dtype, index_range: int, generator: torch.Generator
) -> Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, index_range, shape, generator=generator).to(dtype)


def settle_plan(
    model: nn.Module, flat_weights: Tensor, schema: ExampleSchema, loss_fn: clipping.LossFunction,
) -> EnginePlan:
    """The fast engine's plan for ``model`` on examples of ``schema``: checked once on synthetic examples, then kept.

    The check (``check_rules``) sees only made-up examples of the schema,
    so nothing about the plan, or the log line that reports it, comes from
    private data. A plan that falls back to the vmap engine warns once,
    naming why; that is for rules the check cannot show, never for a model
    that fails a plain forward pass and loss on the examples (``plain_pass``
    raises ModelDoesNotFitData). Raises UnsupportedModuleError for a model
    that mixes examples.
    """
    key = (schema, loss_fn)
    plan = _PLANS.get(model, {}).get(key)
    if plan is None:
        inputs, labels = plain_pass(model, schema, loss_fn, RULE_CHECK_EXAMPLES)
        try:
            plan = check_rules(model, flat_weights, inputs, labels, loss_fn)
        except UnsupportedModuleError:
            raise
        except Exception as error:  # noqa: BLE001 - rules the check cannot run on a model that runs: example by example
            plan = _whole_model_fallback(_units(model),
                                         f"it cannot be checked on synthetic examples ({_first_line(error)})")
        _keep_plan(model, key, plan)
        if plan.fallback is not None:
            _warn_fallback(plan.fallback)
    return plan


def prepare_engine(engine: str, model: nn.Module, schema: ExampleSchema, loss_fn: clipping.LossFunction) -> None:
    """Before any private example: refuse a model that mixes examples and, for the fast engine, settle its plan.

    Both run on synthetic examples of ``schema`` at the model's own
    parameters (``settle_plan``; for the vmap engine, ``check_independence``
    alone). Raises UnsupportedModuleError naming the module and the fix, and
    ModelDoesNotFitData for a model that fails a plain forward pass and loss
    on them: no engine serves it.
    """
    check_engine(engine)
    weights = flat_parameters(model)
    if not weights.numel():
        return
    _refuse_buffer_writes(model, schema)
    if engine == "fast":
        settle_plan(model, weights, schema, loss_fn)
        return
    inputs, _ = plain_pass(model, schema, loss_fn, RULE_CHECK_EXAMPLES)
    reference = copy.deepcopy(model).to(torch.float64)
    _, params, _ = clipping.functional_parameters(reference, weights, clipping.device_of(reference))
    random_state = _random_state()
    try:
        unchecked = check_independence(reference, params, inputs.to(torch.float64) if inputs.is_floating_point()
                                       else inputs)
    except UnsupportedModuleError:
        raise
    except Exception as error:  # noqa: BLE001 - the vmap engine computes each example alone either way
        unchecked = f"it cannot run on synthetic examples ({_first_line(error)})"
    finally:
        _restore_random_state(random_state)
    if unchecked is not None:
        warnings.warn(f"vmap clipping engine: whether this model mixes examples is not checked: {unchecked}; "
                      "each example's gradient is computed alone", stacklevel=2)


def _refuse_buffer_writes(model: nn.Module, schema: ExampleSchema) -> None:
    """Refuse, naming each buffer, a model whose training forward pass on synthetic examples writes a buffer.

    A buffer written in training would learn from private batches, so the
    refusal comes first, before any check that the write could confuse.
    """
    random_state = _random_state()
    try:
        inputs, _ = synthetic_examples(model, schema, RULE_CHECK_EXAMPLES)
        with unchanged_buffers(model), torch.no_grad():
            model(inputs)
    except UnsupportedModuleError:
        raise
    except Exception:  # noqa: BLE001 - a forward pass that fails here fails again, and is reported, in the checks
        pass
    finally:
        _restore_random_state(random_state)


@clipping.in_ieee_float32
def check_rules(
    model: nn.Module, flat_weights: Tensor, inputs: Tensor, labels: Tensor, loss_fn: clipping.LossFunction,
) -> EnginePlan:
    """Show on at least 2 (synthetic) examples that the rules give each example's own gradient, in float64.

    On a float64 copy of the model:

    1. Examples must not mix (``check_independence``): a module whose output
       for one example moves with the others is refused.
    2. With the random generator replayed so that dropout draws the same
       masks, the rules' gradients are compared with autograd's on the same
       batch: each example's own gradient (the clipped sum with a one-hot
       factor, and its squared norm) and the sum over examples, each to
       relative ``RULE_CHECK_TOLERANCE``. Every operation of the forward pass
       is watched for a parameter used outside the layer whose rule covers
       it (a functionally tied weight, a weight read by another module).
    3. With dropout off, one example is changed and the rules on the new
       batch are compared with autograd on each example alone, the gradient
       the engines promise: a change of one example must leave every other
       example's gradient where it was.

    The check is the same for every precision, and runs without autocast.
    Under "bf16" the rules compute in float32 on float32 casts of what a
    bfloat16 pass recorded: the same functions of (input, output gradient)
    that this check holds to autograd, so the check covers them. A check
    under bfloat16 would have to allow about 1% of rounding, enough to pass
    a rule that is wrong by less; the bound itself never rests on the
    rounding, since the norm and the contribution come from one set of
    tensors.

    Any failure (an exception in a rule included), or a model the per-layer
    view cannot serve, yields a plan that runs the whole model on the vmap
    engine, with the reason naming the module or parameter. Raises
    UnsupportedModuleError for a model that mixes examples, and ValueError
    for fewer than 2 examples. The generator's state is left as it was found.
    """
    if inputs.shape[0] < 2:
        raise ValueError(f"the rule check needs at least 2 examples (got {inputs.shape[0]}): mixing across a batch "
                         "cannot show in one; give it synthetic_examples(model, schema, RULE_CHECK_EXAMPLES)")
    units = _units(model)
    reference = copy.deepcopy(model).to(torch.float64)
    reference_units = _units(reference)
    _, params, _ = clipping.functional_parameters(reference, flat_weights, clipping.device_of(reference))
    inputs = inputs.to(clipping.device_of(reference))
    inputs = inputs.to(torch.float64) if inputs.is_floating_point() else inputs
    labels = labels.to(inputs.device)
    labels = labels.to(torch.float64) if labels.is_floating_point() else labels
    random_state = _random_state()
    try:
        unchecked = check_independence(reference, params, inputs)
        if unchecked is not None:
            return _whole_model_fallback(units, unchecked)
        reason = _unsupported_reason(model, units)
        if reason is not None:
            return _whole_model_fallback(units, reason)
        owners_of: dict[str, tuple[int, ...]] = {}
        for index, reference_unit in enumerate(reference_units):
            for name in reference_unit.names:
                canonical = reference_unit.canonical_name(name)
                owners_of[canonical] = (*owners_of.get(canonical, ()), index)
        tracker = _ParameterUseTracker({id(params[name]): owners_of[name] for name in params},
                                       {id(params[name]): name for name in params})
        try:
            calls = _record(reference, reference_units, params, inputs, labels, loss_fn, tracker)
            with torch.no_grad():
                gradients = _rule_gradients(reference_units, calls, params, inputs.shape[0])
        except WholeModelFallback as fallback:
            return _whole_model_fallback(units, str(fallback))
        if tracker.outside:
            used = "; ".join(f"{name} (by {operation})" for name, operation in tracker.outside.items())
            return _whole_model_fallback(units, f"the model's forward uses {used} outside the layer that owns it")

        def expected(summed: bool = False) -> Iterator[dict[str, Tensor]]:
            _restore_random_state(random_state)
            return _autograd_gradients(reference, params, inputs, labels, loss_fn, summed)

        squared_total = sum(gradient.square().sum().item() for row in expected() for gradient in row.values())
        if not math.isfinite(squared_total):
            return _whole_model_fallback(units, "the gradient of synthetic examples is not finite, so the layer "
                                                "rules cannot be checked on them")
        scale = math.sqrt(squared_total)
        wrong = _disagreeing_parameters(params, gradients, expected, inputs.shape[0], scale)
        if not wrong:
            wrong = _disagreeing_after_a_change(reference, reference_units, params, inputs, labels, loss_fn, scale)
    except WholeModelFallback as fallback:
        return _whole_model_fallback(units, str(fallback))
    finally:
        _restore_random_state(random_state)
    if wrong:
        return _whole_model_fallback(
            units, f"the layer rules do not reproduce autograd's per-example gradient of {', '.join(wrong)}"
        )
    return EnginePlan(None, tuple((unit.title, _how(unit, gradients)) for unit in reference_units))


def _disagreeing_after_a_change(
    model: nn.Module, units: list[_Unit], params: dict[str, Tensor], inputs: Tensor, labels: Tensor,
    loss_fn: clipping.LossFunction, scale: float,
) -> list[str]:
    """The parameters whose rule, on the batch with example 0 changed, misses any example's gradient taken alone."""
    changed = inputs.clone()
    changed[0] = -inputs[0] if inputs.is_floating_point() else inputs[-1]
    with _DropoutOff():
        calls = _record(model, units, params, changed, labels, loss_fn)
        with torch.no_grad():
            gradients = _rule_gradients(units, calls, params, inputs.shape[0])

        def alone(summed: bool = False) -> Iterator[dict[str, Tensor]]:
            return _autograd_gradients(model, params, changed, labels, loss_fn, summed, alone=True)

        return _disagreeing_parameters(params, gradients, alone, inputs.shape[0], scale)


# ---------------------------------------------------------------------------
# Independence of the examples in a batch


class _DropoutOff(TorchFunctionMode):
    """Dropout as the identity: without random masks, a batch and its examples taken alone can be compared.

    Dropout draws each example's mask on its own, so it never mixes examples;
    any other random draw in the forward pass is noticed by the check.
    """

    IDENTITIES = frozenset({
        F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
        torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
    })
    # Functions that draw attention dropout inside, and the position of their dropout_p argument.
    DROPOUT_PROBABILITY = {F.scaled_dot_product_attention: 4, F.multi_head_attention_forward: 10}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.IDENTITIES:
            return args[0] if args else kwargs["input"]
        position = self.DROPOUT_PROBABILITY.get(func)
        if position is not None:
            if len(args) > position:
                args = (*args[:position], 0.0, *args[position + 1:])
            elif "dropout_p" in kwargs:
                kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)


@dataclass(frozen=True)
class _ModuleCall:
    name: str
    module: nn.Module
    inputs: list[Tensor]
    outputs: list[Tensor]


def _module_calls(model: nn.Module, params: Mapping[str, Tensor], inputs: Tensor) -> list[_ModuleCall]:
    """Every module call of one forward pass, in the order the calls finish, with copies of their tensors."""
    calls: list[_ModuleCall] = []

    def tensors(value: Any) -> list[Tensor]:
        return [leaf.detach().clone() for leaf in tree_flatten(value)[0] if isinstance(leaf, Tensor)]

    def hook(name: str) -> Callable:
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            calls.append(_ModuleCall(name, module, tensors((args, kwargs)), tensors(output)))
        return record

    handles = [module.register_forward_hook(hook(name), with_kwargs=True) for name, module in model.named_modules()]
    try:
        with torch.no_grad():
            functional_call(model, params, (inputs,))
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _same(actual: Tensor, expected: Tensor) -> bool:
    if not (actual.is_floating_point() or actual.is_complex()):
        return torch.equal(actual, expected)
    return (actual - expected).abs().max().item() <= 1e-7 * max(expected.abs().max().item(), 1e-12)


def _rows_agree(batched: Tensor, alone: list[Tensor]) -> bool | None:
    """Whether a tensor of a batch holds, example by example, the tensor of each example taken alone.

    The batch may lie along any dimension, folded with others ([B * T, D]
    against [T, D]), or nowhere (a table shared by all examples, which must
    then equal every example's). None when the shapes do not tell.
    """
    count = len(alone)
    if any(tensor.shape != alone[0].shape for tensor in alone):
        return None
    if batched.shape == alone[0].shape:
        return all(_same(batched, tensor) for tensor in alone)
    candidates = [
        dim for dim in range(batched.dim())
        if batched.dim() == alone[0].dim() and batched.shape[dim] == count * alone[0].shape[dim]
        and all(batched.shape[other] == alone[0].shape[other] for other in range(batched.dim()) if other != dim)
    ]
    if not candidates:
        return None
    return any(
        all(_same(batched.narrow(dim, index * alone[0].shape[dim], alone[0].shape[dim]), tensor)
            for index, tensor in enumerate(alone))
        for dim in candidates
    )


def check_independence(model: nn.Module, params: Mapping[str, Tensor], inputs: Tensor) -> str | None:
    """Raise UnsupportedModuleError, naming the module and the fix, when one example's output depends on the others.

    With dropout off, every module call of the forward pass over ``inputs``
    (at least 2 examples) is compared with the same call for each example
    taken alone. The module blamed is the first call to finish whose inputs
    agree, example by example, and whose outputs do not: the deepest module
    where the examples meet. Returns None when the examples are independent,
    or why independence cannot be checked (a forward pass that draws random
    numbers other than dropout's, or that calls other modules for a batch
    than for one example): the caller then computes each example alone.
    """
    before = _random_state()
    with _DropoutOff():
        batched = _module_calls(model, params, inputs)
        drew = not _same_random_state(before, _random_state())
        alone = [_module_calls(model, params, inputs[index:index + 1]) for index in range(inputs.shape[0])]
    if drew:
        return "its forward pass draws random numbers other than dropout masks, so its examples' independence " \
               "cannot be checked"
    if any([call.name for call in calls] != [call.name for call in batched] for calls in alone):
        return "its forward pass calls other modules for a batch than for one example"
    for position, call in enumerate(batched):
        alone_calls = [calls[position] for calls in alone]
        inputs_agree = _all_agree(call.inputs, [alone_call.inputs for alone_call in alone_calls])
        if inputs_agree and _all_agree(call.outputs, [alone_call.outputs for alone_call in alone_calls]) is False:
            raise UnsupportedModuleError(_mixing_message(call))
    return None


def _all_agree(batched: list[Tensor], alone: list[list[Tensor]]) -> bool | None:
    """False when a tensor of the batch differs from the examples' alone; None when one cannot be compared."""
    if any(len(tensors) != len(batched) for tensors in alone):
        return None
    agreements = [_rows_agree(tensor, [tensors[index] for tensors in alone]) for index, tensor in enumerate(batched)]
    return False if False in agreements else None if None in agreements else True


def _mixing_message(call: _ModuleCall) -> str:
    module = call.module
    attention = next((inner for inner in module.modules() if isinstance(inner, nn.MultiheadAttention)), None)
    if attention is not None and not attention.batch_first:
        fix = ("nn.MultiheadAttention with batch_first=False attends along dimension 0, where this model keeps its "
               "examples: set batch_first=True on it (or on the transformer layer that holds it) for [B, T, F] "
               "inputs, or give it [T, B, F]")
    else:
        fix = ("compute it within each example, never across dimension 0 (the batch): for normalisation use "
               "nn.LayerNorm or nn.GroupNorm, and take means, softmaxes and attention over an example's own positions")
    return (f"{call.name or '(model)'} ({type(module).__name__}) mixes examples within a batch: its output for one "
            f"example changes with the other examples, which breaks per-example gradient clipping. Fix: {fix}.")


def _how(unit: _Unit, gradients: Mapping[str, ParameterGradients]) -> str:
    if unit.rule is vmap_rule or unit.rule is attention_rule:
        return f"vmap (fallback: no book-keeping rule for {type(unit.layer).__name__})"
    paths = {gradients[unit.canonical_name(name)].path for name in unit.names
             if unit.canonical_name(name) in gradients}
    return "fast (ghost)" if "ghost" in paths else "fast (per-example)"


def _autograd_gradients(
    model: nn.Module, params: Mapping[str, Tensor], inputs: Tensor, labels: Tensor, loss_fn: clipping.LossFunction,
    summed: bool = False, alone: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """Autograd's gradients by name: each example's in turn, or with ``summed`` the one of the summed loss.

    One batched forward, then one backward pass per example (or one in all);
    with ``alone``, one forward and backward pass per example on its own.
    Yielded one at a time, so that a check holds one gradient of a large
    model, not one per example.
    """
    if alone:
        rows = (next(_autograd_gradients(model, params, inputs[index:index + 1], labels[index:index + 1], loss_fn))
                for index in range(inputs.shape[0]))
        if not summed:
            yield from rows
            return
        total: dict[str, Tensor] = {}
        for row in rows:
            total = {name: total[name] + gradient if name in total else gradient for name, gradient in row.items()}
        yield total
        return
    leaves = {name: value.detach().requires_grad_() for name, value in params.items()}
    with torch.enable_grad():
        # Unbound here: a view taken under the caller's no_grad would have no graph.
        losses = per_example_losses(loss_fn, functional_call(model, leaves, (inputs,)), labels)
        losses = [losses.sum()] if summed else losses.unbind(0)
    for loss in losses:
        grads = torch.autograd.grad(loss, list(leaves.values()), retain_graph=not summed, allow_unused=True)
        yield {name: torch.zeros_like(leaf) if gradient is None else gradient
               for (name, leaf), gradient in zip(leaves.items(), grads, strict=True)}


def _disagreeing_parameters(
    params: Mapping[str, Tensor], gradients: Mapping[str, ParameterGradients],
    expected: Callable[..., Iterator[dict[str, Tensor]]], batch_size: int, scale: float,
) -> list[str]:
    """The parameters whose rule misses autograd's per-example gradient, its squared norm or the summed loss's.

    ``expected()`` yields autograd's gradients example by example,
    ``expected(summed=True)`` the summed loss's; ``scale`` (the norm of all
    the examples' gradients together) sets the tolerance's unit.
    """
    wrong: set[str] = set()
    with torch.no_grad():
        for index, row in enumerate(expected()):
            for name, value in params.items():
                rule = gradients.get(name)
                if rule is None:
                    if row[name].norm().item() > 1e-6 * scale:
                        wrong.add(name)
                    continue
                one_hot = torch.zeros(batch_size, dtype=value.dtype, device=value.device)
                one_hot[index] = 1
                if (_mismatch(rule.clipped_sum(one_hot), row[name], scale)
                        or _mismatch(rule.squared_norms[index].reshape(1), row[name].square().sum().reshape(1),
                                     scale**2)):
                    wrong.add(name)
        for total in expected(summed=True):
            for name, rule in gradients.items():
                ones = torch.ones(batch_size, dtype=total[name].dtype, device=total[name].device)
                if name in total and _mismatch(rule.clipped_sum(ones), total[name], scale):
                    wrong.add(name)
    return [name for name in params if name in wrong]


def _random_state() -> tuple[Tensor, list[Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _same_random_state(first: tuple[Tensor, list[Tensor] | None], second: tuple[Tensor, list[Tensor] | None]) -> bool:
    return torch.equal(first[0], second[0]) and (
        first[1] is None or second[1] is None or all(map(torch.equal, first[1], second[1]))
    )


def _restore_random_state(state: tuple[Tensor, list[Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


# ---------------------------------------------------------------------------
# The engine


@keeps_buffers
@clipping.in_ieee_float32
def fast_clipped_sum(
    model: nn.Module,
    flat_weights: Tensor,
    inputs: Tensor,
    labels: Tensor,
    clip_norm: clipping.ClipNorm,
    max_physical_batch: int,
    loss_fn: clipping.LossFunction = F.cross_entropy,
    return_norms: bool = False,
    augmentations: int = 1,
    precision: str = "fp32",
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """Sum over examples of each example's gradient clipped to L2 norm ``clip_norm``, by book-keeping.

    Same arguments, result and guarantees as
    ``workers.vmap_engine.per_example_clipped_sum``: a 1-D float32 tensor laid out
    as ``flat_parameters``, zeros when there are no examples; an example whose
    gradient is not finite contributes exactly zero (its norm is returned as
    it came out, not finite); the model's parameters and their ``.grad`` are
    neither used nor changed (hooks are added to its modules for the duration
    of the call only). With ``return_norms`` it also returns, per trainable
    parameter name, the [n] per-example L2 norms of that parameter's gradient,
    before clipping.

    The first call for each model, example schema (``ExampleSchema``: the
    shapes and dtypes of an example's input and label) and loss settles a
    plan (``settle_plan``) by checking the rules on synthetic examples of
    that schema, never on the examples given; a model they cannot serve runs
    on the vmap engine from then on, with one warning that says why
    (``engine_plan`` tells). A model that mixes examples within a batch is
    refused (UnsupportedModuleError). A rule that fails during a call hands
    the model, for this schema, to the vmap engine, which computes the
    whole call again: a call never returns a partial sum.

    With ``augmentations`` K > 1 the layer rules, which see one example per
    row, cannot give the norm of the mean of K rows' gradients: the call runs
    on the vmap engine, which takes each example's K views in one
    per-example gradient.

    With ``precision`` "bf16" the forward and backward passes run under
    bfloat16 autocast and every recorded layer input and output gradient is
    cast to float32 before the rules take norms and sums from them, so each
    example's norm and its clipped contribution come from the same float32
    tensors and the contribution has norm <= ``clip_norm``. The plan's rule
    check is the same for both precisions (see ``check_rules``).
    """
    clipping.check_precision(precision)
    clipping.check_arguments(model, flat_weights, inputs, labels, clip_norm, max_physical_batch)
    device = clipping.device_of(model)
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    if not trainable:
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return (empty, {}) if return_norms else empty
    vmap_physical_batch = fallback_physical_batch(max_physical_batch, sum(p.numel() for _, p in trainable))
    if augmentations != 1:
        return per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm, vmap_physical_batch,
                                       loss_fn, return_norms, augmentations, precision)
    schema = ExampleSchema.of(inputs, labels)
    plan = settle_plan(model, flat_weights, schema, loss_fn)
    if plan.fallback is None:
        try:
            return _book_keeping(model, _units(model), trainable, flat_weights, inputs, labels, clip_norm,
                                 max_physical_batch, loss_fn, return_norms, device, precision)
        except WholeModelFallback as fallback:
            plan = _whole_model_fallback(_units(model), str(fallback))
            _keep_plan(model, (schema, loss_fn), plan)
            _warn_fallback(plan.fallback)
    return per_example_clipped_sum(model, flat_weights, inputs, labels, clip_norm, vmap_physical_batch,
                                   loss_fn, return_norms, precision=precision)


def fallback_physical_batch(max_physical_batch: int, trainable_elements: int) -> int:
    """How many examples the vmap fallback takes at a time: ``max_physical_batch``, fewer for a large model.

    ``max_physical_batch`` is chosen for the fast engine, which never holds a
    whole per-example gradient. The vmap engine holds one per example, so a
    chunk is also capped at ``VMAP_FALLBACK_GRADIENT_ELEMENTS`` gradient
    entries in all (128 MiB of float32): past that, memory traffic makes a
    step slower, not faster.
    """
    return max(1, min(max_physical_batch, VMAP_FALLBACK_GRADIENT_ELEMENTS // max(1, trainable_elements)))


def _warn_fallback(reason: str) -> None:
    warnings.warn(f"fast clipping engine: {reason}; computing this model's clipped sum with the vmap engine",
                  stacklevel=4)


def _book_keeping(
    model: nn.Module, units: list[_Unit], trainable: list[tuple[str, nn.Parameter]], flat_weights: Tensor,
    inputs: Tensor, labels: Tensor, clip_norm: clipping.ClipNorm, max_physical_batch: int, loss_fn: clipping.LossFunction,
    return_norms: bool, device: torch.device, precision: str,
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    weights = flat_weights.detach().to(device=device, dtype=torch.float32)
    params = {
        name: chunk.view(parameter.shape).to(parameter.dtype)
        for (name, parameter), chunk in zip(trainable, torch.split(weights, [p.numel() for _, p in trainable]),
                                            strict=True)
    }
    flat = torch.zeros(weights.shape, dtype=torch.float32, device=device)
    # Each parameter's sum accumulates in its own slice of the result.
    sums = {
        name: chunk.view(parameter.shape)
        for (name, parameter), chunk in zip(trainable, torch.split(flat, [p.numel() for _, p in trainable]),
                                            strict=True)
    }
    norms = torch.zeros(len(sums), inputs.shape[0], device=device)
    inputs, labels = inputs.to(device), labels.to(device)
    for start in range(0, inputs.shape[0], max_physical_batch):
        # Positions in the batch of the examples still taking part in this chunk.
        positions = torch.arange(start, min(start + max_physical_batch, inputs.shape[0]), device=device)
        while positions.numel():
            calls = _in_float32(_record(model, units, params, inputs[positions], labels[positions], loss_fn,
                                        precision=precision))
            # The recorded inputs are part of the forward graph; nothing below is to be differentiated.
            with torch.no_grad():
                gradients = _rule_gradients(units, calls, params, positions.numel())
                squared = torch.stack([
                    gradients[name].squared_norms.to(torch.float32) if name in gradients
                    else torch.zeros(positions.numel(), device=device)
                    for name in sums
                ])
                norms[:, positions] = squared.sqrt()
                finite = squared.sum(0).isfinite()
                if not finite.all():
                    # Batched clipped sums would carry a non-finite gradient into every entry it touches,
                    # even at factor 0: the chunk runs again without the examples that have one.
                    positions = positions[finite]
                    continue
                factors = clipping.clip_factors_by_parameter(dict(zip(sums, squared)), clip_norm)
                for name, parameter_gradients in gradients.items():
                    sums[name] += parameter_gradients.clipped_sum(factors[name])
            break
    if not return_norms:
        return flat
    return flat, dict(zip(sums, norms))


# ---------------------------------------------------------------------------
# The engines by name

ENGINES: dict[str, Callable[..., Tensor | tuple[Tensor, dict[str, Tensor]]]] = {
    "fast": fast_clipped_sum,
    "vmap": per_example_clipped_sum,
}
"""Clipping engines by name: "fast" (book-keeping, the default) and "vmap" (torch.func, the reference).
Their names are ``workers.names.ENGINE_NAMES``, which configs are checked against."""


def check_engine(engine: str) -> None:
    """Raise ValueError unless ``engine`` names one of ``ENGINES``."""
    if engine not in ENGINES:
        raise ValueError(
            f"engine must be one of {', '.join(repr(name) for name in ENGINES)} (got {engine!r}); "
            "'fast' is the default, 'vmap' the slower reference engine"
        )


def clipped_sum(
    engine: str,
    model: nn.Module,
    flat_weights: Tensor,
    inputs: Tensor,
    labels: Tensor,
    clip_norm: clipping.ClipNorm,
    max_physical_batch: int,
    loss_fn: clipping.LossFunction = F.cross_entropy,
    return_norms: bool = False,
    augmentations: int = 1,
    precision: str = "fp32",
) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
    """``per_example_clipped_sum`` computed by the named engine (see ``ENGINES``); same arguments and result."""
    check_engine(engine)
    return ENGINES[engine](model, flat_weights, inputs, labels, clip_norm, max_physical_batch, loss_fn, return_norms,
                           augmentations, precision=precision)
