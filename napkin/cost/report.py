"""JSON summaries and plots of a program's cost (for the CLI and for people)."""
from __future__ import annotations

import math
from collections.abc import Mapping

import sympy

from napkin.cost.model import Cost, CostError, cost as cost_of, value_at


def _n(expr, sizes):
    try:
        return value_at(expr, sizes)
    except CostError:
        return None


def cost_json(c: Cost, sizes: Mapping, *, objective: str = "time",
              power_of_two: bool = True) -> dict:
    """A JSON-able summary at given axis sizes.  Tile sizes missing from ``sizes`` are chosen
    by :func:`optimize_tiles` (``tiles_source`` says which); every figure comes as a number
    and, where it is symbolic, as a sympy string (``*_expr``)."""
    from napkin.cost.optimize import M_SYM, optimize_tiles
    sizes = dict(sizes)
    missing = [t.name for t in c.tiles if t.name not in sizes]
    tl = optimize_tiles(c, sizes=sizes, objective=objective, power_of_two=power_of_two)
    point = {**sizes, **tl.values}
    ev = c.evaluate(point)
    hw = c.hardware
    tiles = {}
    for t, info in c.tiles.items():
        row = info.to_json()
        row["value"] = point.get(t.name)
        row["source"] = "optimized" if t.name in missing else "given"
        if t.name in tl.continuous:
            row["continuous"] = tl.continuous[t.name]
        if t.name in tl.continuous_expr:
            row["continuous_expr"] = str(tl.continuous_expr[t.name])
        tiles[t.name] = row
    transfers = {}
    for lv in c.levels[1:]:
        by = {}
        for name in sorted(set(c.loads[lv]) | set(c.stores[lv])):
            by[name] = {"loads": _n(c.loads[lv].get(name, 0), point),
                        "stores": _n(c.stores[lv].get(name, 0), point),
                        "loads_expr": str(c.loads[lv].get(name, 0)),
                        "stores_expr": str(c.stores[lv].get(name, 0))}
        transfers[lv] = {"values": ev["transfers"][lv], "bytes": ev["transfers_bytes"][lv],
                         "expr": str(c.transfers[lv]), "bytes_expr": str(c.transfers_bytes[lv]),
                         "bandwidth_bytes_per_s": hw.level(lv).bandwidth_bytes_per_s,
                         "by_array": by}
    memory = {}
    fits = c.fits(point)
    for lv in c.levels:
        cap = hw.level(lv).capacity_bytes
        memory[lv] = {"values": ev["memory"][lv], "bytes": ev["memory_bytes"][lv],
                      "expr": str(c.memory[lv]), "bytes_expr": str(c.memory_bytes[lv]),
                      "capacity_bytes": cap, "fits": fits.get(lv, True)}
    flops = {"total": ev["flops"], "expr": str(c.flops),
             "by_unit": {k: _n(v, point) for k, v in c.flops_by_unit.items()},
             "by_unit_expr": {k: str(v) for k, v in c.flops_by_unit.items()}}
    ts = c.time_s
    time_s = {k: v for k, v in ev["time_s"].items()}
    time_s["bound_by"] = ev["bound_by"]
    time_s["expr"] = str(ts["total"])
    canon = tl.canonical
    lb_expr = tl.lower_bound_expr
    return {
        "program": f"{c.program.dom} -> {c.program.cod}",
        "hardware": hw.name,
        "levels": list(c.levels),
        "main_level": tl.level,
        "dtype": c.dtype if c.dtype is None or isinstance(c.dtype, str) else dict(c.dtype),
        "intermediates": c.intermediates,
        "sizes": {k: (int(v) if float(v).is_integer() else float(v)) for k, v in sizes.items()},
        "tiles": tiles,
        "tiles_source": "optimized" if missing else "given",
        "objective": objective,
        "transfers": transfers,
        "memory": memory,
        "flops": flops,
        "time_s": time_s,
        "alpha_beta": canon.to_json(point) if canon else None,
        "canonical_expr": str(canon.H) if canon else None,
        "canonical_M": "on-chip memory at the main level, in values",
        "optimum": tl.to_json(point),
        "lower_bound": {"values": tl.lower_bound,
                        "expr": None if lb_expr is None else str(lb_expr),
                        "M_values": (tl.capacity_values if math.isfinite(tl.capacity_values)
                                     else None)},
        "lower_bound_ratio": (None if not tl.lower_bound else
                              ev["transfers"][tl.level] / tl.lower_bound),
        "lower_bound_ratio_optimum": tl.lower_bound_ratio,
        "M_symbol": str(M_SYM),
    }


