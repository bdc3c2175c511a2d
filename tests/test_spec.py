"""The text syntax (lexing, typing, printing, errors) and the pass registry."""

from __future__ import annotations

import dataclasses
import re
import sys
import textwrap
from dataclasses import dataclass, replace
from importlib import metadata
from typing import ClassVar, Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.errors import InvalidArgumentError, InvalidArgumentTypeError, SpecError
from autoshard.passes import registry as registry_module
from autoshard.passes.base import Pass, PassContext, ShardProgram, option
from autoshard.passes.pipeline import Pipeline
from autoshard.passes.registry import PassRegistry, function_pass, get_pass, register_pass, registered_passes
from autoshard.passes.options import option_table
from autoshard.passes.spec import format_pass, parse_spec

REG = PassRegistry(entry_point_group=None)


@REG.register
@dataclass(frozen=True)
class SplitPass(Pass):
    """Cut the order into stages."""

    name: ClassVar[str] = "split"
    requires: ClassVar[frozenset[str]] = frozenset({"order"})
    provides: ClassVar[frozenset[str]] = frozenset({"partition"})

    stages: int = option(help="number of stages")
    cost: Literal["params", "flops"] = option("params", help="cost model")
    no_split: tuple[str, ...] = ()

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return replace(program, partition=(self.stages,))


@REG.register
@dataclass(frozen=True)
class KitchenSinkPass(Pass):
    """A pass with one option of every supported type."""

    name: ClassVar[str] = "kitchen-sink"

    count: int = 0
    ratio: float = 0.5
    flag: bool = False
    label: str = "x"
    mode: Literal["a", "b c", "none"] = "a"
    level: Literal[1, 2, 3] = 1
    maybe: int | None = None
    maybe_text: str | None = None
    names: tuple[str, ...] = ()
    sizes: tuple[int, ...] = (1, 2)
    pair: tuple[int, float] = (0, 0.0)
    maybe_names: tuple[str, ...] | None = None
    opt_items: tuple[str | None, ...] = ()

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return program


@REG.register
@dataclass(frozen=True)
class LinearizePass(Pass):
    """Order the DAG."""

    name: ClassVar[str] = "linearize"

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        return program


def parse(text: str) -> Pipeline:
    return Pipeline.parse(text, registry=REG)


# ----------------------------------------------------------------------------------------------
# Syntax
# ----------------------------------------------------------------------------------------------
def test_parse_spec_builds_the_syntax_tree_with_offsets():
    text = 'linearize,split{stages=4 no-split=a,"b c"}'
    first, second = parse_spec(text)
    assert (first.name, first.options, first.start, first.end) == ("linearize", (), 0, 9)
    assert second.name == "split" and (second.start, second.end) == (10, len(text))
    stages, no_split = second.options
    assert stages.key == "stages" and [v.text for v in stages.values] == ["4"]
    assert text[stages.start : stages.key_end] == "stages"
    assert [(v.text, v.quoted) for v in no_split.values] == [("a", False), ("b c", True)]
    assert text[no_split.values[1].start : no_split.values[1].end] == '"b c"'


def test_empty_spec_is_the_empty_pipeline():
    assert parse_spec("") == () and parse_spec("  ") == ()
    assert len(parse("")) == 0 and str(parse("")) == ""


def test_whitespace_between_elements_is_allowed_but_not_printed():
    p = parse(" linearize ,\n split { stages=4   cost=flops } ")
    assert p == Pipeline([LinearizePass(), SplitPass(stages=4, cost="flops")])
    assert str(p) == "linearize,split{stages=4 cost=flops}"


def test_bare_key_is_true_for_a_bool_and_escapes_decode():
    (p,) = parse(r'kitchen-sink{flag label="a\"b\\c\nd\te"}')
    assert p.flag is True
    assert p.label == 'a"b\\c\nd\te'


