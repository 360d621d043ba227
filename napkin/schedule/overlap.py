"""What of a stream's steps may run at once: the schedule's statement of overlap.

A stream's steps are a sequential fold, but its step need not wait for all of the previous
one.  Where a state's update is ``E(state) + A·B`` — ``A`` computed in the step without
reading that state, ``B`` one of the step's chunks — and nothing else the step computes
reads that state, the product A·B may run a step late: step j's own products and
A_{j-1}·B_{j-1} run together, and the work on step j's products (attention's softmax)
runs while the latter is on the tensor cores (FlashAttention-3's intra-warpgroup
pipelining: P·V of chunk j−1 beside Q·Kᵀ and the softmax of chunk j).  The same sums in
the same order, one step later, so the fold's meaning is unchanged.

:func:`deferred_product` reads it off the step's dataflow (not a template); the schedule
states it on the stream's loop (``Loop.overlap``), the pseudocode prints it, and a backend
that can run a product asynchronously spells it (:mod:`napkin.lower.backends.mosaic_gpu`).
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from napkin.core.ir import view
from napkin.core.memo import IdentityMemo
from napkin.core.primitives import matmul_sides


@dataclass(frozen=True)
class Deferral:
    """A stream's step whose product P·V may run a step late (FlashAttention-3's
    intra-warpgroup pipelining): state ``state``'s update is ``E(state) + A·B`` — ``A``
    computed in the step without reading that state, ``B`` a chunk — and nothing else the
    step computes reads that state.  Then the step may carry Õ = E(state) and A instead:
    step j issues its own products and A_{j-1}·B_{j-1} together, works on its products'
    results while the latter runs, and completes state_{j-1} = Õ_{j-1} + A_{j-1}·B_{j-1}
    only where E reads it; after the last step, state = Õ + A·B.  The same sums in the
    same order, one step later.  ``product`` and ``add`` are the boxes' places among the
    step's boxes (the ones ``fold_boxes`` applies), ``later`` those that read the state;
    ``names``: A's, B's and the state's (for the schedule's words)."""
    state: int
    product: int
    add: int
    later: frozenset
    names: tuple = ("A", "B", "state")

    def words(self) -> str:
        """The overlap in words: which product runs a step late, beside what."""
        a, b, state = self.names
        return (f"{a}·{b} may run a step late, beside the next step's products and the work "
                f"that does not read {state}")


def deferred_product(update, n_state: int) -> Deferral | None:
    """The :class:`Deferral` a stream's step allows (None where none): read off the
    step's dataflow, not a template.  One of its operands is computed in the step (A),
    the other is one of the step's inputs (B): a product of two loaded operands (a
    matmul's) has nothing in its step to run beside."""
    g = view(update)
    ins, outs = g.graph["inputs"], g.graph["outputs"]
    ops = sorted(n for n in g if g.nodes[n]["kind"] == "op")  # (in the order of its boxes)
    place = {n: i for i, n in enumerate(ops)}
    for k in range(n_state):
        later = nx.descendants(g, ins[k])
        if any(v in later or v == ins[k] for i, v in enumerate(outs) if i != k):
            continue  # another output reads the state
        for n in ops:
            node = g.nodes[n]
            if matmul_sides(node["box"]) is None or n in later or \
                    g.out_degree(node["outs"][0]) != 1:
                continue
            (z,) = g.successors(node["outs"][0])
            spec = g.nodes[z]["box"].spec
            out = g.nodes[z]["outs"][0]
            if getattr(spec, "kind", None) == "zip" and spec.fn == "add" and z in later and \
                    outs.count(out) == 1 and outs.index(out) == k and g.out_degree(out) == 0 \
                    and sorted(v in ins[n_state:] for v in node["ins"]) == [False, True]:
                names = tuple(g.nodes[v]["ob"].name for v in node["ins"]) + \
                    (update.dom.inside[k].name,)
                return Deferral(k, place[n], place[z],
                                frozenset(place[m] for m in ops if m in later), names)
    return None


_STATED = IdentityMemo(20000)


def stated(update, n_state: int) -> str:
    """What the schedule says of a stream's step with ``update``: its overlap in words, or
    "" where its steps run one after another (memoised: the search builds the same step's
    stream in state after state)."""
    def make():
        d = deferred_product(update, n_state)
        return d.words() if d is not None else ""
    return _STATED.get((update,), make, n_state)
