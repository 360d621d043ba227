"""A program of several kernels, lowered as a sequence of kernels.

A streamed program whose top level holds several boxes is several kernels: the schedule
(``napkin.schedule``) makes every top-level box — a grid of groups, a stream, a lone box over
whole arrays — a kernel of its own, with the values between them in HBM.  The lowering does
exactly that: each top-level box is lowered on its own (:class:`LoweredKernel`) and
:class:`LoweredProgram` runs them in the diagram's order, each intermediate written by one
kernel and read by the next, so the HBM traffic is the sum of the kernels' (the cost model
prices the same).

Its interface is a kernel's (``__call__``, ``plan``, ``source``, ``launch``, ``parts``), so
the pipeline, ``napkin run`` and the traffic count treat one kernel and a sequence alike.
"""
from __future__ import annotations

import jax
import numpy as np

from napkin.core.arrays import array_types
from napkin.core.errors import NapkinError, ShapeError
from napkin.core.ir import ops as op_order, view
from napkin.lower.backends import DEFAULT, VARYING, forward_params
from napkin.lower.emit import identifier
from napkin.lower.kernel import LoweredKernel, interpret_mode
from napkin.core.semantics import bind_sizes, fold_boxes


def top_boxes(program) -> list:
    """The program's top-level boxes in the order the schedule walks them (each a kernel)."""
    g = view(program)
    return [g.nodes[n]["box"] for n in op_order(g)]


def is_one_kernel(program) -> bool:
    """Whether the program is a single kernel (one top-level box)."""
    return len(top_boxes(program)) <= 1


class ProgramPlan:
    """The kernels of a program for one set of input shapes: ``steps`` holds, in launch
    order, (kernel, its input shapes, its Specialised plan)."""

    def __init__(self, program: LoweredProgram, steps: list):
        self.program, self.steps = program, steps

    @property
    def launch(self) -> list[dict]:
        """Each kernel's launch parameters, as written."""
        return [spec.launch for _, _, spec in self.steps]

    @property
    def grid(self) -> list[tuple]:
        return [spec.grid for _, _, spec in self.steps]

    @property
    def notes(self) -> list:
        return [f"{k.name}: {n}" for k, _, spec in self.steps for n in spec.notes]

    @property
    def source(self) -> str:
        return self.program.write_source(self)


