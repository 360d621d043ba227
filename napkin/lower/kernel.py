"""A streamed program lowered to a Pallas kernel: :func:`lower` and :class:`LoweredKernel`.

One generic lowering, no per-algorithm kernels, in two parts:

* :mod:`napkin.lower.plan` decides, for concrete shapes, everything about the kernel:
  the grid (the groups at the top of the program), every array's block and index map,
  every stream's full chunks, ragged tail and tile skipping, the loops over groups inside
  the body, the whole axes padded to a block the backend takes, and the neutral elements
  that pad a ragged tail's reductions;
* a backend (:mod:`napkin.lower.backends`; ``triton`` today) spells that plan, writing
  every box through :func:`napkin.core.semantics.box_function` with a recording array
  namespace, so the kernel's code comes from the semantics' own box mapping.

Ragged sizes: only static shapes reach a kernel, so raggedness is known when it is
written.  A grouped axis that its tile does not divide overhangs the array in its last
tile: loads and stores are masked, and since no box reduces a grouped axis (it is
woven) the padded rows never reach a valid one.  A streamed axis that the chunk does
not divide runs its full chunks unmasked and one ragged tail in which every box that
reduces the axis sees padded positions as its neutral element (0 for sums and
contractions, −∞ for max / logsumexp / softmax): reduce(where(valid, x, e)) is the
reduction over the valid prefix, which is what ``Stream.evaluate`` computes.

A whole axis of a size the backend's blocks cannot take (Triton: not a power of two — a
head dimension of 20, 3 query heads per KV head, a 32,000-token vocabulary) is padded to the
next block the backend takes, and masked the same way.  A tile that covers its whole axis
is one such padded tile.  A program of several kernels (several top-level boxes) lowers to
a sequence of kernels, :class:`napkin.lower.program.LoweredProgram`.

Tile skipping: when a stream's update holds causal / window masks with the streamed
axis as key axis, the loop visits only the chunks that hold a kept key for some row of
the tile; this is exact only where the accumulator absorbs a masked entry (the fill may
flow only into max / logsumexp, or through a row shift and ``exp`` into sums and
contractions), which :func:`napkin.lower.plan.absorbing` checks on the update.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin.core.arrays import array_types, canonical_dtype
from napkin.core.errors import NapkinError, ShapeError
from napkin.lower.backends import DEFAULT, Written, get_backend
from napkin.lower.plan import KernelPlan, Planner, kernel_unlowerable, loop_boxes, peel
from napkin.core.primitives import FLOATING, JNP_DTYPES


def _symbol(key):
    return sympy.Symbol(key, integer=True, positive=True) if isinstance(key, str) else key


class Specialised:
    """One kernel for one set of input shapes: its plan and its spelling."""

    def __init__(self, plan: KernelPlan, written: Written):
        self.plan, self.written = plan, written

    @property
    def source(self) -> str:
        return self.written.source

    @property
    def grid(self) -> tuple:
        """The grid the kernel launches (a raster's two dimensions as one)."""
        return self.plan.launch_shape

    @property
    def block_shapes(self) -> dict:
        return {a.name: a.block for a in self.plan.inputs + self.plan.outputs}

    @property
    def in_shapes(self) -> list:
        return [a.shape for a in self.plan.inputs]

    @property
    def out_shapes(self) -> list:
        return [a.shape for a in self.plan.outputs]

    @property
    def launch(self) -> dict:
        """The launch parameters this kernel was written with ("auto" resolved)."""
        return self.written.launch

    @property
    def notes(self) -> list:
        return self.plan.notes + self.written.notes

    def call(self, *operands, interpret: bool):
        if not interpret and self.plan.gpu_refusal:
            raise NapkinError(f"{self.plan.name} cannot be compiled for a GPU: "
                              f"{self.plan.gpu_refusal}")
        if any(isinstance(x, jax.core.Tracer) for x in operands) or _tracing(operands):
            return self.written.forward(*operands, interpret=bool(interpret))  # jit/vmap/grad
        platform = jax.devices()[0].platform
        if not interpret and platform != "gpu":
            raise NapkinError(f"{self.plan.name}: a compiled kernel runs on a GPU and this "
                              f"machine's device is {platform}: pass interpret=True (napkin run: "
                              f"--interpret on or auto)")
        if interpret and self.written.backend == "mosaic":
            from napkin.lower.backends.mosaic_gpu import interpret_supported
            if not interpret_supported():
                raise NapkinError(f"{self.plan.name}: interpret mode of the Mosaic GPU backend "
                                  f"needs plgpu.InterpretGPUParams (jax >= 0.11); "
                                  f"backend='triton' interprets anywhere")
        return self.written.calls[bool(interpret)](*operands, interpret=bool(interpret))


class LoweredKernel:
    """A streamed program lowered to a Pallas kernel by one backend.

    Call it on arrays like the program's meaning (``evaluate``); it works under
    ``jax.jit`` and ``jax.vmap``.  The kernel is planned and written once per set of
    input shapes and dtypes.

    * ``grid`` / ``block_shapes``: symbolic (sympy, in the program's sizes);
      ``plan(*shapes)`` gives the concrete ones, with the source;
    * ``source(*shapes)``: the readable module that runs (shapes default to those of
      the last call);
    * ``launch``: the backend's launch parameters (Triton: num_warps, num_stages);
    * ``schedule``: the loop nest its plans run (the cost model's, when given by
      ``napkin.optimize``; else built for ``hardware`` with the launch's pipeline stages).
    """

    def __init__(self, program, tiles: dict, *, backend: str = DEFAULT, interpret="auto",
                 dtype=None, f32_precision: str = "highest", name: str | None = None,
                 schedule=None, hardware="h100", suffix: str = "", keep=(), **launch):
        self.program = program
        self.keep = frozenset(keep)  # arrays kept at their declared dtype whatever ``dtype``
        self.suffix = suffix  # appended to the module's names (a program's kernels share one)
        self.backend = get_backend(backend)
        unknown = set(launch) - set(self.backend.launch)
        if unknown:
            raise NapkinError(f"the {self.backend.name} backend takes no option "
                              f"{', '.join(sorted(unknown))} (launch parameters: "
                              f"{', '.join(self.backend.launch)})")
        self.launch = {**self.backend.launch, **launch}
        self.backend.check_launch(self.launch)
        self.tiles = {_symbol(k): v for k, v in (tiles or {}).items()}
        for key, v in self.tiles.items():
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise NapkinError(f"tile {key}={v!r} must be a positive integer")
        self.interpret = interpret_mode(interpret)
        self.dtype = None if dtype is None else np.dtype(JNP_DTYPES[canonical_dtype(
            dtype if isinstance(dtype, str) else np.dtype(dtype).name)])
        if f32_precision not in ("highest", "default"):
            raise NapkinError("f32_precision is 'highest' (exact, as the semantics) or 'default' "
                              "(TF32 on GPUs)")
        self.f32_precision = f32_precision
        self.name = name or getattr(program, "name", None) or "program"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            self.name = "program"
        why = kernel_unlowerable(program)
        if why:  # the search's premise is the lowering's too: refuse, never write it wrong
            raise NapkinError(f"{self.name}: no kernel backend writes this program: {why}")
        self.structure = peel(program)
        self.in_types = array_types(program.dom)
        self.out_types = array_types(program.cod)
        self.in_names = [ob.name for ob in program.dom.inside]
        for spec in self.structure.groups:
            self.size_of(spec.size, f"group {spec.axis}")
        self._loops = [box.spec for box in loop_boxes(self.structure.body)]
        self._streams = [spec for spec in self._loops if spec.kind == "stream"]
        for spec in self._loops:
            self.size_of(spec.chunk if spec.kind == "stream" else spec.size,
                         f"{spec.kind} {spec.axis}")
        if schedule is None:
            from napkin.schedule import build
            schedule = build(program, hardware, stages=self.launch.get("num_stages", 1))
        elif schedule.program is not program:
            raise NapkinError("the schedule given to lower() is another program's")
        self.schedule = schedule  # the loop nest the plan runs (napkin.schedule)
        self._plans: dict = {}
        self._last = None

    # ------------------------------------------------------------ sizes
    def size_of(self, size, what: str, extent: int | None = None) -> int:
        """The value of a tile or chunk ``size``.  With the ``extent`` it tiles (at concrete
        shapes): the size the kernel writes — for a tile symbol whose value covers the whole
        extent (one tile: the search offers the axis's own size; ``fit`` may leave a larger
        one), the least block the backend takes over the extent (the tile overhangs the
        array and is masked); else the value itself when the backend's blocks take it, or
        that least block for an integer size covering the extent; any other size is
        refused."""
        if isinstance(size, (int, np.integer)) or getattr(size, "is_Integer", False):
            value = int(size)
            name = f"{what} size"
        else:
            sym = _symbol(str(size)) if not isinstance(size, sympy.Symbol) else size
            if sym not in self.tiles:
                raise NapkinError(f"{what}: no tile size for {sym} (pass tiles={{'{sym}': 64}})")
            value, name = int(self.tiles[sym]), f"tile {sym}"
        rules = self.backend.rules
        if extent is not None and value >= extent and name.startswith("tile "):
            # one tile of a symbol covers the extent: the least block the backend takes over
            # it (a larger one would pad the axis past what its whole blocks elsewhere hold;
            # an integer size is written into the body's types and stays as it is)
            return rules.block(extent, 1)
        if extent is None or rules.size_ok(value):
            return value
        if value >= extent:
            return rules.block(extent, 1)
        raise NapkinError(f"{name}={value} must be a power of two for the {rules.name} backend "
                          f"(or cover the whole axis, {extent})")

    def describe(self) -> str:
        parts = [f"group {s.axis} ({s.size}={self.size_of(s.size, '')})"
                 for s in self.structure.groups]
        parts += [f"stream {s.axis} ({s.chunk}={self.size_of(s.chunk, '')}, {s.rule})"
                  if s.kind == "stream" else
                  f"loop over group {s.axis} ({s.size}={self.size_of(s.size, '')})"
                  for s in self._loops]
        return " > ".join(parts) or "one program"

    @property
    def grid(self) -> tuple:
        if not self.structure.groups:
            return (sympy.Integer(1),)
        out = []
        for spec in self.structure.groups:
            full = next(t.axis(spec.axis).size for t in self.in_types if t.has(spec.axis))
            out.append(sympy.ceiling(sympy.sympify(full) / self.size_of(spec.size, "")))
        return tuple(out)

    @property
    def block_shapes(self) -> dict:
        """{array name: block shape}, symbolic in the whole axes' sizes."""
        gs = {s.axis: self.size_of(s.size, "") for s in self.structure.groups}
        streams = {s.axis: self.size_of(s.chunk, "") for s in self._streams}
        block = self.backend.rules.block
        out = {}
        body = self.structure.body
        for ob, p in zip(body.dom.inside, self.structure.in_map):
            t = self.in_types[p]
            out[ob.name] = tuple(gs[a.name] if a.name in gs else
                                 block(a.size, streams[a.name]) if a.name in streams
                                 else a.size for a in t.axes)
        for ob in body.cod.inside:
            out[ob.name] = tuple(gs.get(a.name, a.size) for a in ob.type.axes)
        return out

    # ------------------------------------------------------------ specialisation
    def dtypes(self) -> list:
        """The kernel's input dtypes: the override, or the program's types."""
        return self.dtypes_for(self.in_types, self.in_names)

    def dtypes_for(self, types, names=None) -> list:
        """Dtypes of arrays of these types (and names) in the kernel: the override for
        floating ones (integer and boolean arrays — labels, indices — keep their own, and
        so do the arrays named in ``keep``: a backward's saved row statistics), else the
        types'."""
        names = names or [None] * len(types)
        return [self.dtype if self.dtype is not None and t.dtype in FLOATING
                and n not in self.keep else np.dtype(JNP_DTYPES[t.dtype])
                for t, n in zip(types, names)]

    def symbol(self, name: str) -> str:
        """A name of the written module (``kernel``, ``forward``, ``GRID``) with the suffix
        that sets this kernel's apart in a program's module."""
        return f"{name}{self.suffix}"

    def out_shapes(self, spec: Specialised) -> list:
        """The program's output shapes, in its order, for a specialised kernel."""
        return [spec.out_shapes[m] for m in self.structure.out_map]

    def namespaced_source(self, spec: Specialised) -> str:
        """The kernel's definitions without the module header (a program's module holds
        several, each named with its suffix)."""
        return spec.written.definitions

    def parts(self, shapes) -> list:
        """(kernel, input shapes) for every launch: this one (a program has several)."""
        return [(self, [tuple(s.shape if hasattr(s, "shape") else s) for s in shapes])]

    def bound(self, sizes: dict) -> BoundKernel:
        """This kernel with sizes its program binds (see :meth:`plan`)."""
        return BoundKernel(self, sizes)

    def plan(self, *shapes, sizes: dict | None = None) -> Specialised:
        """The kernel for inputs of these shapes (tuples, arrays or ShapeDtypeStructs);
        ``sizes``: size symbols bound by the program this kernel is part of."""
        shapes = self._shapes(shapes)
        dts = self.dtypes()
        key = (tuple(shapes), tuple(str(d) for d in dts), tuple(sorted(map(str, (sizes or {})
                                                                            .items()))))
        if key not in self._plans:
            plan = Planner(self, shapes, dts, self.backend.rules, sizes).plan()
            self._plans[key] = Specialised(plan, self.backend.write(self, plan))
        self._last = key
        return self._plans[key]

    def refusal(self, *shapes, sizes: dict | None = None) -> str:
        """Why the backend refuses the plan for these shapes before writing any of it (""
        where it does not: writing may still refuse, on registers or shared memory)."""
        why = getattr(self.backend, "refusal", None)
        if why is None:
            return ""
        return why(Planner(self, self._shapes(shapes), self.dtypes(), self.backend.rules,
                           sizes).plan())

    def _shapes(self, shapes) -> list:
        """The input shapes as tuples of ints (from tuples, arrays or ShapeDtypeStructs)."""
        if len(shapes) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(shapes)}")
        return [tuple(int(n) for n in (s.shape if hasattr(s, "shape") else s)) for s in shapes]

    def source(self, *shapes) -> str:
        if shapes:
            return self.plan(*shapes).source
        if self._last is None:
            raise NapkinError("source(): give the input shapes (the kernel is written per shape)")
        return self._plans[self._last].source

    def resolve_interpret(self, interpret=None) -> bool:
        # (False on a machine without a GPU is what a CUDA export does: lower, not run)
        mode = self.interpret if interpret is None else interpret_mode(interpret)
        if mode == "auto":
            return jax.devices()[0].platform != "gpu"
        return mode

    def __call__(self, *arrays, interpret=None, sizes: dict | None = None):
        if len(arrays) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(arrays)}")
        plan = self.plan(*[jnp.shape(a) for a in arrays], sizes=sizes)
        dts = self.dtypes()
        arrays = [jnp.asarray(a, dtype=dt) if jnp.result_type(a) != dt else a
                  for a, dt in zip(arrays, dts)]
        operands = [arrays[p] for p in self.structure.in_map]
        outs = plan.call(*operands, interpret=self.resolve_interpret(interpret))
        result = [outs[m] for m in self.structure.out_map]
        return result[0] if len(result) == 1 else tuple(result)

    def abstract(self, shapes) -> list:
        """ShapeDtypeStructs of the kernel's inputs (shapes, arrays or structs)."""
        out = []
        for s, dt in zip(shapes, self.dtypes()):
            shape = s.shape if hasattr(s, "shape") else s
            out.append(jax.ShapeDtypeStruct(tuple(shape), dt))
        return out

    def __repr__(self):
        return f"LoweredKernel({self.name}: {self.describe()}, {self.backend.name})"


