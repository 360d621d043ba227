"""Regenerate the stored derivation certificates.

    python -m proofs.certificates.make            # write every certificate here
    python -m proofs.certificates.make --check    # regenerate in memory, compare, verify

Each entry: file name -> (algorithm, steps, sizes, tiles).  A step is
``(rule, path, params)``: the site is every op of the body at ``path`` unless
params carry ``ops`` (then only those).  Tile sizes stay symbolic in the steps
(g_q, s_x, ...), so a certificate covers every size; ``sizes``/``tiles`` are
only the instance the checker's numeric cross-check runs at: two pieces per
partitioned axis (the checker adds a ragged instance, each size a few less, so
the last piece is partial), which keeps the unrolled check program small.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

DERIVATIONS = {
    # FlashAttention: tile the queries, stream the keys with the
    # softmax-contraction accumulator (mu, z, o).
    "flash_attention": ("attention", [
        ("group_partition", (), {"axis": "q", "size": "g_q"}),
        ("stream_partition", (0,), {"axis": "x", "chunk": "s_x"}),
    ], {"q": 128, "x": 256, "d": 64}, {"g_q": 64, "s_x": 128}),
    # Flash-decoding (split-K): FlashAttention's stream of the keys cut in parts folded in
    # parallel, one partial state (mu, z, o) per part, merged in order by the accumulator's
    # merge (causal: the later parts of a query tile hold no key it sees).
    "flash_decoding": ("causal_attention", [
        ("group_partition", (), {"axis": "q", "size": "g_q"}),
        ("stream_partition", (0,), {"axis": "x", "chunk": "s_x"}),
        ("split_stream", (), {"axis": "x", "size": "p_x", "ops": [0]}),
    ], {"q": 64, "x": 256, "d": 32}, {"g_q": 32, "s_x": 32, "p_x": 64}),
    # Tiled matmul: tile rows, then columns, stream the contracted axis.
    "tiled_matmul": ("matmul", [
        ("group_partition", (), {"axis": "a", "size": "g_a"}),
        ("group_partition", (0,), {"axis": "c", "size": "g_c"}),
        ("stream_partition", (0, 0), {"axis": "b", "chunk": "s_b"}),
    ], {"a": 64, "b": 128, "c": 64}, {"g_a": 32, "g_c": 32, "s_b": 64}),
    # Causal attention: the mask is woven over q and x, so it streams with the
    # logits (indices are global: groups and chunks shift them).
    "causal_attention": ("causal_attention", [
        ("group_partition", (), {"axis": "q", "size": "g_q"}),
        ("stream_partition", (0,), {"axis": "x", "chunk": "s_x"}),
    ], {"q": 128, "x": 128, "d": 64}, {"g_q": 64, "s_x": 64}),
    # GQA: one group per KV head (K, V read once for its r query heads), then
    # FlashAttention inside.
    "gqa": ("gqa", [
        ("head_grouping", (), {"axis": "k"}),
        ("group_partition", (0,), {"axis": "q", "size": "g_q"}),
        ("stream_partition", (0, 0), {"axis": "x", "chunk": "s_x"}),
    ], {"k": 2, "r": 3, "q": 64, "x": 128, "d": 32}, {"g_q": 32, "s_x": 64}),
    # Cross-entropy: tile the rows, stream the vocabulary (logsumexp + the
    # label pick, a plain contraction, in one accumulator).
    "cross_entropy": ("cross_entropy", [
        ("group_partition", (), {"axis": "n", "size": "g_n"}),
        ("stream_partition", (0,), {"axis": "v", "chunk": "s_v"}),
    ], {"n": 64, "v": 512}, {"g_n": 32, "s_v": 256}),
    # RMSNorm -> matmul: pull the per-row 1/rms out of the matmul first, then
    # the row's Σx² and the matmul stream together over d.
    "rmsnorm_matmul": ("rmsnorm_matmul", [
        ("normalized_contraction", (), {"ops": [6]}),
        ("group_partition", (), {"axis": "n", "size": "g_n"}),
        ("stream_partition", (0,), {"axis": "d", "chunk": "s_d"}),
    ], {"n": 64, "d": 256, "e": 48}, {"g_n": 32, "s_d": 64}),
}


def build(name: str):
    from napkin.certify.certificate import derive
    from napkin.core.region import Site
    algorithm, steps, sizes, tiles = DERIVATIONS[name]
    spelled = []
    for rule, path, params in steps:
        params = dict(params)
        ops = params.pop("ops", None)
        site = Site(tuple(path), tuple(ops)) if ops is not None else tuple(path)
        spelled.append((rule, site, params))
    return derive(algorithm, spelled, sizes, tiles)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m proofs.certificates.make", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"which (default all): {', '.join(DERIVATIONS)}")
    ap.add_argument("--out", type=Path, default=HERE, help="folder to write to (default: here)")
    ap.add_argument("--check", action="store_true",
                    help="do not write: compare with the stored files and run the checker")
    args = ap.parse_args(argv)
    names = args.names or list(DERIVATIONS)
    unknown = [n for n in names if n not in DERIVATIONS]
    if unknown:
        ap.error(f"unknown certificate(s) {', '.join(unknown)}; known: {', '.join(DERIVATIONS)}")
    bad = 0
    for name in names:
        cert = build(name)
        path = args.out / f"{name}.json"
        if args.check:
            from napkin.certify.checker import check_certificate
            same = path.exists() and path.read_text(encoding="utf-8") == cert.to_json()
            report = check_certificate(cert, name=name)
            bad += (not same) + (not report.ok)
            print(f"{name}: {'up to date' if same else 'STALE (rerun make)'}; {report}")
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            cert.save(path)
            print(f"wrote {path} ({len(cert.steps)} steps, result {cert.result[:12]}..)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
