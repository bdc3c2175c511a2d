"""Run the traced graph node by node on the example inputs, with real or fake tensors.

Shape propagation, FLOP counting and time profiling all need the same thing: each node run on
the values it really receives, with a hook around it. ``real`` runs the model's own tensors
(exact, and the only way through control flow that reads tensor values); ``fake`` runs
``FakeTensorMode`` tensors that carry shape, dtype and device but no storage, so a model built
on the ``meta`` device (no weights in memory) can be planned. ``auto`` picks ``fake`` exactly
when the model or the inputs hold meta tensors.

A real run replays one random seed and restores the buffers afterwards (as ``verify`` does), so
the user's model is left as it was.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map_only

from autoshard.errors import AutoshardError, InvalidArgumentError, ShapePropagationError
from autoshard.isolation import PlainInterpreter, cloned, grad_mode_unchecked, run_seeded

if TYPE_CHECKING:  # pragma: no cover - imported for annotations only
    from autoshard.inputs import ExampleInputs

Mode = Literal["auto", "real", "fake"]

COMPUTE_OPS = ("call_module", "call_function", "call_method")
"""The fx node kinds that compute something (and become DAG nodes)."""


@dataclass(frozen=True)
class NodeCall:
    """One node about to run, with the values it receives.

    ``run`` may be called again for a compute node (to time it); a placeholder runs once.
    """

    node: fx.Node
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    interpreter: PlainInterpreter

    def run(self, args: tuple[Any, ...] | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """Run the node on its own inputs, or on ``args`` / ``kwargs`` given in their place."""
        call = getattr(self.interpreter, self.node.op)
        return call(self.node.target, self.args if args is None else args, self.kwargs if kwargs is None else kwargs)


NodeHook = Callable[[NodeCall], Any]
"""``hook(call)``: must run the node (``call.run()``) and return its value."""

_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def holds_meta_tensors(module: torch.nn.Module, inputs: "ExampleInputs") -> bool:
    """Whether any parameter, buffer or example input lives on the ``meta`` device."""
    flat, _ = tree_flatten((list(inputs.args), dict(inputs.kwargs)))
    tensors = itertools.chain(module.parameters(), module.buffers(), (v for v in flat if isinstance(v, torch.Tensor)))
    return any(t.is_meta for t in tensors)


def resolve_mode(module: torch.nn.Module, inputs: "ExampleInputs", mode: Mode) -> Literal["real", "fake"]:
    """``auto`` -> ``fake`` when meta tensors are involved, else ``real``; refuse real meta runs."""
    meta = holds_meta_tensors(module, inputs)
    if mode == "auto":
        return "fake" if meta else "real"
    if mode == "real" and meta:
        raise InvalidArgumentError(
            "cannot run the model with real tensors: it holds tensors on the meta device, which have "
            "no values; materialise the model first (times are measured on real tensors), or let "
            "shape-prop use mode=fake (or auto)")
    return mode


def placeholder_values(gm: fx.GraphModule, inputs: "ExampleInputs") -> list[Any]:
    """The example inputs in placeholder order, with the forward's defaults filled in."""
    try:
        bound = inspect.signature(gm.forward).bind(*inputs.args, **dict(inputs.kwargs))
    except TypeError as exc:
        raise InvalidArgumentError(
            f"the example inputs do not match the traced forward{inspect.signature(gm.forward)}: {exc}") from None
    bound.apply_defaults()
    return [bound.arguments[str(node.target)] for node in gm.graph.nodes if node.op == "placeholder"]


#: Tensor methods that only tell autograd something, and change no value.
_AUTOGRAD_ONLY = frozenset({"register_hook", "retain_grad", "register_post_accumulate_grad_hook"})


class _HookedInterpreter(PlainInterpreter):
    def __init__(self, gm: fx.GraphModule, hook: NodeHook, mode: str) -> None:
        super().__init__(gm)
        self.extra_traceback = False  # our errors name the node already; torch's addendum is noise
        self.hook = hook
        self.mode = mode

    def call_method(self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """As the graph's code calls it, but for a method that only tells autograd something (a hook a
        forward registers on a tensor) on a tensor that takes no gradient: these runs are without grad,
        where such a call raises, and skipping it changes no value."""
        if target in _AUTOGRAD_ONLY and isinstance(args[0], torch.Tensor) and not args[0].requires_grad:
            return None
        return super().call_method(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        try:
            with self._set_current_node(n):
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                return self.hook(NodeCall(n, args, kwargs, self))
        except AutoshardError:
            raise
        except Exception as exc:  # noqa: BLE001 - name the node whatever went wrong
            hint = ""
            if self.mode == "fake" and isinstance(exc, _DATA_DEPENDENT):
                hint = ("; fake and meta tensors have no values and this node reads one (control flow "
                        "or .item() on a tensor): materialise the model and run with mode=real")
            first_line = next(iter(str(exc).strip().splitlines()), "")
            raise ShapePropagationError(
                f"running node '{n.name}' ({n.op} {n.target}) on the example inputs with {self.mode} tensors "
                f"failed: {type(exc).__name__}: {first_line}{hint}") from exc


def run_graph(gm: fx.GraphModule, inputs: "ExampleInputs", mode: Mode, hook: NodeHook, seed: int = 0) -> Any:
    """Run ``gm`` on ``inputs`` calling ``hook`` around every node; return the graph's output.

    Gradients are off (a hook may turn them on locally; the graph's grad-mode guards let that be).
    With fake tensors the output is fake.
    """
    chosen = resolve_mode(gm, inputs, mode)
    values = placeholder_values(gm, inputs)
    interpreter = _HookedInterpreter(gm, hook, chosen)
    if chosen == "real":  # on a copy: a graph that writes to its inputs must not write to the user's
        with grad_mode_unchecked():
            return run_seeded(lambda: interpreter.run(*cloned(values)), gm, seed)
    on_meta = holds_meta_tensors(gm, inputs)
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, torch.no_grad(), grad_mode_unchecked():
        def to_fake(t: torch.Tensor) -> torch.Tensor:
            return fake.from_tensor(t.to("meta") if on_meta else t)

        return interpreter.run(*tree_map_only(torch.Tensor, to_fake, values))


@contextlib.contextmanager
def on_threads(threads: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside (None: left as they are) and the caller's
    set back after: what a CPU measurement runs on moves its times several fold."""
    caller = torch.get_num_threads()
    torch.set_num_threads(threads or caller)
    try:
        yield
    finally:
        torch.set_num_threads(caller)