def interpret_mode(value):
    """``interpret`` as a kernel takes it: "auto", or a bool ("on" / "off" as the CLI says
    them); anything else is one line (a truthy "off" or "bogus" ran in interpret mode)."""
    if value == "auto" or isinstance(value, bool):
        return value
    if value in ("on", "off"):
        return value == "on"
    raise NapkinError(f"interpret={value!r}: give 'auto' (interpret unless the device is a GPU), "
                      f"True / 'on' or False / 'off'")


class BoundKernel:
    """A kernel of a program, with the sizes the program binds (a kernel may use a size
    none of its own arrays has): plans and calls pass them; the rest is the kernel's."""

    def __init__(self, kernel: LoweredKernel, sizes: dict):
        self.kernel, self.sizes = kernel, dict(sizes)

    def plan(self, *shapes) -> Specialised:
        return self.kernel.plan(*shapes, sizes=self.sizes)

    def refusal(self, *shapes) -> str:
        return self.kernel.refusal(*shapes, sizes=self.sizes)

    def source(self, *shapes) -> str:
        return self.plan(*shapes).source if shapes else self.kernel.source()

    def __call__(self, *arrays, interpret=None):
        return self.kernel(*arrays, interpret=interpret, sizes=self.sizes)

    def parts(self, shapes) -> list:
        return [(self, [tuple(s.shape if hasattr(s, "shape") else s) for s in shapes])]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _tracing(operands) -> bool:
    """Whether a kernel of no operands (positions made on chip) is called inside a trace
    (jit, an export): with operands, their being tracers says so."""
    if operands:
        return False
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # (a jax without it: taken as traced; eager calls then reach Pallas)
        return True
    return not trace_state_clean()


def export_cuda(kernel: LoweredKernel, shapes, device_kind: str = "NVIDIA H100") -> str:
    """Lower the kernel for CUDA on any machine (no GPU needed) and return the MLIR text
    (its backend's export: for Triton, the ``__gpu$xla.gpu.triton`` custom call with the
    grid, launch parameters and Triton IR)."""
    return kernel.backend.export(kernel, kernel.abstract(shapes), device_kind)
