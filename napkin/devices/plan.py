"""Which axis goes over the devices, and how: the strategies priced, the fastest chosen.

Every strategy's per-device work is the single-device search's best program at the sizes one
device holds (``napkin.optimize``: its launch-model time), so the device level adds only what
crosses the links:

* ``one``     — a single device: the program as searched.
* ``shard a`` — every box woven over ``a``: each of n devices runs the program on ⌈a/n⌉ of it;
  inputs carrying ``a`` arrive cut, the others whole; nothing crosses a link.
* ``ring q, x`` — the queries ``q`` cut over n devices, the streamed axis ``x`` in n chunks,
  one per device, passed round the ring: step s folds the chunk a device holds into its
  state (the accumulator's merge of the chunk's partial state) while the chunk for step s + 1
  arrives.  Time: the first step's fold, then n − 1 steps of max(fold, transfer) + the link's
  latency, then the finalize; a transfer is the chunk's inputs (K and V's share of x).  A
  step's fold is its busiest device's: the block pairs whose entries the causal / window masks
  keep some of (:func:`ring_work`).  In zigzag order each axis is 2n chunks, device i holding
  i and 2n − 1 − i, and the per-device program is a piece's, run on each pair of pieces.
* ``gather x`` — ``x`` cut over n devices, each folding its chunk from the empty state, the
  partial states gathered (n − 1 states in, per device, over the link) and merged.

* a 2-D mesh — any of ring or gather on k of n devices, within each of n / k blocks of
  another woven axis (``Strategy.outer``): its per-device sizes cut by both, its link the
  inner strategy's.

A box that reads positions along a cut axis (a causal or window mask, positions, a take) is
handed the base of the device's share (napkin.frontend.bases: the per-device program takes
``<axis>_base``).  A strategy that does not apply says why (no woven axis, no stream with a
merge, an input carrying both cut axes, sizes that do not fit a device's memory);
:func:`distribute` returns them all, the fastest first.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from napkin.core.errors import NapkinError
from napkin.devices.strategy import ONE, Strategy, layout, mergeable_stream


@dataclass
class Priced:
    """A strategy's modelled time per call, what bounds it, and its per-device program."""
    strategy: Strategy
    time_s: float = math.inf
    compute_s: float = 0.0       # a device's kernels (all of a ring's steps)
    link_s: float = 0.0          # a device's transfers, overlapped or not
    link_bytes: float = 0.0      # bytes one device sends over its links per call (its own)
    arrival_bytes: float = 0.0   # bytes gathered first: inputs that arrive cut otherwise
    bound: str = ""              # "compute", "HBM" or "link"
    local: object = None         # the per-device Optimized
    sizes: dict = field(default_factory=dict)  # the per-device sizes
    why: str = ""                # why it does not apply ("" where it does)
    bases: tuple = ()            # cut axes positions are read along: the per-device program
                                 # takes each one's base (napkin.frontend.bases)

    @property
    def applies(self) -> bool:
        return not self.why

    def explain(self) -> str:
        s = self.strategy
        if not self.applies:
            return f"{s}: not applicable — {self.why}"
        gathered = f" + {self.arrival_bytes / 1e9:.3g} GB of inputs gathered first" \
            if self.arrival_bytes else ""
        return (f"{s}: {self.time_s * 1e3:.4g} ms, bound by {self.bound} (compute "
                f"{self.compute_s * 1e3:.4g} ms, link {self.link_s * 1e3:.4g} ms, "
                f"{self.link_bytes / 1e9:.3g} GB sent per device{gathered})")


