"""Writing Mosaic GPU kernel code through the semantics: the recording namespace of
:mod:`napkin.lower.emit`, with Mosaic's spellings.

* :class:`SmemRef` — an array in shared memory: a box reading it loads it (``ref[...]``), a
  contraction reads it in place;
* :class:`MosaicWriter` — implicit broadcasts become ``lax.broadcast_in_dim`` from the array
  before its unit axes were inserted (Mosaic's register layouts have no (n, 1) arrays), and an
  elementwise op on such expansions runs on their sources;
* :class:`MosaicRecorder` — positions as ``broadcasted_iota``, a contraction as one wgmma
  (``_mma``: operands in shared memory, or a first operand in registers), and ``state + a·b``
  accumulated into the state's own accumulator (``_mma_into``);
* :data:`HELPERS` — those helpers' source, which every Mosaic module holds once.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from napkin.core.errors import NapkinError
from napkin.lower.emit import LOW_PRECISION, NAME, Recorder, Var, Writer

FP8 = np.dtype(jnp.float8_e4m3fn)


class SmemRef(Var):
    """An array in shared memory (a TMA-copied tile or chunk): a box reading it loads it into
    registers (``ref[...]``); a contraction reads it in place."""

    def __init__(self, writer, ref: str, aval):
        super().__init__(writer, ref, aval, temp=False)
        self.ref = ref
        self.pending = None  # a chunk's barrier, until the step has waited for its copy

    def __str__(self):
        # a read written before the step waits for the chunk's copy would race the TMA
        assert self.pending is None, f"{self.ref} read before waiting for {self.pending}"
        return f"{self.ref}[...]"


class MosaicWriter(Writer):
    """A Writer whose implicit broadcasts become ``lax.broadcast_in_dim`` (Mosaic GPU's
    register layouts have no (n, 1) arrays to broadcast from)."""

    def __init__(self, namespace=None):
        super().__init__(namespace)
        self.sizes = {}  # line -> values of the array it computes (the register estimate)
        self.hoisted = None  # barriers waited for, to be written before (a list), or here

    def let(self, expr, *args, name=None, aval=None, comment=None):
        self.ready(*args)
        if aval is None:
            aval = self._aval(expr, args)
            shape = tuple(getattr(aval, "shape", ()))
            inner = self.on_sources(expr, args, shape)
            if inner is not None:  # an op on broadcastable values: on their sources
                src, dims = inner
                out = super().let(f"{{0}}.reshape({shape})", src, name=name, aval=aval,
                                  comment=comment)
                out.expanded = (src, dims)
                return out
            args = tuple(self.broadcast(a, shape) for a in args)
        var = super().let(expr, *args, name=name, aval=aval, comment=comment)
        shape = tuple(getattr(aval, "shape", ()))
        self.sizes[var.line] = (math.prod(shape), shape)
        return var

    def ready(self, *xs) -> None:
        """Wait for the chunks among ``xs`` whose copies this step has not waited for yet:
        each streamed input has its own barrier, so a product can start on K before V has
        landed.  Every chunk's barrier is waited for once a step on every path (Mosaic
        tracks a barrier's phase by its waits): never inside a branch, and a chunk the step
        never read is waited for at its end."""
        for x in xs:
            barrier = getattr(x, "pending", None)
            if barrier:
                x.pending = None
                if self.hoisted is not None:  # written before the code being written
                    self.hoisted.append(barrier)
                else:
                    self.line(f"plgpu.barrier_wait({barrier})")

    def live_indices(self) -> set:
        """The lines :meth:`live_lines` keeps."""
        kept, read = set(), set()
        for i in range(len(self.lines) - 1, -1, -1):
            if i in self.values and self.values[i] not in read:
                continue
            read.update(NAME.findall(self.lines[i]))
            kept.add(i)
        return kept

    def on_sources(self, expr, args, shape):
        """An elementwise op whose array operands are all unit-axis expansions of arrays of
        one shape (a row index minus a window): the op on those arrays, and where their
        axes go — (result, dims) — so that the result broadcasts from it too."""
        vars_ = [a for a in args if isinstance(a, Var) and a.ndim]
        if not vars_ or not all(hasattr(a, "expanded") and a.shape == shape for a in vars_):
            return None
        srcs = {(a.expanded[0].shape, a.expanded[1]) for a in vars_}
        if len(srcs) != 1:
            return None
        dims = vars_[0].expanded[1]
        inner = self.let(expr, *[a.expanded[0] if isinstance(a, Var) and a.ndim else a
                                 for a in args])
        return inner, dims

    def broadcast(self, x, shape):
        if not isinstance(x, Var) or x.shape == shape or not x.shape or not shape:
            return x
        if len(x.shape) > len(shape) or np.broadcast_shapes(x.shape, shape) != shape:
            return x  # a reduction's input, not a broadcast
        src, dims = getattr(x, "expanded", (x, tuple(range(len(shape) - x.ndim, len(shape)))))
        aval = jax.ShapeDtypeStruct(shape, x.dtype)
        self.ready(src)
        return super().let(f"lax.broadcast_in_dim({{0}}, {shape}, {dims})", src, aval=aval)


class MosaicRecorder(Recorder):
    """The Recorder with Mosaic GPU's spellings of broadcasts, positions and contractions."""

    name = "pallas-mosaic-gpu"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # shared-memory buffers a first operand computed in FP8 is stored to for its wgmma
        # (no register layout of Mosaic's takes an accumulator's values to the 8-bit A
        # operand's): name -> (shape, dtype), one (M, K) buffer per consumer (``.at[wg]``)
        self.staging: dict = {}
        plain = self.add

        def add(a, b):
            """state + a·b: the product accumulates into the state (wgmma's accumulator
            initialised with it) instead of a fresh accumulator and an add."""
            for acc, prod in ((a, b), (b, a)):
                mma = getattr(prod, "mma", None)
                if mma and isinstance(acc, Var) and acc.shape == prod.shape and \
                        acc.dtype == np.float32 and not isinstance(acc, SmemRef):
                    A, B, kind, turn = mma
                    return self.w.let(f"_mma_into{kind}({acc.name}, {A}, {B}{turn})",
                                      aval=prod.aval)
            return plain(a, b)
        self.add = add

    # A stream's step in which two consumer warpgroups take turns on the tensor cores
    # (FlashAttention-3's ping-pong): the barrier's name while such a step is written.  The
    # step's first product takes a turn once issued (the other consumer's products run
    # while this one waits for its result and works on it), and a product of a value the
    # step computed takes one before it is issued (the other consumer's softmax ran
    # meanwhile).  Every consumer runs the same code, so each takes as many turns.
    turns: str | None = None
    _issued = False

    # A step whose products are issued first and waited for once (a product run a step late
    # beside them: _Spelling.deferred_step): the products issued so far, as lines, and the
    # product to hold back; None while a step is written the plain way.
    issuing: Issuing | None = None

    def turn(self, a) -> str:
        """The turn keyword of a product whose first operand is ``a`` ("" for none)."""
        if self.turns is None:
            return ""
        first, self._issued = not self._issued, True
        if not isinstance(a, SmemRef):
            return f", before={self.turns}"
        return f", after={self.turns}" if first else ""

    def take_turns(self, barrier: str | None) -> None:
        """Turns on (a barrier's name) for the step written next, or off (None)."""
        self.turns, self._issued = barrier, False

    def reshape(self, x, shape):
        """A reshape that only inserts unit axes remembers its source and where its axes
        went, so that a broadcast of it is written from the source (MosaicWriter)."""
        out = super().reshape(x, shape)
        shape = tuple(int(s) for s in shape)
        if out is not x and len(shape) > x.ndim:
            dims, j = [], 0
            for d, n in enumerate(shape):
                if j < x.ndim and n == x.shape[j]:
                    dims.append(d)
                    j += 1
                elif n != 1:
                    break
            else:
                if j == x.ndim:
                    out.expanded = (x, tuple(dims))
        return out

    def arange(self, n):
        return self.w.let(f"lax.broadcasted_iota(jnp.int32, ({int(n)},), 0)")

    def _dot(self, la, a, lb, b, out, batch, fa, fb, contracted, sizes, dt):
        """One wgmma: A (M x K) from shared memory or registers, B (K x N) from shared
        memory, both as stored or transposed; the result in an f32 accumulator."""
        if dt not in LOW_PRECISION:
            raise NapkinError(f"a {np.dtype(dt).name} matrix product: wgmma runs bf16 / f16 / "
                              f"FP8 e4m3 here")
        if dt == FP8 and not (isinstance(b, SmemRef) and b.dtype == FP8 and
                              (not isinstance(a, SmemRef) or a.dtype == FP8)):
            raise NapkinError(f"contraction {la},{lb}->{out}: an FP8 wgmma takes its second "
                              f"operand FP8 from shared memory, its first FP8 from shared "
                              f"memory or computed (P·V: declare V fp8)")
        if batch or len(la) != 2 or len(lb) != 2 or len(fa) != 1 or len(fb) != 1:
            raise NapkinError(f"contraction {la},{lb}->{out}: wgmma takes one 2-D product "
                              f"(no batch axes)")
        a, b = self.astype(a, dt), self.astype(b, dt)
        m, n = sizes[fa[0]], sizes[fb[0]]

        def operand(x, order, want, which):
            if isinstance(x, SmemRef):
                # an 8-bit wgmma reads both operands K-major: A stored (M, K), B (N, K)
                if dt == FP8 and (order == want) != (which == "A"):
                    name = x.ref.removesuffix("_chunk").removesuffix("_wg")
                    axis = lambda c: self.axis_names.get(c, c)  # noqa: E731
                    stored = "(" + ", ".join(map(axis, order)) + ")"
                    raise NapkinError(
                        f"contraction {la},{lb}->{out}: {name} is stored {stored}, its "
                        f"{axis(order[-1])} axis minor; an FP8 wgmma reads {which} K-major: "
                        f"declare {name} with the contracted axis {axis(contracted[0])} "
                        f"last, ({', '.join(map(axis, order[::-1]))})")
                return x.ref if order == want else f"{x.ref}.T"
            if which == "B":
                raise NapkinError(f"contraction {la},{lb}->{out}: its second operand is computed "
                                  f"in the kernel; wgmma reads it from shared memory")
            if order != want:
                raise NapkinError(f"contraction {la},{lb}->{out}: a first operand in registers "
                                  f"must be (M, K)")
            return x.name
        A = operand(a, la, fa[0] + contracted[0], "A")
        B = operand(b, lb, contracted[0] + fb[0], "B")
        stage = self.stage(a, (m, sizes[contracted[0]]), dt)
        if self.issuing is not None:
            return self.issuing.product(self, a, b, A, B, out != fa[0] + fb[0], (m, n), stage)
        self.w.ready(a, b)
        helper = "_mma" if isinstance(a, SmemRef) else "_mma_registers"
        keywords = self.turn(a) + (f", stage={stage}" if stage else "")
        c = self.w.let(f"{helper}({A}, {B}, ({m}, {n}){keywords})",
                       aval=jax.ShapeDtypeStruct((m, n), jnp.float32))
        c.mma = (A, B, "" if isinstance(a, SmemRef) else "_registers", keywords)
        if out != fa[0] + fb[0]:
            c = self.transpose(c, [1, 0])
        c.origin = ("dot",)
        return c


    def stage(self, a, shape, dt) -> str | None:
        """The consumer's staging buffer for a first operand ``a`` computed in FP8 (its
        spelling), or None where the wgmma reads ``a`` as it is."""
        if isinstance(a, SmemRef) or dt != FP8:
            return None
        key = (tuple(int(v) for v in shape), np.dtype(dt))
        name = next((n for n, k in self.staging.items() if k == key), None)
        if name is None:
            name = self.w.fresh(f"{a.name}_stage")
            self.staging[name] = key
        return f"{name}.at[wg]"


