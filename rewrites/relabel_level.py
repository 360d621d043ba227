"""Level relabelling: move a group's arrays to a lower memory level.

Matches: one group box.  Parameters: ``level``, strictly below the group's
current level in gmem → l2 → smem → registers.  The function never changes
(paper: "resources by relabelling"); only where the arrays live, hence the
cost.  Proof: proofs/relabel_level.py (the semantics ignores levels).
"""
from __future__ import annotations

import dataclasses

from discopy import markov

from napkin.core.errors import RuleError
from napkin.hardware import CANONICAL_LEVELS
from napkin.core.ir import ops as op_order, to_diagram, to_graph, view
from napkin.core.op import make_op
from napkin.core.region import Site, body_at, replace_at
from rewrites.base import Rule, one_op
from rewrites.group_partition import nesting_reason


class RelabelLevel(Rule):
    name = "relabel_level"
    params = ("level",)
    summary = "move a group's arrays to a lower memory level (the meaning is unchanged)"
    proof = "proofs.relabel_level"
    relabels_levels = True

    def _find(self, program, site, params, graph_of=view):
        g, n = one_op(self.name, program, site, graph_of, "one group box")
        spec = g.nodes[n]["box"].spec
        if spec.kind != "group":
            raise RuleError(f"relabel_level: {g.nodes[n]['box'].name} is not a group")
        level = params.get("level")
        if level not in CANONICAL_LEVELS:
            raise RuleError(f"relabel_level: unknown level {level!r}; "
                            f"known: {', '.join(CANONICAL_LEVELS)}")
        if CANONICAL_LEVELS.index(level) <= CANONICAL_LEVELS.index(spec.level):
            raise RuleError(f"relabel_level: {level} is not below the group's level {spec.level}")
        why = nesting_reason([b for b in spec.body.boxes if getattr(b, "spec", None) is not None],
                             spec.axis, level)
        if why:
            raise RuleError(f"relabel_level: cannot move {g.nodes[n]['box'].name} to {level}: {why}")
        return g, n, spec, level

    def check(self, program, site, params):
        self._find(program, site, params)

    def apply(self, program, site, params):
        g, n, spec, level = self._find(program, site, params, graph_of=to_graph)  # mutated below
        node = g.nodes[n]
        dom = markov.Ty(*(g.nodes[v]["ob"] for v in node["ins"]))
        node["box"] = make_op(dataclasses.replace(spec, level=level), dom,
                              [o.name for o in node["box"].cod.inside], node["box"].name)
        return replace_at(program, site.path, to_diagram(g))

    def candidates(self, program, path=()):
        """Every group of the body, to every level below its own."""
        g = view(body_at(program, path))
        for i, n in enumerate(op_order(g)):
            spec = g.nodes[n]["box"].spec
            if spec.kind == "group":
                for level in CANONICAL_LEVELS[CANONICAL_LEVELS.index(spec.level) + 1:]:
                    yield Site(tuple(path), (i,)), {"level": level}
