"""Numerical kernels: Newton–Schulz orthogonalization."""
