"""A distributed program on JAX's SPMD engine: ``jax.shard_map`` over a mesh whose last axis,
"devices", carries the strategy (a 2-D mesh puts each outer woven axis on one of its own
before it, ``<axis>_devices``), with ``ppermute`` and ``all_gather`` along "devices" — no
communication layer of napkin's own.  The per-device body is napkin's single-device kernel.

* ``shard a``: the per-device program's kernel under shard_map, inputs and outputs cut along
  ``a`` where they carry it.
* ``gather x`` and ``ring q, x``: the per-device program split by the rule ``split_stream``
  (rewrites/split_stream.py, proved) into a kernel writing the partial states of its chunk
  of ``x`` and a kernel merging partial states and finalising.  A gather all-gathers the
  partial states along the parts axis and runs the merging kernel on all of them; a ring
  folds the chunk each device holds, passes the chunks on (``ppermute``, issued before the
  fold so the transfer hides behind it) and merges the states step by step with the
  accumulator's own merge (napkin's semantics of ``Stream.merge``), then finalises.

``jax.grad`` goes through ``shard``'s kernel (napkin's derived backward on each device); a
gather's and a ring's partial-state kernels have none of their own, so their derivative is
the algorithm's: the forward that saves each softmax's L and the backward programs
(``napkin.grad``), each distributed in turn (:func:`_with_derivative`).
"""
from __future__ import annotations

from napkin.core.errors import NapkinError

AXIS = "devices"


def mesh_of(s):
    """The mesh strategy ``s`` runs on: its outer axes' mesh axes (a 2-D mesh: heads × ring),
    then its own, "devices"."""
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from napkin.devices.strategy import mesh_axis
    n = s.total
    have = jax.devices()
    if len(have) < n:
        raise NapkinError(f"the plan is for {n} devices and JAX sees {len(have)} "
                          f"({have[0].platform}); on a CPU set XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={n} before JAX starts")
    shape = (*(k for _, k in s.outer), s.devices)
    return Mesh(np.array(have[:n]).reshape(shape), (*(mesh_axis(a) for a, _ in s.outer), AXIS))


def partition_spec(t, cut: str | None, outer=()):
    """The PartitionSpec of an array of type ``t`` cut along ``cut`` over the strategy's own
    mesh axis (None: whole), and along each outer axis ((axis, devices), …) over its own."""
    from jax.sharding import PartitionSpec as P
    from napkin.devices.strategy import mesh_axis
    others = {a for a, _ in outer}
    return P(*(AXIS if a.name == cut else mesh_axis(a.name) if a.name in others else None
               for a in t.axes))


def lower_distributed(d, *, backend="auto", interpret="auto", dtype=None, derivative=None):
    """``d`` (a :class:`napkin.devices.Distributed`) as a jitted function of the global
    arrays, in the diagram's input order; outputs cut as the strategy leaves them.
    ``derivative``: (the saving forward, the backward pieces) as distributed kernels, built
    when first differentiated (a ring's or a gather's partial-state kernels have no backward
    of their own: :func:`_with_derivative`)."""
    import jax
    from napkin.core.arrays import array_types
    from napkin.devices.strategy import layout
    p = d.best
    s = p.strategy
    if s.kind == "one":
        return p.local.kernel(backend, interpret=interpret, dtype=dtype)
    _divides(d, s)
    mesh = mesh_of(s)
    ins, outs = array_types(d.algorithm.dom), array_types(d.algorithm.cod)
    in_specs = tuple(partition_spec(t, layout(s, t), s.outer) for t in ins)
    local_names = [ob.name for ob in p.local.algorithm.dom.inside]  # the inputs, the bases
    bases = _bases(p)
    if s.kind == "shard":
        kernel = p.local.kernel(backend, interpret=interpret, dtype=dtype)
        body = lambda *xs: kernel(*xs, *bases(0))  # noqa: E731
        out_specs = tuple(partition_spec(t, layout(s, t), s.outer) for t in outs)
    else:
        parts, merge_box, finalize, merge, fixed, made = _split(p, backend, interpret, dtype)
        order = _order(made, d.algorithm, s)  # the merged stream's outputs need not be in
        # the algorithm's order (a forward that also saves L)
        if s.kind == "gather":  # the merge folds every device's parts: the whole axis's
            import sympy
            merge_box = merge_box.bound({sympy.Symbol(s.stream, integer=True, positive=True):
                                         d.sizes[s.stream]})
            body = _gather(parts, merge_box, local_names, s, bases)
            out_specs = tuple(partition_spec(t, None, s.outer) for t in outs)
        else:
            body = _ring((parts, merge, finalize, fixed), array_types(p.local.algorithm.dom),
                         [outs[order.index(j)] for j in range(len(made))], local_names, s,
                         bases)
            out_specs = tuple(partition_spec(t, layout(s, t), s.outer) for t in outs)
        body = _in_order(body, order)
    one = len(outs) == 1
    f = jax.shard_map(body if not one else (lambda *xs: _tupled(body(*xs))), mesh=mesh,
                      in_specs=in_specs, out_specs=out_specs, check_vma=False)
    if s.zigzag:
        f = _in_zigzag_order(f, ins, outs, s)
    if s.kind != "shard" and derivative is not None:
        f = _with_derivative(f, d, derivative)
    jitted = jax.jit((lambda *xs: f(*xs)[0]) if one else f)

    def call(*xs, interpret=None):  # (interpret: as the kernels were built; kept for callers
        return jitted(*xs)          # that pass it to any napkin kernel)
    call.strategy = s
    return call


