"""How algorithms are stated: traced Python over symbolic arrays (``trace``, ``ops``), weaving
over extra axes, the library of algorithms with their plain-jnp references, sampling their
inputs, and plain JAX functions read into diagrams (``jaxpr``: napkin.from_jax)."""
