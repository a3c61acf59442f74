"""A small trained DeepSeek-V3-architecture reference model, built offline from text the host
already has: ``python -m benchmarks.reference_model.train --out DIR`` (see ``train.py``)."""
