"""Untie tiles: each kernel of a program gets tile names of its own.

Matches: the whole program (the empty site), where two top-level boxes share a tile name
(partitions of one axis in different kernels share ``g_t`` by convention, chosen once).
No parameters: the names are fixed (napkin.core.retile.untied): in op order, the first
box keeps a name and each later one that also uses it gets the first free ``<name>_<k>``.
Once the values between kernels are in main memory, each kernel's best tiles are its own:
the attention kernel's query tile need not be the MLP's.  The search prices every program
untied (napkin.search.engine.Evaluator) and ends the chain it reports with this move.
Proof: proofs/untie.py (a tile is a bound name: renaming it inside the box that binds it
is alpha-conversion).
"""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.retile import untied
from rewrites.base import Rule


class UntieTiles(Rule):
    name = "untie_tiles"
    params = ()
    summary = "give each kernel tile names of its own (renaming a bound name)"
    proof = "proofs.untie"
    # no candidates (the base's): the search prices programs untied and appends this move

    def _untied(self, program, site):
        if site.path or site.ops:
            raise RuleError("untie_tiles applies to the whole program (the empty site)")
        new, renames = untied(program)
        if not renames:
            raise RuleError("untie_tiles: no two top-level boxes share a tile name")
        return new

    def check(self, program, site, params):
        self._untied(program, site)

    def apply(self, program, site, params):
        return self._untied(program, site)
