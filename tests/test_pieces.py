"""A large algorithm searched as its natural pieces (napkin.search.pieces): a pre-norm
transformer block imported from plain JAX — RMSNorm, Q/K/V from one x, causal attention,
the output projection and residual, RMSNorm, a SwiGLU MLP and residual (71 boxes) — reaches a
runnable program, FlashAttention inside it, as one chain of rule applications on the whole
block.  (The search around it, the checker's replay and the kernels against float64 are
benchmarks/search.py --block: costing a program of twenty kernels takes seconds.)"""
import jax
import jax.numpy as jnp

import napkin as nk
from napkin.core.ir import ops as op_order, view
from napkin.search import pieces
from napkin.search.engine import Evaluator, eager_moves

F = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731


def _rms(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def block(x, g1, wq, wk, wv, wo, g2, w1, w3, w2):  # x[t, e]; wq[e, h, d]; wo[h, d, e]
    h = _rms(x, g1)
    q, k, v = (jnp.einsum("te,ehd->htd", h, w) for w in (wq, wk, wv))
    s = jnp.einsum("htd,hsd->hts", q, k) / jnp.sqrt(q.shape[-1])
    i, j = jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[0])[None, :]
    o = jnp.einsum("hts,hsd->htd", jax.nn.softmax(jnp.where(i >= j, s, -jnp.inf), -1), v)
    x = x + jnp.einsum("htd,hde->te", o, wo)
    h = _rms(x, g2)
    return x + (jax.nn.silu(h @ w1) * (h @ w3)) @ w2


AXES = ["t e", "e", "e h d", "e h d", "e h d", "h d e", "e", "e f", "e f", "f e"]  # block's


def _imported(t=1024, e=512, h=4, d=64, f=1024):
    args = [F(t, e), F(e), F(e, h, d), F(e, h, d), F(e, h, d), F(h, d, e), F(e), F(e, f),
            F(e, f), F(f, e)]
    return nk.from_jax(block, *args, axes=AXES)


def block_at_benchmark_sizes(dtype="f32"):  # benchmarks/search.py --block's source
    return _imported(t=2048, e=1024, h=8, d=128, f=4096)


def _names(program, runs):
    g = view(program)
    order = op_order(g)
    return [[g.nodes[order[i]]["box"].name for i in r] for r in runs]


def test_the_pieces_are_cut_where_least_crosses():
    d = _imported()
    program, _ = eager_moves(d)
    ev = Evaluator("h100", d.sizes, "bf16")
    runs = pieces.cuts(program, ev)
    names = _names(program, runs)
    assert sorted(i for r in runs for i in r) == list(range(len(op_order(view(program)))))
    light = {"add", "mul", "square", "silu", "rsqrt", "add_const(1e-06)", "scale(1/sqrt(d))",
             "causal"}
    assert all(sum(n not in light for n in r) <= pieces.MOST for r in names)
    assert all(len(r) <= pieces.ALONG for r in names)
    # the scores never leave a piece: QKᵀ, the scale, the mask, the softmax and P·V together
    assert ["contract->h,t,t_2", "scale(1/sqrt(d))", "causal", "softmax_t_2",
            "contract->htd"] in names
    # elementwise boxes ride with the products: the norm's multiplications in the piece of
    # the GEMMs they scale (its prologue), the residual x + o in the output projection's (an
    # epilogue, computed once: recomputing a value that reads two arrays is the search's call)
    mlp = next(r for r in names if "contract->tf" in r)
    assert mlp.count("contract->tf") == 2 and mlp.count("mul") >= 4
    wo = next(r for r in names if "contract->te" in r and "contract->tf" not in r)
    assert "add" in wo
    assert sum(r.count("add") for r in names) == 2  # x + o once, and the last residual


def test_the_pieces_chains_replay_on_the_whole_block_as_one_chain():
    from napkin.core.arrays import array_types
    from napkin.core.ir import primitive_boxes
    from napkin.search.engine import apply_move, in_pieces
    d = _imported()
    start = eager_moves(d)
    ev = Evaluator("h100", d.sizes, "f32")
    # bounded by states, not seconds: a time budget made the result depend on the machine's load
    # (20 states found 8 kernels, 111 µs, once a wave's first load was priced; 40 find the
    # expert's 7 and 107 µs)
    program, chain = in_pieces(start, ev, 40, 600.0)
    top = pieces.top_boxes(program)
    assert all(b.spec.kind in ("group", "stream") for b in top)  # every box in a kernel
    moves = [(m.rule, m.params_dict.get("axis")) for m in chain]
    assert ("stream_partition", "t_2") in moves  # the keys streamed: FlashAttention
    kernels = [[p.name for p in primitive_boxes(b)] for b in top]
    # each kernel's products by their outputs' axes (a product streamed over its sum is named
    # "Σ chunk": which of Q, K, V, the gate or up it is, its axes say)
    products = [["".join(a.name for a in array_types(p.cod)[0].axes)
                 for p in primitive_boxes(b) if p.spec.kind == "contract"] for b in top]
    # the expert's kernels: each product shares its kernel with the norm that scales its
    # input (Q; K and V from one x together; the MLP's gate and up together, one pass over
    # the normed x, silu(gate)·up their epilogue), and no kernel is an elementwise box alone
    # (the residual adds are epilogues)
    for axes, n in (("hdt", 1), ("hdt_2", 2)):  # Q; K and V
        (k,) = [k for k, ps in zip(kernels, products) if axes in ps]
        assert products[kernels.index(k)].count(axes) == n and k.count("mul") >= 2 * n, k
    (gate_up,) = [k for k, ps in zip(kernels, products) if ps.count("tf") == 2]
    assert gate_up.count("mul") >= 5 and "silu" in gate_up, gate_up
    assert all(any(n.startswith(("contract", "Σ", "mean", "sum", "softmax", "max")) for n in k)
               for k in kernels), kernels
    # (at these sizes attention's 4 heads × 16 query tiles leave half the SMs idle: split-K
    # may add the merge of its parts)
    assert len([k for k in kernels if not any("_parts" in n for n in k)]) <= 7, kernels
    replayed = d  # one chain of rule applications on the whole algorithm: a certificate's
    for mv in chain:
        replayed = apply_move(replayed, mv)
    assert [b.name for b in pieces.top_boxes(replayed)] == [b.name for b in top]
    # priced as the search prices it, each kernel's tiles its own (napkin.core.retile): the
    # kernels' row tiles are not all one (one name per axis forced attention's on the MLP)
    from napkin.core.retile import untied
    from napkin.core.streamed import names
    from napkin.search.engine import State
    st = State("block", program, chain)
    ev(st)
    assert st.feasible
    rows = [n for n, uses in names(untied(program)[0]).tiles.items()
            if any((u.kind, u.axis) == ("group", "t") for u in uses)]
    assert len(rows) >= 4 and len({st.tile_values[n] for n in rows}) >= 2, \
        {n: st.tile_values[n] for n in rows}