# ----------------------------------------------------------------------------------------------
# Typing of values
# ----------------------------------------------------------------------------------------------
def test_values_are_typed_from_the_annotations():
    (p,) = parse(
        "kitchen-sink{count=-3 ratio=1e-3 flag=false label=7 mode=\"b c\" level=2 maybe=5 maybe-text=none "
        "names=a,b sizes=4 pair=1,2 maybe-names=none opt-items=x,none}"
    )
    assert p == KitchenSinkPass(
        count=-3, ratio=0.001, flag=False, label="7", mode="b c", level=2, maybe=5, maybe_text=None,
        names=("a", "b"), sizes=(4,), pair=(1, 2.0), maybe_names=None, opt_items=("x", None),
    )
    assert type(p.count) is int and type(p.ratio) is float and type(p.pair[1]) is float


def test_kebab_keys_map_to_snake_fields_and_snake_is_accepted():
    assert parse("split{stages=2 no-split=a}") == parse("split{stages=2 no_split=a}")
    assert parse("split{stages=2 no-split=a}")[0].no_split == ("a",)


def test_empty_value_is_the_empty_tuple_and_quoted_none_is_a_string():
    (p,) = parse('kitchen-sink{sizes= maybe-text="none" maybe-names= mode=none}')
    assert p.sizes == () and p.maybe_text == "none" and p.maybe_names == () and p.mode == "none"
    assert str(parse(str(Pipeline([p])))) == 'kitchen-sink{mode=none maybe-text="none" sizes= maybe-names=}'


def test_a_float_option_accepts_an_int_literal():
    (p,) = parse("kitchen-sink{ratio=2}")
    assert p.ratio == 2.0 and type(p.ratio) is float


# ----------------------------------------------------------------------------------------------
# Printing
# ----------------------------------------------------------------------------------------------
def test_python_built_pipeline_prints_required_and_non_default_options_in_field_order():
    p = Pipeline([LinearizePass(), SplitPass(no_split=("x",), stages=4)])
    assert str(p) == "linearize,split{stages=4 no-split=x}"
    assert str(Pipeline([SplitPass(stages=4, cost="params")])) == "split{stages=4}"


def test_parsed_pipeline_remembers_explicit_defaults():
    spec = "linearize,split{stages=4 cost=params}"
    assert str(parse(spec)) == spec
    assert parse(spec) == Pipeline([LinearizePass(), SplitPass(stages=4)])  # equality ignores explicitness


def test_non_canonical_option_order_prints_in_field_order():
    assert str(parse("split{no-split=b,a cost=flops stages=3}")) == "split{stages=3 cost=flops no-split=b,a}"


def test_str_of_a_pass_is_its_spec():
    assert str(SplitPass(stages=4, cost="flops")) == "split{stages=4 cost=flops}"
    assert str(LinearizePass()) == "linearize"
    assert format_pass(SplitPass(stages=4), explicit={"cost"}) == "split{stages=4 cost=params}"


@pytest.mark.parametrize(
    ("label", "printed"),
    [
        ("plain-word_1.2", "plain-word_1.2"),
        ("two words", '"two words"'),
        ("a,b", '"a,b"'),
        ("{x}", '"{x}"'),
        ('say "hi"', r'"say \"hi\""'),
        ("line\nbreak", r'"line\nbreak"'),
        ("", '""'),
        ("k=v", '"k=v"'),
    ],
)
def test_strings_are_quoted_only_when_needed_and_round_trip(label, printed):
    p = Pipeline([KitchenSinkPass(label=label)])
    assert str(p) == f"kitchen-sink{{label={printed}}}"
    assert parse(str(p)) == p


def test_none_string_is_quoted_only_where_none_is_a_value():
    assert str(KitchenSinkPass(label="none")) == "kitchen-sink{label=none}"
    assert str(KitchenSinkPass(maybe_text="none")) == 'kitchen-sink{maybe-text="none"}'
    assert str(KitchenSinkPass(opt_items=("none", None))) == 'kitchen-sink{opt-items="none",none}'
    lone = KitchenSinkPass(maybe_names=("none",))  # an optional tuple of one "none" is not None
    assert str(lone) == 'kitchen-sink{maybe-names="none"}' and parse(str(lone))[0] == lone