def _with_derivative(f, d, derivative):
    """``f`` (the distributed forward) with the derivative the algorithm's own backward gives,
    distributed in turn: differentiated, the forward that also saves each softmax's L runs
    (distributed as this one), then one distributed program per group of floating inputs
    (napkin.grad's, each priced and cut as its own structure asks: dQ rings the keys as the
    forward does, dK and dV ring the queries).  ``derivative()``: (saving kernel, [(input
    names, backward kernel)]); integer inputs get no cotangent."""
    import jax
    import jax.numpy as jnp
    from napkin.core.arrays import array_types
    from napkin.core.primitives import FLOATING
    ins, outs = array_types(d.algorithm.dom), array_types(d.algorithm.cod)
    names = [ob.name for ob in d.algorithm.dom.inside]
    floating_out = [i for i, t in enumerate(outs) if t.dtype in FLOATING]
    built = {}

    def kernels():
        if "k" not in built:
            built["k"] = derivative()
        return built["k"]

    @jax.custom_vjp
    def g(*xs):
        return f(*xs)

    def fwd(*xs):
        out = _tupled(kernels()[0](*xs))
        ys, saved = out[:len(outs)], out[len(outs):]
        return tuple(ys), (xs, [ys[i] for i in floating_out], list(saved))

    def bwd(res, cts):
        xs, ys, saved = res
        seeds = [jnp.zeros(jnp.shape(y), y.dtype) if cts[i] is None else cts[i]
                 for i, y in zip(floating_out, ys)]
        got = {}
        for group, k in kernels()[1]:
            got.update(zip(group, _tupled(k(*xs, *ys, *saved, *seeds))))
        return tuple(got[n].astype(jnp.result_type(x)) if n in got else None
                     for n, x, t in zip(names, xs, ins))
    g.defvjp(fwd, bwd)
    return g


def _bases(p):
    """``bases(step, mine, theirs)``: the int32 starts, inside shard_map, of the pieces the
    per-device program runs on along the axes it reads positions along (p.bases): piece
    ``mine`` of this device's share of the cut woven axis, piece ``theirs`` of the streamed
    chunk it holds — at ``step`` of a ring, the chunk that started on device i − step.  A
    piece's start is its chunk's index (:meth:`Strategy.chunk`: zigzag's order) × the piece
    size (p.sizes: the per-device program's)."""
    import jax
    import jax.numpy as jnp
    from napkin.devices.strategy import mesh_axis
    s = p.strategy

    outer = dict(s.outer)

    def bases(step=0, mine=0, theirs=0):
        i = jax.lax.axis_index(AXIS)
        out = []
        for a in p.bases:
            if a in outer:  # this device's block of an outer axis
                block = jax.lax.axis_index(mesh_axis(a))
                out.append((block * p.sizes[a]).astype(jnp.int32))
            elif s.kind == "ring" and a == s.stream:
                chunk = s.chunk((i - step) % s.devices, theirs)
            else:
                chunk = s.chunk(i, mine if a == s.shard else theirs)
            out.append((chunk * p.sizes[a]).astype(jnp.int32))
        return out
    return bases


