import os
import tempfile

import jax
import pytest

# References and proofs compare in float64.
jax.config.update("jax_enable_x64", True)

# a defect of the cost model raises (napkin.search.engine.STRICT), never passes for a
# program's refusal
os.environ["NAPKIN_STRICT"] = "1"

# napkin.jit's program cache: one of the test run's own, never the user's (~/.cache/napkin)
os.environ["NAPKIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="napkin-cache-")


@pytest.fixture(autouse=True)
def _searches_afresh_around_a_patch(request):
    """A test that patches napkin (a broken rule, a smaller grid) searches afresh, and leaves
    no answer found under its patch to later tests: the search keeps its answers per process
    (napkin.search.engine._ANSWERS)."""
    from napkin.search import forget_searches
    patched = "monkeypatch" in request.fixturenames
    if patched:
        forget_searches()
    yield
    if patched:
        forget_searches()
