"""What a rule is: data plus a check/apply pair (as in PyZX), backed by a proof.

A :class:`Rule` rewrites a program at a :class:`~napkin.core.region.Site` with JSON
parameters.  ``check`` raises :class:`~napkin.core.errors.RuleError` naming the
failed premise, in words; ``apply`` checks, then returns the new program.
``candidates`` proposes sites and parameters for a search; ``proof`` names the
module under ``proofs/`` that proves the rule sound for all sizes.

A :class:`Streamability` rule does not rewrite on its own: it is an
accumulator (state, init, update, finalise) that the stream partition uses for
the reductions it recognises.
"""
from __future__ import annotations

import functools

from dataclasses import dataclass, field

import sympy

from napkin.core.arrays import ArrayType
from napkin.core.errors import RuleError
from napkin.core.memo import IdentityMemo
from napkin.core.ir import ops as op_order
from napkin.core.region import Site, body_at, region_key


_BUILT = IdentityMemo(20000)


def replacement(rule: str, params: tuple, reg, make):
    """The box ``make()`` builds to replace region ``reg``, memoised by the region's
    content (:func:`napkin.core.region.region_key`) and the rule's parameters: a search
    applies the same rewrite to the same boxes from many states, and handing back
    the same box lets the cost and fingerprint memos recognise the kernel."""
    wiring, held = region_key(reg)
    return _BUILT.get(held, make, (rule, params, wiring))


def one_op(rule: str, program, site: Site, graph_of, what: str = "one box"):
    """(graph of the body at ``site.path``, the op node) of a site that names one op;
    a RuleError naming ``rule`` otherwise."""
    g = graph_of(body_at(program, site.path))
    order = op_order(g)
    if len(site.ops) != 1 or not 0 <= site.ops[0] < len(order):
        raise RuleError(f"{rule} applies at {what} (a site of one op)")
    return g, order[site.ops[0]]


class Rule:
    name: str = ""
    summary: str = ""
    proof: str = ""
    # the parameters it takes: check and apply refuse any other, alike for every rule (a
    # certificate's step with a stray parameter is not the step the rule was proved for)
    params: tuple = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        for name in ("check", "apply"):
            f = cls.__dict__.get(name)
            if f is not None:
                setattr(cls, name, _refusing_unknown(f))
    # Traits the search (napkin.search) reads, so that it never names a rule:
    # wraps its site in a group over params["axis"] (the search's symmetry reductions apply)
    groups_axis: bool = False
    # only moves arrays to another memory level: kernels and the function stay as they are
    relabels_levels: bool = False
    # may tile inside a kernel that exists (refining a structure already found)
    tiles_inside_kernels: bool = False
    # the name of a rule whose moves already reach every program this one's would
    subsumed_by: str | None = None
    # exact and never a worse start: the search applies it wherever it applies, before it
    # searches (its moves head every chain), instead of branching on it
    eager: bool = False
    # a choice made once, on the algorithm: the search runs a search of its own from each of
    # its applications and keeps the better answer, instead of branching on it in every state
    rooted: bool = False
    # ends a chain: the search rewrites its programs no further (a split cuts a kernel in
    # two; rewriting the pieces again would repeat the search once per split)
    last: bool = False

    def check(self, program, site: Site, params: dict) -> None:
        raise NotImplementedError

    def apply(self, program, site: Site, params: dict):
        raise NotImplementedError

    def candidates(self, program, path=()):
        """(site, params) proposals in the body at ``path``; premises unchecked."""
        return iter(())


def _refusing_unknown(f):
    @functools.wraps(f)
    def guarded(self, program, site, params):
        extra = sorted(map(str, set(params) - set(self.params)))
        if extra:
            takes = (f"the parameter{'s' if len(self.params) > 1 else ''} "
                     f"{', '.join(self.params)}" if self.params else "no parameters")
            raise RuleError(f"{self.name} takes {takes}; got also {', '.join(extra)}")
        return f(self, program, site, params)
    return guarded


@dataclass
class Claim:
    """Ops of a region a streamability rule takes over, with their boundary.

    ``inputs`` are what ``update`` reads chunk by chunk; ``extra`` are values without
    the streamed axis that only ``finalize`` reads (a softmax's sink logit): inputs of
    the region or values its invariant boxes compute, which the stream hands to the
    finalize (``Streamability.finalize(..., extra=[...])``)."""
    rule: "Streamability"
    nodes: list[int]
    inputs: list[int]
    outputs: list[int]
    data: dict = field(default_factory=dict)
    extra: list[int] = field(default_factory=list)


class Streamability:
    """An accumulator for one kind of reduction over the streamed axis."""
    name: str = ""
    summary: str = ""
    proof: str = ""
    # How many boxes one claim takes: the stream partition offers a region's boxes to the
    # largest claims first, so a compound pattern (softmax·contraction) takes its boxes
    # before a rule for one of them (a plain contraction) can.
    boxes_per_claim: int = 1

    def claims(self, graph, nodes: list[int], axis: str) -> list[Claim]:
        raise NotImplementedError

    def state(self, graph, claim: Claim, axis: str) -> list[tuple[str, ArrayType]]:
        raise NotImplementedError

    def init(self, graph, claim, axis):
        raise NotImplementedError

    def update(self, graph, claim, axis, state, ins):
        raise NotImplementedError

    def finalize(self, graph, claim, axis, state, extra=()):
        """The outputs from the final state; ``extra``: the values of ``claim.extra``."""
        raise NotImplementedError

    def merge(self, graph, claim, axis, a, b):
        """The state of x ⊕ y from the states of x and of y (y after x along the axis):
        the associative combine that lets chunks fold in parallel.  An accumulator that
        does not define it has none: its streams keep ``merge=None`` (stay sequential)."""
        raise NotImplementedError


def acc_dtype(dtype: str) -> str:
    """Accumulate low-precision inputs in float32."""
    return "f64" if dtype == "f64" else "f32"


def ob(graph, v):
    return graph.nodes[v]["ob"]


def size_param(value, what: str = "size"):
    """A tile size from JSON: a positive int, or a symbol name like "g_q"."""
    if isinstance(value, sympy.Symbol):
        value = value.name
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise RuleError(f"{what} must be a positive integer or a tile name, got {value}")
        return value
    if isinstance(value, str) and value.isidentifier():
        return sympy.Symbol(value, integer=True, positive=True)
    raise RuleError(f"{what} must be a positive integer or a tile name such as g_q, got {value!r}")


def size_json(value):
    return int(value) if isinstance(value, int) or getattr(value, "is_Integer", False) else str(value)