class LoweredProgram:
    """A program of several kernels (see the module doc); arguments as :func:`lower`'s, and
    ``launches``: per top-level box, the launch parameters the cost model chose for it."""

    def __init__(self, program, tiles: dict, *, backend, interpret="auto", dtype=None,
                 f32_precision: str = "highest", name: str | None = None, schedule=None,
                 hardware="h100", launches: list | None = None, keep=(), **launch):
        from napkin.schedule import build
        self.program = program
        self.name = name if isinstance(name, str) and name.isidentifier() else "program"
        self.interpret = interpret_mode(interpret)
        self.in_types = array_types(program.dom)
        self.in_names = [ob.name for ob in program.dom.inside]
        boxes = top_boxes(program)
        if launches is not None and len(launches) != len(boxes):
            raise NapkinError(f"{self.name}: {len(launches)} launch settings for "
                              f"{len(boxes)} kernels")
        hw = schedule.hardware if schedule is not None else hardware
        sched_dtype = schedule.dtype if schedule is not None else None
        self.kernels: list = []          # one per distinct top-level box, in launch order
        self._by_box: dict = {}
        for i, box in enumerate(boxes):
            if id(box) in self._by_box or not len(box.cod):
                continue  # the same kernel twice (two identical layers), or one whose every
                # output the program discards: it computes nothing anyone reads
            own = {**launch, **(launches[i] if launches else {})}
            stages = own.get("num_stages")
            k = LoweredKernel(box, tiles, backend=backend, interpret=interpret, dtype=dtype,
                              keep=keep,
                              f32_precision=f32_precision, name=f"{self.name}_{len(self.kernels)}",
                              suffix=f"_{len(self.kernels)}",
                              schedule=build(box, hw, sched_dtype, stages=stages
                                             if isinstance(stages, int) else 1),
                              **own)
            self._by_box[id(box)] = k
            self.kernels.append(k)
        self.backend = self.kernels[0].backend
        self.tiles = {t: v for k in self.kernels for t, v in k.tiles.items()}
        self.schedule = schedule
        self._plans: dict = {}
        self._last = None

    @property
    def launch(self) -> dict:
        """The launch parameters the kernels share (each kernel's own: ``plan(...).launch``)."""
        return dict(self.kernels[0].launch)

    def describe(self) -> str:
        return f"{len(self.kernels)} kernels: " + "; ".join(
            f"{k.name} ({k.describe()})" for k in self.kernels)

    def kernel_of(self, box):
        return self._by_box[id(box)]

    def dtypes(self) -> list:
        return self.kernels[0].dtypes_for(self.in_types, self.in_names)

    # ------------------------------------------------------------ per shapes
    def plan(self, *shapes) -> ProgramPlan:
        if len(shapes) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(shapes)}")
        shapes = [tuple(int(n) for n in (s.shape if hasattr(s, "shape") else s)) for s in shapes]
        key = tuple(shapes)
        if key not in self._plans:
            steps = []
            dummies = [np.broadcast_to(np.zeros((), bool), s) for s in shapes]
            sizes = bind_sizes(self.in_types, dummies, names=self.in_names)

            def apply(box, args):
                if not len(box.cod):
                    return []
                k = self.kernel_of(box).bound(sizes)  # (its sizes and the program's)
                spec = k.plan(*args)
                steps.append((k, list(args), spec))
                return k.out_shapes(spec)
            fold_boxes(self.program, shapes, apply)
            self._plans[key] = ProgramPlan(self, steps)
        self._last = key
        return self._plans[key]

    def parts(self, shapes) -> list:
        """(kernel, its input shapes) for every launch, in order."""
        return [(k, s) for k, s, _ in self.plan(*shapes).steps]

    def source(self, *shapes) -> str:
        if shapes:
            return self.plan(*shapes).source
        if self._last is None:
            raise NapkinError("source(): give the input shapes (the kernels are written per shape)")
        return self._plans[self._last].source

    def write_source(self, plan: ProgramPlan) -> str:
        """One module: every kernel's module, then ``forward`` running them in order."""
        parts, seen = [], set()
        for i, (k, _, spec) in enumerate(plan.steps):
            if id(spec) in seen:
                continue
            seen.add(id(spec))
            parts.append(f"# {'=' * 88}\n# kernel {i + 1} of {len(plan.steps)}: {k.name}\n"
                         f"{k.namespaced_source(spec)}")
        names = [identifier(n, "x") for n in self.in_names]
        lines = ["", "", f"def forward({forward_params(', '.join(names))}):",
                 f'    """{self.name}: {len(plan.steps)} kernels in order, the values between '
                 f'them in HBM."""']
        count = iter(range(10 ** 6))

        def apply(box, args):
            if not len(box.cod):
                return []
            k = self.kernel_of(box)
            r = f"r{next(count)}"
            ins = [args[p] for p in k.structure.in_map]
            lines.append(f"    {r} = {k.symbol('forward')}"
                         f"({', '.join([*ins, 'interpret=interpret'])})")
            outs = []
            for j, ob in enumerate(box.cod.inside):
                outs.append(f"{identifier(ob.name, 'v')}_{next(count)}")
                lines.append(f"    {outs[-1]} = {r}[{k.structure.out_map[j]}]")
            return outs
        result = fold_boxes(self.program, names, apply)
        lines.append(f"    return {', '.join(result)}")
        written = {spec.written.backend for _, _, spec in plan.steps}
        names = " and ".join({"triton": "Triton", "mosaic": "Mosaic GPU"}.get(b, b)
                             for b in sorted(written, reverse=True))
        head = [f'"""Pallas kernels ({names} backend{"s" * (len(written) > 1)}) for '
                f'{self.name}, written by napkin.lower: a program of {len(plan.steps)} kernels.',
                "", "Run it with forward(*inputs, interpret=True) on a CPU, interpret=False on a "
                "GPU.", '"""', "import jax", "import jax.numpy as jnp", "from jax import lax",
                "from jax.experimental import pallas as pl", "", *VARYING, ""]
        if "triton" in written:
            head.append("from jax.experimental.pallas import triton as plt")
        if "mosaic" in written:  # with the helpers its kernels call, once
            from napkin.lower.backends.mosaic_emit import HELPERS
            head += ["from jax.experimental.pallas import mosaic_gpu as plgpu", HELPERS]
        return "\n".join(head + [""] + parts + lines) + "\n"

    # ------------------------------------------------------------ running
    def resolve_interpret(self, interpret=None) -> bool:
        return self.kernels[0].resolve_interpret(self.interpret if interpret is None
                                                 else interpret)

    def __call__(self, *arrays, interpret=None):
        if len(arrays) != len(self.in_types):
            raise ShapeError(f"{self.name} takes {len(self.in_types)} inputs "
                             f"({', '.join(self.in_names)}), got {len(arrays)}")
        mode = self.resolve_interpret(interpret)
        steps = iter(self.plan(*[np.shape(a) for a in arrays]).steps)

        def apply(box, args):
            if not len(box.cod):
                return []
            out = next(steps)[0](*args, interpret=mode)  # the kernels, in their order
            return list(out) if isinstance(out, tuple) else [out]
        result = fold_boxes(self.program, list(arrays), apply)
        return result[0] if len(result) == 1 else tuple(result)

    def abstract(self, shapes) -> list:
        out = []
        for s, dt in zip(shapes, self.dtypes()):
            out.append(jax.ShapeDtypeStruct(tuple(s.shape if hasattr(s, "shape") else s), dt))
        return out

    def __repr__(self):
        return f"LoweredProgram({self.name}: {self.describe()}, {self.backend.name})"


def lower(program, tiles: dict, *, backend: str = DEFAULT, interpret="auto", dtype=None,
          **options):
    """Lower a streamed program to a Pallas kernel (:class:`LoweredKernel`), or, for a program
    of several kernels, to a sequence of kernels (:class:`napkin.lower.program.LoweredProgram`)
    with the values between them in HBM.

    ``tiles``: the size of every group / chunk symbol (``{"g_q": 64, "s_x": 64}``;
    powers of two for Triton).  ``backend``: a name in ``napkin.lower.backends.BACKENDS``.
    ``interpret``: "auto" (interpret unless the default device is a GPU), True or False.
    ``dtype``: the dtype of the kernel's inputs and outputs ("bf16", …); None keeps the
    program's declared dtypes (arrays of another dtype are cast outside the kernel).
    Options: ``f32_precision`` ("highest" — exact float32 dots as in the semantics — or
    "default", TF32 on GPUs), ``name``, ``schedule`` (the program's, from the cost model) or
    ``hardware`` (to build one; default h100), and the backend's launch parameters (Triton:
    ``num_warps``, ``num_stages``); ``launches``: for a program of several kernels, each
    kernel's own launch parameters (a list in the schedule's kernel order).
    """
    if is_one_kernel(program):
        options.pop("launches", None)
        return LoweredKernel(program, tiles, backend=backend, interpret=interpret, dtype=dtype,
                             **options)
    return LoweredProgram(program, tiles, backend=backend, interpret=interpret, dtype=dtype,
                          **options)