def plot_cost(program, hardware, sizes: Mapping, path, dtype=None, *, level: str | None = None,
              intermediates: bool = True, points: int = 13) -> str:
    """PNG at ``path``: (left) integer-optimal transfers against on-chip memory, with the
    continuous canonical form H*(M) and the lower bound, the profile's capacity marked;
    (right) transfers against each tile size (others at the optimum), infeasible points
    hollow.  ``program``: a diagram or a Cost.  Returns the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from napkin.cost.bounds import lower_bound
    from napkin.cost.grid import Grid, reference_bytes
    from napkin.cost.optimize import M_SYM, canonical_form
    from napkin.core.errors import NapkinError

    c = program if isinstance(program, Cost) else cost_of(program, hardware, dtype,
                                                         intermediates=intermediates)
    sizes = dict(sizes)
    g = Grid(c, sizes, level=level)
    lv = g.level
    cap = c.hardware.level(lv).capacity_bytes
    q = reference_bytes(c)
    caps = np.geomspace(cap / 64, cap * 16, points)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    H_int = []
    for cb in caps:
        i, ok = g.best("transfers", {lv: cb})
        H_int.append(g.Hv[i] if ok else np.nan)
    Mv = caps / q
    ax1.loglog(Mv, H_int, "o-", label="integer optimum (model)")
    try:
        canon = canonical_form(c, lv, "values")
        f = sympy.lambdify(M_SYM, sympy.sympify(canon.H).subs(
            {s: sizes[s.name] for s in canon.H.free_symbols if s.name in sizes}), "numpy")
        ax1.loglog(Mv, np.broadcast_to(f(Mv), Mv.shape), "--", label=f"H*(M) = {canon.H}")
    except Exception:  # noqa: BLE001 - the plot still shows the rest
        pass
    lb = lower_bound(c, M_SYM)
    flb = sympy.lambdify(M_SYM, lb.subs({s: sizes[s.name] for s in lb.free_symbols
                                          if s.name in sizes}), "numpy")
    ax1.loglog(Mv, np.broadcast_to(np.asarray(flb(Mv), dtype=float), Mv.shape), ":",
               label="lower bound")
    ax1.axvline(cap / q, color="grey", lw=0.8)
    ax1.text(cap / q, ax1.get_ylim()[1], f" {c.hardware.name}\n {lv} capacity", va="top",
             fontsize=8)
    ax1.set_xlabel(f"on-chip memory M at {lv} (values, {q} B each)")
    ax1.set_ylabel(f"transfers H at {lv} (values)")
    ax1.set_title("transfers vs on-chip memory")
    ax1.legend(fontsize=7)
    # the right panel is about the tiles the table reports (the time optimum, chosen among
    # the points that launch): each curve moves one tile with the others at those, and a
    # point is hollow by the same test that chose them
    best, _ = g.best("time")
    bestv = g.values(best)
    ok = g.feasible()
    hollow = ("does not launch" if g.launches is not None
              else "exceeds capacity")
    for j, t in enumerate(g.free):
        others = np.ones(g.n, bool)
        for k, u in enumerate(g.free):
            if k != j:
                others &= g.flat[k] == bestv[u.name]
        idx = np.where(others)[0]
        xs, ys, fe = g.flat[j][idx], g.Hv[idx], ok[idx]
        order = np.argsort(xs)
        xs, ys, fe = xs[order], ys[order], fe[order]
        line, = ax2.loglog(xs, ys, "-", label=t.name)
        ax2.loglog(xs[fe], ys[fe], "o", color=line.get_color())
        ax2.loglog(xs[~fe], ys[~fe], "o", mfc="none", color=line.get_color())
        ax2.loglog([bestv[t.name]], [g.Hv[best]], "*", ms=16, color=line.get_color(),
                   mec="black", zorder=5)
    if g.free:
        ax2.loglog([], [], "*", ms=12, color="white", mec="black", label="chosen")
    ax2.set_xlabel(f"tile size (others at the chosen ones; hollow = {hollow})")
    ax2.set_ylabel(f"transfers H at {lv} (values)")
    sz = ", ".join(f"{k}={v}" for k, v in sizes.items())
    chosen = ", ".join(f"{t.name}={bestv[t.name]}" for t in g.free)
    ax2.set_title(f"transfers vs tile size ({sz}; chosen {chosen})", fontsize=9)
    if g.free:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise NapkinError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    except ValueError as e:  # a file type matplotlib does not write
        raise NapkinError(f"cannot write {str(path)!r}: {' '.join(str(e).split())}") from None
    finally:
        plt.close(fig)
    return str(path)
