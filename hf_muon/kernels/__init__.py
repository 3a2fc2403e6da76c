"""Numerical kernels: Newton–Schulz orthogonalization and its cost. Imports nothing else of hf_muon."""

from .newton_schulz import ns_flops, orthogonalize, orthogonalize_flops, resolve_method

__all__ = ["ns_flops", "orthogonalize", "orthogonalize_flops", "resolve_method"]