@dataclass
class Distributed:
    """:func:`distribute`'s answer: the best strategy (``best``) and every one priced."""
    name: str
    algorithm: object
    hardware: object
    sizes: dict
    dtype: str | None
    devices: int
    priced: list                # Priced, fastest first; inapplicable ones last
    arrive: tuple = ()          # the axes the inputs come cut along
    source: object = None       # what a certificate names the algorithm by (a library name…)

    @property
    def best(self) -> Priced:
        return self.priced[0]

    @property
    def strategy(self) -> Strategy:
        return self.best.strategy

    def explain(self) -> str:
        lines = [f"{self.name} on {self.devices} × {self.hardware.name} "
                 f"({', '.join(f'{k}={v}' for k, v in self.sizes.items())}): "
                 f"{self.best.strategy}"]
        lines += [f"  {p.explain()}" for p in self.priced]
        return "\n".join(lines)

    def choose(self, strategy: Strategy) -> Distributed:
        """This answer with ``strategy`` (one of those priced) in place of the fastest."""
        for p in self.priced:
            if p.strategy == strategy:
                if not p.applies:
                    raise NapkinError(f"{self.name}: {p.explain()}")
                return dataclasses.replace(self, priced=[p, *(q for q in self.priced
                                                              if q is not p)])
        raise NapkinError(f"{self.name}: {strategy} was not priced (priced: "
                          f"{'; '.join(str(p.strategy) for p in self.priced)})")

    def fit(self, sizes: dict) -> Distributed:
        """The chosen strategy at other (smaller) sizes: its per-device program as found at
        scale, fitted (:meth:`napkin.Optimized.fit`) to the per-device sizes."""
        from napkin.pipeline import sizes_for
        sizes = sizes_for(self.algorithm, sizes)
        p = self.best
        local = local_sizes(p.strategy, sizes)
        opt = p.local.fit(local)
        state = 0.0
        if p.strategy.kind in ("ring", "gather"):
            (outers, box), _ = mergeable_stream((opt.sequential or opt).program)
            state = _sent_state(opt, p.strategy, box, outers, local)
        # the per-device program and what crosses the links at these sizes (the times stay
        # the ones priced at scale: a fitted program is run, not searched)
        fitted = dataclasses.replace(p, local=opt, sizes=local, link_bytes=link_bytes(
            p.strategy, self.algorithm, local, self.dtype, state), arrival_bytes=arrival_bytes(
            p.strategy, self.algorithm, sizes, self.dtype, self.arrive))
        return dataclasses.replace(self, sizes=sizes, priced=[fitted])

    def certificates(self) -> list:
        """[(what, Certificate)] of the chosen strategy, each replayed by ``napkin check``: the
        decomposition over the devices — the algorithm's eager readings, then the group
        partition of the cut woven axis (one share per device, at GMEM) and, for a ring, the
        stream partition of the cut streamed axis in one chunk per device, for a gather its
        stream split in one part per device (split_stream) — with the shares as tiles; and
        the per-device program's own derivation (on its block, the bases as inputs)."""
        from napkin.certify.certificate import derive_from, load_algorithm
        from napkin.core.ir import ops as op_order, view
        from napkin.core.region import Site, body_at
        from napkin.pipeline import check_instance
        from napkin.search.engine import eager_moves
        s = self.strategy
        if self.source is None:
            raise NapkinError(f"{self.name}: a bare diagram names no algorithm the checker can "
                              f"rebuild; distribute a library name or {{'from': FILE:NAME}}")
        program, eager = eager_moves(self.algorithm)
        steps = [(m.rule, m.site, m.params_dict) for m in eager]
        tiles, share = {}, local_sizes(s, self.sizes)

        def everything(path):
            return Site(path, tuple(range(len(op_order(view(body_at(program, path)))))))

        def step(rule, path, params):
            nonlocal program
            from rewrites import RULES
            site = everything(path)
            program = RULES[rule].apply(program, site, params)
            steps.append((rule, site, params))
        inner = ()  # the outer axes' groups first (a 2-D mesh), the strategy's own inside
        for a, _ in s.outer:
            tiles[f"dev_{a}"] = share[a]
            step("group_partition", inner, {"axis": a, "size": f"dev_{a}", "level": "gmem"})
            inner += (0,)
        if s.shard is not None:
            tiles[f"dev_{s.shard}"] = share[s.shard]
            step("group_partition", inner, {"axis": s.shard, "size": f"dev_{s.shard}",
                                            "level": "gmem"})
        if s.stream is not None:
            tiles[f"dev_{s.stream}"] = share[s.stream]
            if s.kind == "ring":
                step("stream_partition", (*inner, 0), {"axis": s.stream,
                                                       "chunk": f"dev_{s.stream}"})
            else:  # each part is one device's share, folded in one chunk
                tiles[f"chunk_{s.stream}"] = share[s.stream]
                step("stream_partition", inner, {"axis": s.stream,
                                                 "chunk": f"chunk_{s.stream}"})
                step("split_stream", inner, {"axis": s.stream, "size": f"dev_{s.stream}"})
        small, small_tiles = check_instance(self.sizes, tiles)
        # (the shares are the per-device program's: zigzag's pieces, two per device; which
        # device holds which group is the group partition's business — groups are
        # independent — and a ring folds its chunks in its own order, which the merge,
        # proved in either order, licenses)
        out = [("the decomposition over the devices",
                derive_from(load_algorithm(self.source), self.source, steps, small,
                            small_tiles, "f32"))]
        local = self.best.local.certificate
        if local is not None:
            out.append(("each device's program", local))
        return out

    def kernel(self, backend: str = "auto", *, interpret="auto", dtype: str | None = None):
        """The chosen strategy as a JAX function of the global arrays, on JAX's SPMD engine
        (:mod:`napkin.devices.spmd`), with a derivative: ``jax.grad`` through it runs the
        forward that saves what the backward reads and the algorithm's backward programs,
        each distributed in turn (searched when first differentiated)."""
        from napkin.devices.spmd import lower_distributed

        def derivative():
            return self._derivative(backend, interpret, dtype)
        return lower_distributed(self, backend=backend, interpret=interpret, dtype=dtype,
                                 derivative=derivative)

    def _derivative(self, backend, interpret, dtype):
        """(the distributed saving forward's kernel, [(input names, the distributed backward
        program's kernel)]) at these sizes: each distributed by the same pricing (the saving
        forward as this one where it applies; the backward programs on this one's mesh where
        a strategy applies on it, else on any of these devices)."""
        from napkin.frontend.grad import grad, residuals
        from napkin.pipeline import backward_groups

        def distributed(diagram, strategy=None):
            n = self.strategy.total
            d = None
            if strategy is not None:
                try:
                    d = distribute(diagram, self.hardware, self.sizes, self.dtype, n,
                                   arrive=self.arrive, strategy=strategy)
                except NapkinError:
                    d = None  # it does not apply to this program: priced like any other
            for mesh in (self.strategy.mesh, None):  # the forward's mesh first: one mesh
                if d is not None:                    # for the step, and fewer to price
                    break
                try:
                    d = distribute(diagram, self.hardware, self.sizes, self.dtype, n,
                                   arrive=self.arrive, all_devices=True, mesh=mesh)
                except NapkinError:
                    if mesh is None:
                        raise
            return d.kernel(backend, interpret=interpret, dtype=dtype)
        saving = distributed(residuals(self.algorithm), self.strategy)
        pieces = []
        for names in backward_groups(self.algorithm):
            wrt = names[0] if len(names) == 1 else list(names)
            pieces.append((names, distributed(grad(self.algorithm, wrt=wrt, residuals=True))))
        return saving, pieces


