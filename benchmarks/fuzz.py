"""Soundness campaign: random algorithms, random rule chains, compared in float64.

    python benchmarks/fuzz.py --chains 10000 --jobs 2
    python benchmarks/fuzz.py --replay 1234          # one seed, with its findings
    python benchmarks/fuzz.py --kernels --chains 2000  # and lower every chain's program
    python benchmarks/fuzz.py --searched --seeds 300   # the search's programs, fitted small

Each seed builds one random algorithm (proofs/fuzz.py: the public primitives,
axis names that collide with default tiles, symbolic and integer sizes, now and
then a library algorithm or a woven one), applies a chain of up to four rule
applications drawn from the rules' own proposals — default, integer and
clashing tile names, and arbitrary sites — and evaluates the algorithm and every
rewritten program (every one for a quarter of the seeds, the last one for the
others) at ragged, prime and size-1 sizes on inputs with ±1e4, −∞, NaN and rows
of −∞ (or, one seed in four, plain normal inputs).  A finding is a move
whose premises passed but whose rewrite failed, a rewritten program that does
not evaluate, or one that differs from its algorithm.  ``--kernels`` also lowers the
chain's last program (Triton, interpret mode, f32) at small ragged sizes and random
power-of-two tiles, some over their axis, and compares the kernel with the float64
meaning (proofs/fuzz.check_kernel: a refusal in one line is allowed, a wrong kernel or
a traceback is a finding); ``--searched`` does the same for the search's own program
at large sizes, shrunk by ``Optimized.fit`` (proofs/fuzz.check_searched).  The table gives counts
and ratios; ``--json`` writes every finding with its seed for replay.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_seed(seed: int, kernels: bool = False, searched: bool = False) -> dict:
    from proofs import fuzz
    ch = fuzz.RandomChooser(seed)
    out = {"seed": seed, "chain": 0, "steps": 0, "refused": 0, "rules": {}, "findings": [],
           "kernels": 0, "kernels_refused": 0}
    try:
        alg = fuzz.random_algorithm(ch)
    except Exception as e:  # noqa: BLE001 - a generator failure is reported, not hidden
        out["findings"].append({"kind": "generator", "detail": f"{type(e).__name__}: {e}"})
        return out
    programs, chain, findings, refused = fuzz.random_chain(alg, ch)
    findings += fuzz.check_chain(alg, programs, chain, ch, special=seed % 4 != 0,
                                 every_step=seed % 4 == 1)
    stats: dict = {}
    if kernels and programs:
        findings += fuzz.check_kernel(alg, programs[-1], chain, ch, stats=stats)
    if searched:
        findings += fuzz.check_searched(alg, ch, stats=stats)
    out.update(kernels=stats.get("ran", 0), kernels_refused=len(stats.get("refused", [])))
    out.update(chain=int(bool(chain)), steps=len(chain), refused=refused,
               rules=dict(collections.Counter(r for r, _, _ in chain)))
    out["findings"] = [{"kind": f.kind, "detail": f.detail,
                        "case": fuzz.describe(alg, f.chain)} for f in findings]
    return out


def _worker(seeds, kernels=False, searched=False):
    sys.path.insert(0, str(ROOT))
    return [run_seed(s, kernels, searched) for s in seeds]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=10000, help="chains with at least one move")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=None,
                   help="run exactly this many seeds (instead of --chains chains)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--batch", type=int, default=50, help="seeds per task")
    p.add_argument("--json", metavar="PATH", help="write the totals and every finding here")
    p.add_argument("--replay", type=int, metavar="SEED", help="run one seed and print it")
    p.add_argument("--kernels", action="store_true",
                   help="also lower each chain's program and compare the kernel")
    p.add_argument("--searched", action="store_true",
                   help="also lower the search's program for each algorithm, fitted small")
    args = p.parse_args(argv)
    flags = (args.kernels, args.searched)
    if args.replay is not None:
        print(json.dumps(_worker([args.replay], *flags)[0], indent=2))
        return 0
    t0 = time.perf_counter()
    totals = collections.Counter()
    rules, kinds, findings = collections.Counter(), collections.Counter(), []
    next_seed = args.seed
    ctx = mp.get_context("spawn")  # JAX is multithreaded: never fork it
    with ctx.Pool(args.jobs) as pool:
        pending = []

        def submit():
            nonlocal next_seed
            pending.append(pool.apply_async(_worker, (list(range(next_seed,
                                                                 next_seed + args.batch)),
                                                      *flags)))
            next_seed += args.batch
        for _ in range(2 * args.jobs):
            if args.seeds is None or next_seed < args.seed + args.seeds:
                submit()
        while pending:
            for r in pending.pop(0).get():
                totals.update(seeds=1, chains=r["chain"], steps=r["steps"], refused=r["refused"],
                              kernels=r["kernels"], kernels_refused=r["kernels_refused"])
                rules.update(r["rules"])
                for f in r["findings"]:
                    kinds[f["kind"]] += 1
                    findings.append({"seed": r["seed"], **f})
                    print(f"  FINDING seed {r['seed']}: {f['kind']}: {f['detail']} — "
                          f"{f.get('case', '')}"[:600], flush=True)
            more = (next_seed < args.seed + args.seeds if args.seeds is not None
                    else totals["chains"] < args.chains)
            if more:
                submit()
            done = totals["chains"]
            if done and done % 1000 < args.batch:
                print(f"  {done} chains, {sum(kinds.values())} findings, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    print(f"\nsoundness campaign: seeds {args.seed}..{next_seed - 1}, {args.jobs} jobs, "
          f"{seconds:.0f} s")
    rows = [("seeds (random algorithms)", totals["seeds"], ""),
            ("chains (≥ 1 move applied)", totals["chains"],
             f"{totals['chains'] / max(totals['seeds'], 1):.2f} per seed"),
            ("moves applied", totals["steps"],
             f"{totals['steps'] / max(totals['chains'], 1):.2f} per chain"),
            ("proposals refused by a premise", totals["refused"],
             f"{totals['refused'] / max(totals['steps'], 1):.2f} per move applied")]
    rows += [(f"  {rule}", n, f"{n / max(totals['steps'], 1):.1%} of moves")
             for rule, n in rules.most_common()]
    if args.kernels or args.searched:
        lowered = totals["kernels"] + totals["kernels_refused"]
        rows += [("kernels run and compared", totals["kernels"],
                  f"{totals['kernels'] / max(lowered, 1):.1%} of programs lowered"),
                 ("lowerings refused in one line", totals["kernels_refused"],
                  f"{totals['kernels_refused'] / max(lowered, 1):.1%} of programs lowered")]
    rows += [(f"findings: {kind}", n, f"{n / max(totals['chains'], 1):.2%} of chains")
             for kind, n in sorted(kinds.items())]
    rows.append(("findings (all kinds)", sum(kinds.values()),
                 f"{sum(kinds.values()) / max(totals['chains'], 1):.2%} of chains"))
    width = max(len(r[0]) for r in rows)
    for name, n, ratio in rows:
        print(f"  {name:<{width}}  {n:>8}  {ratio}")
    for f in findings[:20]:
        print(f"  seed {f['seed']}: {f['kind']}: {f['detail']} — {f.get('case', '')}"[:400])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "command": " ".join(["python", "benchmarks/fuzz.py", *(argv or sys.argv[1:])]),
            "seconds": seconds, "totals": dict(totals), "rules": dict(rules),
            "findings": findings}, indent=2) + "\n")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
