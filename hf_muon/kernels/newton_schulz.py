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

# How each matrix is brought to spectral norm <= 1 before the iterations. "frobenius" divides by the
# Frobenius norm. "aol" (Turbo-Muon, Boissin et al. 2025, arXiv:2512.04632) rescales each row by
# s_i = 1 / sqrt(sum_j |A_ij|), A = X X^T (Prach & Lampert 2022, arXiv:2208.03160): spectral norm
# <= 1 with the top singular values nearer 1 than after the Frobenius norm, and A is the Gram matrix
# the first iteration needs anyway (reused as diag(s) A diag(s)), so it costs only elementwise work.
NS_PRECONDITIONERS = ("aol", "frobenius")
# The steps each preconditioner runs by default: AOL drops one iteration (Turbo-Muon's choice). Against
# 5 Frobenius steps, 4 AOL steps' polar error is 0.93-1.48x on Gaussian matrices but 1.06-1.28x
# (quintic) and 1.5-2.4x (Polar Express) on gradient-like ones (rank 4 plus noise, decaying spectra):
# their tiny singular values grow by about the polynomial's slope per step, which AOL does not make
# up. So Frobenius stays the default (tests/test_newton_schulz.py states the measured margins).
DEFAULT_NS_STEPS = {"aol": 4, "frobenius": 5}
DEFAULT_NS_PRECONDITION = "frobenius"
# Rows whose sum_j |A_ij| is below this (zero rows) are scaled by 1/sqrt(it): they stay (near) zero.
# (In fp16 the floor is 4 / 65504, so that s_i s_j cannot overflow.)
AOL_EPS = NORM_EPS**2


def default_ns_steps(precondition: str) -> int:
    """The Newton–Schulz steps ``precondition`` runs when the caller does not say (AOL 4, Frobenius 5)."""
    check_precondition(precondition)
    return DEFAULT_NS_STEPS[precondition]


def check_precondition(precondition: str) -> None:
    """Raise ``ValueError`` unless ``precondition`` is one of :data:`NS_PRECONDITIONERS`."""
    if precondition not in NS_PRECONDITIONERS:
        raise ValueError(f"ns_precondition must be one of {NS_PRECONDITIONERS}, got {precondition!r}")


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


def ns_matmuls(rows: int, cols: int, steps: int, method: str, dtype: torch.dtype = torch.float32,
               precondition: str = "frobenius") -> list[tuple[int, int, int]]:
    """The matrix products ``(m, k, n)`` (an ``m x k`` times ``k x n``) one Newton–Schulz run on a
    ``rows x cols`` matrix in ``dtype`` executes with ``method`` ("standard" or "gram"), in order.
    Their FLOPs are ``sum(2 * m * k * n)``; benchmarks time the same products bare as the machine's
    limit. Both preconditioners run the same products: AOL's ``X X^T`` is the first iteration's
    (standard) or the first segment's (Gram) Gram matrix, reused, and its rescaling is elementwise."""
    check_precondition(precondition)
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


def ns_flops(rows: int, cols: int, steps: int, method: str, dtype: torch.dtype = torch.float32,
             precondition: str = "frobenius") -> int:
    """Floating-point operations of one Newton–Schulz run (2 per multiply-add of every product)."""
    if not (isinstance(steps, int) and steps >= 1) or min(rows, cols) < 0:
        raise ValueError(f"ns_flops needs steps >= 1 and sizes >= 0, got steps={steps!r}, {rows} x {cols}")
    return sum(2 * m * k * n for m, k, n in ns_matmuls(rows, cols, steps, method, dtype, precondition))


def resolve_method(rows: int, cols: int, steps: int, dtype: torch.dtype, method: str = "auto",
                   precondition: str = "frobenius") -> str:
    """The iteration ``orthogonalize`` runs: ``"auto"`` picks Gram iterations (with restarts in
    bf16/fp16, see :func:`gram_segments`) where they execute at most 0.9x the standard iteration's
    FLOPs, i.e. for clearly wide (or tall) matrices; the standard ones otherwise."""
    if method not in NS_METHODS:
        raise ValueError(f"method must be one of {NS_METHODS}, got {method!r}")
    if method != "auto":
        return method
    gram = ns_flops(rows, cols, steps, "gram", dtype, precondition)
    standard = ns_flops(rows, cols, steps, "standard", dtype, precondition)
    return "gram" if gram <= _GRAM_MAX_FLOP_RATIO * standard else "standard"


