"""Newton–Schulz orthogonalization: the one numerical kernel Muon needs.

``orthogonalize(G)`` maps a (batch of) matrix ``G = U S V^T`` to approximately ``U V^T`` using only
matrix products, so it runs well in bf16 on any accelerator. Every matrix of a batch is handled
independently; callers stack same-shape matrices into one call so the products run batched.
"""

from __future__ import annotations

import functools

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


NS_METHODS = ("auto", "standard", "gram")
# Gram iterations only where they cost at most this fraction of the standard ones' FLOPs: near the
# break-even point (about cols = 1.5 * rows at 5 steps) the cheaper count is not a faster run.
_GRAM_MAX_FLOP_RATIO = 0.9
# In bf16/fp16 the Gram iterations restart (X <- Q X0, then A <- X X^T afresh) after the first 2
# steps and then every 3. Rounding makes the carried A_k slightly indefinite, and the polynomial
# multiplies those spurious eigenvalues by about a^2 = 12 per step: run through 5 steps, a rank-1
# plus noise matrix ends 20x farther from its polar factor than with the standard iteration. A
# fresh X X^T is positive semidefinite again; with the restarts the error is the standard form's.
_LOW_PRECISION_FIRST_SEGMENT, _LOW_PRECISION_SEGMENT = 2, 3


def gram_segments(steps: int, dtype: torch.dtype) -> list[int]:
    """How many steps each run of Gram iterations takes before the next restart, in ``dtype``."""
    if dtype in (torch.float32, torch.float64):
        return [steps]
    segments: list[int] = []
    while sum(segments) < steps:
        size = _LOW_PRECISION_SEGMENT if segments else _LOW_PRECISION_FIRST_SEGMENT
        segments.append(min(size, steps - sum(segments)))
    return segments


def ns_matmuls(rows: int, cols: int, steps: int, method: str,
               dtype: torch.dtype = torch.float32) -> list[tuple[int, int, int]]:
    """The matrix products ``(m, k, n)`` (an ``m x k`` times ``k x n``) one Newton–Schulz run on a
    ``rows x cols`` matrix in ``dtype`` executes with ``method`` ("standard" or "gram"), in order.
    Their FLOPs are ``sum(2 * m * k * n)``; benchmarks time the same products bare as the machine's
    limit."""
    m, n = min(rows, cols), max(rows, cols)
    if method == "standard":
        return [(m, n, m), (m, m, m), (m, m, n)] * steps
    if method == "gram":
        products = []
        for segment in gram_segments(steps, dtype):
            products.append((m, n, m))  # A <- X X^T
            for i in range(segment):
                products.append((m, m, m))  # A @ A
                if i > 0:
                    products.append((m, m, m))  # Q <- B @ Q
                if i < segment - 1:
                    products += [(m, m, m), (m, m, m)]  # A <- B @ (A @ B)
            products.append((m, m, n))  # X <- Q X
        return products
    raise ValueError(f"method must be 'standard' or 'gram' here, got {method!r}")


def ns_flops(rows: int, cols: int, steps: int, method: str, dtype: torch.dtype = torch.float32) -> int:
    """Floating-point operations of one Newton–Schulz run (2 per multiply-add of every product)."""
    return sum(2 * m * k * n for m, k, n in ns_matmuls(rows, cols, steps, method, dtype))


def resolve_method(rows: int, cols: int, steps: int, dtype: torch.dtype, method: str = "auto") -> str:
    """The iteration ``orthogonalize`` runs: ``"auto"`` picks Gram iterations (with restarts in
    bf16/fp16, see :func:`gram_segments`) where they execute at most 0.9x the standard iteration's
    FLOPs, i.e. for clearly wide (or tall) matrices; the standard ones otherwise."""
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {NS_METHODS}, got {method!r}")
    if method != "auto":
        return method
    gram, standard = ns_flops(rows, cols, steps, "gram", dtype), ns_flops(rows, cols, steps, "standard")
    return "gram" if gram <= _GRAM_MAX_FLOP_RATIO * standard else "standard"