def _in_zigzag_order(f, ins, outs, s):
    """``f`` (a zigzag ring under shard_map, whose devices hold contiguous shares) on arrays
    in their natural order: the cut axes' chunks permuted into the order the devices hold
    them (:meth:`Strategy.order`) before, and the outputs' put back after.  A model that
    keeps its sequence in zigzag order would skip both; here XLA moves the chunks."""
    import jax.numpy as jnp
    import numpy as np
    chunks = s.devices * s.pieces
    order = np.array(s.order())
    back = np.argsort(order)

    def permuted(x, t, by):
        for a in (s.shard, s.stream):
            if t.has(a):
                k = t.names.index(a)
                w = x.shape[k] // chunks
                idx = (by[:, None] * w + np.arange(w)[None, :]).reshape(-1)
                x = jnp.take(x, jnp.asarray(idx), axis=k)
        return x

    def g(*xs):
        out = f(*(permuted(x, t, order) for x, t in zip(xs, ins)))
        return tuple(permuted(y, t, back) for y, t in zip(out, outs))
    return g


def by_name(kernel, values: dict) -> list:
    """``kernel``'s inputs from ``values`` by name (a box's wires come in its own order)."""
    return [values[n] for n in kernel.in_names]


def _tupled(out):
    return out if isinstance(out, tuple) else (out,)


def _divides(d, s):
    for a, parts in s.cuts().items():
        if d.sizes[a] % parts:
            what = f"{parts} chunks (zigzag: 2 per device)" if s.zigzag and a in (
                s.shard, s.stream) else f"{parts} devices"
            raise NapkinError(f"{a}={d.sizes[a]} does not divide over {what} (the SPMD engine "
                              f"cuts equal shares): choose sizes or a device count that divide")


def _split(p, backend, interpret, dtype):
    """(the partial-states kernel, the merge-and-finalize kernel, the finalize and merge as
    JAX functions) of the per-device program, split by the rule split_stream."""
    from napkin.core.region import Site
    from napkin.core.semantics import evaluate
    from napkin.devices.strategy import mergeable_stream
    from napkin.lower import lower
    from napkin.lower.program import top_boxes
    from rewrites import RULES
    from rewrites.split_stream import one_box
    opt = p.local
    program = opt.program
    boxes = top_boxes(program)
    if len(boxes) == 1:  # not split within the device: one part, its whole chunk
        found, why = mergeable_stream(program)
        if found is None:
            raise NapkinError(f"{p.strategy}: the per-device program: {why}")
        x = found[1].spec.axis
        program = RULES["split_stream"].apply(program, Site((), (0,)),
                                              {"axis": x, "size": int(p.sizes[x])})
        boxes = top_boxes(program)
    first, second = boxes
    tiles = dict(opt.tiles)
    states = {ob.name for ob in first.cod.inside}
    kernels = [lower(one_box(b.spec, b.dom, [o.name for o in b.cod.inside], b.name), tiles,
                     backend=backend, interpret=interpret, dtype=dtype or opt.dtype,
                     keep=states) for b in (first, second)]
    (_, stream), _ = mergeable_stream(opt.sequential.program if opt.sequential else opt.program)
    spec = stream.spec
    fixed = [ob.name for ob in stream.dom.inside if not ob.type.has(spec.axis)]
    made = [ob.name for ob in stream.cod.inside]  # the stream's outputs, in its own order
    if [ob.name for ob in second.cod.inside] != made:
        raise NapkinError(f"{p.strategy}: the split program's merge writes "
                          f"{[ob.name for ob in second.cod.inside]}, its stream {made}")
    return kernels[0], kernels[1], evaluate(spec.finalize), evaluate(spec.merge), fixed, made


def _order(made: list, algorithm, s) -> list:
    """Where each of the algorithm's outputs is among ``made`` (the merged stream's outputs,
    in the stream's order — a program's outputs need not be: a forward that also saves L)."""
    want = [ob.name for ob in algorithm.cod.inside]
    if sorted(want) != sorted(made):
        raise NapkinError(f"{s}: the per-device stream writes {', '.join(made)} but the "
                          f"algorithm returns {', '.join(want)}")
    return [made.index(n) for n in want]


def _in_order(body, order: list):
    """``body`` with its outputs taken in ``order`` (positions among its own)."""
    if order == list(range(len(order))):
        return body
    return lambda *xs: tuple(_tupled(body(*xs))[i] for i in order)