@functools.lru_cache(maxsize=4096)  # the owner plan asks once per matrix per plan: shapes repeat
def orthogonalize_flops(rows: int, cols: int, steps: int, dtype: torch.dtype = torch.float32,
                        method: str = "auto", precondition: str = "frobenius") -> int:
    """FLOPs :func:`orthogonalize` really executes on one ``rows x cols`` matrix in ``dtype``: the
    iteration :func:`resolve_method` picks (Gram where it is cheaper, with its bf16/fp16 restarts).
    The owner plan balances this cost, so it matches the work each owner rank does."""
    method = resolve_method(rows, cols, steps, dtype, method, precondition)
    return ns_flops(rows, cols, steps, method, dtype, precondition)


def orthogonalize(
    G: Tensor,
    steps: int | None = None,
    coefficients: str = "quintic",
    dtype: torch.dtype | None = torch.bfloat16,
    method: str = "auto",
    precondition: str = "frobenius",
) -> Tensor:
    """Approximate the orthogonal polar factor of each matrix in ``G`` (shape ``[..., rows, cols]``).

    Each matrix is transposed if tall so the Gram matrix ``X X^T`` is the small one, brought to
    spectral norm at most 1 by ``precondition``, then iterated ``X <- a X + (b A + c A^2) X`` with
    ``A = X X^T``, ``steps`` times (``None``: :data:`DEFAULT_NS_STEPS`, 4 for ``"aol"`` and 5 for
    ``"frobenius"``). ``"frobenius"`` divides by the Frobenius norm; ``"aol"`` scales row ``i`` by
    ``1 / sqrt(sum_j |A_ij|)`` and reuses ``A`` rescaled for the first iteration (a better start at
    no extra product) and drops the schedule's first polynomial (Polar Express starts at its
    second). AOL is not the default: 4 AOL steps are less accurate than 5 Frobenius ones on
    gradient-like matrices (see :data:`DEFAULT_NS_STEPS`). Runs in ``dtype`` (``None`` keeps G's
    dtype) and returns that dtype; callers cast back.

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
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"orthogonalize runs in bfloat16, float16, float32 or float64, got dtype={dtype}")
    if not G.is_floating_point():  # scaled in G's dtype below: an integer G would be truncated to zeros
        raise ValueError(f"orthogonalize needs a floating-point G, got {G.dtype}: cast it first")
    check_precondition(precondition)
    steps = DEFAULT_NS_STEPS[precondition] if steps is None else steps
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if G.numel() == 0:  # a matrix with no rows or columns (e.g. nn.Linear(8, 0)) has nothing to orthogonalize
        return G.to(dtype if dtype is not None else G.dtype, copy=True)
    # AOL drops the first iteration of the usual schedule (Turbo-Muon): its start is already past
    # where that iteration leads, so Polar Express begins at its second polynomial.
    skipped = 1 if precondition == "aol" else 0
    schedule = coefficient_schedule(coefficients, steps + skipped)[skipped:]
    # Scale each matrix by a power of two to a largest entry in [0.5, 1): exact (so results are
    # unchanged), and it keeps inputs of 1e-30 or 1e30 from underflowing or overflowing in the norm
    # below or in the cast to bf16/fp16. A zero matrix stays zero.
    X = (G * _power_of_two_scale(G)).to(G.dtype)  # exact: a no-op but for fp16, scaled in float32
    X = X.to(dtype) if dtype is not None else X
    method = resolve_method(X.size(-2), X.size(-1), steps, X.dtype, method, precondition)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    batched = X.ndim > 2
    if X.ndim > 3:
        X = X.reshape(-1, *X.shape[-2:])
    # Polar Express's coefficients assume the slightly tighter bound its reference code uses.
    bound = 1.01 if coefficients == "polar_express" else 1.0
    if precondition == "aol":
        X, A = _aol_rescale(X, bound)
    else:
        X, A = X / (X.norm(dim=(-2, -1), keepdim=True) * bound).clamp(min=NORM_EPS), None
    if method == "gram":
        done = 0
        for segment in gram_segments(steps, X.dtype):
            X = _gram_iterations(X, schedule[done:done + segment], A)
            A = None  # later segments restart from a fresh X X^T
            done += segment
    else:
        for a, b, c in schedule:
            if A is None:
                A = X @ X.mT
            if batched:
                B = torch.baddbmm(A, A, A, beta=b, alpha=c)
                X = torch.baddbmm(X, B, X, beta=a)
            else:
                B = torch.addmm(A, A, A, beta=b, alpha=c)
                X = torch.addmm(X, B, X, beta=a)
            A = None
    if tall:
        X = X.mT
    return X.reshape(G.shape) if X.ndim != G.ndim else X


def _power_of_two_scale(G: Tensor) -> Tensor:
    """``2^-e`` per matrix of ``G`` (shape ``[..., 1, 1]``), ``e`` the exponent of its largest entry, in
    G's dtype where that holds it exactly (bf16, fp32, fp64: ``G * scale`` is then one plain multiply;
    ``torch.ldexp(G, -e)`` took 5x as long on a bf16 batch), else (fp16, where ``2^16`` overflows) in
    float32. For subnormal matrices
    ``2^-e`` would overflow: the scale stops at the largest finite power of two."""
    G = G.detach()
    work = torch.float64 if G.dtype == torch.float64 else torch.float32
    # max |g| as max(amax, -amin): two fast reductions, no |G| temporary (an inf-norm is slower on CPU)
    largest = torch.maximum(G.amax(dim=(-2, -1), keepdim=True), -G.amin(dim=(-2, -1), keepdim=True)).to(work)
    largest_power = 1023 if work == torch.float64 else 127  # 2^this is the largest finite power of two
    exponent = (-torch.frexp(largest).exponent).clamp(max=largest_power)
    scale = torch.ldexp(torch.ones_like(largest), exponent)
    return scale.to(G.dtype) if G.dtype in (torch.bfloat16, torch.float32, torch.float64) else scale


def _aol_rescale(X: Tensor, bound: float = 1.0) -> tuple[Tensor, Tensor]:
    """AOL: ``(diag(s) X, diag(s) A diag(s))`` with ``A = X X^T``, ``s_i = 1 / (bound sqrt(sum_j |A_ij|))``.

    ``||diag(s) X||_2 <= 1 / bound`` (Prach & Lampert 2022, Theorem 1: ``diag(s) A diag(s)`` has
    row sums of absolute values at most 1, which bounds its largest eigenvalue). ``A`` is computed
    once, in X's dtype, and returned rescaled for the first iteration: the same as recomputing it
    from the scaled X up to rounding. The row sums and ``s`` are taken in float32 (bf16 sums of
    ``cols`` terms would lose the bound)."""
    A = X @ X.mT
    row_sums = A.abs().sum(dim=-1, dtype=torch.float64 if A.dtype == torch.float64 else torch.float32)
    # s_i s_j must stay finite in X's dtype (fp16 tops out at 65504), or a zero row would give 0 * inf
    eps = max(AOL_EPS, 4.0 / torch.finfo(X.dtype).max)
    s = row_sums.clamp(min=eps).rsqrt() / bound
    X = X * s.unsqueeze(-1).to(X.dtype)
    A = A * (s.unsqueeze(-1) * s.unsqueeze(-2)).to(A.dtype)
    return X, A


def _gram_iterations(X0: Tensor, schedule: list[tuple[float, float, float]], A: Tensor | None = None) -> Tensor:
    """Newton–Schulz on ``X0`` (``[rows, cols]`` or ``[batch, rows, cols]``, rows <= cols) through
    its Gram matrix (``A``, ``X0 X0^T`` computed here unless given): returns ``Q X0`` with
    ``Q = B_{s-1} ... B_0`` (see :func:`orthogonalize`)."""
    mm = torch.bmm if X0.ndim == 3 else torch.mm
    addmm = torch.baddbmm if X0.ndim == 3 else torch.addmm
    A = mm(X0, X0.mT) if A is None else A
    Q = None
    last = len(schedule) - 1
    for i, (a, b, c) in enumerate(schedule):
        B = addmm(A, A, A, beta=b, alpha=c)
        B.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = B if Q is None else mm(B, Q)
        if i < last:
            A = mm(B, mm(A, B))
    return mm(Q, X0)
