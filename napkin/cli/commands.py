"""The pipeline's subcommands: rules, check, cost, optimize (registered into napkin.cli)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from napkin.cli.options import (PICTURES, Outputs, algorithm_named, arg, command, one_line,
                                signature, table)
from napkin.core.errors import NapkinError
from napkin.lower.backends import BACKENDS, DEFAULT as DEFAULT_BACKEND
from napkin.pipeline import sizes_for

SIZE = arg("--size", action="append", default=[], metavar="AXIS=N",
           help="an axis size (repeatable); unset axes take the library defaults")
HARDWARE = arg("--hardware", default="h100", metavar="NAME|FILE",
               help="a profile (a100, h100, h200) or a TOML hierarchy (default: h100)")
DTYPE = arg("--dtype", default="bf16", metavar="DT", help="bytes per value (default: bf16)")
JSON = arg("--json", action="store_true", help="print JSON instead of text")
TILE = arg("--tile", action="append", default=[], metavar="TILE=N",
           help="a tile size instead of the optimiser's (repeatable), e.g. g_q=192")
FROM = arg("--from", dest="from_", metavar="FILE:NAME", default=None,
           help="a user algorithm: NAME (a diagram, or a function returning one) in FILE")


DEVICES = (arg("--devices", type=int, default=None, metavar="N",
                help="also price running it on N devices (napkin.devices: a shard of a woven "
                     "axis, a ring, a gather of partial states) and say which wins"),
           arg("--arrive", default=None, metavar="AXES",
               help="with --devices: the axes the inputs come cut along, e.g. q,x (a "
                    "sequence-parallel model's); others are gathered first"),
           arg("--mesh", default=None, metavar="AxB",
               help="with --devices: only strategies on a mesh of this shape, e.g. 4x2 (an "
                    "outer woven axis over 4 devices, a ring or gather over 2 within each)"))


def mesh_shape(args) -> tuple | None:
    """--mesh AxB as a tuple of device counts (None without it), checked against --devices."""
    if getattr(args, "mesh", None) is None:
        return None
    try:
        mesh = tuple(int(k) for k in args.mesh.lower().split("x"))
    except ValueError:
        mesh = ()
    if not mesh or min(mesh) < 1 or math.prod(mesh) != args.devices:
        raise NapkinError(f"--mesh {args.mesh}: a shape such as 4x2 whose devices multiply "
                          f"to --devices {args.devices}")
    return mesh


def device_plan(args, name, diagram, sizes):
    """The --devices plan of ``diagram`` (None without --devices), its explanation printed."""
    if args.devices is None:
        return None
    if args.devices < 1:
        raise NapkinError(f"--devices {args.devices}: a positive number of devices")
    from napkin.devices import distribute
    arrive = None if args.arrive is None else tuple(a for a in args.arrive.split(",") if a)
    mesh = mesh_shape(args)
    from napkin.frontend.library import LIBRARY
    source = {"from": args.from_} if getattr(args, "from_", None) else \
        name if name in LIBRARY else None  # what its certificates name it by
    d = distribute(diagram, args.hardware, sizes, getattr(args, "dtype", "bf16"), args.devices,
                   arrive=arrive, max_states=getattr(args, "max_states", 2000),
                   max_seconds=getattr(args, "max_seconds", 60.0), source=source, mesh=mesh)
    print(d.explain().replace(d.name, name, 1))
    return d


# ----------------------------------------------------------------------------- commands
@command("algorithms", "list the library's algorithms: name, signature, summary")
def _algorithms(args) -> int:
    from napkin.frontend.library import LIBRARY
    rows = []
    for name, algo in LIBRARY.items():
        try:
            sig = signature(algo.diagram())
        except NapkinError as e:
            sig = f"(does not build: {one_line(e)})"
        rows.append((name, sig, one_line(algo.summary)))
    print(table(rows))
    return 0


@command("draw", "draw an algorithm's diagram to a PNG or SVG file",
         arg("algorithm", metavar="ALGO", help="a library algorithm (see 'napkin algorithms')"),
         arg("-o", "--output", metavar="PATH", default=None,
             help="file to write, .png or .svg (default: ALGO.png)"),
         arg("--dtype", default="f32", metavar="DT",
             help="storage dtype of the inputs (default: f32)"),
         arg("--streamed", action="store_true",
             help="draw the best streamed program instead (groups and streams as frames, "
                  "arrays coloured by memory level)"),
         arg("--hardware", default="h100", metavar="NAME", help="for --streamed (default: h100)"))
def _draw(args) -> int:
    from napkin.core.arrays import canonical_dtype
    from napkin.views.drawing import draw
    algo = algorithm_named(args.algorithm)
    dtype = canonical_dtype(args.dtype)
    with Outputs() as out:
        target = out.file(args.output or f"{algo.name}{'_streamed' if args.streamed else ''}.png",
                          "-o/--output", suffixes=PICTURES)
        diagram = algo.diagram(dtype)
        if args.streamed:
            from napkin.views.drawing_streamed import draw_streamed
            from napkin.pipeline import optimize
            opt = optimize(diagram, args.hardware, dtype="bf16")
            path = out.write(target, lambda: draw_streamed(opt.program, target,
                                                           hardware=args.hardware,
                                                           tiles=opt.search.best.tile_values))
            print(path)
            return 0
        title = f"{algo.name}: {signature(diagram).replace(' -> ', ' → ')}"
        if dtype != "f32":
            title += f"  ({dtype})"
        path = out.write(target, lambda: draw(diagram, target, title=title))
    print(path)
    return 0


_DIGITS = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit accepts '²'


def parse_sizes(items: list[str], flag: str = "--size", what: str = "AXIS") -> dict[str, int]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        value = value.strip()
        if not sep or not name.isidentifier() or not _DIGITS.fullmatch(value) or int(value) <= 0:
            raise NapkinError(f"{flag} expects {what}=N with N a positive integer (decimal "
                              f"digits, below 10^18), got {item!r}")
        out[name] = int(value)
    return out


def load(spec: str | None, from_: str | None):
    """(name, diagram, certificate or None) for ALGO, a certificate path, or --from."""
    return load_with_source(spec, from_)[:3]


def load_with_source(spec: str | None, from_: str | None):
    """(name, diagram, certificate or None, napkin.certify.certificate.Source: the diagram's builder
    and, where the algorithm states one, its independent reference) for ALGO, a
    certificate path, or --from.

    A --from file, or the from-file of a certificate, is the user's own code:
    it runs in this process.  Whatever goes wrong reading either is a
    NapkinError naming the option or the file."""
    from napkin.certify.certificate import Certificate, CertificateError, load_algorithm
    if from_ and spec is not None:
        raise NapkinError(f"give one algorithm: {spec!r} and --from {from_} name two "
                          f"(drop the name to use the file's, or --from to use {spec!r})")
    if from_:
        if ":" not in from_:
            raise NapkinError(f"--from expects FILE.py:NAME (NAME a diagram, or a function "
                              f"dtype -> diagram, in FILE.py), got {from_!r}")
        try:
            src = load_algorithm({"from": from_}, Path.cwd())
            return from_, src.build("f32"), None, src
        except NapkinError as e:
            raise NapkinError(f"--from {from_}: {e}") from None
    if spec is None:
        raise NapkinError("give an algorithm name, a certificate file, or --from FILE:NAME")
    if spec.endswith(".json"):
        try:
            cert = Certificate.load(spec)
        except CertificateError as e:
            raise NapkinError(f"certificate {spec!r}: {e}") from None
        try:
            src = load_algorithm(cert.algorithm, cert.origin)
            return str(cert.algorithm), src.build(cert.dtype), cert, src
        except NapkinError as e:
            raise NapkinError(f"certificate {spec!r}: algorithm: {e}") from None
    src = load_algorithm(spec)
    return spec, src.build("f32"), None, src


def optimized(args, name, diagram, cert=None, sizes=None, wrt=None, **options):
    """napkin.optimize on a command's algorithm; its certificate names the algorithm as
    the command line did (a library name, --from FILE:NAME, or a certificate's own).
    ``wrt``: the backward pass for that input (or list of inputs) instead, from what the
    forward saves (napkin.grad with residuals; its certificate names ``{"grad": ...,
    "wrt": ..., "residuals": true}``), as ``Optimized.backward`` runs it."""
    from napkin.pipeline import optimize
    if cert is not None:
        source, base = cert.algorithm, cert.origin
    else:
        source, base = ({"from": args.from_} if args.from_ else name), Path.cwd()
    if wrt is not None:
        from napkin.frontend.grad import grad
        diagram = grad(diagram, wrt=wrt, residuals=True)
        source = {"grad": source, "wrt": wrt, "residuals": True}
    return optimize(diagram, args.hardware, sizes, args.dtype, source=source, base=base,
                    **options)


BACKWARD = (arg("--backward", action="store_true",
                help="the backward pass instead: for each group of floating inputs with the "
                     "same axes (or --wrt), the program of their cotangents (napkin.grad)"),
            arg("--wrt", metavar="INPUT", help="with --backward: this input's cotangent only"))


def _names(wrt) -> list:
    return [wrt] if isinstance(wrt, str) else list(wrt)


def backward_inputs(args, diagram) -> list:
    """[None] (the forward) without --backward; else the inputs whose cotangents it asks,
    one entry per program: a name, or a list of names with the same axes
    (napkin.pipeline.backward_groups)."""
    from napkin.core.primitives import FLOATING
    from napkin.pipeline import backward_groups
    if not getattr(args, "backward", False):
        if getattr(args, "wrt", None):
            raise NapkinError("--wrt names an input of the backward pass: give --backward too")
        return [None]
    names = [ob.name for ob in diagram.dom.inside if ob.type.dtype in FLOATING]
    if args.wrt is None:
        return [g[0] if len(g) == 1 else list(g) for g in backward_groups(diagram)]
    if args.wrt not in names:
        raise NapkinError(f"--wrt {args.wrt}: not a floating input of the algorithm (its "
                          f"floating inputs: {', '.join(names)})")
    return [args.wrt]


def replay(cert, path=None):
    """The certificate's final program, replayed as the checker does (premises and
    fingerprints; no numeric check): a tampered certificate is an error, not a
    different program costed or lowered as if it were the certified one."""
    from napkin.certify.checker import CheckFailure, replay as replay_steps
    try:
        original, programs = replay_steps(cert)
    except CheckFailure as e:
        raise NapkinError(f"certificate{' ' + str(path) if path else ''} does not replay: {e} "
                          f"(napkin check {path or 'CERTIFICATE'} tells more)") from None
    return programs[-1] if programs else original


# ----------------------------------------------------------------------------- rules
@command("cache", "list or clear the program cache (napkin.jit's searched programs; "
                  "NAPKIN_CACHE_DIR, default ~/.cache/napkin)",
         arg("action", choices=["ls", "clear"], help="ls: one line per entry; clear: remove all"))
def _cache(args) -> int:
    from napkin.certify import cache
    if args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.folder()}")
        return 0
    rows = []
    for e in cache.entries():
        if e.get("unreadable"):
            rows.append(("?", "", "", "", f"unreadable: {e['path'].name}"))
            continue
        sizes = " ".join(f"{k}={v}" for k, v in e["sizes"].items())
        rows.append((e["name"], e["dtype"], e["hardware"], f"{e['time_s']:.3g} s",
                     sizes + ("" if e["current"] else "  (older code: searched again when used)")))
    print(table(rows) if rows else f"no entries in {cache.folder()}")
    return 0


@command("rules", "list the rule library, one line each")
def _rules(args) -> int:
    from rewrites import RULES, STREAMABILITY
    rows = [(r.name, "rewrite", r.summary, r.proof) for r in RULES.values()]
    rows += [(r.name, "streamability", r.summary, r.proof) for r in STREAMABILITY]
    print(table(rows))
    return 0


# ----------------------------------------------------------------------------- check
def _seconds(text: str) -> float:
    import argparse
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expects a positive number of seconds, got {text!r}")
    return value


def certificate_files(paths) -> list[Path]:
    """Every certificate file under ``paths`` (files, or folders of ``*.json``), each read
    and parsed — nothing run — so that a path or file that is not a certificate stops the
    command before any check (a NapkinError naming it)."""
    from napkin.certify.certificate import Certificate, CertificateError
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(p for p in path.rglob("*.json") if p.is_file())
            if not found:
                raise NapkinError(f"{str(raw)!r}: no certificates (*.json) in this folder")
            files += found
        elif path.exists():
            files.append(path)
        else:
            raise NapkinError(f"{str(raw)!r}: no such file or directory (give certificate files, "
                              f"folders of them, or 'proofs')")
    for f in files:
        try:
            Certificate.load(f)
        except CertificateError as e:
            raise NapkinError(f"{str(f)!r} is not a certificate: {e}") from None
    return files


@command("check", "verify certificates (files or folders), or 'proofs': every rule's proof "
                  "and every stored certificate",
         arg("paths", nargs="+", metavar="PATH", help="certificate files/folders, or 'proofs'"),
         arg("--no-numeric", action="store_true", help="skip the numeric re-check"),
         arg("--timeout", type=_seconds, default=600.0, metavar="SECONDS",
             help="time limit for each certificate, checked in a process of its own "
                  "(default: 600)"))
def _check(args) -> int:
    from napkin.certify.isolate import check_paths, start_server
    start_server()
    paths, failures = list(args.paths), 0
    proofs = "proofs" in paths and not Path("proofs").is_dir() or paths == ["proofs"]
    if proofs:
        paths.remove("proofs")
    files = certificate_files(paths)  # before any work: a bad path is an error, not a FAIL

    def show(line):
        print(line, flush=True)
    if proofs:
        from napkin.certify.certificate import stored_certificates
        from proofs import prove_all, prove_derivatives, prove_wrong
        results = prove_all()
        for r in results:
            print(("proved   " if r.ok else "FAILED   ") + f"{r.rule}: " +
                  (f"{len(r.obligations)} obligations" if r.ok else r.detail))
        derivatives = prove_derivatives()
        bad = [r for r in derivatives if not r.ok]
        for r in bad:
            print(f"FAILED   {r.rule}: {r.detail}")
        print(f"proved   {len(derivatives) - len(bad)} of {len(derivatives)} primitive "
              f"derivatives (vjp)")
        failures += len(bad)
        wrong = prove_wrong()
        for r in wrong:
            print(("refuted  " if not r.ok else "ACCEPTED ") + f"wrong variant {r.rule}")
        failures += sum(not r.ok for r in results) + sum(r.ok for r in wrong)
        n_ok, n_fail, _ = check_paths([Path(str(stored_certificates()))],
                                      numeric=not args.no_numeric, timeout=args.timeout,
                                      progress=show)
        failures += n_fail
        print(f"{sum(r.ok for r in results)} rules proved, {n_ok} certificates verified"
              + (f", {failures} failure(s)" if failures else ""))
    if files:
        n_ok, n_fail, _ = check_paths(files, numeric=not args.no_numeric, timeout=args.timeout,
                                      progress=show)
        print(f"{n_ok} certificates verified" + (f", {n_fail} failed" if n_fail else ""))
        failures += n_fail
    return 1 if failures else 0


# ----------------------------------------------------------------------------- cost
@command("cost", "transfers, memory, FLOPs and time per memory level of a streamed program",
         arg("algorithm", metavar="ALGO|CERTIFICATE", nargs="?"), FROM, SIZE, HARDWARE, DTYPE,
         JSON, arg("--plot", metavar="PATH",
                   help="draw transfers vs memory and tile size (PNG or SVG by suffix)"),
         *DEVICES)
def _cost(args) -> int:
    with Outputs() as out:
        return _cost_to(args, out.file(args.plot, "--plot", suffixes=PICTURES), out)


def _cost_to(args, plot, out) -> int:
    from napkin.cost import cost, cost_json, plot_cost
    from napkin.hardware import get_hardware
    name, diagram, cert = load(args.algorithm, args.from_)
    sizes = sizes_for(diagram, parse_sizes(args.size), "--size")
    if cert is not None:
        hw = get_hardware(args.hardware).two_level()
        program, chain = replay(cert, args.algorithm), [s.rule for s in cert.steps]
        c = cost(program, hw, args.dtype)
    else:
        opt = optimized(args, name, diagram, sizes=sizes)
        hw, program, chain, c = opt.hardware, opt.program, [m.rule for m in opt.chain], opt.cost
    data = cost_json(c, sizes)
    data.update({"algorithm": name, "hardware": hw.name, "chain": chain})
    if plot:
        out.write(plot, lambda: plot_cost(program, hw, sizes, plot, args.dtype))
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
        cells = (tr.get("values"), tr.get("bytes"), mem.get("bytes"), mem.get("capacity_bytes"),
                 data["time_s"].get(lv))
        rows.append((lv, *map(_table_cell, cells), tr.get("expr", "-")))
    print(table(rows))
    print(f"flops {data['flops']['total']:.4g} ({data['flops']['expr']}); compute "
          f"{data['time_s']['compute']:.4g} s; total {data['time_s']['total']:.4g} s, bound by "
          f"{data['time_s']['bound_by']}")
    ratio = data.get("lower_bound_ratio")
    # no ratio where the lower bound is 0 (the whole problem fits on chip at these sizes)
    print(f"canonical form H*(M) = {data.get('canonical_expr')}; transfers / lower bound = "
          + (f"{ratio:.3g}" if ratio is not None else "- (no lower bound at these sizes)"))
    if args.plot:
        print(f"plot: {args.plot}")
    if args.devices is not None:
        if cert is not None:
            raise NapkinError("--devices prices an algorithm's strategies, not a certificate's "
                              "program: give the algorithm")
        device_plan(args, name, diagram, sizes)
    return 0


def _table_cell(v) -> str:
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
LIMITS = (arg("--max-states", type=int, default=2000,
              help="stop the search after this many programs (default: 2000)"),
          arg("--max-seconds", type=float, default=60.0,
              help="stop the search after this long, in seconds (default: 60)"))


@command("optimize", "search the rewrite chain and tiles that minimise modelled time",
         arg("algorithm", metavar="ALGO", nargs="?"), FROM, SIZE, HARDWARE, DTYPE, JSON,
         arg("--certificate", metavar="PATH", help="write the chain as a certificate"),
         arg("--draw", metavar="PATH", help="draw the algorithm and its streamed program"),
         arg("--levels", choices=("two", "all"), default="two",
             help="GMEM+SMEM (the paper's setting) or the profile's whole hierarchy"),
         *LIMITS, *BACKWARD, *DEVICES)
def _optimize(args) -> int:
    with Outputs() as out:
        cert = out.file(args.certificate, "--certificate")
        drawing = out.file(args.draw, "--draw", suffixes=PICTURES)
        # with --devices, the plan's two beside it: PATH's stem + .decomposition / .device
        beside = [] if cert is None or args.devices is None else [
            out.file(cert.with_name(f"{cert.stem}.{part}{cert.suffix or '.json'}"),
                     "--certificate with --devices") for part in ("decomposition", "device")]
        return _optimize_to(args, cert, drawing, out, beside)


def _optimize_to(args, cert, drawing, out, beside=()) -> int:
    name, diagram, loaded = load(args.algorithm, args.from_)
    sizes = sizes_for(diagram, parse_sizes(args.size), "--size")
    targets = backward_inputs(args, diagram)
    if len(targets) > 1 and (cert or drawing or args.json):
        raise NapkinError("--backward has one program per input: give --wrt INPUT with "
                          "--certificate, --draw or --json")
    total = 0.0
    for wrt in targets:
        opt = optimized(args, name, diagram, loaded, sizes, wrt=wrt, max_states=args.max_states,
                        max_seconds=args.max_seconds, levels=args.levels)
        label = name if wrt is None else \
            f"the backward of {name} with respect to {', '.join(_names(wrt))}"
        _report_optimized(args, label, opt, sizes, cert, drawing, out)
        total += opt.search.best.time_s
    if len(targets) > 1:
        print(f"backward: {len(targets)} programs, {total:.4g} s modelled in all")
    if args.devices is not None and not args.json:
        if targets != [None]:
            raise NapkinError("--devices prices the forward: leave out --backward")
        plan = device_plan(args, name, diagram, sizes)
        for path, (what, c) in zip(beside, plan.certificates() if beside else ()):
            out.write(path, lambda c=c, path=path: c.save(path))
            print(f"certificate of {what} ({plan.strategy}): {path}")
    return 0


def _report_optimized(args, name, opt, sizes, cert, drawing, out) -> None:
    diagram, r = opt.algorithm, opt.search
    cert_path = None
    if cert:
        cert_path = out.write(cert, lambda: write_certificate(opt, args.certificate))
    if drawing:
        from napkin.views.drawing_streamed import draw_before_after
        out.write(drawing, lambda: draw_before_after(diagram, opt.program, drawing,
                                                     hardware=args.hardware,
                                                     tiles=r.best.tile_values))
    if args.json:
        data = {**result_json(r, sizes, cert_path), "launch": opt.launch}
        print(json.dumps(_jsonable(data), indent=2, sort_keys=True))
        return
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
    if r.note:
        print(f"slow: {r.note}")
    print(f"search: {r.states} states ({r.pruned} not costed), {r.expanded} expanded, "
          f"{r.seconds:.2f} s "
          f"(best reached at {r.best.found_s:.2f} s)"
          + (f"; {r.limit_hit}" if r.limit_hit else ""))
    if cert_path:
        print(f"certificate: {cert_path}")
    if args.draw:
        print(f"drawing: {args.draw}")


def write_certificate(opt, path) -> str:
    """Save the result's certificate (derived now) at ``path``; returns the path."""
    opt.certificate.save(path)
    return path


