"""Model-aware pieces: what a model's structure says (which modules are attention, how heads are laid out).

Importing this package is cheap; each module imports torch/transformers only when used.
"""
