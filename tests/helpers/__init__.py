"""Shared test helpers: tiny checkpoints, packs, manifests and pairs that tests and benches write (imported as
``tests.helpers.<module>``; pyproject's ``pythonpath = ["."]`` puts the repository root on the path)."""
