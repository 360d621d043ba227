"""A kernel called as JAX users call one (napkin.lower.call): inputs by the diagram's names,
leading batch axes mapped in one launch, gradients through the batched call, and
``jax.shard_map`` (outputs that declare how they vary over the mesh)."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin as nk
from napkin.core.errors import ShapeError


@pytest.fixture(scope="module")
def attention():
    opt = nk.optimize("attention", sizes={"q": 128, "x": 128, "d": 32}, dtype="f32")
    return opt.fit({"q": 37, "x": 53, "d": 32}).kernel()


def _bhsd(rng, b, h, s, d):
    return jnp.asarray(rng.standard_normal((b, h, s, d)), jnp.float32)


def _reference(q, k, v):  # jax's own attention takes (B, S, H, D)
    t = lambda a: a.transpose(0, 2, 1, 3)  # noqa: E731
    return t(jax.nn.dot_product_attention(t(q), t(k), t(v)))


def test_batch_axes_and_names_match_jax_attention(attention):
    rng = np.random.default_rng(3)
    q, k, v = _bhsd(rng, 2, 3, 37, 32), _bhsd(rng, 2, 3, 53, 32), _bhsd(rng, 2, 3, 53, 32)
    want = _reference(q, k, v)
    for got in (attention(q, k, v), attention(Q=q, K=k, V=v), attention(q, V=v, K=k)):
        assert got.shape == (2, 3, 37, 32)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # gradients through the batched call: the backward's kernels are mapped the same way
    ct = jnp.asarray(rng.standard_normal(want.shape), jnp.float32)
    mine = jax.grad(lambda *a: jnp.sum(attention(*a) * ct), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.grad(lambda *a: jnp.sum(_reference(*a) * ct), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(mine, theirs):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_a_batched_call_is_one_launch(attention):
    """vmap of a pallas_call puts the batch axes in its grid: one kernel, not a loop."""
    rng = np.random.default_rng(4)
    q, k, v = _bhsd(rng, 2, 3, 37, 32), _bhsd(rng, 2, 3, 53, 32), _bhsd(rng, 2, 3, 53, 32)
    text = str(jax.make_jaxpr(lambda *a: attention(*a, interpret=True))(q, k, v))
    assert text.count("pallas_call[") == 1 and "grid=(2, 3," in text


def test_an_unbatched_input_is_broadcast():
    """A weight without the activations' leading axes is shared by every batch entry."""
    opt = nk.optimize("matmul", sizes={"a": 64, "b": 64, "c": 64}, dtype="f32")
    kernel = opt.fit({"a": 20, "b": 24, "c": 18}).kernel()
    rng = np.random.default_rng(5)
    a = jnp.asarray(rng.standard_normal((4, 20, 24)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((24, 18)), jnp.float32)
    np.testing.assert_allclose(kernel(a, b), a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, message", [
    (lambda k, q: k(q, q), "no value for input V"),
    (lambda k, q: k(q, q, q, Q=q), "input Q given twice"),
    (lambda k, q: k(q, q, W=q), "has no input 'W': its inputs are Q, K, V"),
    (lambda k, q: k(q, q, q, q), "takes 3 inputs"),
    (lambda k, q: k(q[0], q, q), "K has leading batch axes (2, 3) but Q has (3,)"),
    (lambda k, q: k(q[0, 0, 0], q, q), r"Q[q,d] takes 2 axes (and any leading batch axes)"),
])
def test_bad_calls_are_one_line(attention, call, message):
    q = jnp.zeros((2, 3, 37, 32), jnp.float32)
    with pytest.raises(ShapeError) as e:
        call(attention, q)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_kernel_lowers_for_cuda_inside_shard_map():
    """With shard_map's varying-axis check on, a Pallas call's outputs must say how they vary:
    napkin's do (as the inputs), so a head-sharded call lowers for CUDA (no GPU needed)."""
    from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec as P
    opt = nk.optimize("attention", sizes={"q": 64, "x": 64, "d": 32}, dtype="bf16")
    kernel = opt.fit({"q": 64, "x": 64, "d": 32}).kernel("triton")
    mesh = AbstractMesh((4,), ("h",), abstract_device=AbstractDevice(
        device_kind="NVIDIA H100", num_cores=132, platform="gpu"))
    f = jax.shard_map(lambda *a: kernel(*a, interpret=False), mesh=mesh,
                      in_specs=(P(None, "h"),) * 3, out_specs=P(None, "h"))
    structs = [jax.ShapeDtypeStruct((2, 4, 64, 32), jnp.bfloat16,
                                    sharding=NamedSharding(mesh, P(None, "h")))] * 3
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.export.export(jax.jit(f), platforms=["cuda"],
                                 disabled_checks=checks)(*structs).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1