def distribute(algorithm, hardware="h200", sizes: dict | None = None, dtype: str | None = "bf16",
               devices: int | None = None, *, arrive: tuple | None = None,
               strategy: Strategy | None = None, all_devices: bool = False,
               max_states: int = 2000, max_seconds: float = 60.0,
               source=None, mesh: tuple | None = None) -> Distributed:
    """Price every way of running ``algorithm`` on ``devices`` chips of ``hardware`` (default:
    the profile's ``devices``), fastest first.  ``arrive``: the axes the inputs come cut
    along (a sequence-parallel model hands attention Q cut along q and K, V along x:
    ``("q", "x")``); a strategy that wants an input otherwise gathers it first, over the
    link (default: each strategy's own layout, nothing moved before it runs).
    ``strategy``: price that one only (or those, a list); ``all_devices``: only strategies
    on all ``devices`` (and one device); ``mesh``: only strategies on a mesh of that shape
    (``(4, 2)``: an outer axis over 4, the strategy's own over 2).  Sizes, dtype and
    ``source`` (what a diagram's certificates name it by) as :func:`napkin.optimize`."""
    from napkin.hardware import get_hardware
    from napkin.pipeline import optimize, resolve, sizes_for
    hw = get_hardware(hardware)
    n = hw.devices if devices is None else devices
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise NapkinError(f"devices={n!r}: a positive number of devices")
    name, diagram, source = resolve(algorithm, source, None)
    sizes = sizes_for(diagram, sizes or {})
    cache: dict = {}

    def searched(local: dict, bases: tuple = ()):
        key = (tuple(sorted(local.items())), bases)
        if key not in cache:
            from napkin.frontend.bases import with_bases
            own = source if not bases or source is None else \
                {"bases": source, "axes": list(bases)}  # a certificate names the block
            cache[key] = optimize(with_bases(diagram, bases) if bases else diagram, hw, local,
                                  dtype, source=own, max_states=max_states,
                                  max_seconds=max_seconds)
        return cache[key]

    whole = searched(sizes)
    arrive = tuple(arrive or ())
    unknown = [a for a in arrive if a not in sizes]
    if unknown:
        raise NapkinError(f"arrive names {unknown[0]}, which {name} does not have (its axes: "
                          f"{', '.join(sizes)})")
    wanted = candidates(diagram, whole, sizes, n) if strategy is None else \
        list(strategy) if isinstance(strategy, (list, tuple)) else [strategy]
    if all_devices:
        wanted = [w for w in wanted if w.total in (1, n)]
    if mesh is not None:
        shapes = sorted({w.mesh for w in wanted if w.kind != ONE}, key=lambda m: (len(m), m))
        wanted = [w for w in wanted if w.mesh == tuple(mesh)]
        if not wanted:
            raise NapkinError(f"{name}: no strategy on a {' × '.join(map(str, mesh))} mesh "
                              f"(the meshes priced on {n} devices: "
                              f"{', '.join(' × '.join(map(str, m)) for m in shapes) or 'none'})")
    priced = [price(s, diagram, whole, sizes, hw, dtype, searched, arrive) for s in wanted]
    priced.sort(key=lambda p: (not p.applies, p.time_s, p.strategy.devices))
    if not priced[0].applies:
        raise NapkinError(f"{name}: {priced[0].explain()}")
    return Distributed(name, diagram, hw, sizes, dtype, n, priced, arrive, source)


