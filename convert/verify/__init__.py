"""Verification: package checks against the torch modules, the transformers reference, the statistical gates."""