class NotDeferred(Exception):
    """The step cannot be written with its products issued first (a product of a value it
    computes other than the deferred one, a transposed result): written the plain way."""


class DeferredProduct(Var):
    """The product the step holds back: A (in registers, the wgmma dtype) and B (this step's
    chunk; ``b_view``: how the product reads it, as stored or transposed — ".T"; ``stage``:
    where an FP8 A is stored for it, see MosaicRecorder.stage), accumulated into the state at
    the next step."""

    def __init__(self, writer, a, b, aval, b_view="", stage=None):
        super().__init__(writer, "_deferred", aval, temp=False)
        self.a, self.b, self.b_view, self.stage = a, b, b_view, stage

    @property
    def keywords(self) -> str:
        """The stage keyword of the late product's helper call ("" where A is read as held)."""
        return f", stage={self.stage}" if self.stage else ""


class Issuing:
    """A step's products, issued before any of them is waited for: each of two operands in
    shared memory gets an accumulator and an ``_issue`` line; its value is an ``_load`` —
    the first load waits for all but the deferred product (issued last), the others not at
    all.  The product to defer is returned as a :class:`DeferredProduct`."""

    def __init__(self):
        self.lines, self.accumulators, self.defer_next, self.loads = [], [], False, 0

    def product(self, xp, a, b, A, B, transposed: bool, mn, stage=None):
        """The product ``a @ b`` (written ``A``, ``B``: MosaicRecorder._dot's operands)."""
        if transposed:
            raise NotDeferred(f"{A} @ {B}: a transposed product")
        if self.defer_next:  # (its B, this step's chunk, is read a step later: no wait now)
            self.defer_next = False
            if isinstance(a, SmemRef) or not isinstance(b, SmemRef):
                raise NotDeferred(f"{A} @ {B}: not A (registers) @ B (shared memory)")
            return DeferredProduct(xp.w, a, b, jax.ShapeDtypeStruct(mn, jnp.float32),
                                   B.removeprefix(b.ref), stage)
        if not (isinstance(a, SmemRef) and isinstance(b, SmemRef)) or stage:
            raise NotDeferred(f"{A} @ {B}: a product of a value the step computes")
        xp.w.ready(a, b)
        acc = f"acc_{len(self.accumulators)}"
        self.accumulators.append(mn)
        self.lines.append(f"_issue({acc}, {A}, {B})")
        wait = "1 if late else 0" if self.loads == 0 else None
        self.loads += 1
        c = xp.w.let(f"_load({acc}, {wait})", aval=jax.ShapeDtypeStruct(mn, jnp.float32))
        c.origin = ("dot",)
        return c