# ----------------------------------------------------------------------------------------------
# Round trip properties
# ----------------------------------------------------------------------------------------------
texts = st.text(max_size=8)
floats = st.floats(allow_nan=False)
sink_passes = st.builds(
    KitchenSinkPass,
    count=st.integers(),
    ratio=floats,
    flag=st.booleans(),
    label=texts,
    mode=st.sampled_from(["a", "b c", "none"]),
    level=st.sampled_from([1, 2, 3]),
    maybe=st.none() | st.integers(),
    maybe_text=st.none() | texts,
    names=st.lists(texts, max_size=3).map(tuple),
    sizes=st.lists(st.integers(), max_size=3).map(tuple),
    pair=st.tuples(st.integers(), floats),
    maybe_names=st.none() | st.lists(texts, max_size=3).map(tuple),
    opt_items=st.lists(st.none() | texts, max_size=3).map(tuple),
)
split_passes = st.builds(
    SplitPass,
    stages=st.integers(1, 64),
    cost=st.sampled_from(["params", "flops"]),
    no_split=st.lists(texts, max_size=3).map(tuple),
)
pipelines = st.lists(sink_passes | split_passes | st.just(LinearizePass()), max_size=4).map(Pipeline)


@settings(max_examples=150, deadline=None)
@given(pipelines)
def test_property_parse_of_str_is_identity(p):
    parsed = parse(str(p))
    assert parsed == p
    assert str(parsed) == str(p)


@settings(max_examples=100, deadline=None)
@given(sink_passes, st.sets(st.sampled_from([f.name for f in dataclasses.fields(KitchenSinkPass)])))
def test_property_canonical_spec_with_explicit_defaults_prints_back_identically(p, explicit):
    spec = format_pass(p, explicit)
    assert str(parse(spec)) == spec
    assert parse(spec)[0] == p


# ----------------------------------------------------------------------------------------------
# Errors: message, column and caret
# ----------------------------------------------------------------------------------------------
def caret_of(exc: SpecError) -> tuple[int, int]:
    """(column, width) read back from the caret line of the message."""
    caret_line = str(exc).splitlines()[2]
    m = re.fullmatch(r"  ( *)(\^+) column (\d+)", caret_line)
    assert m, caret_line
    assert int(m.group(3)) == len(m.group(1)) + 1
    return len(m.group(1)) + 1, len(m.group(2))