# --------------------------------------------------------------------------- the candidates
def woven_axes(diagram) -> list:
    """The axes every box of ``diagram`` is woven over: a group partition of the whole
    program is legal along them (rules.group_partition's premise)."""
    from napkin.core.ir import ops as op_order, view
    from napkin.core.region import Site
    from rewrites import RULES
    n_ops = len(op_order(view(diagram)))
    names = dict.fromkeys(a for ob in diagram.dom.inside for a in ob.type.names)
    out = []
    for a in names:
        try:
            RULES["group_partition"].check(diagram, Site((), tuple(range(n_ops))), {"axis": a})
        except NapkinError:
            continue
        out.append(a)
    return out


def counts(n: int, size: int) -> list:
    """Device counts to try for an axis of ``size``: n, and its halvings down to 2, each at
    most the axis."""
    out, k = [], n
    while k >= 2:
        if k <= size:
            out.append(k)
        k //= 2
    return out


def candidates(diagram, whole, sizes: dict, n: int) -> list:
    """Every strategy to price: one device; each woven axis sharded; where the best
    program is a mergeable stream, a ring (with each woven axis of its groups cut) and a
    gather."""
    out = [Strategy(ONE)]
    woven = woven_axes(diagram)
    for a in woven:
        out += [Strategy("shard", k, shard=a) for k in counts(n, sizes[a])]
    found, _ = mergeable_stream((whole.sequential or whole).program)  # before a split-K
    if found is not None:
        outers, box = found
        x = box.spec.axis
        from napkin.frontend.bases import kept_band
        for k in counts(n, sizes.get(x, 1)):
            out.append(Strategy("gather", k, stream=x))
            for g in outers:
                a = g.spec.axis
                if a not in woven or sizes[a] < k:
                    continue
                out.append(Strategy("ring", k, shard=a, stream=x))
                # masks between the two cut axes: the zigzag order balances what each keeps
                if (kept_band(diagram, a, x) or kept_band(diagram, x, a)) is not None \
                        and min(sizes[a], sizes[x]) >= 2 * k:
                    out.append(Strategy("ring", k, shard=a, stream=x, zigzag=True))
    # a 2-D mesh: a ring or gather on part of the devices, within each block of another woven
    # axis (heads) cut over the rest
    for s in [s for s in out if s.kind in ("ring", "gather") and s.devices < n
              and n % s.devices == 0]:
        k = n // s.devices
        out += [dataclasses.replace(s, outer=((a, k),)) for a in woven
                if a not in (s.shard, s.stream) and sizes[a] >= k]
    return out