@functools.lru_cache(maxsize=4096)  # the owner plan asks once per matrix per plan: shapes repeat
def orthogonalize_flops(rows: int, cols: int, steps: int, dtype: torch.dtype = torch.float32,
                        method: str = "auto") -> int:
    """FLOPs :func:`orthogonalize` really executes on one ``rows x cols`` matrix in ``dtype``: the
    iteration :func:`resolve_method` picks (Gram where it is cheaper, with its bf16/fp16 restarts).
    The owner plan balances this cost, so it matches the work each owner rank does."""
    return ns_flops(rows, cols, steps, resolve_method(rows, cols, steps, dtype, method), dtype)


def orthogonalize(
    G: Tensor,
    steps: int = 5,
    coefficients: str = "quintic",
    dtype: torch.dtype | None = torch.bfloat16,
    method: str = "auto",
) -> Tensor:
    """Approximate the orthogonal polar factor of each matrix in ``G`` (shape ``[..., rows, cols]``).

    Each matrix is divided by its Frobenius norm (so its spectral norm is at most 1), transposed
    if tall so the Gram matrix ``X X^T`` is the small one, then iterated
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``. Runs in ``dtype`` (``None`` keeps G's dtype)
    and returns that dtype; callers cast back.

    ``method="gram"`` computes the same iterates differently: every ``A_k`` and the accumulated
    ``Q_k`` with ``X_k = Q_k X_0`` are polynomials of ``X_0 X_0^T``, so they commute and
    ``A_{k+1} = B_k A_k B_k``, ``Q_{k+1} = B_k Q_k`` (``B_k = a I + b A_k + c A_k^2``) run on
    ``rows x rows`` matrices only; the wide matrix is touched twice (``X_0 X_0^T`` and ``Q X_0``)
    instead of twice per step. At 5 steps that is 0.66x the FLOPs for ``cols = 3 rows`` and 0.56x
    for ``cols = 4 rows`` (0.74x and 0.67x in bf16/fp16, which restart once; see
    :func:`gram_segments`). ``"auto"`` (see :func:`resolve_method`) chooses per shape and dtype.
    """
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix or a batch of matrices, got shape {tuple(G.shape)}")
    schedule = coefficient_schedule(coefficients, steps)
    # Scale each matrix by a power of two to a largest entry in [0.5, 1): exact (so results are
    # unchanged), and it keeps inputs of 1e-30 or 1e30 from underflowing or overflowing in the norm
    # below or in the cast to bf16/fp16. A zero matrix stays zero.
    exponent = torch.frexp(G.detach().abs().amax(dim=(-2, -1), keepdim=True)).exponent
    X = torch.ldexp(G, -exponent)
    X = X.to(dtype) if dtype is not None else X
    method = resolve_method(X.size(-2), X.size(-1), steps, X.dtype, method)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    # Polar Express's coefficients assume the slightly tighter bound its reference code uses.
    bound = 1.01 if coefficients == "polar_express" else 1.0
    X = X / (X.norm(dim=(-2, -1), keepdim=True) * bound).clamp(min=NORM_EPS)
    batched = X.ndim > 2
    if X.ndim > 3:
        X = X.reshape(-1, *X.shape[-2:])
    if method == "gram":
        done = 0
        for segment in gram_segments(steps, X.dtype):
            X = _gram_iterations(X, schedule[done:done + segment])
            done += segment
    else:
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


def _gram_iterations(X0: Tensor, schedule: list[tuple[float, float, float]]) -> Tensor:
    """Newton–Schulz on ``X0`` (``[rows, cols]`` or ``[batch, rows, cols]``, rows <= cols) through
    its Gram matrix: returns ``Q X0`` with ``Q = B_{s-1} ... B_0`` (see :func:`orthogonalize`)."""
    mm = torch.bmm if X0.ndim == 3 else torch.mm
    addmm = torch.baddbmm if X0.ndim == 3 else torch.addmm
    A = mm(X0, X0.mT)
    Q = None
    last = len(schedule) - 1
    for i, (a, b, c) in enumerate(schedule):
        B = addmm(A, A, A, beta=b, alpha=c)
        B.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = B if Q is None else mm(B, Q)
        if i < last:
            A = mm(B, mm(A, B))
    return mm(Q, X0)