@pytest.mark.parametrize(
    ("spec", "message", "column", "width"),
    [
        ("split{stage=4}", "unknown option 'stage' for pass 'split' (did you mean 'stages'?)", 7, 5),
        ("linearize{x=1}", "unknown option 'x' for pass 'linearize'; 'linearize' takes no options", 11, 1),
        ("split{zzz=1}", "unknown option 'zzz' for pass 'split'; its options are: stages, cost, no-split", 7, 3),
        ("linearize,splt{stages=4}",
         "unknown pass 'splt' (did you mean 'split'?); run `autoshard passes` to list them", 11, 4),
        ("split{stages=four}", "option 'stages' of 'split' expects an int, got 'four'", 14, 4),
        ("split{stages=4.5}", "option 'stages' of 'split' expects an int, got '4.5'", 14, 3),
        ('split{stages="4"}', "option 'stages' of 'split' expects an int, got '4'", 14, 3),
        ("split{stages=4 cost=flop}", "expects one of 'params', 'flops', got 'flop' (did you mean 'flops'?)", 21, 4),
        ("kitchen-sink{flag=yes}", "option 'flag' of 'kitchen-sink' expects a bool (true or false), got 'yes'", 19, 3),
        ("kitchen-sink{ratio=fast}", "option 'ratio' of 'kitchen-sink' expects a float, got 'fast'", 20, 4),
        ("kitchen-sink{sizes=1,x}", "expects a comma-separated list of ints, got 'x'", 22, 1),
        ("kitchen-sink{pair=1,2,3}", "expects 2 comma-separated values (an int, a float), got 3 values", 19, 5),
        ("kitchen-sink{count=}", "option 'count' of 'kitchen-sink' expects an int, got nothing", 19, 1),
        ("kitchen-sink{count}", "option 'count' of 'kitchen-sink' needs a value (an int): write count=...", 14, 5),
        ("kitchen-sink{maybe=nope}", "expects an int or none, got 'nope'", 20, 4),
        ("linearize,split",
         "missing required option 'stages' for pass 'split' (an int): write split{stages=...}", 11, 5),
        ("split{cost=flops}", "missing required option 'stages' for pass 'split'", 1, 17),
        ("split{stages=4 stages=5}", "option 'stages' of 'split' is given twice (first at column 7)", 16, 6),
        ("split{stages=4 no-split=a no_split=b}", "option 'no-split' of 'split' is given twice", 27, 8),
        ("split{stages=4", "unclosed '{' of pass 'split': expected '}'", 6, 1),
        ("split{stages=4}}", "unexpected '}' (no matching '{')", 16, 1),
        ("split{stages=4,cost=flops}", "options are separated by spaces, not commas", 15, 1),
        ("split{stages=4 cost}x", "expected ',' between passes, got 'x'", 21, 1),
        ("linearize,", "expected a pass name, got the end of the spec", 11, 1),
        ("linearize,,split", "expected a pass name, got ','", 11, 1),
        ("linearize linearize", "expected ',' between passes, got 'l'", 11, 1),
        ("split{=4}", "expected an option name or '}' in the options of 'split', got '='", 7, 1),
        ('kitchen-sink{label="abc}', "unterminated string: expected a closing '\"'", 20, 1),
        (r'kitchen-sink{label="a\qb"}', "unknown escape in string", 22, 2),
        ('kitchen-sink{label=a"b"}', "expected a space or '}' after option 'label', got '\"'", 21, 1),
        ("kitchen-sink{flag,count=1}", "unexpected ',': options are separated by spaces, not commas", 18, 1),
        ("split{stages = 4}", "no spaces around '=' in an option: write stages=...", 13, 2),
        ("split{stages=4 no-split=a, b}", "no spaces after ',' in a list of values: write a,b", 27, 1),
        ("splït", "unexpected 'ï' in pass name 'spl...': names use ASCII letters", 4, 1),
        ("split{stagés=4}", "unexpected 'é' in option name 'stag...': names use ASCII letters", 11, 1),
    ],
)
def test_spec_errors_name_the_problem_and_point_at_it(spec, message, column, width):
    with pytest.raises(SpecError) as info:
        parse(spec)
    exc = info.value
    first_line, spec_line = str(exc).splitlines()[:2]
    assert message in first_line
    assert spec_line == "  " + spec
    assert caret_of(exc) == (column, width)
    assert (exc.column, exc.spec) == (column, spec)


def test_an_option_of_another_pass_names_the_pass_that_takes_it():
    with pytest.raises(SpecError, match=r"unknown option 'time-limit' for pass 'split'; its options are: .* "
                                        r"\(pass 'split-exact' takes it\)"):
        Pipeline.parse("split{stages=2 strategy=exact time-limit=5}")


def test_multi_line_spec_errors_show_the_line_and_its_number():
    with pytest.raises(SpecError) as info:
        parse("linearize,\nsplit{stage=1}")
    lines = str(info.value).splitlines()
    assert lines[1] == "  split{stage=1}"
    assert lines[2] == "        ^^^^^ line 2, column 7"
    assert (info.value.line, info.value.column) == (2, 7)


def test_spec_error_is_a_value_error_for_callers_that_catch_builtins():
    with pytest.raises(ValueError):
        parse("nope")


