"""Test rigs: helpers only tests use (the product and the benchmarks never import them)."""
