"""CPU proofs of the GPU code: every library kernel at the optimiser's own tiles and launch
parameters, compiled for sm_90 with the pinned triton (no GPU needed), set beside the launch
model (napkin.cost.launch): shared memory per block, registers, spills, tensor cores.

    python benchmarks/cpu_proofs.py [--hardware h100 h200] [--dtype bf16]
    python benchmarks/cpu_proofs.py --backward --names attention gqa   # the backward's kernels
    python benchmarks/cpu_proofs.py --names attention mha --size q=16 x=131072 --hardware h200
                                                    # decoding shapes: the split-K kernels
    python benchmarks/cpu_proofs.py --block --hardware h100   # the transformer block's kernels

Prints one table per profile (ratios allocated / modelled); a line per kernel the lowering
or Triton refuses, with the reason.  ``--backward``: the kernels of each algorithm's backward
programs (one per input's cotangent, ``Optimized.backward``), rows named ``name dX``.
``--size axis=N``: search at these sizes (the rest the library defaults) — decoding shapes,
where the search splits the keys (split-K: a kernel of parts, then a merge kernel).
``--block``: the pre-norm transformer block from plain JAX (tests/test_pieces.py, at
benchmarks/search.py --block's sizes), searched in pieces: a row per kernel.
"""
from __future__ import annotations

import argparse
import time
import warnings

from napkin.frontend.library import LIBRARY
from napkin.lower import ptx
from napkin.pipeline import optimize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", nargs="+", default=["h100", "h200"])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--names", nargs="+", default=list(LIBRARY))
    ap.add_argument("--backward", action="store_true", help="the backward programs' kernels")
    ap.add_argument("--size", nargs="+", default=[], metavar="AXIS=N",
                    help="sizes to search at (others: the library defaults)")
    ap.add_argument("--block", action="store_true",
                    help="the transformer block's kernels (benchmarks/search.py --block)")
    args = ap.parse_args()
    sizes = {k: int(v) for k, v in (item.split("=") for item in args.size)}
    warnings.simplefilter("ignore")
    head = (f"{'kernel':<26} {'tiles':<30} {'warps':>5} {'stg':>3} {'smem model':>10} "
            f"{'smem triton':>11} {'ratio':>5} {'regs model':>10} {'regs ptxas':>10} "
            f"{'spills':>6} {'dots':>4} {'wgmma':>5} {'search s':>8} {'compile s':>9}")
    for hw in args.hardware:
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items()) or "default sizes"
        print(f"\n{hw}, {args.dtype}, {shown} (others: napkin.frontend.library.DEFAULT_SIZES)"
              f"\n{head}")
        programs = _block(hw, args.dtype) if args.block else \
            _programs(args.names, hw, args.dtype, args.backward, sizes)
        for name, opt, t0 in programs:
            try:
                shapes = [tuple(opt.sizes[a.name] for a in ob.type.axes)
                          for ob in opt.algorithm.dom.inside]
                launches = opt.search.best.tiles.launch
                t1 = time.perf_counter()
                compiled = ptx.compile_ptx(opt.kernel(), shapes, check_shared=False)
                t2 = time.perf_counter()
            except Exception as e:  # noqa: BLE001 - a row saying why
                print(f"{name:<26} refused: {str(e).splitlines()[0][:150]}")
                continue
            split = " split" if opt.chain and opt.chain[-1].rule == "split_stream" else ""
            for j, (m, k) in enumerate(zip(launches, compiled)):
                tiles = ",".join(f"{t}={v}" for t, v in opt.tiles.items()) \
                    if not args.block else f"({len(opt.tiles)} tiles: search.py --block)"
                row = f"{name}{split}" + (f" #{j}" if len(compiled) > 1 else "")
                ratio = k.shared / m["smem_bytes"] if m["smem_bytes"] else float("nan")
                print(f"{row:<26} {tiles:<30} {m['num_warps']:>5} {m['num_stages']:>3} "
                      f"{m['smem_bytes']:>10,} {k.shared:>11,} {ratio:>5.2f} "
                      f"{m['registers_per_thread']:>10} {k.registers:>10} {k.spills:>6} "
                      f"{k.dots - k.fma_dots}/{k.dots:<2} {'yes' if 'wgmma' in k.ptx else 'no':>5} "
                      f"{t1 - t0:>8.1f} {t2 - t1:>9.1f}")


def _block(hw, dtype):
    """The transformer block's one program (its row names: "block #k")."""
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import test_pieces
    t0 = time.perf_counter()
    yield "block", optimize(test_pieces.block_at_benchmark_sizes(), hw, None, dtype,
                            max_seconds=25), t0


def _programs(names, hw, dtype, backward, sizes):
    """(row name, Optimized, start time) per program: the forward's, or each cotangent's."""
    from napkin.certify.certificate import size_symbols
    for name in names:
        t0 = time.perf_counter()
        try:
            axes = {str(a) for a in size_symbols(LIBRARY[name].diagram())}
            opt = optimize(name, hw, {k: v for k, v in sizes.items() if k in axes}, dtype)
            pieces = [(f"{name} " + ",".join("d" + n for n in w), o)
                      for w, o in opt.backward.pieces] if backward \
                else [(name, opt)]
        except Exception as e:  # noqa: BLE001 - a row saying why
            print(f"{name:<26} refused: {str(e).splitlines()[0][:150]}")
            continue
        for row, o in pieces:
            yield row, o, t0


if __name__ == "__main__":
    main()
