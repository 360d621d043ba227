"""JAX functions in: ``napkin.from_jax(fn, *shape_dtype_structs, axes=...)`` reads a plain
JAX function's jaxpr into a napkin diagram over named axes.

    def attention(q, k, v):                    # q[q,d], k[x,d], v[x,d]: plain jnp
        s = jnp.einsum("qd,xd->qx", q, k) / jnp.sqrt(q.shape[-1])
        return jax.nn.softmax(30.0 * jnp.tanh(s / 30.0), axis=-1) @ v

    S = jax.ShapeDtypeStruct
    diagram = napkin.from_jax(attention, S((512, 64), jnp.float32), S((2048, 64), jnp.float32),
                              S((2048, 64), jnp.float32), axes=["q d", "x d", "x d"])
    napkin.optimize(diagram, sizes=diagram.sizes)     # FlashAttention for the soft-capped form

The diagram is a faithful translation: its meaning is the function's over the reals (a
float literal the exact value it holds, a float cast the identity — napkin's semantics),
every pattern read back only where it provably means the same.  The modules, in order:

* **Tracing** (:mod:`.tracing`).  ``fn`` is traced with ``jax.make_jaxpr`` at *symbolic*
  sizes (one ``jax.export`` symbol per axis name), so sizes the function computes with
  (``jnp.sqrt(q.shape[-1])``, a mean's divisor, ``jnp.arange(q.shape[0])``) stay symbols
  and the diagram serves every size, as a library algorithm does.  Code that needs a
  Python number from a size (``math.sqrt(d)``, ``d ** -0.5``) cannot trace so; it is then
  traced at the given sizes and once more at other sizes — the same equations, every axis
  its size in both — and each constant that changed is read back as c·sizeᵖ (p = ±1, ±½,
  ±2) of the one axis that explains both traces exactly (to its dtype's rounding), or
  refused with a line saying how to write it.  jit / pjit / custom_jvp / custom_vjp calls
  are inlined.
* **Axes** (:mod:`.naming`).  Every dimension of every jaxpr variable gets an axis by
  unification along the data flow (elementwise operands, dot_general's contracting and
  batch dimensions, broadcast_in_dim's mapped dimensions, ...); the arguments' axes come
  from ``axes=`` or, without it, from sizes (``n4096``: one axis per distinct size; two
  different axes of one size are an error asking for ``axes=``).  A dimension of size 1 is
  *no* axis: napkin broadcasts by name, so ``broadcast_in_dim``, ``reshape``, ``tile``,
  ``expand_dims``, ``squeeze`` and ``transpose`` are wiring, not boxes.
* **Primitives** (:mod:`.graph`).  ``stop_gradient`` is the identity; the rest map to
  napkin primitives one by one, a literal operand to the constant forms (``scale``,
  ``add_const``, ``max_const``, ...), constants folded (exactly for sizes, square roots and
  reciprocals).  Common subexpressions are shared (JAX does not share them: ``jnp.exp(x) /
  jnp.exp(x).sum()`` computes exp twice), before the patterns and after.
* **Patterns** (:mod:`.patterns`, :mod:`.elementwise`, :mod:`.masks`), read back into the
  primitives the search streams: softmax, logsumexp and log-softmax (``jax.nn.softmax``,
  ``jax.scipy.special.logsumexp``, ``jax.nn.log_softmax`` and their hand-written
  max-shifted forms, by structure), mean (c·|a| = 1 exactly), ``c·tanh(x/c)`` (softcap,
  c·(1/c) = 1 exactly), ``max(x, 0)`` (relu), ``select_n(is_finite(m), 0, m)``; gelu (both
  forms), silu and sigmoid from any elementwise cone of one input that sympy *proves*
  equal to napkin's definition (a constant counts as √(2/π), 0.044715, 1/√2 where its
  dtype holds it as that constant's rounding, as ``jax.nn.gelu`` writes it); a causal or
  sliding-window mask written with ``jnp.arange`` (iota) comparisons in int32 or f64, a
  fill ≤ −5e29 (or −∞) in an f64/f32/bf16 array, whose result only feeds softmaxes over
  the key axis, becomes ``causal_mask`` / ``window_mask`` (the search skips masked
  tiles); any other mask stays positions / compare / where, correct but not skipped.
* **Anything else** is one line naming the primitive and the user's source line: a
  cumsum, a sort, a gather other than take_along_axis's, a take_along_axis with
  ``mode="clip"``, a reshape that regroups dimensions without merging or splitting axes, a
  dtype napkin lacks (uint8, int16, ...).
* **Merged and split axes** (:mod:`.naming`, :mod:`.boundary`): a dimension fn merges from
  others or splits into others (``jnp.repeat`` / ``jnp.tile`` of K over heads, a head split
  (t, h·d) -> (t, h, d)) is the axes it is the product of, outer first; an argument's such
  dimension is split, an output's merged back, at the kernel's boundary.
* **An argument read twice** (:mod:`.renaming`): where an axis t meets itself (``x @ x.T``,
  self-attention from one x), the operand bringing the second dimension is read over a
  second axis t_2 from a copy of the argument; ``diagram.arguments`` says which argument
  each input is, ``diagram.aliases`` ``{t_2: t}``.

Where they differ (napkin's primitives document each): napkin's softmax gives a row that
keeps no entry (its maximum −∞ or below −5e29) zeros, where ``jax.nn.softmax`` gives NaN
(−∞) or the uniform average (a finite fill), and the unshifted exp(x)/Σexp(x) overflows
where napkin's does not; napkin's take_along_axis gives 0 for an index out of range, JAX
its fill (NaN); int64 (x64) is read as int32 (a value int32 cannot hold is refused by
name when the diagram is evaluated, not wrapped); and a dimension of size 1 is dropped from
the diagram's inputs (marked "1" in ``axes``) and outputs.
"""
from __future__ import annotations

