import jax

# References and proofs compare in float64.
jax.config.update("jax_enable_x64", True)