def result_json(r, sizes, cert_path) -> dict:
    t = r.best.tiles
    return {
        "chain": [m.to_json() for m in r.best.chain],
        "tiles": t.values,
        "kernels": t.launch,  # each kernel's launch: warps, stages, smem, registers, waves
        "cost": {"time_s": t.time_s, "bound_by": t.bound_by, "transfers": t.transfers,
                 "transfers_bytes": t.transfers_bytes, "memory_bytes": t.memory_bytes,
                 "lower_bound_ratio": t.lower_bound_ratio,
                 "transfers_expr": {lv: str(e) for lv, e in r.best.cost.transfers.items()}},
        "alternatives": [{"chain": [m.to_json() for m in a.chain], "time_s": a.time_s,
                          "feasible": a.feasible, "why_worse": r.reason_loses(a)}
                         for a in r.alternatives],
        "refused": [{"rule": k[0], "axis": k[1], "why": v} for k, v in r.refused.items()],
        "search": {"states": r.states, "not_costed": r.pruned, "expanded": r.expanded,
                   "seconds": r.seconds,
                   "best_found_s": r.best.found_s, "first_fit_s": r.first_fit_s,
                   "limit_hit": r.limit_hit, "lower_bound_s": r.lower_bound_s,
                   "note": r.note},
        "sizes": sizes, "certificate": cert_path,
    }


