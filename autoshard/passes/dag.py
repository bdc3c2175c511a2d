"""The ``build-dag`` pass: the weighted networkx DAG over the traced graph."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import networkx as nx

from autoshard.lowering.from_fx import build_dag
from autoshard.passes.base import Pass, PassContext, ShardProgram


@dataclass(frozen=True)
class BuildDagPass(Pass):
    """Build the networkx DAG of inputs and compute nodes, with parameter counts and bytes.

    Nodes carry ``op``, ``target``, ``module`` (owning module path), ``params``, ``param_bytes``
    and ``bytes`` (the output value's size); edges carry the ``value`` passed. The DAG is frozen:
    later passes read it and never write to it. ``cost=params`` charges each weight's bytes from
    ``dag.graph["weights"]`` (a shared one once per stage), not ``param_bytes``, so a pass that edits
    ``param_bytes`` changes no split: reweight with ``cost=fn`` instead. The ``facts`` and ``times``
    measured before it ride on the DAG's nodes (``value_meta``, ``flops``, ``seconds``, ...), so
    ``shape-prop`` and ``profile`` go before it. Example: ``trace,build-dag``.
    """

    name: ClassVar[str] = "build-dag"
    requires: ClassVar[frozenset[str]] = frozenset({"traced"})
    provides: ClassVar[frozenset[str]] = frozenset({"dag"})
    reads: ClassVar[frozenset[str]] = frozenset({"facts", "times"})

    def run(self, program: ShardProgram, ctx: PassContext) -> ShardProgram:
        dag = nx.freeze(build_dag(program.traced.graph_module, program.model))
        return dataclasses.replace(program, dag=dag)
