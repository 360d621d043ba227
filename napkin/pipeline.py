"""The pipeline as a library call: an algorithm in; its best streamed program out, with
tiles, launch parameters, cost, certificate, schedule and kernel.

    import napkin
    fa = napkin.optimize("attention", hardware="h100", sizes={"q": 8192}, dtype="bf16")
    fa.chain, fa.tiles, fa.cost      # the moves, {"g_q": 256, "s_x": 8}, the symbolic Cost
    fa.check()                       # the certificate, replayed by the independent checker
    fa.kernel()(Q, K, V)             # a JAX function (Pallas; interpret mode without a GPU)

The command line (optimize, cost, lower, run, pseudocode, demo, draw --streamed) is a
thin layer over :func:`optimize`; :func:`jit` is the same as a decorator of a plain JAX
function.  Nothing heavy is imported until it is called.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from napkin.core.errors import NapkinError



@dataclass(frozen=True, eq=False)
class Optimized:
    """What :func:`optimize` found for one algorithm, hardware, sizes and dtype.

    ``program``, ``chain`` and ``cost`` are the search's best; ``tiles`` are its tile
    values (or, after :meth:`fit`, those shrunk to smaller sizes).  ``certificate`` is
    derived when first asked for; it is None when ``source`` is None (a bare diagram
    names no algorithm a checker could rebuild)."""
    name: str                 # a label: the library name, FILE.py:NAME, or "algorithm"
    algorithm: object         # the diagram searched
    source: str | dict | None  # what a certificate names it by: a library name or
                              # {"from": "FILE.py:NAME"}; None for a bare diagram
    hardware: object          # the profile as searched (its GMEM + SMEM view for levels="two")
    sizes: dict               # axis name -> int
    dtype: str | None         # storage dtype of every value (None: each wire's own)
    search: object            # napkin.search.SearchResult
    tiles: dict               # tile name -> int
    launch: dict              # the kernel's launch parameters, chosen with the tiles
    base: Path | None = None  # the folder a relative FILE.py of ``source`` is in
    limits: tuple = (2000, 60.0)  # the search's (max_states, max_seconds): the backward's too
    pinned: frozenset = frozenset()  # tiles the user set (with_tiles): every backend writes
                              # these, none chooses its own
    fitted_from: Optimized | None = field(default=None, repr=False)  # (after fit) the
                              # program at the searched sizes

    @property
    def program(self):
        return self.search.best.program

    @property
    def chain(self) -> tuple:
        return self.search.best.chain

    @property
    def cost(self):
        """napkin.cost.Cost of the program on ``hardware`` (symbolic in sizes and tiles)."""
        return self.search.best.cost

    @functools.cached_property
    def certificate(self):
        """The chain as a certificate, at a small instance of these sizes and tiles (the
        derivation is symbolic; the checker also draws instances of its own), derived on
        the algorithm built at the searched dtype: the checker runs the program at the
        wires the kernel stores (a builder that ignores the dtype keeps its own)."""
        if self.source is None:
            return None
        from napkin.certify.certificate import derive_from, fingerprint, load_algorithm
        src = load_algorithm(self.source, self.base)
        own = built_at(self.algorithm)
        if fingerprint(src.build(own)) != fingerprint(self.algorithm):
            raise NapkinError(f"source {_label(self.source)} builds a different diagram from "
                              f"the one searched: a certificate must name the very diagram it "
                              f"certifies")
        dtype = own
        if self.dtype is not None and self.dtype != own:
            from napkin.certify.checker import dtype_disagreement
            if not dtype_disagreement(src.build(self.dtype), self.dtype):
                dtype = self.dtype
        small, small_tiles = check_instance(self.sizes, self.tiles)
        chosen = {k: v for k, v in self.launch.items() if isinstance(v, int)}  # not "auto"
        return derive_from(src, self.source, [(m.rule, m.site, m.params_dict)
                                              for m in self.chain],
                           small, small_tiles, dtype, self.base, chosen)

    def check(self, numeric: bool = True):
        """Replay the certificate with the independent checker: a CheckReport."""
        if self.certificate is None:
            raise NapkinError(f"{self.name} has no certificate: a bare diagram names no "
                              f"algorithm the checker can rebuild; give optimize source="
                              f"'LIBRARY_NAME' or source={{'from': 'FILE.py:NAME'}}")
        from napkin.certify.checker import check_certificate
        return check_certificate(self.certificate, numeric=numeric)

    @functools.cached_property
    def backward(self) -> Backward:
        """The backward pass (:class:`Backward`): :func:`napkin.grad` of the algorithm with
        respect to the floating inputs, reading what :attr:`saving` saved (the outputs and
        each softmax's L), one program per set of inputs with the same axes (dK and dV,
        both [x, d], share one stream over the queries; dQ has its own), searched like the
        forward on the same hardware, sizes and dtype."""
        from napkin.frontend.grad import grad
        pieces = []
        for names in backward_groups(self.algorithm):
            wrt = names[0] if len(names) == 1 else list(names)
            source = None if self.source is None else {"grad": self.source, "wrt": wrt,
                                                       "residuals": True}
            pieces.append((names, self._searched_like(
                grad(self.algorithm, wrt=wrt, residuals=True), source)))
        wanted = {n for names, _ in pieces for n in names}
        return Backward(tuple(pieces), tuple(ob.name for ob in self.algorithm.dom.inside
                                             if ob.name in wanted))

    @functools.cached_property
    def saving(self) -> Optimized:
        """The forward that also writes what the backward reads (napkin.frontend.grad
        .residuals: its outputs, then each softmax's row logsumexp L), searched like this
        one; the differentiated kernel runs it (a plain call runs this program)."""
        from napkin.frontend.grad import residuals
        source = None if self.source is None else {"residuals": self.source}
        return self._searched_like(residuals(self.algorithm), source)

    def _searched_like(self, diagram, source) -> Optimized:
        from napkin.certify.certificate import size_symbols
        axes = size_symbols(diagram)
        return optimize(diagram, self.hardware, {k: v for k, v in self.sizes.items()
                                                 if k in axes},
                        self.dtype, source=source, base=self.base, max_states=self.limits[0],
                        max_seconds=self.limits[1])

    def kernel(self, backend: str = "auto", *, interpret="auto", dtype: str | None = None):
        """The program as a JAX function with these tiles and launch parameters, and a
        derivative: ``jax.grad`` through it runs :attr:`backward`'s kernels (searched when
        first differentiated).  ``backend``: "auto" (Mosaic GPU on a Hopper GPU when it
        takes the kernel, else Triton), "triton" or "mosaic".  ``dtype``: the kernel's input
        and output dtype (default: the searched one)."""
        from napkin.lower.vjp import differentiable
        if dtype is not None:
            from napkin.core.arrays import canonical_dtype
            from napkin.core.primitives import FLOATING
            if canonical_dtype(dtype) not in FLOATING:
                raise NapkinError(f"dtype={dtype!r}: a kernel's dtype is that of its floating "
                                  f"inputs and outputs ({', '.join(FLOATING)}); integer inputs "
                                  f"keep their own")
        return differentiable(
            self._forward_kernel(backend, interpret, dtype), self.algorithm,
            lambda: self.saving._forward_kernel(backend, interpret, dtype),
            lambda: self.backward.kernel(backend, interpret=interpret, dtype=dtype))

    @property
    def sequential(self) -> Optimized | None:
        """The program before its chain's split of a stream in parallel parts (split-K),
        at its own best tiles (those this one shares kept); None for a program not split.
        A backend that writes no split runs it (Mosaic GPU)."""
        best = self.search.best
        moves = [m for m in best.chain if m.rule != "untie_tiles"]  # (names, not structure)
        if not moves or moves[-1].rule != "split_stream" or best.parent is None:
            return None
        from napkin.lower.backends import get_backend
        parent = best.parent
        if parent._report is None:  # its full optimum, worked out as the best's was
            parent._report = best._report
        tiles = {**parent.tile_values, **{k: v for k, v in self.tiles.items()
                                          if k in parent.tile_values}}
        return dataclasses.replace(self, search=dataclasses.replace(self.search, best=parent),
                                   tiles=tiles, launch=launch_of(parent.tiles, get_backend()),
                                   fitted_from=self.fitted_from and self.fitted_from.sequential)

    def backend_tiles(self, backend: str):
        """The tiles ``backend`` writes this program at (:mod:`napkin.lower.tiles`): the
        search's for Triton; Mosaic GPU's own launch model's best that its writer takes (the
        pinned tiles kept), with its modelled time, or why it takes none."""
        from napkin.lower.tiles import BackendTiles, choose, writer_refusal
        cache = self.__dict__.setdefault("_backend_tiles", {})
        if backend in cache:
            return cache[backend]
        fixed = {t: v for t, v in self.tiles.items() if t in self.pinned}
        own = None
        if backend == "triton":
            own = BackendTiles("triton", dict(self.tiles), list(self.search.best.tiles.launch),
                               self.search.best.time_s)
        elif self.fitted_from is not None:  # chosen at the searched sizes, shrunk as fit's,
            at = self.fitted_from.backend_tiles(backend)  # while the writer still takes them
            tiles = {**self._shrunk(at.tiles, self.sizes, at.multiples), **fixed}
            if not at.refused and not writer_refusal(
                    self.program, tiles, backend, self.dtype, self.schedule,
                    self.input_shapes(), self._constant_sizes()):
                own = dataclasses.replace(at, tiles=tiles)
        if own is None:  # (a shrunk tile that no longer divides its axis: chosen here)
            own = choose(self.program, self.hardware, self.sizes, self.dtype, backend,
                         self.input_shapes(), fixed=fixed, constants=self._constant_sizes())
        cache[backend] = own
        return own

    def input_shapes(self) -> list[tuple]:
        """The program's input shapes at these sizes."""
        from napkin.cost.model import value_at
        return [tuple(int(value_at(a.size, self.sizes)) for a in ob.type.axes)
                for ob in self.program.dom.inside]

    def written_at(self, backend: str):
        """(backend to lower with, its tiles, each kernel's launch as its model chose it with
        them — None where they are the search's, launched as ``launch`` says): Mosaic GPU at
        its own tiles where it takes some (else at the search's, where its refusal is raised
        when the kernel is planned); ``auto`` on a Hopper GPU compares the two backends'
        modelled times at their own tiles, Mosaic winning ties, Triton where Mosaic's is
        slower (with every tile set by the user both would write the same: Mosaic, where it
        takes them)."""
        if set(self.tiles) <= self.pinned:  # every tile the user's: launched as they say,
            return _either(backend, self.tiles), dict(self.tiles), None  # auto: Mosaic first
        if backend == "auto":
            from napkin.lower.backends.auto import hopper_here
            if hopper_here():
                return backend, dict(self.tiles), None
            from napkin.cost.grid import TIED
            mosaic = self.backend_tiles("mosaic")
            faster = mosaic.time_s <= self.search.best.time_s * (1 + TIED)
            if mosaic.refused:  # (auto says why when it writes Triton)
                return backend, dict(self.tiles), None
            if not faster:
                return "triton", dict(self.tiles), None
            return _either(backend, mosaic.tiles), mosaic.tiles, _own(mosaic)
        if backend == "mosaic" and not self.backend_tiles("mosaic").refused:
            return backend, self.backend_tiles("mosaic").tiles, \
                _own(self.backend_tiles("mosaic"))
        return backend, dict(self.tiles), None

    def _forward_kernel(self, backend, interpret, dtype):
        from napkin.lower import lower
        from napkin.lower.backends import get_backend
        sequential = self.sequential if backend == "mosaic" else None
        if sequential is not None:
            return sequential._forward_kernel(backend, interpret, dtype)
        self._check_divisibility(backend)
        backend, tiles, modelled = self.written_at(backend)
        chosen = self.search.best.tiles.launch if modelled is None else modelled
        own = get_backend(backend).launch
        # a program of several kernels: each launched as the cost model chose for it
        launches = [{k: v for k, v in c.items() if k in own} for c in chosen] \
            if len(chosen) > 1 else None
        launch = {**self.launch, **(modelled[0] if modelled and len(modelled) == 1 else {})}
        return lower(self.program, {**self._constant_sizes(), **tiles}, backend=backend,
                     interpret=interpret, keep=self._statistics(),
                     dtype=dtype or self.dtype, name=self.name.rpartition(":")[2],
                     schedule=self.schedule, launches=launches,
                     **{k: v for k, v in launch.items() if k in own})  # FILE.py:NAME -> NAME

    def _statistics(self) -> set:
        """A backward's or a saving forward's row statistics (L): stored in f32."""
        from napkin.certify.certificate import is_grad_spec, is_saving_spec
        if not (is_grad_spec(self.source) or is_saving_spec(self.source)):
            return set()
        from napkin.frontend.grad import statistics
        return statistics(self.program)

    def _constant_sizes(self) -> dict:
        """Sizes that only a constant names (no input carries an axis of that size: its
        input was discarded): the kernel cannot read them off its arrays' shapes, so they
        are bound as the search saw them."""
        from napkin.core.streamed import names
        carried = {str(s) for ob in self.program.dom.inside for a in ob.type.axes
                   if not isinstance(a.size, int) for s in a.size.free_symbols}
        return {n: int(self.sizes[n]) for n in names(self.program).sizes - carried
                if n in self.sizes}

    def _check_divisibility(self, backend: str) -> None:
        """One line when the hardware's divisibility (its tensor-core shape) and the
        backend's block rules leave no tile for an axis: a multiple of 96 is never a power
        of two, so the search's tile could not be written, and no other tile could."""
        from napkin.lower.backends import get_backend
        rules = get_backend(backend).rules
        for t, info in self.cost.tiles.items():
            value = self.tiles.get(t.name)
            if value is None or rules.size_ok(value) or rules.size_ok(info.multiple):
                continue
            why = ", ".join(f"{r} = {m}" for r, m in info.multiples)
            raise NapkinError(
                f"hardware {self.hardware.name!r} asks tiles of {info.axis} ({t.name}) in "
                f"multiples of {info.multiple} ({why}), and the {rules.name} backend writes "
                f"power-of-two tiles only: no tile is both; give the hardware a power-of-two "
                f"divisibility for {info.axis}")

    def fit(self, sizes: dict) -> Optimized:
        """This program at other (smaller) sizes, its tiles shrunk to powers of two of at
        most a quarter of their axis, so that a small run still has several groups and
        chunks — but never below the least dot side a tile feeding a matrix product needs
        (the hardware's ``dot_min``: a GPU kernel refuses a smaller one).  The search is not
        redone: the structure stays the one found."""
        sizes = sizes_for(self.algorithm, sizes)
        info = {t.name: i for t, i in self.cost.tiles.items()}
        least = {t: dict(i.multiples).get("dot_min", 1) for t, i in info.items()}
        fitted = dataclasses.replace(self, sizes=sizes,
                                     tiles=self._shrunk(self.tiles, sizes, least),
                                     fitted_from=self.fitted_from or self)
        if "backward" in self.__dict__:  # searched already: the same structure, fitted too
            fitted.__dict__["backward"] = self.backward.fit(sizes)
        if "saving" in self.__dict__:
            fitted.__dict__["saving"] = self.saving.fit(sizes)
        return fitted

    def _shrunk(self, tiles: dict, sizes: dict, least: dict) -> dict:
        """``tiles`` shrunk for a run at ``sizes`` (:meth:`fit`): powers of two of at most a
        quarter of their axis, never below ``least`` (a tile's least value)."""
        import sympy
        from napkin.cost import value_at
        info = {t.name: i for t, i in self.cost.tiles.items()}

        def shrunk(tile: str, value: int) -> int:
            axis = sizes.get(info[tile].axis, value) if tile in info else value
            return min(int(value), max(_pow2_at_most(axis // 4), least.get(tile, 1)))
        out = {t: shrunk(t, v) for t, v in tiles.items()}
        for t, v in out.items():  # a tile inside another's tile of its axis (a split's
            full = info[t].full if t in info else None  # chunk in its part) fits in it
            if full is not None and {str(f) for f in sympy.sympify(full).free_symbols} & set(out):
                out[t] = min(v, int(value_at(full, {**sizes, **out})))
        return out

    def with_tiles(self, tiles: dict) -> Optimized:
        """This program at other tile sizes (the launch parameters kept): a configuration
        of one's own — the paper's three consumer warpgroups are ``{"g_q": 192, "s_x": 64}``
        with ``kernel("mosaic")``.  Names must be the program's tiles; values positive."""
        unknown = sorted(set(tiles) - set(self.tiles))
        if unknown:
            raise NapkinError(f"tile {unknown[0]}: the program has tiles "
                              f"{', '.join(sorted(self.tiles)) or 'none'}")
        for name, v in tiles.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise NapkinError(f"tile {name}={v!r} must be a positive integer")
        other = dataclasses.replace(self, tiles={**self.tiles, **tiles},
                                    pinned=self.pinned | frozenset(tiles))
        for kept in ("backward", "saving"):  # the forward's tiles only: the same backward
            if kept in self.__dict__:
                other.__dict__[kept] = self.__dict__[kept]
        return other

    @property
    def schedule(self):
        """The program as one loop nest on ``hardware`` (napkin.schedule): the very one
        ``cost`` folds."""
        return self.cost.schedule


def _either(backend: str, tiles: dict) -> str:
    """On a Hopper GPU, ``auto`` (Mosaic, its fallback Triton) where Triton could write
    ``tiles`` too, else Mosaic GPU's (192 rows, 192-key chunks: no Triton block)."""
    from napkin.lower.backends import get_backend
    from napkin.lower.backends.auto import hopper_here
    if backend != "auto" or hopper_here() or \
            all(get_backend("triton").rules.size_ok(v) for v in tiles.values()):
        return backend
    return "mosaic"


def _own(chosen) -> list:
    """A backend's own launch, as its model chose it with its tiles, in that backend's
    terms only (Mosaic's stages; its consumer warps are no Triton launch's)."""
    from napkin.lower.backends import get_backend
    keys = get_backend(chosen.backend).launch
    return [{k: v for k, v in c.items() if k in keys} for c in chosen.launch]


def backward_groups(algorithm) -> list[tuple[str, ...]]:
    """The floating inputs, grouped by their axes (in input order): the cotangents one
    backward program computes together."""
    from napkin.core.primitives import FLOATING
    groups: dict = {}
    for ob in algorithm.dom.inside:
        if ob.type.dtype in FLOATING:
            groups.setdefault(frozenset(ob.type.names), []).append(ob.name)
    return [tuple(g) for g in groups.values()]


@dataclass(frozen=True, eq=False)
class Backward:
    """An algorithm's backward pass: one program per group of floating inputs with the same
    axes (:func:`backward_groups`), the cotangents of those inputs
    (``napkin.grad(algorithm, wrt=...)``: the algorithm's inputs, then one cotangent per
    floating output, in), each searched on its own and recomputing from the inputs what it
    needs of the forward.  ``pieces``: (input names, their :class:`Optimized`);
    ``inputs``: the floating inputs' names, in input order."""
    pieces: tuple
    inputs: tuple

    @property
    def time_s(self) -> float:
        """The modelled time of the whole backward: its programs run one after another."""
        return sum(o.search.best.time_s for _, o in self.pieces)

    def kernel(self, backend: str = "auto", *, interpret="auto", dtype: str | None = None):
        """(inputs..., saved..., cotangents...) -> the floating inputs' cotangents, in input
        order (saved: what ``Optimized.saving`` wrote beyond the outputs' own — the floating
        outputs, then each softmax's L)."""
        kernels = [(names, o._forward_kernel(backend, interpret, dtype))
                   for names, o in self.pieces]

        def run(*arrays):
            got = {}
            for names, k in kernels:
                out = k(*arrays)
                got.update(zip(names, out if isinstance(out, tuple) else (out,)))
            return tuple(got[n] for n in self.inputs)
        return run

    def fit(self, sizes: dict) -> Backward:
        return Backward(tuple((n, o.fit({k: v for k, v in sizes.items() if k in o.sizes}))
                              for n, o in self.pieces), self.inputs)

    def check(self, numeric: bool = True) -> list:
        """Every program's certificate, replayed by the independent checker."""
        return [o.check(numeric) for _, o in self.pieces]


def optimize(algorithm, hardware="h100", sizes: dict | None = None, dtype: str | None = "bf16",
             *, source=None, base=None, levels: str = "two", max_states: int = 2000,
             max_seconds: float = 60.0) -> Optimized:
    """Search ``algorithm``'s fastest streamed program on ``hardware`` (a profile name,
    a TOML file or a :class:`napkin.hardware.Hardware`).

    ``algorithm``: a library name, a :class:`napkin.frontend.library.Algorithm`, a diagram, or
    ``{"from": "FILE.py:NAME"}`` (FILE's code runs here).  ``source`` names a diagram's
    algorithm for its certificate (a library name or ``{"from": ...}``, relative to
    ``base``, default the current directory); a library name or Algorithm is its own.
    ``sizes``: axis sizes, unset axes taking the library defaults.  ``dtype``: bytes per
    value for the cost model (None: each wire's own dtype).  ``levels``: "two" (GMEM +
    SMEM, the paper's setting) or "all" (the profile's whole hierarchy).  ``max_states``,
    ``max_seconds``: the search's limits, and each search the result makes later (the
    backward's programs, the saving forward's) — a program that fits is always found, the
    limits only bound how long a better one is sought."""
    from napkin.core.arrays import canonical_dtype
    from napkin.lower.backends import get_backend
    from napkin.search import search  # looked up per call: tests replace it
    name, diagram, source = resolve(algorithm, source, base)
    sizes = sizes_for(diagram, sizes or {})
    dtype = None if dtype is None else canonical_dtype(dtype)
    r = search(diagram, hardware, sizes, dtype, max_states=max_states, max_seconds=max_seconds,
               levels=levels)
    return Optimized(name, diagram, source, r.hardware, sizes, dtype, r,
                     dict(r.best.tiles.values), launch_of(r.best.tiles, get_backend()),
                     None if base is None else Path(base), (max_states, max_seconds))


def built_at(diagram) -> str:
    """The dtype a builder was asked for to make ``diagram``: that of its narrowest floating
    input (what the checker rebuilds it at), f32 when it takes none."""
    from napkin.core.arrays import narrowest_of
    return narrowest_of((ob.type.dtype for ob in diagram.dom.inside), "f32")


def launch_of(tiles, backend) -> dict:
    """The launch parameters the cost model chose with the tiles (one kernel's warps and
    stages), in the backend's terms; its defaults where the model chose none."""
    chosen = {k: v for k, v in (tiles.launch[0] if len(tiles.launch) == 1 else {}).items()
              if k in backend.launch}
    return {**backend.launch, **chosen}


def resolve(algorithm, source, base) -> tuple[str, object, str | dict | None]:
    """(label, diagram, certificate source) of what :func:`optimize` was given."""
    from napkin.core.diagram import is_diagram
    from napkin.frontend.library import LIBRARY, Algorithm, get
    if isinstance(algorithm, str):
        diagram, own = get(algorithm).diagram(), algorithm
    elif isinstance(algorithm, dict):
        from napkin.certify.certificate import load_algorithm
        diagram, own = load_algorithm(algorithm, base).build("f32"), algorithm
    elif isinstance(algorithm, Algorithm):
        diagram = algorithm.diagram()
        own = algorithm.name if LIBRARY.get(algorithm.name) is algorithm else None
    elif is_diagram(algorithm):
        diagram, own = algorithm, None
    else:
        raise NapkinError(f"optimize takes a library name, an Algorithm, a diagram or "
                          f"{{'from': 'FILE.py:NAME'}}, got a {type(algorithm).__name__}")
    source = source or own
    return _label(source) if source is not None else "algorithm", diagram, source


def _label(source) -> str:
    from napkin.certify.certificate import spec_label
    return spec_label(source)


def sizes_for(diagram, given: dict, option: str = "sizes") -> dict:
    """Every size symbol of ``diagram`` mapped to an int: ``given``, else the size the
    diagram knows (``napkin.from_jax`` records its arguments' sizes as ``diagram.sizes``),
    else — for a diagram that knows none — the library default.  ``option``: how the caller
    gives sizes, for its errors ("--size")."""
    from napkin.certify.certificate import size_symbols
    from napkin.frontend.library import DEFAULT_SIZES
    need = sorted(size_symbols(diagram))
    known = getattr(diagram, "sizes", None)
    # an imported function's own sizes are its defaults; a library default (4096) in their
    # place would quietly turn, say, a 32-entry table axis into 4096 entries
    defaults = dict(known) if isinstance(known, dict) else DEFAULT_SIZES
    given = dict(given)
    for second, axis in (getattr(diagram, "aliases", None) or {}).items():
        # an argument read twice (self-attention from one x): t_2 is t, wherever it is sized
        if second in given and given[second] != given.get(axis, given[second]):
            raise NapkinError(f"{option} gives {second}={given[second]} but {second} is a "
                              f"second reading of axis {axis} ({axis}={given[axis]}): give "
                              f"{axis} only")
        if axis in given:
            given[second] = given[axis]
    out = {}
    for n in need:
        if n in given:
            out[n] = given[n]
        elif n in defaults:
            out[n] = defaults[n]
        else:
            ask = f"--size {n}=N" if option == "--size" else f"{option}={{{n!r}: N}}"
            raise NapkinError(f"no size for axis {n}: give {ask}")
    unknown = sorted(set(given) - set(need))
    parts = getattr(getattr(diagram, "boundary", None), "parts", {})
    merged = [a for a in unknown if a in parts]
    if merged:  # jnp.repeat / a head split: the diagram has the merged axis's parts
        a = merged[0]
        raise NapkinError(f"{option} names {a}, which the function merges from axes "
                          f"{' × '.join(parts[a])} (the diagram has those): size "
                          f"{' and '.join(p for p in parts[a] if p in need) or 'none of them'}"
                          f" instead (a part the function sizes itself is fixed)")
    if unknown:
        raise NapkinError(f"{option} names {', '.join(unknown)}, which the algorithm does not "
                          f"have (its axes: {', '.join(need)})")
    return out


def check_instance(sizes: dict, tiles: dict) -> tuple[dict, dict]:
    """A small instance for a certificate's numeric check: tiles of 2–4 and ragged sizes."""
    return {a: min(v, 9) for a, v in sizes.items()}, {t: min(v, 4) for t, v in tiles.items()}


def _pow2_at_most(n: int) -> int:
    """The largest power of two ≤ n (1 for n < 2)."""
    return 1 << max(int(n), 1).bit_length() - 1


# ----------------------------------------------------------------------------- napkin.jit
def jit(fn=None, *, axes=None, hardware="h100", backend: str = "auto", interpret="auto",
        cache: bool = True):
    """A plain JAX function run as napkin's searched, certified kernel:

        @napkin.jit(axes=["q d", "x d", "x d"])
        def attention(Q, K, V):
            return jax.nn.softmax(Q @ K.T / 8.0, axis=-1) @ V

        out = attention(q, k, v)      # first call at these shapes: import, search, lower

    On the first call at new shapes and dtypes the function is read into a diagram
    (:func:`napkin.from_jax`, with ``axes`` naming each argument's dimensions), searched at
    those sizes on ``hardware`` and lowered; later calls reuse the kernel.  The chosen program
    is kept in the program cache (:mod:`napkin.certify.cache`, ``NAPKIN_CACHE_DIR``), so another
    process pays neither the search nor the derivation — it replays the cached certificate on the
    diagram it imported, and an entry that does not replay is searched again.  The kernel has a
    derivative (``jax.grad`` searches the backward when first asked) and takes leading batch
    axes (napkin.lower.call): with ``axes`` given, dimensions before those it names are batch
    axes, as if the function were ``jax.vmap``-ed over them (batched inputs share them; an input
    without them is broadcast).

    ``cache=False``: search in every process."""
    if fn is None:
        return functools.partial(jit, axes=axes, hardware=hardware, backend=backend,
                                 interpret=interpret, cache=cache)
    return Compiled(fn, axes, hardware, backend, interpret, cache)


class Compiled:
    """A function compiled per argument shapes and dtypes; ``optimized(*args)`` is the
    :class:`~napkin.pipeline.Optimized` behind a call, ``how[shapes]`` whether it was
    "searched" or read from the "cache"."""

    def __init__(self, fn, axes, hardware, backend, interpret, cache):
        from napkin.lower.kernel import interpret_mode
        interpret_mode(interpret)  # a bad value is one line now, not at the first call
        self.fn, self.axes, self.hardware = fn, axes, hardware
        self.backend, self.interpret, self.cache = backend, interpret, cache
        self._built: dict = {}
        self.how: dict = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args):
        return self._entry(args)[1](*args)

    def optimized(self, *args):
        return self._entry(args)[0]

    def _entry(self, args):
        import jax.numpy as jnp
        import numpy as np
        k = tuple((tuple(np.shape(a)), str(jnp.result_type(a))) for a in args)
        if k not in self._built:
            opt = self._optimized(args, k)
            self._built[k] = opt, opt.kernel(self.backend, interpret=self.interpret)
        return self._built[k]

    def _optimized(self, args, k):
        import jax
        import jax.numpy as jnp
        import numpy as np
        from napkin.certify import cache
        from napkin.core.arrays import canonical_dtype
        from napkin.core.primitives import FLOATING
        from napkin.frontend.jaxpr import from_jax
        from napkin.search.engine import Evaluator
        # leading dimensions beyond those ``axes`` names are batch axes: the function is
        # read at one entry's shapes and the kernel maps the rest (as jax.vmap of it would)
        ranks = _ranks(self.fn, self.axes, len(args))
        structs = [jax.ShapeDtypeStruct(np.shape(a)[max(0, np.ndim(a) - r):] if r is not None
                                        else np.shape(a), jnp.result_type(a))
                   for a, r in zip(args, ranks)]
        diagram = from_jax(self.fn, *structs, axes=self.axes)
        # the narrowest floating argument's dtype: what the certificate and the kernel take
        floating = [d for d in (canonical_dtype(str(s.dtype)) for s in structs) if d in FLOATING]
        dtype = min(floating, key=lambda d: {"f64": 8, "f32": 4}.get(d, 2), default="f32")
        name = getattr(self.fn, "__name__", "fn")
        sizes = dict(diagram.sizes)
        hw = Evaluator(self.hardware, sizes, dtype).hw  # the profile as the search sees it
        if self.cache:
            found = cache.load(diagram, sizes, dtype, hw, name)
            if found is not None:
                self.how[k] = "cache"
                return _from_cache(found, diagram, sizes, dtype, hw)
        opt = dataclasses.replace(optimize(diagram, self.hardware, sizes, dtype), name=name)
        if self.cache:
            best = opt.search.best
            cache.store(diagram, sizes, dtype, hw, cache.Entry(
                name, opt.chain, dict(opt.tiles), dict(opt.launch), list(best.tiles.launch),
                best.time_s), check_instance(opt.sizes, opt.tiles))
        self.how[k] = "searched"
        return opt


def _ranks(fn, axes, n: int) -> list:
    """How many dimensions ``axes`` names for each argument (None: not named)."""
    if axes is None:
        return [None] * n
    if isinstance(axes, dict):
        from napkin.frontend.jaxpr import arg_names
        axes = [axes.get(name) for name in arg_names(fn, n)]
    out = []
    for entry in list(axes) + [None] * (n - len(axes)):
        if entry is None:
            out.append(None)
        else:
            out.append(len(entry.split()) if isinstance(entry, str) else len(entry))
    return out


def _from_cache(entry, diagram, sizes, dtype, hardware) -> Optimized:
    """An :class:`Optimized` from a replayed cache entry: what the search's result is read for
    (the best program, chain, cost, launches), without the search."""
    from types import SimpleNamespace
    from napkin.cost import cost
    best = SimpleNamespace(program=entry.program, chain=entry.chain,
                           cost=cost(entry.program, hardware, dtype), time_s=entry.time_s,
                           tiles=SimpleNamespace(values=entry.tiles, launch=entry.launches))
    found = SimpleNamespace(best=best, hardware=hardware)
    return Optimized(entry.name, diagram, None, hardware, dict(sizes), dtype, found,
                     dict(entry.tiles), dict(entry.launch))


__all__ = ["Compiled", "Optimized", "check_instance", "jit", "optimize", "sizes_for"]