# ----------------------------------------------------------------------------- lower / run / demo
RUN_SIZES = {"q": 256, "x": 256, "d": 64, "a": 256, "b": 256, "c": 256, "h": 2, "k": 2, "r": 2,
             "n": 128, "v": 1024, "e": 128, "batch": 2}
BACKEND = arg("--backend", choices=tuple(BACKENDS), default=DEFAULT_BACKEND,
              help=f"the kernel backend (default: {DEFAULT_BACKEND})")
INTERPRET = arg("--interpret", choices=("auto", "on", "off"), default="auto",
                help="Pallas interpret mode: auto = when no GPU is present")


def _interpret(mode: str):
    return {"auto": "auto", "on": True, "off": False}[mode]


def _on_gpu() -> bool:
    import jax
    return jax.devices()[0].platform == "gpu"


def written_by(kernel, shapes) -> str:
    """Which backend wrote each of the kernel's launches, and why not Mosaic where the
    default chose Triton."""
    names = {"triton": "Triton", "mosaic": "Mosaic GPU"}
    out = []
    for part, part_shapes in kernel.parts(shapes):
        spec = part.plan(*part_shapes)
        why = next((n.split(": ", 1)[1] for n in spec.written.notes if n.startswith("backend: ")),
                   None)
        out.append((why or f"{names.get(spec.written.backend, spec.written.backend)}")
                   + (", consumers taking turns" if spec.written.turns else "")
                   + (", a product a step late" if spec.written.deferred else ""))
    return "; ".join(dict.fromkeys(out))


