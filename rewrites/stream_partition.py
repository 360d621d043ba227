"""Stream partition, with fusion: fold a region over chunks of an axis.

Matches: a convex region of boxes.  Parameters: ``axis``, chunk size
``chunk`` (an int or a symbol such as ``s_x``).

Premise — the region is *streamable* over the axis (the fusion theorem as one
mechanism): its boxes split into

* **reductions** claimed by a streamability rule (sum/contraction, max,
  logsumexp, mean, softmax-contraction, …): each brings an accumulator;
* **pre** boxes woven over the axis and independent along it (pre-composition
  and weaving keep streamability): replayed on every chunk;
* **post** boxes that never see the axis (post-composition by a finaliser).

and the axis is reduced inside the region (no output keeps it), no pre box
depends on a reduction, no post box reads a value that still carries the axis.

Replacement: one :class:`~napkin.core.streamed.Stream` box whose accumulator is
the product of the claimed accumulators: init = their inits; update = pre
boxes on the chunk, then each update; finalize = each finalize, then the post
boxes.  Proof: proofs/stream_partition.py (fusion) and the proof of every
streamability rule it uses.
"""
from __future__ import annotations

import itertools

import networkx as nx
from discopy import markov

from napkin.frontend import ops
from napkin.core.errors import RuleError
from napkin.core.ir import ops as op_order, to_diagram, view
from napkin.core.op import make_op
from napkin.core.primitives import FLOATING
from napkin.core.region import Site, body_at, region, replace_at, splice
from napkin.core.streamed import Stream
from napkin.frontend.trace import trace
from rewrites import tiles
from rewrites.accumulators import STREAMABILITY
from rewrites.base import Rule, Streamability, ob, replacement
from rewrites.group_partition import mixing_reason


def streamability_rules():
    """The accumulators in the order they claim boxes: the largest claims first, then by
    name (a fixed order: the stream's state, and so its fingerprint, follows it)."""
    return sorted(STREAMABILITY, key=lambda rule: (-rule.boxes_per_claim, rule.name))


def analyse(graph, reg, axis):
    """Split a region into claims, pre and post boxes; raise RuleError with the
    failed premise otherwise.  Returns (claims, pre, post)."""
    has = lambda v: ob(graph, v).type.has(axis)  # noqa: E731
    if not any(has(v) for v in reg.inputs):
        raise RuleError(f"cannot stream over {axis}: no input of the region carries axis {axis}")
    for v in reg.outputs:
        if has(v):
            producer = next(iter(graph.predecessors(v)))
            raise RuleError(
                f"cannot stream {graph.nodes[producer]['box'].name} over {axis}: its output "
                f"{ob(graph, v)} keeps axis {axis} (stream partition needs {axis} reduced inside "
                f"the region)")
    claims, taken = [], set()
    for rule in streamability_rules():
        for c in rule.claims(graph, [n for n in reg.nodes if n not in taken], axis):
            claims.append(c)
            taken.update(c.nodes)
    # Boxes that never see the axis are *invariant* when they depend on no
    # reduction (computed from fixed inputs: replayed wherever needed), else *post*.
    after_claims = set()
    for c in claims:
        for v in c.outputs:
            after_claims |= nx.descendants(graph, v)
    invariant, pre, post = [], [], []
    for n in reg.nodes:
        if n in taken:
            continue
        box = graph.nodes[n]["box"]
        touches = [v for v in graph.nodes[n]["ins"] + graph.nodes[n]["outs"] if has(v)]
        if not touches:
            (post if n in after_claims else invariant).append(n)
            continue
        why = mixing_reason(box, axis)
        if why:
            hint = (" (softmax over an axis streams only when its output is contracted over "
                    "that axis)" if box.spec.kind == "softmax" else "")
            raise RuleError(f"cannot stream over {axis}: {why} and no streamability rule covers "
                            f"it{hint}")
        pre.append(n)
    # Dependencies: pre boxes must be computable chunk by chunk.
    reduced = {v for c in claims for v in c.outputs}
    post_vals = {v for n in post for v in graph.nodes[n]["outs"]}  # invariants excluded
    for n in pre:
        for v in graph.nodes[n]["ins"]:
            if v in reduced or v in post_vals:
                raise RuleError(
                    f"cannot stream over {axis}: {graph.nodes[n]['box'].name} needs "
                    f"{ob(graph, v)}, which depends on a reduction over {axis}; no streamability "
                    f"rule covers this (a factor without {axis} can be pulled out of a contraction "
                    f"first: rule normalized_contraction)")
    for c in claims:  # a reduction's inputs, too, must be there chunk by chunk
        for v in [*c.inputs, *c.extra]:
            if v in reduced or v in post_vals:
                names = ", ".join(graph.nodes[n]["box"].name for n in c.nodes)
                raise RuleError(
                    f"cannot stream over {axis}: {names} reduces {ob(graph, v)}, which "
                    f"depends on a reduction over {axis} (a reduction of a reduction over the "
                    f"same axis does not stream in one pass)")
    for n in post:
        for v in graph.nodes[n]["ins"]:
            if has(v):
                raise RuleError(f"cannot stream over {axis}: {graph.nodes[n]['box'].name} reads "
                                f"{ob(graph, v)} which still carries {axis}")
    if not claims:
        raise RuleError(f"cannot stream over {axis}: the region reduces {axis} with no "
                        f"streamable reduction")
    for c in claims:
        # what is accumulated must be floating; an input without the axis (an integer
        # index of take_along_axis) is read whole by every chunk, never accumulated
        for v in [*(u for u in c.inputs if has(u)), *c.extra, *c.outputs]:
            if ob(graph, v).type.dtype not in FLOATING:
                names = ", ".join(graph.nodes[n]["box"].name for n in c.nodes)
                raise RuleError(f"cannot stream over {axis}: {names} reduces {ob(graph, v)} of "
                                f"dtype {ob(graph, v).type.dtype}; accumulators are "
                                f"floating-point (cast the values to a float dtype first)")
    return claims, invariant + pre, invariant + post


