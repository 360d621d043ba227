import os
import tempfile

import jax

# References and proofs compare in float64.
jax.config.update("jax_enable_x64", True)

# napkin.jit's program cache: one of the test run's own, never the user's (~/.cache/napkin)
os.environ["NAPKIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="napkin-cache-")
