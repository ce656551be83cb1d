"""The JAX side of jaxps (``jaxps.ops``): the push_pull primitive."""
