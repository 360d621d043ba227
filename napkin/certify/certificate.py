"""Derivation certificates: a replayable proof that a streamed program computes
its algorithm.

A certificate is the path a search (or a person) took: the algorithm it starts
from, then one entry per rewrite — rule, site, parameters — each with the
*fingerprint* of the program after that step.  The checker
(:mod:`napkin.certify.checker`) trusts none of it: it rebuilds the algorithm, re-checks
every premise, re-applies every rule, recomputes every fingerprint and compares,
then evaluates the final program against the algorithm and its reference.

JSON format (``napkin-certificate/1``; keys sorted, 2-space indent)::

    {
      "format": "napkin-certificate/1",
      "algorithm": "attention",            # a library name, or {"from": "FILE:NAME"}
      "dtype": "f32",
      "source": "<sha256>",                # fingerprint of the algorithm's diagram
      "sizes": {"d": 64, "q": 192, "x": 256},   # numeric instance for the check
      "tiles": {"g_q": 64, "s_x": 128},         # values of the tile symbols
      "symbolic": ["d", "g_q", "q", "s_x", "x"],  # size symbols of the final program
      "steps": [
        {"rule": "group_partition", "site": {"path": [], "ops": [0, 1, 2, 3]},
         "params": {"axis": "q", "size": "g_q"}, "result": "<sha256>"},
        {"rule": "stream_partition", "site": {"path": [0], "ops": [0, 1, 2, 3]},
         "params": {"axis": "x", "chunk": "s_x"}, "result": "<sha256>"}
      ],
      "result": "<sha256>",                # fingerprint of the final program
      "launch": {"num_warps": 8, "num_stages": 2}  # optional: the kernel's launch
    }

The derivation is symbolic: programs (and so fingerprints) carry symbolic axis
and tile sizes, so one certificate covers every size; ``sizes`` and ``tiles``
only instantiate the numeric cross-check.  ``launch`` (optional) records the launch
parameters the cost model chose with the full-size tiles (warps, pipeline stages), so
the kernel can be rebuilt as it was measured; they change how a kernel runs, not what it
computes, so the checker only checks their form (positive integers, powers of two for
warps).

A *fingerprint* is the sha256 of a canonical text rendering of a program:
input wire types, then boxes in the deterministic topological order of
:func:`napkin.core.ir.ops` (spec kind and fields, argument wires, output wire
types), recursing into group bodies and stream init/update/finalize, then the
outputs.  Names of boxes and wires are labels and are left out.  Nothing in it
depends on object ids, dict order or hash seeds.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import sympy

from napkin.core.arrays import ArrayType, canonical_dtype
from napkin.core.diagram import is_diagram
from napkin.core.errors import NapkinError
from napkin.core.ir import ops as op_order, to_graph, view
from napkin.core.memo import IdentityMemo
from napkin.core.region import Site

FORMAT = "napkin-certificate/1"


class CertificateError(NapkinError):
    """A certificate is malformed (not: wrong — that is the checker's report).
    ``step``: the 1-based step whose entry is malformed, if one is."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------- fingerprints
def _size(value) -> str:
    if isinstance(value, bool):
        raise TypeError(f"a size cannot be a bool: {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, sympy.Basic):
        return _srepr(value)
    raise TypeError(f"cannot fingerprint a size {value!r} ({type(value).__name__})")


@functools.lru_cache(maxsize=16384)
def _type(t: ArrayType) -> str:
    return "[" + ",".join(f"{a.name}:{_size(a.size)}" for a in t.axes) + "]" + t.dtype


def _wire(ob, labels: bool) -> str:
    return f"{json.dumps(ob.name)}{_type(ob.type)}" if labels else _type(ob.type)


@functools.lru_cache(maxsize=4096)
def _srepr(expr) -> str:
    return sympy.srepr(expr)


def _value(value, indent: str, labels: bool) -> str:
    """Canonical text of one spec field (a nested diagram renders as a block)."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)          # shortest round-trip repr: deterministic
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, sympy.Basic):
        return "sym:" + _srepr(value)
    if isinstance(value, ArrayType):
        return _type(value)
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_value(v, indent, labels) for v in value) + ")"
    if isinstance(value, dict):
        items = sorted((json.dumps(str(k)), _value(v, indent, labels)) for k, v in value.items())
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if is_diagram(value):
        return "{\n" + _render(value, indent + "  ", labels) + indent + "}"
    if dataclasses.is_dataclass(value):
        return _spec(value, indent, labels)
    raise TypeError(f"cannot fingerprint a {type(value).__name__}: {value!r}")


def render_value(value) -> str:
    """The canonical text of one value that is not a diagram (a spec field, a type)."""
    return _value(value, "", False)


def _spec(spec, indent: str, labels: bool) -> str:
    fields = [f"{f.name}={_value(getattr(spec, f.name), indent, labels)}"
              for f in dataclasses.fields(spec)]
    return f"{getattr(spec, 'kind', type(spec).__name__)}(" + ", ".join(fields) + ")"


_RENDERED = IdentityMemo(20000)


def _render(diagram, indent: str, labels: bool) -> str:
    """Memoised per diagram object: a rewrite rebuilds only the bodies on its
    path, so the search re-renders the same nested bodies state after state."""
    return _RENDERED.get((diagram,), lambda: _render_uncached(diagram, indent, labels),
                         (indent, labels))


def _render_uncached(diagram, indent: str, labels: bool) -> str:
    g = view(diagram)
    names = {}
    lines = []
    for i, v in enumerate(g.graph["inputs"]):
        names[v] = f"%{i}"
        lines.append(f"{indent}in %{i} {_wire(g.nodes[v]['ob'], labels)}\n")
    for i, n in enumerate(op_order(g)):
        node = g.nodes[n]
        box = node["box"]
        spec = getattr(box, "spec", None)
        if spec is None:
            raise TypeError(f"cannot fingerprint box {box.name!r}: it has no primitive spec")
        for j, v in enumerate(node["outs"]):
            names[v] = f"#{i}.{j}"
        args = ", ".join(names[v] for v in node["ins"])
        outs = ", ".join(_wire(g.nodes[v]["ob"], labels) for v in node["outs"])
        name = f"{json.dumps(box.name)} " if labels else ""
        lines.append(f"{indent}#{i} {name}{_spec(spec, indent, labels)} ({args}) -> ({outs})\n")
    lines.append(f"{indent}out " + ", ".join(names[v] for v in g.graph["outputs"]) + "\n")
    return "".join(lines)


def render(diagram, labels: bool = False) -> str:
    """The canonical text of a program (what :func:`fingerprint` hashes).

    Box and wire names are labels (wires compare by type, boxes mean their
    spec), so they are left out unless ``labels`` (for reading a diff): a
    cosmetic renaming does not invalidate certificates."""
    return _render(diagram, "", labels)


def fingerprint(diagram) -> str:
    """sha256 (hex) of the canonical rendering of ``diagram`` (without labels)."""
    return hashlib.sha256(render(diagram).encode("utf-8")).hexdigest()


def size_symbols(diagram) -> set[str]:
    """Names of the free size symbols of a program (axis sizes and tile sizes,
    inside group bodies and stream accumulators too)."""
    from napkin.core.streamed import names
    found = names(diagram)
    return found.sizes | set(found.tiles)


# ----------------------------------------------------------------------------- algorithms
@dataclass(frozen=True)
class Source:
    """What a certificate starts from: a diagram builder and, where known, a
    plain-jnp reference and an input sampler."""
    label: str
    build: object            # dtype -> Diagram
    reference: object = None
    sample: object = None    # (rng, sizes) -> list of arrays, or None


def algorithm_file(spec, base: Path | None = None) -> tuple[Path, str]:
    """The file and the name a ``{"from": "FILE:NAME"}`` spec points at, checked
    without running anything: FILE must be an existing ``.py`` file (relative
    to ``base``), NAME an identifier."""
    if not (isinstance(spec, dict) and set(spec) == {"from"} and isinstance(spec["from"], str)
            and ":" in spec["from"]):
        raise CertificateError(f"algorithm must be a library name or {{\"from\": \"FILE:NAME\"}}, "
                               f"got {_short_repr(spec)}")
    file, _, name = spec["from"].rpartition(":")
    if not file or not name.isidentifier():
        raise CertificateError(f"algorithm {spec['from']!r}: want FILE.py:NAME, NAME a Python "
                               f"identifier")
    path = Path(file)
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if path.is_dir():
        raise CertificateError(f"algorithm file {file} is a directory (want FILE.py:NAME)")
    if not path.is_file():
        raise CertificateError(f"algorithm file {file} not found (looked at {path})")
    if path.suffix != ".py":
        raise CertificateError(f"algorithm file {file} is not a Python source file "
                               f"(want FILE.py:NAME)")
    return path, name


def load_algorithm(spec, base: Path | None = None, prebuilt: dict | None = None) -> Source:
    """Resolve ``"name"`` (the library) or ``{"from": "FILE:NAME"}`` (a Python
    file, relative to ``base``; NAME is an Algorithm, a diagram, or a function
    dtype -> diagram).

    A ``from`` file is trusted code: it runs here, in the calling process.  What it
    raises or returns is reported as a :class:`CertificateError`: an exception
    (or ``sys.exit``) while loading it or building the diagram, a builder that
    returns something other than a diagram.  ``prebuilt`` (what ``napkin check``
    judges with): ``{"FILE:NAME": entry}`` of diagrams another process built and handed
    back as data (:func:`build_entry`); a ``from`` spec is then rebuilt from that data
    with napkin's own primitives, and no file is run here."""
    from napkin.frontend.library import Algorithm, get
    if isinstance(spec, str):
        alg = get(spec)
        return Source(spec, alg.diagram, alg.reference, alg.sample)
    if is_grad_spec(spec):  # a backward pass: napkin.grad of it (for one input, or all)
        from napkin.frontend.grad import grad
        inner, wrt, saved = load_algorithm(spec["grad"], base, prebuilt), spec.get("wrt"), \
            spec.get("residuals", False)
        return Source(spec_label(spec), lambda dtype="f32": grad(inner.build(dtype), wrt=wrt,
                                                                 residuals=saved))
    if is_saving_spec(spec):  # the forward that saves what its backward reads
        from napkin.frontend.grad import residuals
        inner = load_algorithm(spec["residuals"], base, prebuilt)
        return Source(spec_label(spec), lambda dtype="f32": residuals(inner.build(dtype)))
    if is_bases_spec(spec):  # one device's block: positions along cut axes from its bases
        from napkin.frontend.bases import with_bases
        inner, axes = load_algorithm(spec["bases"], base, prebuilt), tuple(spec["axes"])
        return Source(spec_label(spec), lambda dtype="f32": with_bases(inner.build(dtype),
                                                                       axes))
    if prebuilt is not None:
        return _rebuilt(spec, prebuilt)
    path, name = algorithm_file(spec, base)
    label = spec["from"]
    module_name = f"_napkin_alg_{path.stem}"
    mod_spec = importlib.util.spec_from_file_location(module_name, path,
                                                      loader=_NoBytecode(module_name, str(path)))
    if mod_spec is None or mod_spec.loader is None:
        raise CertificateError(f"algorithm file {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)  # as `python FILE.py` runs it: a module beside it imports
    try:
        mod_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's file: report what it raised
        raise CertificateError(f"cannot load {path}: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(folder)
    try:
        obj = getattr(module, name)
    except AttributeError:
        raise CertificateError(f"{path} has no {name!r}") from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a module __getattr__ that raises
        raise CertificateError(f"{path}: getting {name!r} raised {type(e).__name__}: {e}") \
            from None
    if isinstance(obj, Algorithm):
        return Source(label, _checked_builder(obj.diagram, name), obj.reference, obj.sample)
    if is_diagram(obj):
        return Source(label, lambda dtype="f32": obj)
    if callable(obj):
        return Source(label, _checked_builder(obj, name))
    raise CertificateError(f"{label} is {_kind(obj)}: neither an Algorithm, a diagram nor a "
                           f"builder (a function dtype -> diagram)")


def from_specs(spec) -> list[dict]:
    """The ``{"from": ...}`` specs a certificate's algorithm names (inside grad and
    residuals specs too): the code ``napkin check`` runs apart from its judgement."""
    if is_grad_spec(spec):
        return from_specs(spec["grad"])
    if is_saving_spec(spec):
        return from_specs(spec["residuals"])
    if is_bases_spec(spec):
        return from_specs(spec["bases"])
    return [spec] if isinstance(spec, dict) and "from" in spec else []


def build_entry(spec, base: Path | None, dtype: str) -> tuple[dict, Source | None]:
    """Run a ``from`` spec's file and build its diagram at ``dtype``: the data
    :func:`load_algorithm` rebuilds it from (``{"dtype", "diagram"}``), or
    ``{"error": the one line}`` when loading or building fails; and the Source loaded."""
    from napkin.core.serial import to_data
    try:
        src = load_algorithm(spec, base)
        return {"dtype": dtype, "diagram": to_data(src.build(dtype))}, src
    except NapkinError as e:
        return {"error": str(e)}, None
    except BaseException as e:  # noqa: BLE001 - a user's file may raise anything
        said = f": {e}" if str(e) else ""
        return {"error": f"building {spec_label(spec)} raised {type(e).__name__}{said}"}, None


def _rebuilt(spec, prebuilt: dict) -> Source:
    """A ``from`` spec's diagram, rebuilt from the data another process handed back."""
    from napkin.core.serial import from_data
    label = spec.get("from") if isinstance(spec, dict) else None
    entry = prebuilt.get(label) if isinstance(label, str) else None
    if not isinstance(entry, dict):
        raise CertificateError(f"algorithm {spec_label(spec)}: the process that runs its file "
                               f"handed back no diagram for it")
    if "error" in entry:
        raise CertificateError(" ".join(str(entry["error"]).split())[:2000])
    diagram, built = from_data(entry.get("diagram")), entry.get("dtype")

    def build(dtype="f32"):
        if dtype != built:
            raise CertificateError(f"{label} was built at {built!r}, not {dtype!r}")
        return diagram
    return Source(label, build)


class _NoBytecode(importlib.machinery.SourceFileLoader):
    """Runs FILE.py without writing a __pycache__ beside it: loading an algorithm
    (checking a certificate, the demo) leaves the user's folders as they were."""

    def set_data(self, path, data, *, _mode=0o666):
        pass


def _kind(obj) -> str:
    if obj is None:
        return "None"
    kind = type(obj).__name__
    return f"{'an' if kind[:1].lower() in 'aeiou' else 'a'} {kind}"


def _short_repr(obj, limit: int = 80) -> str:
    try:
        text = repr(obj)
    except Exception:  # noqa: BLE001 - repr of arbitrary JSON data cannot really fail
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def _checked_builder(build, name: str):
    """``build`` (dtype -> diagram), reporting what a user's builder does wrong."""
    def checked(dtype="f32"):
        try:
            diagram = build(dtype)
        except NapkinError:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a user's builder
            raise CertificateError(f"{name}({dtype!r}) raised {type(e).__name__}: {e}") \
                from None
        if not is_diagram(diagram):
            raise CertificateError(f"{name}({dtype!r}) returned {_kind(diagram)}, not a diagram "
                                   f"(NAME must be a diagram, an Algorithm or a function "
                                   f"dtype -> diagram)")
        return diagram
    return checked


# ----------------------------------------------------------------------------- the data
# The numeric check evaluates the program at a certificate's sizes: the
# derivation is symbolic, so small sizes check every size (make.py uses <= 512).
MAX_CHECK_SIZE = 4096
# A certificate nests five levels (certificate, steps, step, site, path); JSON
# deeper than this is not one (and would exhaust Python's recursion limit).
MAX_NESTING = 32


def _show_int(v: int) -> str:
    if v.bit_length() <= 60:
        return str(v)
    return f"an integer of {int(v.bit_length() * 0.30103)}+ digits"


def _int_map(data, what: str, bound: int | None = MAX_CHECK_SIZE) -> dict[str, int]:
    if not isinstance(data, dict):
        raise CertificateError(f"{what} must be an object of name: int, got {_short_repr(data)}")
    for k, v in data.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int):
            raise CertificateError(f"{what}: {k!r} must map to an integer, got {_short_repr(v)}")
        if bound is not None and v > bound:
            raise CertificateError(f"{what}: {k} = {_show_int(v)} is above {bound}, the largest "
                                   f"{what[:-1]} a certificate's numeric check takes (the "
                                   f"derivation is symbolic: small sizes cover every size)")
    return dict(data)


# the launch parameters a backend writes a kernel with (napkin.lower.backends), and the
# values a GPU block can take: warps of one block (1,024 threads), software-pipelining
# stages, consumer warp groups beside the producer (four warp groups per block)
LAUNCH = {"num_warps": (1, 2, 4, 8, 16, 32), "num_stages": tuple(range(1, 9)),
          "consumer_warpgroups": (1, 2, 3)}


MAX_NAME = 4096  # characters of an algorithm's name, file or input name


def _texts(value):
    """Every string in a parsed JSON value, keys included."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)


def _launch(data) -> dict[str, int]:
    """A certificate's launch parameters: known names, each within what a block can take."""
    launch = _int_map(data, "launch", bound=1024)
    unknown = sorted(set(launch) - set(LAUNCH))
    if unknown:
        raise CertificateError(f"launch: unknown parameter(s) {', '.join(unknown)} (known: "
                               f"{', '.join(LAUNCH)})")
    for k, v in launch.items():
        if v not in LAUNCH[k]:
            raise CertificateError(f"launch: {k} = {v} is not one of "
                                   f"{', '.join(map(str, LAUNCH[k]))}")
    return launch


def _nesting(data) -> int:
    """How deeply lists and objects nest in parsed JSON (iteratively)."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if depth > MAX_NESTING:
                break
            todo.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict)
                                                 else value))
    return deepest


def _digest(value, what: str, step: int | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise CertificateError(f"{what} must be a fingerprint string, got {_short_repr(value)}",
                               step)
    return value


@dataclass
class Step:
    rule: str
    site: Site
    params: dict
    result: str

    def to_json(self) -> dict:
        return {"rule": self.rule, "site": self.site.to_json(), "params": dict(self.params),
                "result": self.result}

    @classmethod
    def from_json(cls, data, i: int = 0) -> Step:
        where = f"step {i}"
        if not isinstance(data, dict):
            raise CertificateError(f"{where} must be an object, got {_short_repr(data)}", i)
        missing = [k for k in ("rule", "site", "params", "result") if k not in data]
        if missing:
            raise CertificateError(f"{where} lacks {', '.join(missing)}", i)
        unknown = sorted(map(str, set(data) - {"rule", "site", "params", "result"}))
        if unknown:
            raise CertificateError(f"{where}: unknown field(s) {', '.join(unknown)} (a step is "
                                   f"rule, site, params, result)", i)
        if not isinstance(data["rule"], str):
            raise CertificateError(f"{where}: rule must be a string, got "
                                   f"{_short_repr(data['rule'])}", i)
        if not isinstance(data["params"], dict):
            raise CertificateError(f"{where}: params must be an object, got "
                                   f"{_short_repr(data['params'])}", i)
        site = data["site"]
        if not (isinstance(site, dict) and set(site) <= {"path", "ops"} and "ops" in site
                and all(isinstance(site.get(k, []), list)
                        and all(isinstance(j, int) and not isinstance(j, bool) and j >= 0
                                for j in site.get(k, []))
                        for k in ("path", "ops"))):
            raise CertificateError(f"{where}: bad site {_short_repr(site)} (want "
                                   f"{{\"path\": [int >= 0, ...], \"ops\": [int >= 0, ...]}})", i)
        site = Site.from_json(site)
        return cls(data["rule"], site, dict(data["params"]),
                   _digest(data["result"], f"{where}: result", i))


@dataclass
class Certificate:
    algorithm: str | dict
    dtype: str
    sizes: dict[str, int]
    tiles: dict[str, int]
    steps: list[Step]
    result: str
    source: str
    symbolic: list[str] = field(default_factory=list)
    launch: dict[str, int] = field(default_factory=dict)
    format: str = FORMAT
    origin: Path | None = field(default=None, compare=False)  # the file it came from

    def to_dict(self) -> dict:
        out = {"format": self.format, "algorithm": self.algorithm, "dtype": self.dtype,
               "source": self.source, "sizes": dict(self.sizes), "tiles": dict(self.tiles),
               "symbolic": sorted(self.symbolic), "steps": [s.to_json() for s in self.steps],
               "result": self.result}
        if self.launch:
            out["launch"] = dict(self.launch)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=2) + "\n"

    @classmethod
    def from_dict(cls, data, origin: Path | None = None) -> Certificate:
        if not isinstance(data, dict):
            raise CertificateError("a certificate is a JSON object")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise CertificateError(f"unsupported format {_short_repr(fmt)} (this checker reads "
                                   f"{FORMAT})")
        missing = [k for k in ("algorithm", "dtype", "source", "sizes", "tiles", "steps", "result")
                   if k not in data]
        if missing:
            raise CertificateError(f"certificate lacks {', '.join(missing)}")
        unknown = sorted(set(data) - {"format", "algorithm", "dtype", "source", "sizes", "tiles",
                                      "symbolic", "steps", "result", "launch"})
        if unknown:
            raise CertificateError(f"unknown certificate field(s) {', '.join(unknown)}")
        try:
            dtype = canonical_dtype(data["dtype"])
        except NapkinError as e:
            raise CertificateError(str(e)) from None
        if not isinstance(data["steps"], list):
            raise CertificateError("steps must be a list")
        symbolic = data.get("symbolic", [])
        if not isinstance(symbolic, list) or not all(isinstance(s, str) for s in symbolic):
            raise CertificateError(f"symbolic must be a list of names, got {_short_repr(symbolic)}")
        algorithm = data["algorithm"]
        if not isinstance(algorithm, (str, dict)):
            raise CertificateError(f"algorithm must be a name or {{\"from\": ...}}, "
                                   f"got {_short_repr(algorithm)}")
        longest = max(_texts(algorithm), key=len, default="")
        if len(longest) > MAX_NAME:
            raise CertificateError(f"algorithm: a name of {len(longest):,} characters "
                                   f"({_short_repr(longest, 40)}; at most {MAX_NAME:,})")
        return cls(algorithm, dtype, _int_map(data["sizes"], "sizes"),
                   _int_map(data["tiles"], "tiles"),
                   [Step.from_json(s, i + 1) for i, s in enumerate(data["steps"])],
                   _digest(data["result"], "result"), _digest(data["source"], "source"),
                   list(symbolic), _launch(data.get("launch", {})), fmt, origin)

    @classmethod
    def from_json(cls, text: str, origin: Path | None = None) -> Certificate:
        data = parse_json(text)
        return cls.from_dict(data, origin)

    @classmethod
    def load(cls, path) -> Certificate:
        """Read a certificate file; every way it can fail is a CertificateError."""
        path = Path(path)
        return cls.from_json(read_text(path), origin=path.resolve().parent)

    def save(self, path) -> None:
        """Write the certificate to ``path``.  A ``from`` file is named relative to the
        certificate's folder, where a checker looks for it (it was named relative to the
        folder the certificate was made in, ``origin``)."""
        cert = self
        if isinstance(self.algorithm, dict) and self.origin is not None:
            folder = Path(path).resolve().parent
            cert = dataclasses.replace(self, algorithm=_relative(self.algorithm, self.origin,
                                                                 folder), origin=folder)
        Path(path).write_text(cert.to_json(), encoding="utf-8")


def is_grad_spec(spec) -> bool:
    """``{"grad": SOURCE}`` or ``{"grad": SOURCE, "wrt": INPUT or [INPUTS]}``: the backward
    pass of SOURCE (napkin.grad), every floating input's cotangent or those named."""
    wrt = spec.get("wrt", "") if isinstance(spec, dict) else None
    return isinstance(spec, dict) and "grad" in spec and \
        set(spec) <= {"grad", "wrt", "residuals"} and \
        isinstance(spec.get("residuals", False), bool) and (
            isinstance(wrt, str) or (isinstance(wrt, list) and bool(wrt)
                                     and all(isinstance(w, str) for w in wrt)))


def is_saving_spec(spec) -> bool:
    """``{"residuals": SOURCE}``: SOURCE's forward saving what its backward reads."""
    return isinstance(spec, dict) and set(spec) == {"residuals"}


def is_bases_spec(spec) -> bool:
    """``{"bases": SOURCE, "axes": [AXES]}``: SOURCE as one device runs its share of the
    axes — positions along each read from an int32 input, its base (napkin.frontend.bases)."""
    axes = spec.get("axes") if isinstance(spec, dict) else None
    return isinstance(spec, dict) and set(spec) == {"bases", "axes"} and \
        isinstance(axes, list) and bool(axes) and all(isinstance(a, str) for a in axes)


def spec_label(spec) -> str:
    """How a certificate's algorithm is named in messages."""
    if is_grad_spec(spec):
        w = spec.get("wrt")
        wrt = f" with respect to {', '.join(w) if isinstance(w, list) else w}" if w else ""
        saved = " (from the saved residuals)" if spec.get("residuals") else ""
        return f"grad of {spec_label(spec['grad'])}{wrt}{saved}"
    if is_saving_spec(spec):
        return f"{spec_label(spec['residuals'])} saving its residuals"
    if is_bases_spec(spec):
        return f"{spec_label(spec['bases'])} on one device's share of {', '.join(spec['axes'])}"
    if isinstance(spec, dict):
        return str(spec.get("from", repr(spec)))
    return spec if isinstance(spec, str) else repr(spec)


def _relative(spec, origin, folder):
    """``spec`` with its ``from`` file named relative to ``folder`` (a grad's, inside)."""
    if is_grad_spec(spec):
        return {**spec, "grad": _relative(spec["grad"], origin, folder)}
    if is_saving_spec(spec):
        return {"residuals": _relative(spec["residuals"], origin, folder)}
    if is_bases_spec(spec):
        return {**spec, "bases": _relative(spec["bases"], origin, folder)}
    if not isinstance(spec, dict):
        return spec
    file, _, name = spec["from"].rpartition(":")
    where = Path(file) if Path(file).is_absolute() else Path(origin) / file
    return {"from": f"{os.path.relpath(where.resolve(), folder)}:{name}"}


def read_text(path: Path) -> str:
    """The UTF-8 text of a certificate file, or a CertificateError saying why not."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CertificateError("no such file") from None
    except IsADirectoryError:
        raise CertificateError("is a directory, not a certificate file") from None
    except UnicodeDecodeError as e:
        raise CertificateError(f"not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                               f"{e.start}); a certificate is a UTF-8 JSON file") from None
    except OSError as e:
        raise CertificateError(f"cannot read it: {e.strerror or e}") from None


def parse_json(text: str):
    """Parsed JSON of a certificate, or a CertificateError saying why not: bad
    syntax, nesting deeper than MAX_NESTING, an integer too long to convert."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CertificateError(f"not JSON: {e}") from None
    except RecursionError:
        raise CertificateError(f"JSON nested too deeply (a certificate nests at most "
                               f"{MAX_NESTING} levels)") from None
    except ValueError as e:  # an integer literal beyond Python's int-parsing limit
        why = " ".join(str(e).split())
        if "integer string conversion" in why:
            why = (f"an integer has more than {sys.get_int_max_str_digits()} digits (sizes "
                   f"and tiles are at most {MAX_CHECK_SIZE})")
        raise CertificateError(f"not JSON napkin reads: {why}") from None
    if _nesting(data) > MAX_NESTING:
        raise CertificateError(f"JSON nested more than {MAX_NESTING} levels deep (a "
                               f"certificate nests at most {MAX_NESTING})")
    return data


# ----------------------------------------------------------------------------- deriving
def _site(program, site, rule: str):
    """A Site from a Site, a dict, or a path tuple (meaning every op of that body)."""
    if isinstance(site, Site):
        return site
    if isinstance(site, dict):
        if "ops" in site:
            return Site.from_json(site)
        site = tuple(site.get("path", ()))
    path = tuple(int(i) for i in site)
    from napkin.core.region import body_at
    n = len(op_order(to_graph(body_at(program, path))))
    return Site(path, tuple(range(n)))


def derive(algorithm, steps, sizes: dict, tiles: dict, dtype: str = "f32",
           base: Path | None = None, launch: dict | None = None) -> Certificate:
    """Apply ``steps`` to the algorithm and record the certificate.

    ``algorithm``: a library name or ``{"from": "FILE:NAME"}``.  ``steps``:
    ``(rule, site, params)`` triples or ``{"rule", "site", "params"}`` dicts;
    a site is a :class:`Site`, ``{"path", "ops"}``, or a bare path (every op of
    the body there).  Raises :class:`~napkin.core.errors.RuleError` when a premise
    fails.  The certificate is not checked numerically here: run the checker.
    """
    return derive_from(load_algorithm(algorithm, base), algorithm, steps, sizes, tiles, dtype,
                       base, launch)


def derive_from(src: Source, algorithm, steps, sizes: dict, tiles: dict, dtype: str = "f32",
                base: Path | None = None, launch: dict | None = None) -> Certificate:
    """:func:`derive` from a loaded algorithm (``src.build(dtype)`` is the diagram): the
    certificate names it ``algorithm``."""
    from rewrites import get_rule
    dtype = canonical_dtype(dtype)
    program = src.build(dtype)
    source = fingerprint(program)
    recorded = []
    for i, step in enumerate(steps, 1):
        if isinstance(step, dict):
            rule, site, params = step["rule"], step.get("site", ()), step.get("params", {})
        else:
            rule, site, params = step
        try:  # replay sees the parameters as JSON gives them back: apply those
            params = json.loads(json.dumps(dict(params), sort_keys=True))
        except TypeError as e:
            raise CertificateError(f"step {i} ({rule}): parameters must be JSON data: {e}") \
                from None
        site = _site(program, site, rule)
        try:
            program = get_rule(rule).apply(program, site, dict(params))
        except NapkinError as e:
            raise type(e)(f"step {i} ({rule}): {e}") from None
        recorded.append(Step(rule, site, params, fingerprint(program)))
    return Certificate(algorithm, dtype, _int_map(dict(sizes), "sizes"),
                       _int_map(dict(tiles), "tiles"), recorded, fingerprint(program), source,
                       sorted(size_symbols(program)), _launch(dict(launch or {})),
                       origin=Path(base) if base else None)


def stored_certificates():
    """The folder of certificates shipped with the package (proofs/certificates)."""
    from importlib.resources import files
    return files("proofs") / "certificates"


__all__ = ["FORMAT", "MAX_CHECK_SIZE", "Certificate", "CertificateError", "Source", "Step",
           "algorithm_file", "derive", "fingerprint", "load_algorithm", "render", "size_symbols",
           "stored_certificates"]