def run_and_compare(kernel, alg, diagram, sizes, dtype, interpret):
    """Random inputs → kernel and reference; returns (max relative error, seconds).
    The reference runs in float64 inside ``jax.enable_x64``: JAX's global mode is left
    as it was."""
    import time
    import jax
    import jax.numpy as jnp
    import numpy as np
    from napkin.core.primitives import FLOATING, JNP_DTYPES
    from napkin.frontend.sampling import sample
    from napkin.core.semantics import evaluate
    rng = np.random.default_rng(0)
    # the algorithm's own sampler and independent reference where it states them (a library
    # algorithm, an Algorithm in a --from file); else random normals and the diagram's meaning
    sampler = getattr(alg, "sample", None)
    xs64 = sampler(rng, sizes) if sampler is not None else sample(diagram, sizes, rng)
    # floating inputs at the run's dtype; integer ones (labels, indices) keep their own
    own = [ob.type.dtype for ob in diagram.dom.inside]
    xs = [jnp.asarray(x, JNP_DTYPES[dtype if d in FLOATING else d]) for x, d in zip(xs64, own)]
    kernel(*xs, interpret=interpret)  # compile
    t0 = time.perf_counter()
    y = jax.block_until_ready(kernel(*xs, interpret=interpret))
    wall = time.perf_counter() - t0
    reference = getattr(alg, "reference", None) or evaluate(diagram)
    with jax.enable_x64(True):
        ref = np.asarray(reference(*[jnp.asarray(x, jnp.float64) if d in FLOATING else x
                                     for x, d in zip(xs, own)]), np.float64)
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    err = float(np.max(np.abs(y - ref)) / max(float(np.max(np.abs(ref))), 1e-300))
    return err, wall


