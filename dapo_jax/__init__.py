"""dapo-jax: DAPO (arXiv 2503.14476) reinforcement learning for language models in JAX."""
