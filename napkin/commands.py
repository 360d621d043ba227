"""The pipeline's subcommands: rules, check, cost, optimize (registered into napkin.cli)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from napkin.cli import arg, command, signature, table
from napkin.errors import NapkinError

SIZE = arg("--size", action="append", default=[], metavar="AXIS=N",
           help="an axis size (repeatable); unset axes take the library defaults")
HARDWARE = arg("--hardware", default="h100", metavar="NAME|FILE",
               help="a profile (a100, h100, h200) or a TOML hierarchy (default: h100)")
DTYPE = arg("--dtype", default="bf16", metavar="DT", help="bytes per value (default: bf16)")
JSON = arg("--json", action="store_true", help="print JSON instead of text")
FROM = arg("--from", dest="from_", metavar="FILE:NAME", default=None,
           help="a user algorithm: NAME (a diagram, or a function returning one) in FILE")


def parse_sizes(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier() or not value.strip().isdigit() or int(value) <= 0:
            raise NapkinError(f"--size expects AXIS=N with N a positive integer, got {item!r}")
        out[name] = int(value)
    return out


def load(spec: str | None, from_: str | None):
    """(name, diagram, certificate or None) for ALGO, a certificate path, or --from."""
    from napkin.certificate import Certificate, load_algorithm
    if from_:
        src = load_algorithm({"from": from_}, Path.cwd())
        return from_, src.build("f32"), None
    if spec is None:
        raise NapkinError("give an algorithm name, a certificate file, or --from FILE:NAME")
    if spec.endswith(".json"):
        cert = Certificate.load(spec)
        src = load_algorithm(cert.algorithm, Path(spec).parent)
        return str(cert.algorithm), src.build(cert.dtype), cert
    from napkin.library import get
    return spec, get(spec).diagram(), None


def sizes_for(diagram, given: dict) -> dict:
    from napkin.certificate import size_symbols
    from napkin.library import DEFAULT_SIZES
    need = sorted(size_symbols(diagram))
    out = {}
    for n in need:
        if n in given:
            out[n] = given[n]
        elif n in DEFAULT_SIZES:
            out[n] = DEFAULT_SIZES[n]
        else:
            raise NapkinError(f"no size for axis {n}: give --size {n}=N")
    unknown = sorted(set(given) - set(need))
    if unknown:
        raise NapkinError(f"--size names {', '.join(unknown)}, which the algorithm does not have "
                          f"(its axes: {', '.join(need)})")
    return out


def replay(cert):
    from napkin.certificate import load_algorithm
    from rewrites import get_rule
    from napkin.region import Site
    program = load_algorithm(cert.algorithm, cert.origin).build(cert.dtype)
    for st in cert.steps:
        program = get_rule(st.rule).apply(program, st.site if isinstance(st.site, Site)
                                          else Site.from_json(st.site), dict(st.params))
    return program


# ----------------------------------------------------------------------------- rules
@command("rules", "list the rule library, one line each")
def _rules(args) -> int:
    from rewrites import RULES, STREAMABILITY
    rows = [(r.name, "rewrite", r.summary, r.proof) for r in RULES.values()]
    rows += [(r.name, "streamability", r.summary, r.proof) for r in STREAMABILITY]
    print(table(rows))
    return 0


# ----------------------------------------------------------------------------- check
@command("check", "verify certificates (files or folders), or 'proofs': every rule's proof "
                  "and every stored certificate",
         arg("paths", nargs="+", metavar="PATH", help="certificate files/folders, or 'proofs'"),
         arg("--no-numeric", action="store_true", help="skip the numeric re-check"))
def _check(args) -> int:
    from napkin.checker import check_paths
    paths, failures = list(args.paths), 0
    if "proofs" in paths and not Path("proofs").is_dir() or paths == ["proofs"]:
        paths.remove("proofs")
        from napkin.certificate import stored_certificates
        from proofs import prove_all, prove_wrong
        results = prove_all()
        for r in results:
            print(("proved   " if r.ok else "FAILED   ") + f"{r.rule}: " +
                  (f"{len(r.obligations)} obligations" if r.ok else r.detail))
        wrong = prove_wrong()
        for r in wrong:
            print(("refuted  " if not r.ok else "ACCEPTED ") + f"wrong variant {r.rule}")
        failures += sum(not r.ok for r in results) + sum(r.ok for r in wrong)
        n_ok, n_fail, lines = check_paths([Path(str(stored_certificates()))],
                                          numeric=not args.no_numeric)
        print("\n".join(lines))
        failures += n_fail
        print(f"{sum(r.ok for r in results)} rules proved, {n_ok} certificates verified"
              + (f", {failures} failure(s)" if failures else ""))
    if paths:
        n_ok, n_fail, lines = check_paths(paths, numeric=not args.no_numeric)
        print("\n".join(lines))
        print(f"{n_ok} certificates verified" + (f", {n_fail} failed" if n_fail else ""))
        failures += n_fail
    return 1 if failures else 0


# ----------------------------------------------------------------------------- cost
@command("cost", "transfers, memory, FLOPs and time per memory level of a streamed program",
         arg("algorithm", metavar="ALGO|CERTIFICATE", nargs="?"), FROM, SIZE, HARDWARE, DTYPE,
         JSON, arg("--plot", metavar="PATH", help="draw transfers vs memory and tile size (PNG)"))
def _cost(args) -> int:
    from napkin.cost import cost, cost_json, plot_cost
    from napkin.hardware import get_hardware
    name, diagram, cert = load(args.algorithm, args.from_)
    sizes = sizes_for(diagram, parse_sizes(args.size))
    hw = get_hardware(args.hardware).two_level()
    if cert is not None:
        program, chain = replay(cert), [s.rule for s in cert.steps]
    else:
        from napkin.search import search
        result = search(diagram, hw, sizes, args.dtype)
        program, chain = result.best.program, [m.rule for m in result.best.chain]
    c = cost(program, hw, args.dtype)
    data = cost_json(c, sizes)
    data.update({"algorithm": name, "hardware": hw.name, "chain": chain})
    if args.plot:
        plot_cost(program, hw, sizes, args.plot, args.dtype)
    if args.json:
        print(json.dumps(_jsonable(data), indent=2, sort_keys=True))
        return 0
    print(f"{name} on {hw.name}, {args.dtype}, sizes "
          + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    print(f"program: {' → '.join(chain) or '(no rewrite)'}; tiles "
          + ", ".join(f"{k}={v['value']}" for k, v in data["tiles"].items()))
    rows = [("level", "transfers (values)", "transfers (bytes)", "memory (bytes)",
             "capacity", "time (s)", "symbolic transfers")]
    for lv in c.levels:
        tr, mem = data["transfers"].get(lv, {}), data["memory"].get(lv, {})
        rows.append((lv, _num(tr.get("values")), _num(tr.get("bytes")), _num(mem.get("bytes")),
                     _num(mem.get("capacity_bytes")), _num(data["time_s"].get(lv)),
                     tr.get("expr", "-")))
    print(table(rows))
    print(f"flops {data['flops']['total']:.4g} ({data['flops']['expr']}); compute "
          f"{data['time_s']['compute']:.4g} s; total {data['time_s']['total']:.4g} s, bound by "
          f"{data['time_s']['bound_by']}")
    print(f"canonical form H*(M) = {data.get('canonical_expr')}; transfers / lower bound = "
          f"{data.get('lower_bound_ratio'):.3g}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _num(v) -> str:
    return "-" if v is None else (f"{v:.4g}" if isinstance(v, (int, float)) else str(v))


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)


# ----------------------------------------------------------------------------- optimize
@command("optimize", "search the rewrite chain and tiles that minimise modelled time",
         arg("algorithm", metavar="ALGO", nargs="?"), FROM, SIZE, HARDWARE, DTYPE, JSON,
         arg("--certificate", metavar="PATH", help="write the chain as a certificate"),
         arg("--draw", metavar="PATH", help="draw the algorithm and its streamed program"),
         arg("--levels", choices=("two", "all"), default="two",
             help="GMEM+SMEM (the paper's setting) or the profile's whole hierarchy"),
         arg("--max-states", type=int, default=400), arg("--max-seconds", type=float, default=60.0))
def _optimize(args) -> int:
    from napkin.search import search
    name, diagram, _ = load(args.algorithm, args.from_)
    sizes = sizes_for(diagram, parse_sizes(args.size))
    r = search(diagram, args.hardware, sizes, args.dtype, max_states=args.max_states,
               max_seconds=args.max_seconds, levels=args.levels)
    cert_path = None
    if args.certificate:
        cert_path = write_certificate(args, name, r)
    if args.draw:
        from napkin.drawing import draw_side_by_side
        draw_side_by_side(diagram, r.best.program, args.draw, titles=(name, "streamed program"))
    if args.json:
        print(json.dumps(_jsonable(result_json(r, sizes, cert_path)), indent=2, sort_keys=True))
        return 0
    print(f"{name} on {args.hardware} ({args.levels} levels), {args.dtype}, sizes "
          + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    for i, mv in enumerate(r.best.chain, 1):
        print(f"  {i}. {mv}")
    t = r.best.tiles
    print(f"tiles: {', '.join(f'{k}={v}' for k, v in t.values.items())}")
    print(f"time {t.time_s:.4g} s (bound by {t.bound_by}); {t.transfers_bytes:.4g} bytes moved at "
          f"{t.level}; memory " + ", ".join(f"{lv} {b / 1024:.1f} KiB" for lv, b in t.memory_bytes.items())
          + (f"; lower-bound ratio {t.lower_bound_ratio:.3g}" if t.lower_bound_ratio else ""))
    print("alternatives:")
    for alt in r.alternatives:
        chain = " → ".join(m.rule + (f"({dict(m.params).get('axis')})" if "axis" in dict(m.params)
                                     else "") for m in alt.chain) or "(no rewrite)"
        print(f"  {chain}: {r.reason_loses(alt)}")
    used = {(m.rule, dict(m.params).get("axis")) for m in r.best.chain}
    why_not = [(k, v) for k, v in r.refused.items() if k[0] == "stream_partition" and k not in used]
    if why_not:
        print("not streamable:")
        for (rule, axis), why in why_not:
            print(f"  {axis}: {why}")
    print(f"search: {r.states} states, {r.expanded} expanded, {r.seconds:.2f} s"
          + (f"; {r.limit_hit}" if r.limit_hit else ""))
    if cert_path:
        print(f"certificate: {cert_path}")
    if args.draw:
        print(f"drawing: {args.draw}")
    return 0


def check_instance(sizes: dict, tiles: dict) -> tuple[dict, dict]:
    """A small instance for a certificate's numeric check: tiles of 2–4 and ragged sizes."""
    small_tiles = {t: min(v, 4) for t, v in tiles.items()}
    small = {a: min(v, 9) for a, v in sizes.items()}
    return small, small_tiles