HELPERS = '''
_MODE = {"interpret": False}


def _turn(barrier):
    """The two consumer warpgroups take turns on the tensor cores (FlashAttention-3's
    ping-pong): a phase of ``barrier`` completes when both have arrived."""
    if barrier is not None:
        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)


def _mma(a, b, shape, before=None, after=None):
    """a @ b on the tensor cores (wgmma), both operands in shared memory; ``before`` /
    ``after``: a turn (see _turn) taken before issuing it / after issuing it, before its
    result is waited for."""
    _turn(before)

    def run(acc):
        plgpu.wgmma(acc, a, b)
        _turn(after)
        return acc[...]
    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


def _mma_registers(a, b, shape, before=None, after=None, stage=None):
    """a @ b with ``a`` in registers (WGMMA layout), ``b`` in shared memory; interpret mode's
    wgmma reads shared memory only, so there it is a plain dot.  An FP8 ``a`` is stored to
    ``stage`` first (see _staged)."""
    if _MODE["interpret"]:
        _turn(before)
        out = lax.dot_general(a, b[...], (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
        _turn(after)
        return out
    return _mma(_staged(a, stage), b, shape, before, after)


def _staged(a, stage):
    """The first operand as its wgmma reads it: ``a`` in registers, or — where ``stage`` is
    given (an FP8 ``a``: no register layout of Mosaic's takes an accumulator's values to
    the 8-bit A operand's) — stored to the consumer's buffer ``stage``, fenced for the
    tensor cores, and read from there (FA2's way; FA3 permutes registers instead)."""
    if stage is None:
        return a
    stage[...] = a
    plgpu.commit_smem()
    return stage


def _mma_into(acc, a, b, before=None, after=None):
    """acc + a @ b, accumulated on the tensor cores into ``acc``'s registers (interpret
    mode does not run an accumulator initialised from registers: a fresh one, and an add)."""
    if _MODE["interpret"]:
        return acc + _mma(a, b, acc.shape, before, after)
    _turn(before)

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        _turn(after)
    return pl.run_state(run)(plgpu.ACC.init(acc))


def _mma_into_registers(acc, a, b, before=None, after=None, stage=None):
    """acc + a @ b with ``a`` in registers (see _mma_registers)."""
    if _MODE["interpret"]:
        return acc + _mma_registers(a, b, acc.shape, before, after)
    return _mma_into(acc, _staged(a, stage), b, before, after)


def _issue(acc, a, b):
    """Issue acc += a @ b on the tensor cores (both operands in shared memory); its result
    is waited for where it is loaded (_load)."""
    plgpu.wgmma(acc, a, b)


def _load(acc, wait_n):
    """An issued product's result, once at most ``wait_n`` wgmma groups are in flight (None:
    no wait — an earlier load waited for it already)."""
    if _MODE["interpret"]:
        return acc[...]
    return plgpu.wgmma_accumulator_load(acc, wait_n=wait_n)


def _issue_into(acc, init, a, b, late=True, stage=None):
    """Issue acc = init + a @ b (``a`` in registers, WGMMA layout, or stored to ``stage``:
    see _staged); _load_into waits for it.  Interpret mode computes it at once (its wgmma
    takes no registers, its accumulators no initial value).  Not ``late`` (the first step:
    nothing to add yet): init."""
    if not late:
        return init
    if _MODE["interpret"]:
        return init + lax.dot_general(a, b[...], (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32)
    acc[...] = init
    plgpu.wgmma(acc, _staged(a, stage), b)
    return None


def _load_into(acc, issued, late=True):
    """The result of _issue_into, waiting for every product in flight."""
    if _MODE["interpret"] or not late:
        return issued
    return plgpu.wgmma_accumulator_load(acc, wait_n=0)


def _first_or_late(step, first, *accumulators):
    """A step whose product runs a step late, over its accumulators: written twice, the
    first step's (no late product yet) and the others'."""
    return lax.cond(first, lambda: pl.run_scoped(lambda *a: step(*a, late=False), *accumulators),
                    lambda: pl.run_scoped(lambda *a: step(*a, late=True), *accumulators))


def _release(*barriers):
    """Arrive on a pipeline's consumed barriers: the chunks in those slots may be refilled."""
    for barrier in barriers:
        plgpu.barrier_arrive(barrier)


def _transforms(block, dtype):
    """Tiling and swizzling of a shared-memory block (its last dimension's bytes): for
    matrices of 8-row tiles whose rows are 32 B or more (what wgmma and TMA swizzle)."""
    if len(block) < 2 or block[-2] % 8 or block[-1] * jnp.dtype(dtype).itemsize < 32:
        return ()
    swizzle = plgpu.find_swizzle(block[-1] * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _ignore(*args, **kwargs):
    return None
'''
