"""A diagram mapped over axes — every input carries them and no box mixes them (MHA's
heads, a batch) — is one program per index.  Searched whole, the
best-first meets the kernels of one index only after grouping them (MHA's backward: a
group over the keys, a stream over the queries, both infeasible until a group over the
heads comes last, then the D kernel's groups: 3,000 states did not get there).  So it is
also searched at those axes' size 1 — one head's problem, attention's — and each kernel of
that answer is then grouped over them, one block per index: the grid axis FlashAttention
gives the heads.  Where that program beats the search's answer, the engine searches on
from it in a run of its own and keeps the better (napkin.search.engine)."""
from __future__ import annotations

from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, view
from napkin.core.region import Site


def map_axes(diagram) -> list[str]:
    """The axes every input of ``diagram`` carries and no top-level box mixes (reduces, or
    reads along, as a softmax does): one index's values depend on that index's inputs alone.
    A box that touches none of them — ALiBi's positions q − x — is a constant a group
    replays per index, as FlashAttention recomputes a bias per head.  None for a diagram
    without inputs or boxes."""
    from rewrites.group_partition import mixing_reason
    g = view(diagram)
    boxes = [g.nodes[n]["box"] for n in op_order(g)]
    if not diagram.dom.inside or not boxes:
        return []
    common = set.intersection(*(set(ob.type.names) for ob in diagram.dom.inside))
    return sorted(a for a in common if not any(mixing_reason(box, a) for box in boxes))


def searched_per_index(start, sizes: dict, search, rules, move) -> tuple | None:
    """(program, chain) from ``start`` (a (program, chain) pair): ``search(sizes)`` — the
    evaluated states of a search of ``start`` at ``sizes`` — run with the map axes of more
    than one index at 1, its fastest program that a final move (a split) has not closed,
    and each of that program's top-level boxes grouped over each map axis (a box that
    groups one already keeps it); None without such an axis or such a program.
    ``move(rule, site, params)`` records a move of the chain."""
    axes = [a for a in map_axes(start[0]) if int(sizes.get(a, 1)) > 1]
    if not axes:
        return None
    states = search({**sizes, **{a: 1 for a in axes}})
    open_ = [s for s in states if s.feasible and not s.error
             and not any(rules[m.rule].last for m in s.chain)]
    if not open_:
        return None
    best = min(open_, key=lambda s: s.time_s)
    program, chain = best.program, list(best.chain)
    group = rules["group_partition"]
    for i in range(len(op_order(view(program)))):
        for axis in axes:
            site, params = Site((), (i,)), {"axis": axis}
            try:
                program = group.apply(program, site, params)
            except RuleError:
                continue
            chain.append(move("group_partition", site, params))
    return program, tuple(chain)