def write_certificate(args, name, r) -> str:
    from napkin.certificate import derive
    small, small_tiles = check_instance(r.best.tile_values and {
        k: v for k, v in r.best.tiles.values.items() if k in r.best.tiles.values} and
        sizes_for(r.algorithm, parse_sizes(args.size)) or {}, r.best.tiles.values)
    algo = {"from": args.from_} if args.from_ else name
    steps = [(m.rule, m.site, m.params_dict) for m in r.best.chain]
    cert = derive(algo, steps, small, small_tiles, base=Path.cwd())
    cert.save(args.certificate)
    return args.certificate


def result_json(r, sizes, cert_path) -> dict:
    t = r.best.tiles
    return {
        "chain": [m.to_json() for m in r.best.chain],
        "tiles": t.values,
        "cost": {"time_s": t.time_s, "bound_by": t.bound_by, "transfers": t.transfers,
                 "transfers_bytes": t.transfers_bytes, "memory_bytes": t.memory_bytes,
                 "lower_bound_ratio": t.lower_bound_ratio,
                 "transfers_expr": {lv: str(e) for lv, e in r.best.cost.transfers.items()}},
        "alternatives": [{"chain": [m.to_json() for m in a.chain], "time_s": a.time_s,
                          "feasible": a.feasible, "why_worse": r.reason_loses(a)}
                         for a in r.alternatives],
        "refused": [{"rule": k[0], "axis": k[1], "why": v} for k, v in r.refused.items()],
        "search": {"states": r.states, "expanded": r.expanded, "seconds": r.seconds,
                   "limit_hit": r.limit_hit, "lower_bound_s": r.lower_bound_s},
        "sizes": sizes, "certificate": cert_path,
    }