_SHARDED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import napkin as nk
    opt = nk.optimize("attention", sizes={"q": 128, "x": 128, "d": 32}, dtype="f32")
    k = opt.fit({"q": 37, "x": 53, "d": 32}).kernel()
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((2, 4, 37, 32)), jnp.float32)
    kv = [jnp.asarray(rng.standard_normal((2, 4, 53, 32)), jnp.float32) for _ in range(2)]
    mesh = Mesh(np.array(jax.devices()), ("h",))
    # check_vma=False: JAX's Pallas interpreter (CPU) mixes invariant constants into the
    # kernel's varying values; on a GPU the checked form lowers (the test above)
    f = jax.shard_map(k, mesh=mesh, in_specs=(P(None, "h"),) * 3, out_specs=P(None, "h"),
                      check_vma=False)
    out = jax.jit(f)(q, *kv)
    g = jax.jit(jax.grad(lambda a: jnp.sum(f(a, *kv) ** 2)))(q)
    want_g = jax.grad(lambda a: jnp.sum(k(a, *kv) ** 2))(q)
    print(len(jax.devices()), float(jnp.max(jnp.abs(out - k(q, *kv)))),
          float(jnp.max(jnp.abs(g - want_g))))
    # no shard_map: jit(vmap(k)) of head-sharded inputs keeps the heads' sharding (no
    # all-gather in the compiled program, the output sharded as the inputs), its gradient too
    from jax.sharding import NamedSharding
    heads = NamedSharding(mesh, P("h"))
    q3, kv3 = jax.device_put(q[0], heads), [jax.device_put(a[0], heads) for a in kv]
    for f, args in ((jax.jit(jax.vmap(k)), (q3, *kv3)), (jax.jit(k), (q3, *kv3)),
                    (jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(k)(a, *kv3) ** 2))), (q3,))):
        out = f(*args)
        print(f.lower(*args).compile().as_text().count("all-gather"), out.sharding.spec)
    print(float(jnp.max(jnp.abs(jax.jit(jax.vmap(k))(q3, *kv3) - k(q[0], *(a[0] for a in kv))))))
""")


def test_four_cpu_devices_shard_map_and_jit_vmap_keep_the_heads_sharding():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    devices, err, gerr = lines[0].split()
    assert devices == "4" and float(err) <= 1e-6 and float(gerr) <= 1e-5
    assert lines[1:4] == ["0 P('h',)"] * 3, lines  # (issue 31: it all-gathered, replicated)
    assert float(lines[4]) <= 1e-6


def test_other_floating_dtypes_come_back_in_the_callers_dtype(attention):
    """An f32 kernel fed bf16 computes in f32 and hands back bf16 (as a JAX function of bf16
    arrays would), its value the f32 result rounded; the gradient too."""
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
               for s in ((37, 32), (53, 32), (53, 32)))
    out = attention(q, k, v)
    assert out.dtype == jnp.bfloat16
    f32 = attention(*(a.astype(jnp.float32) for a in (q, k, v)))
    assert f32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(f32.astype(jnp.bfloat16), np.float32))
    g = jax.grad(lambda a: jnp.sum(attention(a, k, v).astype(jnp.float32)))(q)
    assert g.dtype == jnp.bfloat16