def _gather(parts, merge_box, names, s, bases):
    """Each device's partial states, gathered along the parts axis; merged and finalised on
    every device (the states are small: a row statistic and a row of the output each)."""
    import jax

    def body(*xs):
        values = dict(zip(names, [*xs, *bases(0)]))
        states = _tupled(parts(*by_name(parts, values)))
        gathered = [jax.lax.all_gather(st, AXIS, axis=0, tiled=True) for st in states]
        values.update(zip(merge_box.in_names, gathered))  # the states by their names
        return _tupled(merge_box(*by_name(merge_box, values)))
    return body


def _ring(split, ins, outs, names, s, bases):
    """Fold the chunk a device holds, pass the chunks on, merge: s.devices steps.  In zigzag
    order a device holds two pieces of its queries and of each chunk: every step folds each
    pair of pieces into its queries' piece's state (the per-device program is a piece's),
    and the outputs are the pieces' finalized, side by side."""
    import jax
    import jax.numpy as jnp
    parts, merge, finalize, fixed = split
    n, h = s.devices, s.pieces
    streamed = [j for j, t in enumerate(ins) if t.has(s.stream)]
    perm = [(j, (j + 1) % n) for j in range(n)]

    def piece(x, t, axis, k):
        if h == 1 or not t.has(axis):
            return x
        dim = t.names.index(axis)
        w = x.shape[dim] // h
        return jax.lax.slice_in_dim(x, k * w, (k + 1) * w, axis=dim)

    def pieces(xs, mine, theirs):
        return [piece(piece(x, t, s.shard, mine), t, s.stream, theirs) for x, t in zip(xs, ins)]

    def body(*xs):
        cur = list(xs)
        states = [None] * h
        for step in range(n):
            if step < n - 1:  # the next chunk's transfer, issued before this fold
                nxt = jax.lax.ppermute([cur[j] for j in streamed], AXIS, perm)
            for mine in range(h):
                for theirs in range(h):
                    values = dict(zip(names, [*pieces(cur, mine, theirs),
                                              *bases(step, mine, theirs)]))
                    part = [st[0] for st in _tupled(parts(*by_name(parts, values)))]
                    states[mine] = part if states[mine] is None else \
                        _tupled(merge(*states[mine], *part))
            if step < n - 1:
                for j, m in zip(streamed, nxt):
                    cur[j] = m
        done = []
        for mine in range(h):
            values = dict(zip(names, [*pieces(xs, mine, 0), *bases(0, mine, 0)]))
            done.append(_tupled(finalize(*states[mine], *(values[nm] for nm in fixed))))
        if h == 1:
            return done[0]
        return tuple(jnp.concatenate(ys, axis=t.names.index(s.shard)) if t.has(s.shard)
                     else ys[0] for t, *ys in zip(outs, *done))
    return body


COLLECTIVES = ("ppermute", "all_gather", "psum", "all_to_all", "reduce_scatter")


def communication(f, *args) -> dict:
    """What ``f``'s program sends between devices, read off its jaxpr: {collective: bytes one
    device sends} — a ppermute its operands, an all_gather (n − 1) shares of its result's
    per-device operand.  Counted, not modelled: the model's ``Priced.link_bytes`` must
    agree."""
    import jax
    import numpy as np
    out: dict = {}

    def walk(jaxpr, n):
        for e in jaxpr.eqns:
            name = e.primitive.name
            if name == "shard_map":
                walk(e.params["jaxpr"], int(np.prod(list(e.params["mesh"].shape.values()))))
                continue
            if name in COLLECTIVES:
                sent = sum(v.aval.size * v.aval.dtype.itemsize for v in e.invars)
                if name == "all_gather":  # from the others along its own mesh axis
                    sent *= e.params.get("axis_size", n) - 1
                out[name] = out.get(name, 0) + sent
            for sub in jax.core.subjaxprs(e) if hasattr(jax.core, "subjaxprs") else ():
                walk(sub, n)
            for p in e.params.values():
                inner = getattr(p, "jaxpr", None)
                if inner is not None and hasattr(inner, "eqns"):
                    walk(inner, n)
                elif hasattr(p, "eqns"):
                    walk(p, n)
    walk(jax.make_jaxpr(f)(*args).jaxpr, 1)
    return out
