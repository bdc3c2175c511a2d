"""The pass registry: pass name -> ``Pass`` subclass.

Built-in passes are registered explicitly (``autoshard.passes`` does it from one tuple); third-party
passes plug in through the ``autoshard.passes`` entry-point group, where each entry point's name is
the pass name and its object is the ``Pass`` subclass::

    [project.entry-points."autoshard.passes"]
    my-split = "my_pkg.passes:MySplitPass"

Plugins are loaded lazily: looking up a name imports only that plugin; listing imports all of them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from importlib import metadata
from typing import Callable, ClassVar, Iterable, Iterator, TypeVar, overload

from autoshard.errors import InvalidArgumentTypeError, SpecError, suggest
from autoshard.passes.base import Pass, PassContext, ShardProgram
from autoshard.passes.options import option_types

__all__ = [
    "ENTRY_POINT_GROUP",
    "PassRegistry",
    "check_pass_class",
    "default_registry",
    "function_pass",
    "get_pass",
    "register_pass",
    "registered_passes",
]

ENTRY_POINT_GROUP = "autoshard.passes"

_KEBAB = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_SNAKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")

P = TypeVar("P", bound=type[Pass])


def _generated_dataclass_doc(cls: type) -> str:
    """The docstring ``@dataclass`` invents for a class that has none."""
    try:
        sig = str(inspect.signature(cls)).replace(" -> None", "")
    except (TypeError, ValueError):  # pragma: no cover - mirrors dataclasses
        sig = ""
    return cls.__name__ + sig


def check_pass_class(cls: object) -> None:
    """Raise ``SpecError`` unless ``cls`` is a well-formed pass class.

    Checked: a subclass of ``Pass`` decorated with ``@dataclass(frozen=True)`` itself, not abstract,
    a kebab-case ``name``, a docstring, ``requires``/``provides`` naming ``ShardProgram`` fields (all
    three ``ClassVar``s, not options), and snake_case options whose types the text syntax can express.
    """
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        raise SpecError(f"cannot register {cls!r}: a pass must be a subclass of autoshard.passes.base.Pass")
    label = f"pass class {cls.__qualname__}"
    name = cls.__dict__.get("name", getattr(cls, "name", None))
    if not isinstance(name, str):
        raise SpecError(f'{label} has no name: add `name: ClassVar[str] = "my-pass"`')
    if not _KEBAB.fullmatch(name):
        raise SpecError(
            f"{label} has name {name!r}, which is not kebab-case: use lower-case words joined by '-', "
            f"e.g. {_to_kebab(name)!r}"
        )
    params = cls.__dict__.get("__dataclass_params__")
    if params is None or not params.frozen:
        raise SpecError(
            f"{label} ('{name}') must be decorated with @dataclass(frozen=True) itself: its fields are "
            "its options and a pass keeps no mutable state"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise SpecError(f"{label} ('{name}') is abstract: implement {missing}")
    doc = cls.__doc__
    if not doc or not doc.strip() or doc == _generated_dataclass_doc(cls):
        raise SpecError(
            f"{label} ('{name}') has no docstring: its first line is the summary `autoshard passes` lists"
        )
    artifacts = ShardProgram.artifact_names()
    for attr in ("requires", "provides", "reads"):
        declared = getattr(cls, attr)
        if not isinstance(declared, frozenset):
            raise SpecError(f"{label} ('{name}'): `{attr}` must be a frozenset of artifact names")
        for artifact in sorted(declared):
            if artifact not in artifacts:
                raise SpecError(
                    f"{label} ('{name}') {attr} unknown artifact {artifact!r}{suggest(str(artifact), artifacts)}; "
                    f"artifacts are the ShardProgram fields: {', '.join(artifacts)}"
                )
    for f in cls.options():
        if f.name in ("name", "requires", "provides", "reads"):  # annotated without ClassVar, so a dataclass field
            kind = "str" if f.name == "name" else "frozenset[str]"
            raise SpecError(
                f"{label} ('{name}') declares `{f.name}` as a dataclass field, which would make it an option: "
                f"annotate it `{f.name}: ClassVar[{kind}] = ...`, with ClassVar imported from typing at module "
                "level (@dataclass looks it up there when annotations are strings)"
            )
        if not _SNAKE.fullmatch(f.name):
            raise SpecError(
                f"{label} ('{name}') has option {f.name!r}: option fields must be snake_case "
                "so that they map to kebab-case keys"
            )
    option_types(cls)  # raises SpecError naming an option whose type the text syntax cannot express


def _to_kebab(name: str) -> str:
    name = re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "my-pass"


class PassRegistry:
    """A mapping from pass name to ``Pass`` subclass, with lazily loaded entry-point plugins.

    ``PassRegistry(entry_point_group=None)`` makes a registry without plugins (handy in tests).
    """

    def __init__(self, passes: Iterable[type[Pass]] = (), *, entry_point_group: str | None = ENTRY_POINT_GROUP):
        self._passes: dict[str, type[Pass]] = {}
        self._group = entry_point_group
        self._plugins: dict[str, metadata.EntryPoint] | None = None  # discovered, not yet loaded
        for cls in passes:
            self.register(cls)

    # -- registration ---------------------------------------------------------------------------
    @overload
    def register(self, cls: P, *, replace: bool = False) -> P: ...

    @overload
    def register(self, cls: None = None, *, replace: bool = False) -> Callable[[P], P]: ...

    def register(self, cls=None, *, replace=False):
        """Add a pass class; usable as ``@registry.register``. Returns the class unchanged.

        A different class under a name already taken raises ``SpecError`` unless ``replace=True``;
        registering the same class twice is a no-op.
        """
        if cls is None:
            return lambda c: self.register(c, replace=replace)
        check_pass_class(cls)
        existing = self._passes.get(cls.name)
        if existing is not None and existing is not cls and not replace:
            raise SpecError(
                f"pass name '{cls.name}' is already registered by {_where(existing)}; "
                f"cannot register {_where(cls)} under the same name (pick another name)"
            )
        self._passes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        self._passes.pop(name, None)

    # -- lookup ---------------------------------------------------------------------------------
    def get(self, name: str) -> type[Pass]:
        """The class registered as ``name``; an unknown name raises ``SpecError`` with suggestions."""
        if not isinstance(name, str):
            raise InvalidArgumentTypeError(f"a pass name is a str, got {name!r}")
        cls = self._passes.get(name)
        if cls is not None:
            return cls
        plugins = self._discover()
        if name in plugins:
            return self._load(name)
        raise SpecError(
            f"unknown pass '{name}'{suggest(name, [*self._passes, *plugins])}; "
            "run `autoshard passes` to list them"
        )

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._passes or name in self._discover())

    def names(self) -> tuple[str, ...]:
        """All pass names, plugins included, sorted."""
        return tuple(sorted({*self._passes, *self._discover()}))

    def passes(self) -> tuple[type[Pass], ...]:
        """All pass classes sorted by name; loads every plugin."""
        for name in list(self._discover()):
            if name not in self._passes:
                self._load(name)
        return tuple(self._passes[n] for n in sorted(self._passes))

    def __iter__(self) -> Iterator[type[Pass]]:
        return iter(self.passes())

    def __len__(self) -> int:
        return len(self.names())

    def providers(self, artifact: str) -> tuple[str, ...]:
        """Names of the registered passes that provide ``artifact``, sorted (for hints)."""
        return tuple(sorted(c.name for c in self.loadable() if artifact in c.provides))

    def loadable(self) -> tuple[type[Pass], ...]:
        """The pass classes that load, for hints in error messages: a plugin that fails to load is
        skipped here rather than hiding the error being reported."""
        try:
            return self.passes()
        except SpecError:
            return tuple(self._passes.values())

    # -- plugins --------------------------------------------------------------------------------
    def _entry_points(self) -> Iterable[metadata.EntryPoint]:
        if self._group is None:
            return ()
        return metadata.entry_points(group=self._group)

    def _discover(self) -> dict[str, metadata.EntryPoint]:
        if self._plugins is None:
            self._plugins = {ep.name: ep for ep in self._entry_points()}
        return self._plugins

    def _load(self, name: str) -> type[Pass]:
        ep = self._discover()[name]
        dist = getattr(getattr(ep, "dist", None), "name", None)
        origin = f"entry point '{ep.name} = {ep.value}'" + (f" of distribution '{dist}'" if dist else "")
        try:
            cls = ep.load()
        except Exception as exc:
            raise SpecError(f"could not load pass plugin '{name}' ({origin}): {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise SpecError(f"pass plugin '{name}' ({origin}) is {cls!r}, not a Pass subclass")
        if getattr(cls, "name", None) != name:
            raise SpecError(
                f"pass plugin '{name}' ({origin}) loads a pass named {getattr(cls, 'name', None)!r}; "
                "the entry point name must equal the pass's `name`"
            )
        try:
            return self.register(cls)
        except SpecError as exc:
            raise SpecError(f"pass plugin '{name}' ({origin}) is invalid: {exc}") from exc

    def __repr__(self) -> str:
        return f"PassRegistry({len(self._passes)} passes, plugins={self._group!r})"


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


default_registry = PassRegistry()
"""The registry that ``@register_pass``, ``get_pass`` and ``Pipeline.parse`` use by default."""


def register_pass(cls: P | None = None, *, registry: PassRegistry | None = None, replace: bool = False):
    """Class decorator adding a pass to the default registry (or ``registry``).

    ``@register_pass`` and ``@register_pass(registry=r)`` both work.
    """
    reg = default_registry if registry is None else registry
    if cls is None:
        return lambda c: reg.register(c, replace=replace)
    return reg.register(cls, replace=replace)


def get_pass(name: str, registry: PassRegistry | None = None) -> type[Pass]:
    """The pass class called ``name``; raises ``SpecError`` with close names when unknown."""
    return (default_registry if registry is None else registry).get(name)


def registered_passes(registry: PassRegistry | None = None) -> tuple[type[Pass], ...]:
    """Every registered pass class (plugins included), sorted by name."""
    return (default_registry if registry is None else registry).passes()


def function_pass(
    name: str,
    *,
    requires: Iterable[str] = (),
    provides: Iterable[str] = (),
    register: bool = True,
    registry: PassRegistry | None = None,
) -> Callable[[Callable[[ShardProgram, PassContext], ShardProgram]], type[Pass]]:
    """Turn ``fn(program, ctx) -> program`` into a pass class (without options).

    The docstring of ``fn`` becomes the pass's docstring. The class is named CamelCase(name) + "Pass"
    and is registered in ``registry`` (default: the default registry) unless ``register=False``::

        @function_pass("drop-dag", requires={"dag"})
        def drop_dag(program, ctx):
            "Forget the DAG."
            ...

        Pipeline([drop_dag()])
    """
    req, prov = frozenset(requires), frozenset(provides)

    def decorate(fn: Callable[[ShardProgram, PassContext], ShardProgram]) -> type[Pass]:
        def run(self: Pass, program: ShardProgram, ctx: PassContext) -> ShardProgram:
            return fn(program, ctx)

        run.__doc__ = fn.__doc__
        namespace = {
            "__doc__": fn.__doc__,
            "__module__": getattr(fn, "__module__", __name__),
            "__qualname__": "".join(w.capitalize() for w in name.split("-")) + "Pass",
            "__annotations__": {"name": ClassVar[str], "requires": ClassVar[frozenset[str]],
                                "provides": ClassVar[frozenset[str]]},
            "name": name,
            "requires": req,
            "provides": prov,
            "run": run,
            "function": staticmethod(fn),
        }
        cls = dataclasses.dataclass(frozen=True)(type(namespace["__qualname__"], (Pass,), namespace))
        if register:
            (default_registry if registry is None else registry).register(cls)
        else:
            check_pass_class(cls)
        return cls

    return decorate
