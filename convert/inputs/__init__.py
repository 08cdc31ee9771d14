"""Inputs: recipes and their contracts and gate bars, checkpoint sources (Hugging Face cache, local), Prism packs."""
