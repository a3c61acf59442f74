"""latentspeed's benchmarks and the reference-model builder (importable for their tests)."""