def replay(graph, nodes, env, axis=None, chunk=None):
    """Re-record boxes on the current builder, re-inferring types (on chunks,
    nested groups and streams see the axis relabelled to the chunk)."""
    for n in nodes:
        node = graph.nodes[n]
        box = node["box"]
        spec = box.spec.relabelled(axis, chunk) if axis else box.spec
        outs = ops.apply(spec, *[env[v] for v in node["ins"]], name=box.name,
                         out_names=[o.name for o in box.cod.inside])
        env.update(zip(node["outs"], outs))


def _needed(graph, boxes, values, env) -> list:
    """The boxes of ``boxes`` (in their order) that compute ``values`` from ``env`` (the
    walk stops at values in ``env`` and at boxes outside ``boxes``: claims, whose outputs
    the finalize provides)."""
    pool, chosen, todo = set(boxes), set(), [v for v in values if v not in env]
    while todo:
        v = todo.pop()
        (n,) = graph.predecessors(v)
        if n in pool and n not in chosen:
            chosen.add(n)
            todo += [u for u in graph.nodes[n]["ins"] if u not in env]
    return [n for n in boxes if n in chosen]


def build_stream(graph, reg, axis, chunk, claims, pre, post):
    has = lambda v: ob(graph, v).type.has(axis)  # noqa: E731
    states = [c.rule.state(graph, c, axis) for c in claims]
    flat = [s for st in states for s in st]
    fixed = [v for v in reg.inputs if not has(v)]
    chunked = [(ob(graph, v).name, ob(graph, v).type.resize(axis, chunk) if has(v) else ob(graph, v).type)
               for v in reg.inputs]

    def init():
        return [x for c in claims for x in c.rule.init(graph, c, axis)]

    def update(*args):
        state, ins = list(args[:len(flat)]), args[len(flat):]
        env = dict(zip(reg.inputs, ins))
        # an invariant box only the finalize reads (positions along another axis) is not
        # replayed here: only what the claims' updates read
        replay(graph, _needed(graph, pre, [v for c in claims for v in c.inputs], env), env,
                axis, chunk)
        out, i = [], 0
        for c, st in zip(claims, states):
            out += c.rule.update(graph, c, axis, state[i:i + len(st)], [env[v] for v in c.inputs])
            i += len(st)
        return out

    def finalize(*args):
        state, rest = list(args[:len(flat)]), args[len(flat):]
        env = dict(zip(fixed, rest))
        # invariant boxes that compute what a claim's finalize reads go first (a sink
        # logit scaled inside the region); none for claims without extra values
        early = _needed(graph, post, [v for c in claims for v in c.extra], env)
        replay(graph, early, env)
        i = 0
        for c, st in zip(claims, states):
            part = state[i:i + len(st)]
            outs = (c.rule.finalize(graph, c, axis, part, extra=[env[v] for v in c.extra])
                    if c.extra else c.rule.finalize(graph, c, axis, part))
            env.update(zip(c.outputs, outs))
            i += len(st)
        replay(graph, [n for n in _needed(graph, post, reg.outputs, env) if n not in early],
                env)
        # accumulators run in float32: hand results back in the region's dtypes
        return [env[v] if env[v].type.dtype == ob(graph, v).type.dtype
                else ops.cast(env[v], ob(graph, v).type.dtype, as_=ob(graph, v).name)
                for v in reg.outputs]

    def merge(*args):
        a, b, out, i = args[:len(flat)], args[len(flat):], [], 0
        for c, st in zip(claims, states):
            out += c.rule.merge(graph, c, axis, list(a[i:i + len(st)]), list(b[i:i + len(st)]))
            i += len(st)
        return out

    rule = "+".join(dict.fromkeys(c.rule.name for c in claims))
    mergeable = all(type(c.rule).merge is not Streamability.merge for c in claims)
    return Stream(axis, chunk,
                  trace(init, [], "init"),
                  trace(update, flat + chunked, "update"),
                  trace(finalize, flat + [(ob(graph, v).name, ob(graph, v).type) for v in fixed],
                        "finalize"),
                  rule,
                  trace(merge, flat + [(n + "_y", t) for n, t in flat], "merge")
                  if mergeable else None)