from napkin.frontend.jaxpr.boundary import boundary
from napkin.frontend.jaxpr.emit import emit
from napkin.frontend.jaxpr.graph import Graph, Uses
from napkin.frontend.jaxpr.naming import Clash, Naming, arg_names, axis_names, struct
from napkin.frontend.jaxpr.patterns import recognise
from napkin.frontend.jaxpr.renaming import Renaming
from napkin.frontend.jaxpr.tracing import dce, read_size_constants, trace
from napkin.frontend.jaxpr.vocabulary import fail

__all__ = ["from_jax", "inputs_of", "outputs_of"]


def inputs_of(diagram, args):
    """The diagram's inputs from ``fn``'s arguments (an argument read twice is passed twice,
    a dimension fn merges or splits is passed as its axes: :mod:`.boundary`)."""
    b = getattr(diagram, "boundary", None)
    return list(args) if b is None else b.inputs(args)


def outputs_of(diagram, outs):
    """``fn``'s results from the diagram's outputs (a merged dimension merged back)."""
    b = getattr(diagram, "boundary", None)
    return outs if b is None else b.outputs(outs)


def from_jax(fn, *args, axes=None, name: str | None = None):
    """Read the plain JAX function ``fn`` into a napkin diagram.

    ``args``: one ``jax.ShapeDtypeStruct`` (or array) per positional argument of ``fn``.
    ``axes``: the names of each argument's dimensions — a list (one entry per argument)
    or a dict ``{argument name: names}``, each entry a space-separated string (``"q d"``)
    or a sequence of names or :class:`~napkin.Axis`; ``"1"`` or ``"_"`` marks a dimension
    of size 1 that is broadcast rather than an axis (the diagram's input then lacks it).
    Without ``axes`` a dimension is named by its size (``n4096``).  Sizes in the diagram
    are symbols; the arguments' sizes are ``diagram.sizes`` (``{axis: int}``), for
    ``napkin.optimize(diagram, sizes=diagram.sizes)``.  ``name``: the algorithm's name
    (default ``fn.__name__``).  Dimensions of size 1 in the outputs are dropped (napkin
    arrays have no unit axes).  See :mod:`napkin.frontend.jaxpr` for what is read and how."""
    if not callable(fn):
        fail(f"expected a function, got {type(fn).__name__}")
    structs = [struct(a, i) for i, a in enumerate(args)]
    argnames = arg_names(fn, len(structs))
    label = name or getattr(fn, "__name__", "fn")
    if not label.isidentifier():
        label = "fn"
    names = axis_names(axes, structs, argnames)
    traced = trace(fn, structs, names, label)
    eqns = dce(traced.eqns, traced.outvars)
    twice = Renaming(traced, names, argnames)
    while True:  # an axis that meets itself is read as a copy of its argument (renaming.py)
        naming = Naming(traced, twice.names, twice.argnames, twice.aliases, twice.renamed)
        try:
            naming.run(eqns)
            break
        except Clash as clash:
            eqns = twice.resolve(eqns, clash)
    argnames = twice.argnames
    if traced.mode == "concrete":  # sizes the function read as numbers: back to symbols
        original = lambda v: tuple(twice.aliases.get(a, a) for a in naming.dims(v))  # noqa: E731
        products = {traced.per[i][j]: d for i, v in enumerate(traced.invars[:len(structs)])
                    for j, d in enumerate(naming.dims(v)) if isinstance(d, tuple)}
        read_size_constants(fn, structs, traced, original, {id(e) for e in eqns}, label,
                            products, naming.new_axes)
    graph = Graph(naming, traced)
    outs = graph.build(eqns, traced.invars, traced.outvars)
    recognise(graph, outs)
    # a stop_gradient inside a softmax or logsumexp (JAX's own shift by the row max) is gone
    # with the pattern, and harmless: both are invariant under the shift; one still live
    # would make napkin.grad differ from jax.grad, so grad refuses such a diagram
    live = {id(n) for n in Uses(graph, outs).live}
    stopped = [where for n, where in graph.stopped if id(n) in live]
    diagram = emit(graph, outs, traced.invars, naming, argnames, label)
    diagram.stop_gradients = stopped
    from napkin.certify.certificate import size_symbols
    diagram.sizes = {a: traced.stand_ins.get(a, s) for a, s in traced.sizes.items()
                     if a in size_symbols(diagram)}
    # an argument read twice: which of fn's arguments each input is, and the second axes'
    # originals (a size given for t is t_2's too)
    diagram.arguments = (list(argnames[:len(structs)]), twice.sources) if twice.read_twice \
        else None
    diagram.aliases = {a: b for a, b in twice.aliases.items() if a in diagram.sizes}
    diagram.boundary = boundary(naming, traced, argnames, twice.sources, traced.outvars)
    if traced.stand_ins:
        _same_at_the_given_sizes(fn, structs, diagram, traced.stand_ins)
    return diagram


