"""Newton–Schulz orthogonalization: the one numerical kernel Muon needs.

``orthogonalize(G)`` maps a (batch of) matrix ``G = U S V^T`` to approximately ``U V^T`` using only
matrix products, so it runs well in bf16 on any accelerator. Every matrix of a batch is handled
independently; callers stack same-shape matrices into one call so the products run batched.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Keller Jordan's quintic: one polynomial applied ``steps`` times. Its slope at zero is maximal, so
# small singular values grow fast; the result has singular values in roughly [0.7, 1.2], not 1.
QUINTIC = (3.4445, -4.7750, 2.0315)

# Polar Express (Amsel et al., 2025, arXiv:2505.16932): a different optimal polynomial per
# iteration, converging to singular values of 1. Divided by a 1.01 safety factor (except the last,
# which repeats) for bf16 round-off, as in the paper's reference code.
_POLAR_EXPRESS_RAW = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
POLAR_EXPRESS = tuple((a / 1.01, b / 1.01**3, c / 1.01**5) for a, b, c in _POLAR_EXPRESS_RAW[:-1]) + (
    _POLAR_EXPRESS_RAW[-1],
)

NS_COEFFICIENT_SETS = ("quintic", "polar_express")
NORM_EPS = 1e-7


def coefficient_schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) used at each of ``steps`` iterations for coefficient set ``name``."""
    if name == "quintic":
        return [QUINTIC] * steps
    if name == "polar_express":
        return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
    raise ValueError(f"ns_coefficients must be one of {NS_COEFFICIENT_SETS}, got {name!r}")


def orthogonalize(
    G: Tensor, steps: int = 5, coefficients: str = "quintic", dtype: torch.dtype | None = torch.bfloat16
) -> Tensor:
    """Approximate the orthogonal polar factor of each matrix in ``G`` (shape ``[..., rows, cols]``).

    Each matrix is divided by its Frobenius norm (so its spectral norm is at most 1), transposed
    if tall so the Gram matrix ``X X^T`` is the small one, then iterated
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. Runs in ``dtype`` (``None`` keeps G's dtype)
    and returns that dtype; callers cast back.
    """
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    schedule = coefficient_schedule(coefficients, steps)
    X = G.to(dtype) if dtype is not None else G.clone()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    # Polar Express's coefficients assume the slightly tighter bound its reference code uses.
    bound = 1.01 if coefficients == "polar_express" else 1.0
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * bound).clamp(min=NORM_EPS)
    batched = X.ndim > 2
    if X.ndim > 3:
        X = X.reshape(-1, *X.shape[-2:])
    for a, b, c in schedule:
        A = X @ X.mT
        if batched:
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B, X, beta=a)
        else:
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
    if tall:
        X = X.mT
    return X.reshape(G.shape) if X.ndim != G.ndim else X
