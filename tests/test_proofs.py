"""Every rule is proved; every wrong accumulator is caught; a missing proof fails."""
import pytest

from proofs import ProofResult, prove_all, prove_rule, prove_wrong
from proofs.wrong_variants import VARIANTS
from rewrites import RULES, STREAMABILITY


ALL = list(RULES.values()) + list(STREAMABILITY)
_PROVED: dict = {}  # proof module -> its result, shared by the rules that share a module


def proved(rule):
    return prove_rule(rule, _PROVED)


@pytest.fixture(scope="module")
def wrong():
    return prove_wrong()


def test_every_rule_names_a_proof_module():
    from proofs import all_rules
    assert [r.name for r in all_rules()] == [r.name for r in ALL]  # what prove_all proves
    assert {r.proof for r in ALL} == {
        f"proofs.{m}" for m in ("group_partition", "stream_partition", "sum_contraction",
                                "max_reduce", "logsumexp", "softmax_contraction",
                                "normalized_contraction", "relabel_level", "recognize",
                                "recompute", "softmax_lse", "split_stream", "split_sum", "untie")}


# one test per rule, so the proofs spread over the workers
@pytest.mark.parametrize("rule", ALL, ids=[r.name for r in ALL])
def test_the_rule_proves_with_symbolic_and_numeric_obligations(rule):
    r = proved(rule)
    assert isinstance(r, ProofResult) and r.rule == rule.name and r.module == rule.proof
    assert r.ok, r.summary()
    kinds = {o.kind for o in r.obligations}
    assert "numeric" in kinds, r.rule
    assert kinds & {"symbolic", "structure"}, r.rule
    assert r.statement, f"{r.module} has no docstring statement"
    if r.rule in ("softmax_contraction", "logsumexp", "max", "sum_contraction",
                  "stream_partition"):
        descs = " ".join(o.description for o in r.obligations)
        assert "accumulator law update(state(x), y) = state(x ⊕ y)" in descs
        # every accumulator has a merge, proved symbolically and on splits in float64
        assert "merge law merge(state(x), state(y)) = state(x ⊕ y) = merge(state(y), state(x))" \
            in descs  # in either order: a ring over devices folds its chunks rotated
        if r.rule != "stream_partition":
            assert "merged splits = f" in descs


def test_wrong_variants_fail(wrong):
    accumulators = [r for r in wrong if r.module == "proofs.wrong_variants"]
    assert [r.rule for r in accumulators] == list(VARIANTS)  # the driver runs every variant
    for r in accumulators:
        assert not r.ok, r.summary()
        failed = [o.description for o in r.failed]
        if "merge" in r.rule:  # a right stream with a wrong merge: only the merge fails
            assert failed and all("merge" in d for d in failed), r.summary()
            assert {o.kind for o in r.failed} == {"symbolic", "numeric"}, r.summary()
            assert "merge law" in r.detail and "counterexample" in r.detail
            continue
        assert any("accumulator law" in d for d in failed), r.summary()
        assert any(o.kind == "numeric" for o in r.failed), r.summary()
        # the detail names the failed obligation and shows a counterexample
        assert "accumulator law" in r.detail and "counterexample" in r.detail
        # one chunk is computed right: the base case is not what catches them
        base = [o for o in r.obligations if "base case" in o.description]
        assert base and all(o.ok for o in base)


def test_wrong_recognitions_fail(wrong):
    """Plausible but wrong recognition entries (the max over one axis and the sum over another;
    a logsumexp without the + m; a mean by the wrong axis's length; a softmax shifted by the
    max of another array along another axis), run through the same obligations as the real
    table: each fails its symbolic check with a counterexample, and numerically."""
    from proofs.recognize import _wrong_table
    mine = [r for r in wrong if r.module == "proofs.recognize"]
    assert [r.rule for r in mine] == [e.name for e, _ in _wrong_table()]
    for r in mine:
        assert not r.ok, r.summary()
        kinds = {o.kind for o in r.failed}
        assert kinds == {"symbolic", "numeric"}, r.summary()
        assert "counterexample" in r.detail, r.summary()
    # ... while the real rule refuses those hosts, naming the premise
    rec = proved(RULES["recognize"])
    premises = [o for o in rec.obligations if o.kind == "premise"]
    assert len(premises) >= 7 and all(o.ok and o.detail.startswith("refused: ") for o in premises)
    words = " ".join(o.detail for o in premises)
    for needle in ("the max reduces v but the sum reduces d", "must read the same array",
                   "the pattern ends in the addition of the max", "but the pattern needs scale(1/v)",
                   "is also an output of the program", "outside the pattern",
                   "the contraction also reduces d"):
        assert needle in words, needle


class _Fake:
    def __init__(self, name, proof):
        self.name, self.proof = name, proof


def test_missing_proof_module_is_a_failure():
    (r,) = prove_all([_Fake("imaginary_rule", "proofs.no_such_proof")])
    assert not r.ok
    assert r.rule == "imaginary_rule"
    assert "proofs.no_such_proof" in r.detail and "no module" in r.detail


def test_bad_proof_attributes_are_failures():
    for attr in ("", "os.path", None):
        r = prove_rule(_Fake("odd", attr))
        assert not r.ok and "proof" in r.detail
    r = prove_rule(_Fake("no_prove", "proofs._core"))   # a module without prove()
    assert not r.ok and "prove()" in r.detail


def test_empty_result_is_not_ok():
    assert not ProofResult("nothing").ok


def test_streaming_keeps_low_precision_output_dtypes():
    from proofs import logsumexp, max_reduce, softmax_contraction, sum_contraction
    from proofs._core import stream_rule
    for D in (max_reduce.generic("bf16"), logsumexp.generic("bf16"),
              softmax_contraction.generic("bf16"), sum_contraction.reduction("mean", "bf16")):
        st = stream_rule(D, "x")
        assert st.rewritten.cod == D.cod, (D.cod, st.rewritten.cod)


def test_a_counterexample_is_one_of_the_claim_not_of_its_canonical_form(monkeypatch):
    """The canonical forms' many terms can cancel past what sympy.N evaluates a Max to (a
    sink's saved L: 2.1e-13 at one point where mpmath at 400 digits gives 3e-398).  A
    residue nonzero where the claim as written is 0 is no counterexample; a claim nonzero
    there still is."""
    import sympy
    import proofs._core as core
    x, y = sympy.symbols("x y", real=True)
    monkeypatch.setattr(core, "_CANON", (("off", lambda e: e + sympy.Rational(1, 10**9)),))
    ok, how = core.decide_zero(sympy.Max(x, y) + sympy.Min(x, y) - x - y)
    assert "counterexample" not in how
    ok, how = core.decide_zero(sympy.Max(x, y) - x)
    assert not ok and "counterexample" in how