# --------------------------------------------------------------------------- the prices
def price(s: Strategy, diagram, whole, sizes, hw, dtype, searched, arrive=()) -> Priced:
    if s.kind == ONE:
        return _priced_program(Priced(s, local=whole, sizes=dict(sizes)), whole, sizes)
    p = _price(s, diagram, sizes, hw, dtype, searched)
    if not p.applies or not arrive:
        return p
    moved = arrival_bytes(s, diagram, sizes, dtype, arrive)
    if moved:
        extra = moved / _link(hw) + (s.devices - 1) * hw.link_latency_s
        p.arrival_bytes = moved
        p.link_s += extra
        p.time_s += extra
        if extra > p.compute_s:
            p.bound = "link"
    return p


def arrival_bytes(s: Strategy, diagram, sizes: dict, dtype, arrive) -> float:
    """Bytes one device gathers before ``s`` runs: each input that arrives cut along another
    axis than ``s`` wants it (``arrive``), all-gathered ((n − 1) shares of it)."""
    moved = 0.0
    outer = dict(s.outer)
    for ob in diagram.dom.inside:
        came = next((a for a in arrive or () if ob.type.has(a)), None)
        if came is not None and came != layout(s, ob.type) and came not in outer:
            moved += (s.devices - 1) / s.devices * _bytes(ob.type, sizes, dtype) / math.prod(
                k for a, k in s.outer if ob.type.has(a))
    return moved


def _price(s: Strategy, diagram, sizes, hw, dtype, searched) -> Priced:
    local = local_sizes(s, sizes)
    p = Priced(s, sizes=local)
    held = {a: v * s.pieces if a in (s.shard, s.stream) else v for a, v in local.items()}
    why = _fits_memory(diagram, held, hw, dtype)
    if why:
        p.why = why
        return p
    from napkin.frontend.bases import position_readers
    # a cut axis positions are read along: each device is handed its share's start
    p.bases = tuple(a for a in (*(a for a, _ in s.outer), s.shard, s.stream)
                    if a is not None and position_readers(diagram, a))
    for ob in diagram.dom.inside:
        try:
            layout(s, ob.type)
        except NapkinError as e:
            p.why = str(e)
            return p
    opt = searched(local, p.bases)
    p.local = opt
    if s.kind == "shard":
        return _priced_program(p, opt, local)
    # a device's fold of its chunk: one stream (a gather may split it over the SMs as well:
    # the split's parts are merged with the other devices' states)
    if mergeable_stream((opt.sequential or opt).program)[0] is None:
        p.local = opt = _fastest_stream(opt) or opt
    seq = opt.sequential or opt
    if s.kind == "ring":
        p.local = opt = seq
    found, why = mergeable_stream(seq.program)
    if found is None:
        p.why = f"at the per-device sizes {why}"
        return p
    outers, box = found
    fold = opt.search.best.time_s
    state = _sent_state(opt, s, box, outers, local)
    hbm = hw.memory_bandwidth
    merge = 3 * state / hbm            # read two states, write one (f32)
    p.link_bytes = link_bytes(s, diagram, local, dtype, state)
    if s.kind == "ring":
        # each step lasts as long as its busiest device: the block pairs it folds (those its
        # masks keep nothing of skipped, where the kernel skips them), each merged into its
        # queries' state, or the next chunk's transfer if that is longer
        from napkin.lower.plan import chunk_guards
        work = ring_work(s, diagram, sizes, skips=bool(chunk_guards(box.spec)))
        link = p.link_bytes / (s.devices - 1) / _link(hw) + hw.link_latency_s
        steps = [w * fold + max(w - (s.pieces if t == 0 else 0), 0) * merge
                 for t, w in enumerate(work)]
        p.compute_s = sum(steps)
        p.link_s = (s.devices - 1) * link
        p.time_s = steps[0] + sum(max(c, link) for c in steps[1:]) + s.pieces * state / hbm
        p.bound = "link" if link > max(steps[1:], default=0) else _bound(opt, local)
    else:  # gather: fold one chunk, gather the others' states, merge them all
        p.compute_s = fold + (s.devices - 1) * merge
        p.link_s = p.link_bytes / _link(hw) + (s.devices - 1) * hw.link_latency_s
        p.time_s = p.compute_s + p.link_s + state / hbm
        p.bound = "link" if p.link_s > p.compute_s else _bound(opt, local)
    return p


