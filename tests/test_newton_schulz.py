"""The Newton–Schulz kernel: orthogonality, batching, tall matrices."""

import pytest
import torch

from hf_muon import orthogonalize
from hf_muon.kernels.newton_schulz import coefficient_schedule


def singular_values(x):
    return torch.linalg.svdvals(x.double())


@pytest.mark.parametrize("shape, steps", [((32, 128), 8), ((128, 32), 8), ((64, 64), 10)])
def test_polar_express_converges_to_orthogonal(shape, steps):
    # a square Gaussian matrix has singular values near 0: it needs more iterations
    torch.manual_seed(0)
    g = torch.randn(shape)
    s = singular_values(orthogonalize(g, steps=steps, coefficients="polar_express", dtype=torch.float32))
    assert s.min() > 0.97 and s.max() < 1.03


@pytest.mark.parametrize("shape", [(48, 96), (32, 128), (128, 32)])
def test_quintic_lands_in_its_band(shape):
    torch.manual_seed(0)
    g = torch.randn(shape)
    o = orthogonalize(g, steps=5, coefficients="quintic", dtype=torch.float32)
    assert o.shape == g.shape
    s = singular_values(o)
    assert s.min() > 0.6 and s.max() < 1.25


def test_result_approximates_polar_factor_direction():
    torch.manual_seed(0)
    g = torch.randn(48, 96)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = (u @ vh).float()
    o = orthogonalize(g, steps=8, coefficients="polar_express", dtype=torch.float32)
    assert ((o - polar).norm() / polar.norm()) < 0.05


def test_batched_equals_one_by_one():
    torch.manual_seed(0)
    g = torch.randn(5, 24, 40)
    batched = orthogonalize(g, dtype=torch.float32)
    single = torch.stack([orthogonalize(m, dtype=torch.float32) for m in g])
    assert torch.allclose(batched, single, atol=1e-5)


def test_bf16_default_and_errors():
    assert orthogonalize(torch.randn(8, 4)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(8))
    with pytest.raises(ValueError, match="ns_coefficients"):
        coefficient_schedule("cubic", 5)
    assert len(coefficient_schedule("polar_express", 10)) == 10


@pytest.mark.parametrize("coefficients, steps", [("quintic", 5), ("polar_express", 8)])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (3, 32, 128), (2, 2, 20, 70), (24, 24)])
def test_gram_iterations_equal_standard_ones(shape, coefficients, steps):
    torch.manual_seed(0)
    g = torch.randn(shape, dtype=torch.float64)
    standard = orthogonalize(g, steps, coefficients, torch.float64, method="standard")
    gram = orthogonalize(g, steps, coefficients, torch.float64, method="gram")
    assert gram.shape == g.shape
    assert ((gram - standard).norm() / standard.norm()) < 1e-10


def test_auto_method_picks_gram_for_wide_matrices():
    from hf_muon.kernels.newton_schulz import gram_segments, ns_flops, resolve_method

    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_method(512, 1536, 5, dtype) == "gram"
        assert resolve_method(1536, 512, 5, dtype) == "gram"
        assert resolve_method(512, 512, 5, dtype) == "standard"
    assert ns_flops(512, 1536, 5, "gram") < 0.7 * ns_flops(512, 1536, 5, "standard")
    assert ns_flops(512, 1536, 5, "gram", torch.bfloat16) < 0.75 * ns_flops(512, 1536, 5, "standard")
    assert gram_segments(5, torch.float32) == [5]
    assert gram_segments(5, torch.bfloat16) == [2, 3] and gram_segments(8, torch.float16) == [2, 3, 3]
    with pytest.raises(ValueError, match="method"):
        orthogonalize(torch.randn(4, 8), method="cubic")


def _polar_error(o, g):
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    polar = u @ vh
    return ((o.double() - polar).norm() / polar.norm()).item()


@pytest.mark.parametrize("shape", [(128, 512), (1536, 512)])
def test_bf16_gram_iterations_are_as_accurate_as_standard_ones(shape):
    # A rank-1 momentum plus small noise: its tiny singular values are where bf16 Gram iterations
    # without restarts diverge (relative error about 20 instead of 0.8).
    torch.manual_seed(0)
    m, n = shape
    g = torch.randn(m, 1) @ torch.randn(1, n) * 10 + torch.randn(m, n) * 0.1
    standard = _polar_error(orthogonalize(g, 5, "quintic", torch.bfloat16, method="standard"), g)
    gram = _polar_error(orthogonalize(g, 5, "quintic", torch.bfloat16, method="gram"), g)
    assert gram < 1.02 * standard
    s = singular_values(orthogonalize(g, 5, "quintic", torch.bfloat16, method="gram"))
    assert s.max() < 1.25