def grad_and_compare(kernel, alg, diagram, sizes, dtype) -> float:
    """jax.grad of Σ out·c (c random) through ``kernel`` (a differentiable one, its
    backward napkin's kernels) against jax.vjp of the reference in float64; the largest
    relative error over the floating inputs' cotangents."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from napkin.core.primitives import FLOATING, JNP_DTYPES
    from napkin.frontend.sampling import sample
    from napkin.core.semantics import evaluate
    rng = np.random.default_rng(1)
    sampler = getattr(alg, "sample", None)
    xs64 = sampler(rng, sizes) if sampler is not None else sample(diagram, sizes, rng)
    own = [ob.type.dtype for ob in diagram.dom.inside]
    xs = [jnp.asarray(x, JNP_DTYPES[dtype if d in FLOATING else d]) for x, d in zip(xs64, own)]
    fl = [i for i, d in enumerate(own) if d in FLOATING]
    out_shape = jax.eval_shape(kernel, *xs).shape
    c = rng.standard_normal(out_shape)

    def of_floats(fn, base):
        def f(*fx):
            a = list(base)
            for i, v in zip(fl, fx):
                a[i] = v
            return fn(*a)
        return f
    got = jax.grad(lambda *fx: jnp.sum(of_floats(kernel, xs)(*fx).astype(jnp.float32)
                                       * jnp.asarray(c, jnp.float32)),
                   argnums=tuple(range(len(fl))))(*[xs[i] for i in fl])
    reference = getattr(alg, "reference", None) or evaluate(diagram)
    with jax.enable_x64(True):
        base = [jnp.asarray(x, jnp.float64) if d in FLOATING else x for x, d in zip(xs, own)]
        _, back = jax.vjp(of_floats(reference, base), *[base[i] for i in fl])
        want = back(jnp.asarray(c, jnp.float64))
    err = 0.0
    for g, w in zip(got, want):
        g, w = np.asarray(jnp.asarray(g, jnp.float32), np.float64), np.asarray(w, np.float64)
        err = max(err, float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-300)))
    return err


def _shapes(diagram, sizes: dict) -> list[tuple]:
    return [tuple(sizes[str(a.size)] if not isinstance(a.size, int) else a.size
                  for a in ob.type.axes) for ob in diagram.dom.inside]


TOL = {"f32": 1e-5, "bf16": 2e-2, "f16": 1e-2}
KERNEL_DTYPES = tuple(TOL)  # what the generated kernels take as inputs


def kernel_dtype(dtype: str) -> str:
    """``dtype`` canonicalised, if the kernels take it (f32, bf16, f16); else a NapkinError."""
    from napkin.core.arrays import canonical_dtype
    try:
        name = canonical_dtype(dtype)
    except NapkinError:
        name = None
    if name not in KERNEL_DTYPES:
        raise NapkinError(f"--dtype {dtype!r}: the kernels take {', '.join(KERNEL_DTYPES[:-1])} "
                          f"or {KERNEL_DTYPES[-1]} inputs")
    return name


@command("lower", "write the Pallas kernel of an algorithm's best program (or a certificate's)",
         arg("algorithm", metavar="ALGO|CERTIFICATE", nargs="?"), FROM, SIZE, HARDWARE, DTYPE,
         BACKEND, TILE, arg("--emit", metavar="PATH", help="write the kernel's Python source here"),
         arg("--force", action="store_true", help="let --emit overwrite an existing file"),
         arg("--report", action="store_true",
             help="instead of the source: the schedule's buffers per level beside what Triton "
                  "allocates (compiled for sm_90 with the dev extra's triton)"))
def _lower(args) -> int:
    with Outputs() as out:
        emit = out.file(args.emit, "--emit", overwrite=args.force,
                        hint="add --force to overwrite it")
        return _lower_to(args, emit, out)


def _lower_to(args, emit, out) -> int:
    from napkin.lower import lower
    name, diagram, cert = load(args.algorithm, args.from_)
    if cert is not None and args.tile:
        raise NapkinError("--tile: a certificate's kernel is lowered with the certificate's "
                          "own tiles")
    if cert is not None:
        from napkin.hardware import get_hardware
        program, sizes = replay(cert, args.algorithm), dict(cert.sizes)
        from napkin.lower.backends import get_backend
        launch = {k: v for k, v in cert.launch.items() if k in get_backend(args.backend).launch}
        k = lower(program, dict(cert.tiles), backend=args.backend, dtype=args.dtype,
                  name=str(name), **launch)  # as the certificate's kernel was launched
        hardware = get_hardware(args.hardware).two_level()  # as `cost` models a certificate
    else:
        sizes = sizes_for(diagram, parse_sizes(args.size), "--size")
        opt = optimized(args, name, diagram, sizes=sizes)
        opt = opt.with_tiles(parse_sizes(args.tile, "--tile", "TILE"))
        k, program, hardware = opt.kernel(args.backend), opt.program, opt.hardware
    shapes = _shapes(diagram, sizes)
    src = k.source(*shapes)
    if emit:
        out.write(emit, lambda: emit.write_text(src, encoding="utf-8"))
        print(f"kernel source ({len(src.splitlines())} lines): {args.emit}")
    elif not args.report:
        print(src)
    if args.report:
        from napkin.lower.report import report
        from napkin.schedule import build
        stages = k.launch.get("num_stages", 1)  # the backend's software pipelining
        print(report(k, build(program, hardware, args.dtype, stages=stages), sizes, shapes))
    return 0


@command("run", "optimise → check the certificate → lower → run on random inputs → compare",
         arg("algorithm", metavar="ALGO", nargs="?"), FROM, SIZE, HARDWARE,
         arg("--dtype", default="f32", metavar="DT", help="input dtype (default: f32)"), BACKEND,
         TILE, INTERPRET, *LIMITS,
         arg("--backward", action="store_true",
             help="also jax.grad through the kernel (its backward napkin's programs) against "
                  "jax.grad of the reference"), *DEVICES)
def _run(args) -> int:
    import os
    import sys
    if args.devices is not None and args.devices > 1 and "jax" not in sys.modules:
        # a CPU run of a plan for several devices: as many host devices (a GPU ignores it)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={args.devices}")
    from napkin.frontend.library import DEFAULT_SIZES
    from napkin.lower import hbm_bytes
    args.dtype = kernel_dtype(args.dtype)  # before any search
    name, diagram, _, source = load_with_source(args.algorithm, args.from_)
    given = parse_sizes(args.size)
    interpret = _interpret(args.interpret)
    small = interpret is True or (interpret == "auto" and not _on_gpu())
    # the small run's defaults for the axes this algorithm has; every axis the user gives is
    # checked (an axis it lacks is one line, as in optimize)
    axes = _axes(diagram)
    base = {**{k: v for k, v in RUN_SIZES.items() if k in axes}, **given} if small else given
    sizes = sizes_for(diagram, base, "--size")
    _runnable(args, diagram, sizes, interpret)  # before the search: what would fail after it
    print(f"{name}: sizes " + ", ".join(f"{k}={v}" for k, v in sizes.items())
          + (" (interpret mode: small default sizes)" if small and not given else ""))
    # a small run keeps the program found at full scale, its tiles shrunk to the run; an
    # axis the user sized is searched at that size
    full = {a: n if a in given else DEFAULT_SIZES.get(a, n) for a, n in sizes.items()} \
        if small else sizes
    if args.devices is not None:
        return _run_devices(args, name, diagram, source, full, sizes, interpret, small)
    opt = optimized(args, name, diagram, sizes=full, max_states=args.max_states,
                    max_seconds=args.max_seconds)
    if args.backward:
        opt.backward  # searched at full scale too, then fitted with the forward  # noqa: B018
    opt = opt.fit(sizes) if small and full != sizes else opt  # (searched at these: as found)
    chosen = parse_sizes(args.tile, "--tile", "TILE")
    if args.backend == "mosaic" and opt.sequential is not None:
        print("split-K: the Mosaic GPU backend writes no split stream; running the program "
              "before the split")
        opt = opt.sequential
    opt = opt.with_tiles(chosen)
    print("chain: " + " → ".join(str(m) for m in opt.chain))
    if opt.search.note:
        print(f"slow: {opt.search.note}")
    _, tiles, _ = opt.written_at(args.backend)  # Mosaic GPU's launch model chooses its own
    own = "" if tiles == opt.tiles else \
        f"; Mosaic GPU's own tiles ({opt.backend_tiles('mosaic').time_s:.3g} s on its launch model)"
    print("tiles: " + ", ".join(f"{k}={v}" + (" (--tile)" if k in chosen else "")
                                for k, v in tiles.items())
          + f"; modelled time {opt.search.best.time_s:.3g} s ({opt.search.best.bound_by}-bound"
          + (", at the optimiser's tiles)" if chosen else ")") + own)
    report = opt.check()
    print(f"certificate: {report}")
    if not report.ok:
        raise NapkinError(f"the derived certificate does not check: {report}")
    k = opt.kernel(args.backend)
    err, wall = run_and_compare(k, source, diagram, sizes, args.dtype, interpret)
    print(f"kernel: {written_by(k, _shapes(diagram, sizes))}")
    tol = TOL.get(args.dtype, 2e-2)
    model = opt.cost.evaluate({**sizes, **{str(t): v for t, v in k.tiles.items()}})
    level = list(model["transfers_bytes"])[-1]
    print(f"max relative error vs reference {err:.2e} (tolerance {tol:g}); wall {wall * 1e3:.1f} ms"
          f" ({'interpret' if small else 'GPU'}); modelled {model['time_s']['total'] * 1e3:.4g} ms"
          f" on {args.hardware}; HBM bytes {hbm_bytes(k, _shapes(diagram, sizes)):.4g} "
          f"(model {model['transfers_bytes'][level]:.4g}; tiles "
          + ", ".join(f"{t}={v}" for t, v in k.tiles.items()) + ")")
    if err > tol:
        raise NapkinError(f"kernel differs from the reference: relative error {err:.2e} > {tol:g}")
    if args.backward:
        g_err = grad_and_compare(opt.kernel(args.backend, interpret=interpret), source, diagram,
                                 sizes, args.dtype)
        pieces = opt.backward.pieces
        print(f"backward: {len(pieces)} programs (" + "; ".join(
            f"{', '.join('d' + w for w in n)}: {len(o.search.best.tiles.launch)} kernel(s), "
            + " → ".join(m.rule + (f"({dict(m.params)['axis']})" if "axis" in dict(m.params)
                                   else "") for m in o.chain)
            for n, o in pieces) + f"); jax.grad max relative error vs the reference's "
            f"{g_err:.2e} (tolerance {tol:g})")
        if g_err > tol:
            raise NapkinError(f"the gradient differs from the reference's: relative error "
                              f"{g_err:.2e} > {tol:g}")
    return 0


def _run_devices(args, name, diagram, source, full, sizes, interpret, small) -> int:
    """``napkin run --devices N``: the plan priced at full scale, run at ``sizes`` on JAX's
    SPMD engine, compared with the reference, and its communication counted from the
    program against the model's."""
    import numpy as np
    from napkin.devices.spmd import communication
    if args.backward or args.tile:
        raise NapkinError("--devices runs the forward at the optimiser's tiles: leave out "
                          "--backward and --tile")
    d = device_plan(args, name, diagram, full)
    if small:  # a small run's default sizes cut into equal shares (a size you gave is kept)
        given = parse_sizes(args.size)
        for a in (d.strategy.shard, d.strategy.stream):
            n = d.strategy.devices
            if a is not None and a not in given and sizes[a] % n:
                sizes = {**sizes, a: -(-sizes[a] // n) * n}
    run = d.fit(sizes) if small and full != sizes else d
    k = run.kernel(args.backend, interpret=interpret)
    err, wall = run_and_compare(k, source, diagram, sizes, args.dtype, interpret)
    tol = TOL.get(args.dtype, 2e-2)
    xs = [np.zeros(s, np.float32) for s in _shapes(diagram, sizes)]
    counted = sum(communication(k, *xs).values()) if run.strategy.devices > 1 else 0
    print(f"{run.strategy} at " + ", ".join(f"{a}={v}" for a, v in sizes.items())
          + f": max relative error vs reference {err:.2e} (tolerance {tol:g}); wall "
          f"{wall * 1e3:.1f} ms; sent per device {counted:.4g} bytes counted from the program, "
          f"{run.best.link_bytes:.4g} modelled" + (
              f" (and {run.best.arrival_bytes:.4g} to gather inputs that arrive cut otherwise, "
              f"which XLA moves before the program)" if run.best.arrival_bytes else ""))
    if err > tol:
        raise NapkinError(f"the distributed kernel differs from the reference: relative error "
                          f"{err:.2e} > {tol:g}")
    return 0


def _runnable(args, diagram, sizes, interpret) -> None:
    """One line, before any search, for a run that could only fail after it: compiled mode
    without a GPU, a --tile value no block of the backend takes, inputs larger than memory."""
    import math
    import os
    from napkin.core.arrays import array_types
    from napkin.lower.backends import get_backend
    from napkin.schedule.build import bytes_per_value
    if interpret is False and not _on_gpu():
        raise NapkinError("--interpret off: a compiled kernel runs on a GPU and this machine's "
                          "device is cpu (--interpret on or auto)")
    rules = get_backend("triton" if args.backend == "auto" else args.backend).rules
    for tile, v in parse_sizes(args.tile, "--tile", "TILE").items():
        axis = tile.partition("_")[2]
        if axis not in sizes:  # not a tile of this algorithm's axes: named after the search
            continue
        if not (rules.size_ok(v) or v >= sizes[axis]):  # the lowering's own test
            raise NapkinError(f"--tile {tile}={v}: the {rules.name} backend takes "
                              f"power-of-two tiles (or one covering the whole axis, "
                              f"{sizes[axis]})")
    need = sum(math.prod(int(sizes.get(a.name, 1)) for a in t.axes) *
               bytes_per_value(t.dtype if t.dtype not in ("f32", "f64") else args.dtype)
               for t in array_types(diagram.dom) + array_types(diagram.cod))
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have // 2:
        raise NapkinError(f"--size: the run's inputs and outputs take {need / 2**30:,.1f} GiB, "
                          f"more than half this machine's {have / 2**30:,.1f} GiB of memory "
                          f"(napkin cost and optimize take any size)")


def _axes(diagram):
    from napkin.certify.certificate import size_symbols
    return size_symbols(diagram)


DEMO_ALGORITHM = '''"""Attention, as `napkin demo` states it.

Its certificate names it {"from": "attention.py:attention"};
`napkin optimize --from attention.py:attention` searches it again."""
import napkin as nk
from napkin.frontend import ops

q, x, d = nk.axes("q x d")


@nk.algorithm(Q=(q, d), K=(x, d), V=(x, d))
def attention(Q, K, V):
    S = ops.scale(ops.contract(Q, K, out=(q, x), name="QK^T"), 1 / d.size ** 0.5)
    return ops.contract(ops.softmax(S, x), V, out=(q, d), name="PV")
'''
DEMO_SIZES = {"q": 4096, "x": 4096, "d": 128}   # searched at
DEMO_RUN_SIZES = {"q": 256, "x": 256, "d": 64}  # run at (a CPU-sized run)


@command("demo", "the main job on attention: state, search, prove, draw, lower, run, verify",
         arg("--out", default="napkin-demo", metavar="DIR", help="where pictures and files go"),
         HARDWARE, INTERPRET)
def _demo(args) -> int:
    from napkin.hardware import get_hardware
    hardware = get_hardware(args.hardware)  # before any work
    with Outputs() as files:
        out = files.directory(args.out, "--out")
        return _demo_in(args, hardware, files, out)


def _demo_sizes(sizes: dict) -> str:
    return f"q = x = {sizes['q']}, d = {sizes['d']}"


def state_demo_algorithm(files, out: Path) -> tuple[dict, object]:
    """Write the demo's attention to ``out/attention.py`` and load it from there, so that
    the diagram searched is the one its certificate names: (source, diagram)."""
    from napkin.certify.certificate import load_algorithm
    path = out / "attention.py"
    files.write(path, lambda: path.write_text(DEMO_ALGORITHM, encoding="utf-8"))
    source = {"from": "attention.py:attention"}
    return source, load_algorithm(source, out).build("f32")


def _demo_in(args, hardware, files, out) -> int:
    import time
    from napkin.views.drawing import draw
    from napkin.views.drawing_streamed import draw_before_after
    from napkin.frontend.library import get
    from napkin.pipeline import optimize
    t0 = time.perf_counter()
    files.make_directory(out)
    source, diagram = state_demo_algorithm(files, out)
    boxes = len([b for b in diagram.boxes if getattr(b, "spec", None)])
    print(f"1. stated: {signature(diagram)} ({boxes} boxes) in {out / 'attention.py'}")
    files.write(out / "attention.png",
                lambda: draw(diagram, out / "attention.png", title="attention"))
    print(f"2. searched ({hardware.name}, {_demo_sizes(DEMO_SIZES)}):")
    opt = optimize(diagram, hardware, DEMO_SIZES, "bf16", source=source, base=out)
    r = opt.search
    for i, m in enumerate(opt.chain, 1):
        print(f"   {i}. {m}")
    print(f"   tiles {opt.tiles}; modelled {r.best.time_s * 1e6:.2f} µs, "
          f"{r.states} states in {r.seconds:.1f} s")
    from proofs import prove_rule
    from rewrites import RULES, STREAMABILITY
    used = {m.rule for m in opt.chain} | {"softmax_contraction"}
    rules = [x for x in [*RULES.values(), *STREAMABILITY] if x.name in used]
    proved = [prove_rule(x) for x in rules]
    print("3. proved: " + ", ".join(f"{p.rule} ({'ok' if p.ok else 'FAILED'})" for p in proved))
    cert_path = out / "attention.cert.json"
    files.write(cert_path, lambda: opt.certificate.save(cert_path))
    rep = opt.check()
    print(f"   certificate {cert_path}: {rep}")
    # the streamed side opened up: the group's frame, the stream's init / update / finalize
    # with its state wires, each wire coloured by the memory level its array lives in
    files.write(out / "before_after.png",
                lambda: draw_before_after(diagram, opt.program, out / "before_after.png",
                                          hardware=hardware, tiles=opt.tiles,
                                          titles=("attention", "streamed program")))
    print(f"4. drawn: {out / 'attention.png'}, {out / 'before_after.png'}")
    run = opt.fit(DEMO_RUN_SIZES)
    k = run.kernel(dtype="f32")
    shapes = _shapes(diagram, run.sizes)
    kernel_source = k.source(*shapes)
    files.write(out / "attention_kernel.py",
                lambda: (out / "attention_kernel.py").write_text(kernel_source, encoding="utf-8"))
    print(f"5. lowered: grid {k.plan(*shapes).grid}, tiles {run.tiles} (the {hardware.name} "
          f"tiles, shrunk for a CPU-sized run); source {out / 'attention_kernel.py'}")
    err, wall = run_and_compare(k, get("attention"), diagram, run.sizes, "f32",
                                _interpret(args.interpret))
    ok = err <= TOL["f32"] and rep.ok and all(p.ok for p in proved)
    print(f"6. ran at {_demo_sizes(run.sizes)}: max relative error {err:.2e} vs plain jnp "
          f"({'interpret mode' if not _on_gpu() else 'GPU'}, {wall * 1e3:.0f} ms)")
    print(f"{'verified' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


# ----------------------------------------------------------------------------- pseudocode / hopper
@command("pseudocode", "looped pseudocode of the best program (or a certificate's), with "
                       "per-loop memory and transfers that match the cost model",
         arg("algorithm", metavar="ALGO|CERTIFICATE", nargs="?"), FROM, SIZE, HARDWARE, DTYPE,
         arg("--markdown", action="store_true", help="Markdown instead of plain text"),
         arg("--levels", choices=("two", "all"), default="two"),
         arg("--hopper", action="store_true",
             help="also the paper's Hopper warpgroup derivation (occupancy, bound unit, TFLOP/s)"),
         *BACKWARD)
def _pseudocode(args) -> int:
    from napkin.hardware import get_hardware
    from napkin.views.pseudocode import pseudocode
    name, diagram, cert = load(args.algorithm, args.from_)
    hw = get_hardware(args.hardware)
    hw2 = hw.two_level() if args.levels == "two" else hw
    targets = backward_inputs(args, diagram)
    if cert is not None and targets != [None]:
        raise NapkinError("a certificate is one program: --backward takes an algorithm")
    for wrt in targets:
        if cert is not None:
            program, tiles = replay(cert, args.algorithm), dict(cert.tiles)
            sizes = dict(cert.sizes)
        else:
            sizes = sizes_for(diagram, parse_sizes(args.size), "--size")
            opt = optimized(args, name, diagram, sizes=sizes, wrt=wrt, levels=args.levels)
            program, tiles = opt.program, opt.search.best.tiles
        title = str(name) if wrt is None else \
            f"{', '.join('d' + w for w in _names(wrt))}: the backward of {name}"
        print(pseudocode(program, hw2, sizes, tiles, args.dtype,
                         fmt="markdown" if args.markdown else "text", title=title))
    if args.hopper and targets == [None]:
        from napkin.views.hopper import derive_config, hopper_attention_config
        values = tiles if isinstance(tiles, dict) else dict(tiles.values)
        print()
        print(derive_config(program, hw2, {**sizes, **values}, args.dtype).describe())
        if "softmax_contraction" in _stream_rules(program):
            print()
            print(hopper_attention_config(hw).describe())
    return 0


def _stream_rules(program) -> set[str]:
    out = set()
    for b in program.boxes:
        spec = getattr(b, "spec", None)
        if spec is not None and spec.kind == "stream":
            out.update(spec.rule.split("+"))
        if spec is not None and spec.kind == "group":
            out |= _stream_rules(spec.body)
    return out

