"""Weights: streaming a checkpoint, the quantize stage, the shipped export modules of a target or of its parts."""