def ring_work(s: Strategy, diagram, sizes: dict, skips: bool = True) -> list:
    """Per step of the ring ``s``, the most block pairs (a piece of the device's queries
    against a piece of the chunk it holds) any device folds: all ``pieces²`` of them, less
    those the algorithm's causal and window masks keep nothing of where the kernel skips
    them (``skips``).  Cut contiguously, a causal ring's last device keeps all of every
    chunk, so every step is a whole fold; in zigzag order each device keeps about half."""
    from napkin.frontend.bases import keeps_any, kept_band
    n, h = s.devices, s.pieces
    band, rows_are_shard = kept_band(diagram, s.shard, s.stream), True
    if band is None:
        band, rows_are_shard = kept_band(diagram, s.stream, s.shard), False
    if band is None or not skips:
        return [h * h] * n
    w_shard = -(-sizes[s.shard] // (n * h))
    w_stream = -(-sizes[s.stream] // (n * h))
    out = []
    for t in range(n):
        most = 0
        for i in range(n):
            held = (i - t) % n  # the device whose chunk device i folds at step t
            kept = 0
            for a in range(h):
                for b in range(h):
                    mine = (s.chunk(i, a) * w_shard, (s.chunk(i, a) + 1) * w_shard)
                    theirs = (s.chunk(held, b) * w_stream, (s.chunk(held, b) + 1) * w_stream)
                    rows, cols = (mine, theirs) if rows_are_shard else (theirs, mine)
                    kept += keeps_any(band, rows, cols)
            most = max(most, kept)
        out.append(most)
    return out


def _fastest_stream(opt):
    """The fastest program ``opt``'s search reached that is one stream with a merge (what a
    ring or a gather folds), as an Optimized; None when it reached none.  A share small
    enough for one tile of the streamed axis is searched best unstreamed, and the device
    level needs the stream all the same."""
    from napkin.lower.backends import get_backend
    from napkin.pipeline import launch_of
    r = opt.search
    reached = sorted((r.graph.nodes[n]["state"] for n in r.graph.nodes),
                     key=lambda st: st.time_s)
    for st in reached:
        if not st.feasible or st.error or st.unlowerable \
                or mergeable_stream(st.program)[0] is None:
            continue
        if st._report is None:  # its full optimum, worked out as the best's was
            st._report = r.best._report
        return dataclasses.replace(opt, search=dataclasses.replace(r, best=st),
                                   tiles=dict(st.tiles.values),
                                   launch=launch_of(st.tiles, get_backend()))
    return None


def link_bytes(s: Strategy, diagram, local: dict, dtype, state: float) -> float:
    """Bytes one device sends per call under ``s`` (besides gathering inputs that arrive cut
    otherwise): a ring passes its chunk of every input carrying the streamed axis on, n − 1
    times (zigzag: its two pieces, ``local`` being one piece's sizes); a gather sends its
    partial states to the n − 1 others."""
    if s.kind == "ring":
        return (s.devices - 1) * s.pieces * sum(
            _bytes(ob.type, local, dtype) for ob in diagram.dom.inside if ob.type.has(s.stream))
    if s.kind == "gather":
        return (s.devices - 1) * state
    return 0.0


def local_sizes(s: Strategy, sizes: dict) -> dict:
    """The sizes the per-device program runs at under ``s``: the axes it cuts,
    ⌈size / devices⌉ (zigzag: a piece, ⌈size / 2·devices⌉; a device runs it on each pair of
    its pieces)."""
    local = dict(sizes)
    for a, k in s.cuts().items():
        local[a] = -(-sizes[a] // k)
    return local


def _priced_program(p: Priced, opt, sizes) -> Priced:
    p.compute_s = p.time_s = opt.search.best.time_s
    p.bound = _bound(opt, sizes)
    return p


def _bound(opt, sizes) -> str:
    """compute or HBM: what bounds the program's roofline at these sizes."""
    try:
        by = opt.cost.evaluate({**sizes, **opt.tiles})["bound_by"]
    except Exception:  # noqa: BLE001 - a bound the model cannot name is no reason to fail
        return "?"
    return "compute" if str(by).startswith("compute") else "HBM"


def _link(hw) -> float:
    if not hw.link_bytes_per_s:
        raise NapkinError(f"hardware {hw.name!r} states no link_bytes_per_s: the device level "
                          f"needs the links between its chips")
    return hw.link_bytes_per_s


def _bytes(t, sizes: dict, dtype) -> float:
    from napkin.hardware import DTYPE_BYTES
    from napkin.core.arrays import canonical_dtype
    width = DTYPE_BYTES.get(canonical_dtype(dtype) if dtype else t.dtype, 4)
    return width * math.prod(_size(a.size, sizes) for a in t.axes)


def _size(s, sizes) -> int:
    import sympy
    v = sympy.sympify(s).xreplace({sym: sympy.Integer(sizes.get(str(sym), 1))
                                   for sym in sympy.sympify(s).free_symbols})
    return int(v)


def _sent_state(opt, s, box, outers, local: dict) -> float:
    """The stream's state a device sends: one per part of its keys where a gather's
    program split them (each merged with the other devices' states), else one."""
    state = _state_bytes(box, outers, local)
    return state * _parts(opt, s.stream, local) if s.kind == "gather" else state


def _parts(opt, axis: str, local: dict) -> int:
    """The partial states a device's program leaves of its stream over ``axis``: a split's
    parts (split_stream's stacked axis, each merged with the other devices' states), else 1."""
    from napkin.core.ir import ops as op_order, view
    from napkin.cost import value_at
    from rewrites.split_stream import parts_axis
    if opt.sequential is None:
        return 1
    g = view(opt.program)
    for n in op_order(g):
        for ob in g.nodes[n]["box"].cod.inside:
            if ob.type.has(parts_axis(axis)):
                return int(value_at(ob.type.axis(parts_axis(axis)).size, {**local, **opt.tiles}))
    return 1


def _state_bytes(box, outers, local: dict) -> float:
    """The stream's state over the whole per-device shares of its groups' axes, in f32."""
    tiles = {str(g.spec.size): local.get(g.spec.axis, 1) for g in outers}
    env = {**local, **tiles}
    return sum(4 * math.prod(_size(a.size, env) for a in ob.type.axes)
               for ob in box.spec.init.cod.inside)


def _fits_memory(diagram, local: dict, hw, dtype) -> str:
    if hw.hbm_bytes is None:
        return ""
    need = sum(_bytes(ob.type, local, dtype) for ob in (*diagram.dom.inside, *diagram.cod.inside))
    if need > hw.hbm_bytes:
        return (f"a device's inputs and outputs take {need / 1e9:.3g} GB at these sizes, more "
                f"than its {hw.hbm_bytes / 1e9:.3g} GB")
    return ""