def test_constructor_validation_errors_become_spec_errors_pointing_at_the_element():
    reg = PassRegistry(entry_point_group=None)

    @reg.register
    @dataclass(frozen=True)
    class PositivePass(Pass):
        """Needs k >= 1."""

        name: ClassVar[str] = "positive"
        k: int = 1

        def __post_init__(self) -> None:
            if self.k < 1:
                raise ValueError(f"k must be >= 1, got {self.k}")

        def run(self, program, ctx):
            return program

    with pytest.raises(SpecError, match=r"invalid options for pass 'positive': k must be >= 1, got 0") as info:
        Pipeline.parse("positive,positive{k=0}", registry=reg)
    assert caret_of(info.value) == (10, 13)
    assert isinstance(info.value.__cause__, ValueError)


def test_typed_errors_from_the_constructor_keep_their_type_and_gain_the_caret():
    reg = PassRegistry(entry_point_group=None)

    @reg.register
    @dataclass(frozen=True)
    class StagesPass(Pass):
        """Needs stages >= 1."""

        name: ClassVar[str] = "stages"
        k: int = 1

        def __post_init__(self) -> None:
            if self.k < 1:
                raise InvalidArgumentError(f"k must be >= 1, got {self.k}")

        def run(self, program, ctx):
            return program

    with pytest.raises(InvalidArgumentError, match="k must be >= 1, got 0") as info:
        Pipeline.parse("stages{k=0}", registry=reg)
    assert type(info.value) is InvalidArgumentError
    assert info.value.__notes__ == ["in the pass spec:\n  stages{k=0}\n  ^^^^^^^^^^^ column 1"]


def test_python_built_passes_with_ill_typed_options_are_rejected():
    with pytest.raises(InvalidArgumentTypeError,
                       match=r"option 'stages' of pass 'split' expects an int, got 'four' \(str\)"):
        Pipeline([SplitPass(stages="four")])
    with pytest.raises(InvalidArgumentTypeError,
                       match=r"expects a comma-separated list of strings, got \['a'\] \(list\) \(use a tuple\)"):
        Pipeline([SplitPass(stages=1, no_split=["a"])])
    with pytest.raises(InvalidArgumentTypeError, match="expects an int, got True"):
        Pipeline([SplitPass(stages=True)])
    with pytest.raises(InvalidArgumentTypeError, match="expects one of 'params', 'flops', got 'FLOPS'"):
        Pipeline([SplitPass(stages=1, cost="FLOPS")])


def test_option_table_documents_keys_types_defaults_and_help():
    rows = {r.key: r for r in option_table(SplitPass)}
    assert list(rows) == ["stages", "cost", "no-split"]
    assert (rows["stages"].default is None and rows["stages"].type == "an int"
            and rows["stages"].help == "number of stages")
    assert rows["cost"].default == "params" and rows["cost"].type == "one of 'params', 'flops'"
    assert rows["no-split"].default == "" and rows["no-split"].field == "no_split"


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------
def make_pass(pass_name: str = "fresh", *, decorate: bool = True, doc: str | None = "Does a thing.", **ns):
    namespace = {"__annotations__": {"name": ClassVar[str]}, "name": pass_name, "__doc__": doc,
                 "run": lambda self, program, ctx: program, **ns}
    cls = type("FreshPass", (Pass,), namespace)
    return dataclass(frozen=True)(cls) if decorate else cls


def test_registry_lookup_listing_and_membership():
    reg = PassRegistry([SplitPass, LinearizePass], entry_point_group=None)
    assert reg.get("split") is SplitPass
    assert "linearize" in reg and "nope" not in reg
    assert reg.names() == ("linearize", "split")
    assert registered_passes(reg) == (LinearizePass, SplitPass)
    assert get_pass("split", reg) is SplitPass
    assert reg.providers("partition") == ("split",)
    assert len(reg) == 2
    reg.unregister("split")
    assert reg.names() == ("linearize",) and reg.providers("partition") == ()


def test_unknown_pass_suggests_close_names():
    with pytest.raises(SpecError) as info:
        REG.get("kitchen-snk")
    assert str(info.value) == ("unknown pass 'kitchen-snk' (did you mean 'kitchen-sink'?); "
                               "run `autoshard passes` to list them")
    with pytest.raises(SpecError, match=r"^unknown pass 'zzz'; run `autoshard passes` to list them$"):
        REG.get("zzz")