def _same_at_the_given_sizes(fn, structs, diagram, stand_ins):
    """A size-1 axis was read at another size: the diagram at the given sizes must be the
    function there (one that treats size 1 apart — squeezes it, branches on it — is refused)."""
    import numpy as np
    from napkin.core.semantics import evaluate
    rng = np.random.default_rng(0)
    xs = [np.asarray(rng.standard_normal(s.shape) if np.issubdtype(s.dtype, np.floating)
                     else rng.integers(0, max(1, min(s.shape or (1,))), s.shape), s.dtype)
          for s in structs]
    try:
        want = fn(*xs)
        got = outputs_of(diagram, evaluate(diagram, dict(diagram.sizes))(*inputs_of(diagram, xs)))
    except Exception as e:  # noqa: BLE001
        fail(f"axis {', '.join(stand_ins)} has size 1 and fn was read at another size; at "
             f"size 1 it does not run as read ({type(e).__name__}): give it another size")
    want = want if isinstance(want, (tuple, list)) else [want]
    got = got if isinstance(got, (tuple, list)) else [got]
    for w, g in zip(want, got):
        w = np.asarray(w, np.float64).reshape(-1)
        g = np.asarray(g, np.float64).reshape(-1)
        if w.shape != g.shape or not np.allclose(w, g, rtol=1e-4, atol=1e-5):
            fail(f"axis {', '.join(stand_ins)} has size 1 and fn treats it apart (at size 1 "
                 f"it computes something else than at other sizes): give it another size, "
                 f"or mark it '1' (a broadcast dimension)")
