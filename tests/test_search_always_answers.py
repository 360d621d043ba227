"""The search always hands back a runnable program, and says what kept it slow.

Attention with a sink written by hand as a constant logit (m = max(rowmax S, c),
z = Σ exp(S − m) + exp(c − m)) ended in "no streamed program fits" at q = x = 4096: now
recognition knows the constant sink (one stream, as the library's sink attention), and a
form it does not know (exp(−(m − c))) falls back to every box its own kernel — grouped,
streamed over what it reduces, values through HBM — with a note naming the premise that
kept it apart.  A budget below one box's smallest tile is still an error naming it
(tests/test_search.py, tests/test_launch.py)."""
import jax
import jax.numpy as jnp
import numpy as np

import napkin as nk
from napkin.search import apply_move

F = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
C = 0.5


def constant_sink(q, k, v):
    s = jnp.einsum("qd,xd->qx", q, k) / jnp.sqrt(q.shape[-1])
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), C)
    p = jnp.exp(s - m)
    return (p @ v) / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(C - m))


def constant_sink_other_form(q, k, v):  # c − m written −(m − c): no recognition knows it
    s = jnp.einsum("qd,xd->qx", q, k) / jnp.sqrt(q.shape[-1])
    m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), C)
    p = jnp.exp(s - m)
    return (p @ v) / (jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(-(m - C)))


def _inputs(q, x, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(q, d)).astype(np.float32),
            *(rng.normal(size=(x, d)).astype(np.float32) for _ in range(2))]


def _reference(fn, xs):
    with jax.enable_x64():
        return np.asarray(fn(*[x.astype(np.float64) for x in xs]))


def _imported(fn):
    return nk.from_jax(fn, F(4096, 128), F(4096, 128), F(4096, 128), axes=["q d", "x d", "x d"])


def test_a_constant_sink_written_by_hand_streams_in_one_pass():
    found = nk.optimize(_imported(constant_sink), sizes={"q": 4096, "x": 4096, "d": 128})
    rules = [m.rule for m in found.chain]
    assert rules[0] == "recognize" and found.chain[0].params_dict == {
        "pattern": "sink_attention_const"}
    assert "stream_partition" in rules and not found.search.note
    small = found.fit({"q": 40, "x": 56, "d": 16})
    xs = _inputs(40, 56, 16)
    got = np.asarray(small.kernel(interpret=True, dtype="f32")(*xs))
    np.testing.assert_allclose(got, _reference(constant_sink, xs), rtol=1e-5, atol=1e-6)


def test_a_form_no_recognition_knows_streams_in_two_passes():
    # c − m written −(m − c): no one-pass accumulator takes it, but the scores recomputed
    # per reader (recompute_product) stream twice in one kernel: the row max, then the rest
    alg = _imported(constant_sink_other_form)
    found = nk.optimize(alg, sizes={"q": 4096, "x": 4096, "d": 128})
    rules = [m.rule for m in found.chain]
    assert not found.search.note and len(found.search.best.tiles.launch) == 1
    assert "recompute_product" in rules and rules.count("stream_partition") == 2
    small = found.fit({"q": 40, "x": 56, "d": 16})
    xs = _inputs(40, 56, 16, seed=2)
    got = np.asarray(small.kernel(interpret=True, dtype="f32")(*xs))
    np.testing.assert_allclose(got, _reference(constant_sink_other_form, xs), rtol=1e-5,
                               atol=1e-6)


def test_a_search_that_finds_nothing_fused_gets_a_kernel_per_box_and_a_note():
    alg = _imported(constant_sink_other_form)
    found = nk.optimize(alg, sizes={"q": 4096, "x": 4096, "d": 128}, max_states=3)
    note = found.search.note
    assert "every box runs as a kernel of its own" in note
    assert "bytes of smem but the budget is 232448" in note  # the best fused, and why not
    assert "state limit 3 reached" in note
    assert found.search.best.feasible and len(found.program.boxes) > 5
    program = alg  # the chain is rule applications: replaying it gives the program
    for mv in found.chain:
        program = apply_move(program, mv)
    assert program == found.program
    small = found.fit({"q": 40, "x": 56, "d": 16})
    xs = _inputs(40, 56, 16, seed=1)
    got = np.asarray(small.kernel(interpret=True, dtype="f32")(*xs))
    np.testing.assert_allclose(got, _reference(constant_sink_other_form, xs), rtol=1e-5,
                               atol=1e-6)