def test_duplicate_name_raises_but_same_class_and_replace_are_fine():
    reg = PassRegistry([SplitPass], entry_point_group=None)
    reg.register(SplitPass)  # idempotent
    other = make_pass("split")
    with pytest.raises(SpecError, match=r"pass name 'split' is already registered by .*SplitPass; cannot register"):
        reg.register(other)
    assert reg.get("split") is SplitPass
    reg.register(other, replace=True)
    assert reg.get("split") is other


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: int, "a pass must be a subclass of autoshard.passes.base.Pass"),
        (lambda: make_pass("Split_Min"), r"name 'Split_Min', which is not kebab-case.*e\.g\. 'split-min'"),
        (lambda: make_pass("split--min"), "not kebab-case"),
        (lambda: make_pass(decorate=False), r"must be decorated with @dataclass\(frozen=True\)"),
        (lambda: type("Sub", (SplitPass,), {"__doc__": "Sub.", "name": "sub"}), r"must be decorated with @dataclass"),
        (lambda: make_pass(doc=None), r"has no docstring"),
        (lambda: make_pass(doc="   "), r"has no docstring"),
        (lambda: make_pass(provides=frozenset({"partiton"})),
         r"provides unknown artifact 'partiton' \(did you mean 'partition'\?\)"),
        (lambda: make_pass(requires={"dag"}), r"`requires` must be a frozenset"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "f": "list[int]"}, f=None),
         r"option 'f' of pass 'fresh' has type list\[int\], which pass specs cannot express"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "f": "int | str"}, f=0),
         r"the only union it can express is `X \| None`"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "f": "tuple[tuple[int, ...], ...]"}, f=()),
         "tuples cannot nest"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "f": "tuple[int | None, ...] | None"}, f=None),
         "the value `none` would be ambiguous"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "f": "int"}, f="3"),
         r"option 'f' of pass 'fresh' has default '3', which is not an int"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "maxDepth": "int"}, maxDepth=1),
         "option fields must be snake_case"),
        (lambda: make_pass(__annotations__={"name": str}),
         r"\('fresh'\) declares `name` as a dataclass field, which would make it an option: annotate it "
         r"`name: ClassVar\[str\] = \.\.\.`"),
        # a string annotation in a module that does not import ClassVar (imported in a function instead)
        (lambda: make_pass(__annotations__={"name": "ClassVar[str]"}, __module__="json"),
         r"declares `name` as a dataclass field.*ClassVar imported from typing at module level"),
        (lambda: make_pass(__annotations__={"name": ClassVar[str], "requires": "frozenset[str]"},
                           requires=frozenset({"dag"})),
         r"declares `requires` as a dataclass field.*`requires: ClassVar\[frozenset\[str\]\] = \.\.\.`"),
    ],
)
def test_registration_checks_give_clear_errors(make, message):
    with pytest.raises(SpecError, match=message):
        PassRegistry(entry_point_group=None).register(make())


def test_abstract_pass_is_rejected():
    @dataclass(frozen=True)
    class NoRunPass(Pass):
        """Forgot run."""

        name: ClassVar[str] = "no-run"

    with pytest.raises(SpecError, match=r"is abstract: implement run"):
        PassRegistry(entry_point_group=None).register(NoRunPass)


def test_register_pass_decorator_targets_the_default_registry(monkeypatch):
    fresh = PassRegistry(entry_point_group=None)
    monkeypatch.setattr(registry_module, "default_registry", fresh)
    cls = register_pass(make_pass("via-default"))
    assert fresh.get("via-default") is cls and get_pass("via-default") is cls
    other = PassRegistry(entry_point_group=None)
    cls2 = register_pass(registry=other)(make_pass("via-kwarg"))
    assert other.get("via-kwarg") is cls2 and "via-kwarg" not in fresh


