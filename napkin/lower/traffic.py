"""HBM traffic of a lowered kernel, read off the kernel itself.

Independent of any cost model: the kernel is traced to its jaxpr and the
``pallas_call`` inside is walked once for every program of the grid (all
programs at once, as numpy vectors).  Scalar index arithmetic is evaluated
(``program_id``, offsets, loop bounds — so tile skipping shows), loads and
stores of kernel refs are counted at the shape they move, and every load or
store inside a loop counts once per trip (``fori_loop`` bounds and ``scan``
lengths evaluated per program); which primitives load and store is the backend's
(``loads`` / ``stores``).  With the Triton backend a ref is a pointer
into HBM: what a kernel loads is what crosses from HBM (the L2 cache is not
modelled), and outputs are written by their stores.

Masked loads and stores count their whole tile, masked lanes included: exact
for sizes the tiles divide, an upper bound for ragged ones.

A Mosaic GPU kernel moves HBM data only by TMA copies of whole blocks, which its backend
writes once per program and counts as it writes them (``Written.copies``); its jaxpr (warp
specialisation, barriers) is not walked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
from jax.extend import core as jex_core
import numpy as np

from napkin.core.errors import NapkinError


class _Unknown:
    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()


@dataclass(frozen=True)
class Ref:
    name: str
    kind: str  # "in" | "out"


@dataclass
class Traffic:
    """Bytes per kernel array; ``total`` = reads + writes."""
    reads: dict = field(default_factory=dict)
    writes: dict = field(default_factory=dict)
    grid: tuple = ()

    @property
    def read_bytes(self) -> int:
        return int(sum(self.reads.values()))

    @property
    def write_bytes(self) -> int:
        return int(sum(self.writes.values()))

    @property
    def total(self) -> int:
        return self.read_bytes + self.write_bytes


def _trunc_div(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(np.result_type(a, b), np.integer):
        q = np.abs(a) // np.maximum(np.abs(b), 1)
        return (np.sign(a) * np.sign(b) * q).astype(np.result_type(a, b))
    return a / b


_SCALAR = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": _trunc_div,
    "rem": np.fmod, "max": np.maximum, "min": np.minimum, "neg": np.negative,
    "sign": np.sign, "abs": np.abs, "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal, "and": np.logical_and,
    "or": np.logical_or, "not": np.logical_not, "square": np.square,
}


def _eval_scalar(eqn, vals):
    name = eqn.primitive.name
    if name in _SCALAR:
        return _SCALAR[name](*vals)
    if name == "select_n":
        pred, *cases = vals
        idx = np.asarray(pred).astype(int)
        out = cases[0]
        for i, c in enumerate(cases[1:], 1):
            out = np.where(idx == i, c, out)
        return out
    if name == "convert_element_type":
        return np.asarray(vals[0]).astype(np.dtype(eqn.params["new_dtype"]))
    if name == "integer_pow":
        return np.power(vals[0], eqn.params["y"])
    if name == "clamp":
        return np.clip(vals[1], vals[0], vals[2])
    if name in ("copy", "copy_p", "optimization_barrier"):
        return vals[0]
    return UNKNOWN


class _Walker:
    def __init__(self, grid, loads, stores):
        self.loads, self.stores = loads, stores
        self.grid = tuple(int(g) for g in grid) or (1,)
        n = int(np.prod(self.grid))
        idx = np.indices(self.grid).reshape(len(self.grid), n)
        self.pids = [idx[i].astype(np.int32) for i in range(len(self.grid))]
        self.ones = np.ones(n, dtype=np.int64)
        self.reads: dict = {}
        self.writes: dict = {}

    @staticmethod
    def _nbytes(aval) -> int:
        return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize

    def _read(self, env, v):
        if isinstance(v, jex_core.Literal):
            return np.asarray(v.val)
        return env.get(v, UNKNOWN)

    def walk(self, jaxpr, env, mult):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            ins = [self._read(env, v) for v in eqn.invars]
            outs = None
            if name == "program_id":
                outs = [self.pids[eqn.params["axis"]]]
            elif name == "num_programs":
                outs = [np.asarray(self.grid[eqn.params["axis"]], np.int32)]
            elif name in self.loads:
                ref = ins[0]
                if isinstance(ref, Ref):
                    self.reads[ref.name] = self.reads.get(ref.name, 0) + \
                        mult * self._nbytes(eqn.outvars[0].aval)
            elif name in self.stores:
                ref = ins[0]
                if isinstance(ref, Ref):
                    self.writes[ref.name] = self.writes.get(ref.name, 0) + \
                        mult * self._nbytes(eqn.invars[1].aval)
            elif name == "while":
                outs = self._while(eqn, ins, mult)
            elif name == "scan":
                outs = self._scan(eqn, ins, mult)
            elif name == "cond":
                outs = self._cond(eqn, ins, mult)
            else:
                sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
                if sub is not None and hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    outs = self._call(sub, ins, mult)
                elif all(v.aval.shape == () for v in eqn.outvars) and \
                        not any(x is UNKNOWN or isinstance(x, Ref) for x in ins):
                    try:
                        outs = [_eval_scalar(eqn, ins)]
                    except Exception:  # noqa: BLE001 — unknown is always safe here
                        outs = None
                    if outs is not None and outs[0] is UNKNOWN:
                        outs = None
            if outs is None:
                outs = [UNKNOWN] * len(eqn.outvars)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [self._read(env, v) for v in jaxpr.outvars]

    def _call(self, closed, ins, mult):
        jaxpr = getattr(closed, "jaxpr", closed)
        consts = getattr(closed, "consts", [])
        env = {v: np.asarray(c) if not hasattr(c, "aval") or np.ndim(c) == 0 else UNKNOWN
               for v, c in zip(jaxpr.constvars, consts)}
        env.update(zip(jaxpr.invars, ins))
        return self.walk(jaxpr, env, mult)

    def _while(self, eqn, ins, mult):
        p = eqn.params
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        body_consts, carry = ins[cn:cn + bn], ins[cn + bn:]
        cj = p["cond_jaxpr"].jaxpr
        fori = (len(cj.eqns) == 1 and cj.eqns[0].primitive.name == "lt"
                and list(cj.eqns[0].invars) == list(cj.invars[cn:cn + 2]))
        if not fori or carry[0] is UNKNOWN or carry[1] is UNKNOWN:
            if self._has_io(p["body_jaxpr"].jaxpr):
                raise NapkinError("cannot count traffic: a loop with loads or stores has bounds "
                                  "that depend on data")
            return None
        trips = np.maximum(np.asarray(carry[1]) - np.asarray(carry[0]), 0)
        body = p["body_jaxpr"]
        inner = [*body_consts, UNKNOWN, carry[1]] + [UNKNOWN] * (len(carry) - 2)
        self._call(body, inner, mult * trips)
        return [carry[1], carry[1]] + [UNKNOWN] * (len(carry) - 2)

    def _scan(self, eqn, ins, mult):
        p = eqn.params
        nc = p.get("num_consts")
        if nc is None:  # jax >= 0.12 keeps no count: refs stay refs, the rest is unknown
            inner = [x if isinstance(x, Ref) else UNKNOWN for x in ins]
        else:
            inner = list(ins[:nc]) + [UNKNOWN] * (len(ins) - nc)
        self._call(p["jaxpr"], inner, mult * int(p["length"]))
        return None

    def _cond(self, eqn, ins, mult):
        index, *ops = ins
        branches = eqn.params["branches"]
        if index is UNKNOWN:  # a branch on data (a chunk a data mask may skip): count the
            best = None       # heaviest branch, the bound the cost model prices
            for b in branches:
                saved, self.reads, self.writes = (self.reads, self.writes), {}, {}
                self._call(b, ops, mult)
                got = (self.reads, self.writes)
                self.reads, self.writes = saved
                total = sum(int(np.sum(v)) for d in got for v in d.values())
                if best is None or total > best[0]:
                    best = (total, got)
            for mine, theirs in zip((self.reads, self.writes), best[1]):
                for name, n in theirs.items():
                    mine[name] = mine.get(name, 0) + n
            return None
        for i, b in enumerate(branches):
            self._call(b, ops, mult * (np.asarray(index) == i))
        return None

    def _has_io(self, jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in self.loads | self.stores:
                return True
            for v in eqn.params.values():
                sub = getattr(v, "jaxpr", v)
                if hasattr(sub, "eqns") and self._has_io(sub):
                    return True
                if isinstance(v, (tuple, list)):
                    for b in v:
                        sb = getattr(b, "jaxpr", b)
                        if hasattr(sb, "eqns") and self._has_io(sb):
                            return True
        return False


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for v in eqn.params.values():
            sub = getattr(v, "jaxpr", v)
            if hasattr(sub, "eqns"):
                yield from _pallas_calls(sub)


def traffic(kernel, shapes) -> Traffic:
    """Bytes read and written per kernel array (see the module doc); for a program of several
    kernels, the sum over its launches (arrays named ``kernel.array``)."""
    parts = kernel.parts(shapes)
    if len(parts) > 1:
        total = Traffic()
        for k, s in parts:
            t = traffic(k, s)
            for mine, theirs in ((total.reads, t.reads), (total.writes, t.writes)):
                for name, n in theirs.items():
                    mine[f"{k.name}.{name}"] = mine.get(f"{k.name}.{name}", 0) + n
        return total
    structs = kernel.abstract(shapes)
    spec = kernel.plan(*structs)
    plan = spec.plan
    if spec.written.copies is not None:  # the backend's own count (Mosaic's TMA): no walk
        reads, writes = spec.written.copies
        return Traffic(dict(reads), dict(writes), tuple(plan.launch_shape))
    closed = jax.make_jaxpr(lambda *xs: kernel(*xs, interpret=False))(*structs)
    calls = list(_pallas_calls(closed.jaxpr))
    if len(calls) != 1:
        raise NapkinError(f"expected one pallas_call in the kernel, found {len(calls)}")
    eqn = calls[0]
    grid = eqn.params["grid_mapping"].grid
    body = eqn.params["jaxpr"]
    n_in = len(plan.inputs)
    refs = [a.name for a in plan.inputs + plan.outputs]
    if len(refs) != len(body.invars):
        raise NapkinError("the kernel's refs do not match its inputs and outputs")
    walker = _Walker(grid, kernel.backend.loads, kernel.backend.stores)
    env = {v: Ref(refs[i], "in" if i < n_in else "out") for i, v in enumerate(body.invars)}
    walker.walk(body, env, walker.ones)
    return Traffic({k: int(np.sum(v)) for k, v in walker.reads.items()},
                   {k: int(np.sum(v)) for k, v in walker.writes.items()}, tuple(grid))


def hbm_bytes(kernel, shapes) -> int:
    """Total bytes the kernel moves through HBM for inputs of these shapes."""
    return traffic(kernel, shapes).total