class StreamPartition(Rule):
    name = "stream_partition"
    params = ("axis", "chunk")
    summary = "stream an axis in chunks, folding an accumulator (fusion of pre/post boxes)"
    proof = "proofs.stream_partition"

    def _analyse(self, program, site, params):
        axis = params.get("axis")
        if not isinstance(axis, str):
            raise RuleError("stream_partition needs a parameter axis (an axis name)")
        body = body_at(program, site.path)
        graph = view(body)
        reg = region(graph, site.ops)
        parts = analyse(graph, reg, axis)
        chunk = tiles.choose(program, site.path, reg.boxes(), params.get("chunk"), "stream", axis,
                             f"s_{axis}", f"cannot stream over {axis}")
        return graph, reg, axis, chunk, parts

    def check(self, program, site, params):
        self._analyse(program, site, params)

    def apply(self, program, site, params):
        graph, reg, axis, chunk, (claims, pre, post) = self._analyse(program, site, params)

        def make():
            spec = build_stream(graph, reg, axis, chunk, claims, pre, post)
            dom = markov.Ty(*(ob(graph, v) for v in reg.inputs))
            return make_op(spec, dom, [ob(graph, v).name for v in reg.outputs], f"stream {axis}")
        box = replacement(self.name, (axis, chunk), reg, make)
        return replace_at(program, site.path, to_diagram(splice(reg, box)))

    def candidates(self, program, path=()):
        """Whole-body sites, for every axis some input carries (the premises
        then say why an axis that an output keeps cannot be streamed)."""
        body = body_at(program, path)
        graph = view(body)
        order = op_order(graph)
        index = {n: i for i, n in enumerate(order)}
        axes = dict.fromkeys(a for v in graph.graph["inputs"] for a in ob(graph, v).type.names)
        for axis in axes:
            whole = tuple(range(len(order)))
            yield Site(tuple(path), whole), {"axis": axis}
            # Each reduction over the axis with the boxes upstream of it that carry
            # the axis: the smallest region that can stream (one layer of a stack);
            # and two of those that read one input, or all that do, one stream of their
            # accumulators (a gate's and an up projection's GEMMs, or Q's, K's and V's, over
            # one loop of their input's chunks)
            sites = []
            for n in order:
                node = graph.nodes[n]
                if not any(ob(graph, v).type.has(axis) for v in node["ins"]) or \
                        any(ob(graph, v).type.has(axis) for v in node["outs"]):
                    continue
                part, todo = {n}, list(node["ins"])
                while todo:
                    v = todo.pop()
                    if not ob(graph, v).type.has(axis):
                        continue
                    for m in graph.predecessors(v):
                        if m not in part:
                            part.add(m)
                            todo += graph.nodes[m]["ins"]
                site = tuple(sorted(index[m] for m in part))
                if site != whole and site not in sites:
                    sites.append(site)
                    yield Site(tuple(path), site), {"axis": axis}
            reads = [{v for i in site for v in graph.nodes[order[i]]["ins"]
                      if v in graph.graph["inputs"] and ob(graph, v).type.has(axis)}
                     for site in sites]
            shared = [[site for site, r in zip(sites, reads) if v in r]
                      for v in dict.fromkeys(v for r in reads for v in r)]
            unions = [{*a, *b} for (a, ra), (b, rb) in itertools.combinations(zip(sites, reads), 2)
                      if ra & rb] + [set().union(*group) for group in shared if len(group) > 2]
            for union in map(tuple, map(sorted, unions)):
                if union != whole and union not in sites:
                    sites.append(union)
                    yield Site(tuple(path), union), {"axis": axis}