def test_function_pass_adapter_builds_a_registered_pass():
    reg = PassRegistry(entry_point_group=None)

    @function_pass("add-order", requires={"model"}, provides={"order"}, registry=reg)
    def add_order(program, ctx):
        """Give the program a trivial order."""
        return replace(program, order=("x",))

    assert add_order.__name__ == "AddOrderPass" and reg.get("add-order") is add_order
    assert add_order.summary() == "Give the program a trivial order."
    assert add_order.provides == frozenset({"order"})
    result = Pipeline.parse("add-order", registry=reg).run(ShardProgram(model=object()))
    assert result.program.order == ("x",)
    assert add_order() == add_order() and str(add_order()) == "add-order"


def test_function_pass_needs_a_docstring_and_can_skip_registration():
    with pytest.raises(SpecError, match="has no docstring"):
        function_pass("undocumented", register=False)(lambda program, ctx: program)
    reg = PassRegistry(entry_point_group=None)

    def noop(program, ctx):
        """Nothing."""
        return program

    cls = function_pass("noop", register=False, registry=reg)(noop)
    assert "noop" not in reg and cls.name == "noop"


# ----------------------------------------------------------------------------------------------
# Entry-point plugins
# ----------------------------------------------------------------------------------------------
PLUGIN_SOURCE = textwrap.dedent(
    '''
    from dataclasses import dataclass
    from typing import ClassVar
    from autoshard.passes.base import Pass

    @dataclass(frozen=True)
    class PluggedPass(Pass):
        """A third-party pass."""
        name: ClassVar[str] = "plugged"
        depth: int = 1
        def run(self, program, ctx):
            return program

    NOT_A_PASS = 42
    '''
)


@pytest.fixture
def plugin_registry(tmp_path, monkeypatch):
    module = "autoshard_test_plugin_mod"
    (tmp_path / f"{module}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, module, raising=False)
    group = "autoshard.passes"

    def make(*entries: tuple[str, str]) -> PassRegistry:
        reg = PassRegistry([LinearizePass])
        eps = [metadata.EntryPoint(name=n, value=f"{module}:{v}", group=group) for n, v in entries]
        monkeypatch.setattr(reg, "_entry_points", lambda: eps)
        return reg

    yield make
    sys.modules.pop(module, None)


def test_plugins_are_listed_without_loading_and_loaded_on_lookup(plugin_registry):
    reg = plugin_registry(("plugged", "PluggedPass"))
    assert reg.names() == ("linearize", "plugged")
    assert "autoshard_test_plugin_mod" not in sys.modules  # discovery does not import
    cls = reg.get("plugged")
    assert cls.__name__ == "PluggedPass" and "autoshard_test_plugin_mod" in sys.modules
    assert Pipeline.parse("linearize,plugged{depth=3}", registry=reg)[1].depth == 3


def test_unknown_pass_suggestions_include_plugins(plugin_registry):
    reg = plugin_registry(("plugged", "PluggedPass"))
    with pytest.raises(SpecError, match=r"did you mean 'plugged'\?"):
        reg.get("pluged")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (("plugged", "Missing"),
         r"could not load pass plugin 'plugged' \(entry point 'plugged = autoshard_test_plugin_mod:Missing'\): "
         r"AttributeError"),
        (("plugged", "NOT_A_PASS"), r"pass plugin 'plugged' .* is 42, not a Pass subclass"),
        (("other-name", "PluggedPass"),
         r"loads a pass named 'plugged'; the entry point name must equal the pass's `name`"),
    ],
)
def test_broken_plugins_fail_with_the_entry_point_named(plugin_registry, entry, message):
    reg = plugin_registry(entry)
    with pytest.raises(SpecError, match=message):
        reg.get(entry[0])
    with pytest.raises(SpecError, match=message):
        registered_passes(reg)
    assert reg.providers("order") == ()  # hints still work with a broken plugin around


def test_default_registry_reads_the_real_entry_point_group():
    reg = PassRegistry()
    assert reg._group == "autoshard.passes"
    assert isinstance(reg.names(), tuple)  # discovery through importlib.metadata works
