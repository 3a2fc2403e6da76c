"""Reliability: the README's bad-input table (each row a test), fp16 loss-scaling overflows, Newton–Schulz
properties (hypothesis), determinism."""

import os
import re
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from hf_muon import Muon
from hf_muon.kernels.newton_schulz import orthogonalize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 16))


def loss_of(model, seed=0):
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(seed))
    return model(ids).logsumexp(-1).mean()


def snapshot(model, optimizer):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items()}
    return params, state


def same(a, b):
    return a[0].keys() == b[0].keys() and all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and \
        a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# ---------------------------------------------------------------------------------------------------------------
# The bad-input table. Each row: (id, what a user does, what they get). The README's "Reliability" table lists
# the same ids; test_readme_lists_every_row keeps the two in step.


def _muon(**kw):
    return lambda: Muon(mlp(), **kw)


def _optim_args(text):
    from hf_muon.integrations.transformers import check_optim_args

    return lambda: check_optim_args(text)


def _ds(config, optim="muon"):
    from hf_muon.integrations.deepspeed_config import check_deepspeed_config

    return lambda: check_deepspeed_config(config, optim)


def _step_with(grad_value):
    def run():
        model = mlp()
        optimizer = Muon(model, lr=0.1)
        loss_of(model).backward()
        optimizer.step()
        before = snapshot(model, optimizer)
        loss_of(model, 1).backward()
        model[1].weight.grad[0, 0] = grad_value
        with pytest.warns(UserWarning, match="skipped a step with non-finite gradients"):
            optimizer.step()
        assert optimizer.skipped_steps == 1 and same(before, snapshot(model, optimizer))
    return run


def _step_on(param, grad):
    def run():
        p = param
        optimizer = Muon([{"params": [p], "algorithm": "adamw"}])
        p.grad = grad
        optimizer.step()
    return run


def _frozen_and_empty():
    model = mlp()
    model[1].weight.requires_grad_(False)
    optimizer = Muon(model, lr=0.1)
    optimizer.add_param_group({"params": [], "param_names": [], "algorithm": "muon"})
    frozen = model[1].weight.detach().clone()
    loss_of(model).backward()
    optimizer.step()
    assert torch.equal(model[1].weight, frozen) and model[1].weight not in optimizer.state


def _checkpoint(damage):
    def run():
        import tempfile

        from hf_muon.checkpoint import load_portable, save_portable

        with tempfile.TemporaryDirectory() as d:
            model = mlp()
            optimizer = Muon(model)
            loss_of(model).backward()
            optimizer.step()
            save_portable(optimizer, model, d)
            if damage == "split":
                load_portable(Muon(model, force_adamw=r"^3\."), model, d)
            else:
                os.remove(os.path.join(d, "hf_muon_state", "tensors.safetensors"))
                load_portable(Muon(model), model, d)
    return run


def _use_muon_attribute():
    model = mlp()
    model[1].weight.use_muon = True
    with pytest.warns(UserWarning, match="removing the 'use_muon' attribute"):
        Muon(model)
    assert not hasattr(model[1].weight, "use_muon")


BAD_INPUTS = [
    ("lr-negative", "Muon(params, lr=-1)", _muon(lr=-1.0), ValueError, "lr must be a finite number >= 0"),
    ("lr-string", "Muon(params, lr='1e-3')", _muon(lr="1e-3"), ValueError, "lr must be a finite number"),
    ("lr-bool", "Muon(params, lr=True)", _muon(lr=True), ValueError, "lr must be a finite number"),
    ("betas-one", "betas=(0.9,)", _muon(betas=(0.9,)), ValueError, r"betas must be a pair \(beta1, beta2\)"),
    ("weight-decay-negative", "weight_decay=-0.1", _muon(weight_decay=-0.1), ValueError,
     "weight_decay must be a finite number >= 0"),
    ("weight-decay-inf", "weight_decay=float('inf')", _muon(weight_decay=float("inf")), ValueError,
     "weight_decay must be a finite number >= 0"),
    ("momentum-one", "momentum=1.0", _muon(momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    ("ns-steps-zero", "ns_steps=0", _muon(ns_steps=0), ValueError, "ns_steps must be an integer"),
    ("ns-coefficients", "ns_coefficients='cubic'", _muon(ns_coefficients="cubic"), ValueError,
     "ns_coefficients must be one of"),
    ("ns-precondition", "ns_precondition='newton'", _muon(ns_precondition="newton"), ValueError,
     "ns_precondition must be one of"),
    ("ns-precondition-fn", "ns_precondition='aol' with a 4-argument orthogonalize_fn",
     _muon(ns_precondition="aol", orthogonalize_fn=lambda g, steps, coefficients, dtype: g), ValueError,
     "needs an orthogonalize_fn that takes the keyword 'precondition'"),
    ("ns-dtype", "ns_dtype='int8'", _muon(ns_dtype="int8"), ValueError, "ns_dtype must be one of"),
    ("adjust-lr", "adjust_lr='rms'", _muon(adjust_lr="rms"), ValueError, "adjust_lr must be one of"),
    ("betas", "betas=(1.0, 0.999)", _muon(betas=(1.0, 0.999)), ValueError, r"betas must each be in \[0, 1\)"),
    ("eps", "eps=-1e-8", _muon(eps=-1e-8), ValueError, "eps must be a finite number >= 0"),
    ("adamw-lr", "adamw_lr=-1", _muon(adamw_lr=-1.0), ValueError, "adamw_lr must be a finite number >= 0"),
    ("ns-split", "ns_split='rows'", _muon(ns_split="rows"), ValueError, "ns_split must be one of"),
    ("bucket-bytes", "bucket_bytes=0", _muon(bucket_bytes=0), ValueError, "bucket_bytes must be > 0"),
    ("exchange-flops-per-byte", "exchange_flops_per_byte=0", _muon(exchange_flops_per_byte=0), ValueError,
     "exchange_flops_per_byte must be a positive number"),
    ("comm-dtype", "comm_dtype=torch.int8", _muon(comm_dtype=torch.int8), ValueError, "comm_dtype must be None"),
    ("orthogonalize-fn", "orthogonalize_fn='ns'", _muon(orthogonalize_fn="ns"), TypeError,
     "orthogonalize_fn must be callable"),
    ("process-group-alone", "process_group=... with distributed=False",
     _muon(process_group=object(), distributed=False), ValueError, "process_group needs distributed=True"),
    ("empty-params", "Muon([])", lambda: Muon([]), ValueError, "empty parameter list"),
    ("single-tensor", "Muon(torch.zeros(3, 3))", lambda: Muon(nn.Parameter(torch.zeros(3, 3))), TypeError,
     "not a single Tensor"),
    ("force-without-model", "Muon(tensors, force_muon='x')",
     lambda: Muon(list(mlp().parameters()), force_muon="x"), ValueError, "need the model"),
    ("force-no-match", "Muon(model, force_adamw='q_prj')", _muon(force_adamw="q_prj"), ValueError,
     "matches no parameter"),
    ("vector-pinned-to-muon", "a 1-D tensor in a group pinned to 'muon'",
     lambda: Muon([{"params": [nn.Parameter(torch.zeros(4))], "algorithm": "muon"}]), ValueError,
     "Muon needs matrices"),
    ("unknown-algorithm", "a group with 'algorithm': 'sgd'",
     lambda: Muon([{"params": [nn.Parameter(torch.zeros(4))], "algorithm": "sgd"}]), ValueError,
     "'algorithm' must be one of"),
    ("use-muon-key", "a group with DeepSpeed's 'use_muon' key",
     lambda: Muon([{"params": [nn.Parameter(torch.zeros(4, 4))], "use_muon": True}]), ValueError,
     "'use_muon' key"),
    ("use-muon-attribute", "a parameter carrying DeepSpeed's use_muon attribute", _use_muon_attribute, None,
     "warning; attribute removed"),
    ("group-without-algorithm", "add_param_group of matrices without 'algorithm'",
     lambda: Muon(mlp()).add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))]}), ValueError,
     "must set 'algorithm'"),
    ("frozen-and-empty", "frozen parameters and an empty group", _frozen_and_empty, None, "trains the rest"),
    ("nan-gradient", "a NaN gradient", _step_with(float("nan")), None, "step skipped, counted, warned"),
    ("inf-gradient", "an Inf gradient", _step_with(float("inf")), None, "step skipped, counted, warned"),
    ("complex-parameter", "a complex parameter",
     _step_on(nn.Parameter(torch.zeros(2, dtype=torch.complex64)), torch.ones(2, dtype=torch.complex64)), ValueError,
     "does not support complex"),
    ("sparse-gradient", "a sparse gradient (Embedding(sparse=True))",
     _step_on(nn.Parameter(torch.zeros(3, 2)), torch.ones(3, 2).to_sparse()), ValueError, "sparse gradients"),
    ("optim-args-key", "--optim_args warmup=3", _optim_args("warmup=3"), ValueError, "is not a Muon setting"),
    ("optim-args-form", "--optim_args momentum", _optim_args("momentum"), ValueError, "is not key=value"),
    ("optim-args-value", "--optim_args momentum=high", _optim_args("momentum=high"), ValueError,
     "not a valid value"),
    ("optim-args-range", "--optim_args momentum=1.5", _optim_args("momentum=1.5"), ValueError,
     r"momentum must be in \[0, 1\)"),
    ("optim-args-regex", "--optim_args force_adamw=(", _optim_args("force_adamw=("), ValueError,
     "not a valid regular expression"),
    ("optim-args-twice", "--optim_args momentum=0.9,momentum=0.5", _optim_args("momentum=0.9,momentum=0.5"),
     ValueError, "sets momentum twice"),
    ("ds-optimizer-block", "DS config with an \"optimizer\" block and --optim muon",
     _ds({"optimizer": {"type": "AdamW", "params": {}}}), ValueError, "silently ignore --optim muon"),
    ("ds-own-muon", "DS config \"type\": \"Muon\"", _ds({"optimizer": {"type": "Muon"}}), ValueError,
     "always DeepSpeed's own Muon"),
    ("ds-cpu-adam", "DS optimizer offload (DeepSpeedCPUAdam swap)",
     _ds({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}), ValueError,
     "DeepSpeedCPUAdam"),
    ("checkpoint-split", "resume a checkpoint of another parameter split", _checkpoint("split"), ValueError,
     "different model or parameter split"),
    ("checkpoint-partial", "resume a checkpoint missing its tensors", _checkpoint("partial"), ValueError,
     "cannot be read"),
    ("ns-vector", "orthogonalize(torch.zeros(4))", lambda: orthogonalize(torch.zeros(4)), ValueError,
     "needs a matrix"),
]


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input(row):
    _, _, action, error, message = row
    if error is None:  # accepted: the row's action asserts what happens
        action()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(error, match=message):
            action()


def test_readme_lists_every_row():
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("## Reliability"):]
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", table, flags=re.M)
    assert sorted(listed) == sorted(r[0] for r in BAD_INPUTS)
    assert len(listed) >= 25


# ---------------------------------------------------------------------------------------------------------------
# fp16 loss scaling: torch.amp.GradScaler on CPU


def scaled_step(model, optimizer, scaler, seed, autocast=False):
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = loss_of(model, seed)
    scaler.scale(loss).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()


def test_fp16_overflows_skip_count_and_recover():
    """fp16 autocast at a huge loss scale: gradients overflow; each such step changes nothing and is
    counted in skipped_steps (GradScaler calls Muon's step, which sees the overflow); the scaler backs
    off until steps go through, and training goes on."""
    model = mlp()
    optimizer = Muon(model, lr=0.05, ns_dtype="float32")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60, backoff_factor=2.0 ** -8, growth_interval=1000)
    skipped = steps = 0
    for seed in range(40):
        before, scale = snapshot(model, optimizer), scaler.get_scale()
        scaled_step(model, optimizer, scaler, seed, autocast=True)
        if scaler.get_scale() < scale:
            skipped += 1
            assert same(before, snapshot(model, optimizer)), "an overflowing step changed something"
        else:
            steps += 1
            assert not same(before, snapshot(model, optimizer))
        if steps == 3:
            break
    assert steps == 3 and skipped >= 2 and optimizer.skipped_steps == skipped
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_grad_scaler_unscales_exactly_and_skips_an_injected_inf():
    model, reference = mlp(), mlp()
    optimizer = Muon(model, lr=0.05, ns_dtype="float32")
    plain = Muon(reference, lr=0.05, ns_dtype="float32")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scaled_step(model, optimizer, scaler, 0)
    loss_of(reference, 0).backward()
    plain.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    before = snapshot(model, optimizer)
    scaler.scale(loss_of(model, 1)).backward()
    model[3].bias.grad[0] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        scaler.step(optimizer)
    scaler.update()
    assert same(before, snapshot(model, optimizer)) and optimizer.skipped_steps == 1
    assert scaler.get_scale() == 2.0 ** 15


# ---------------------------------------------------------------------------------------------------------------
# Newton–Schulz properties (hypothesis)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Where 5 quintic steps put the singular values that started above 5% of the largest, measured on 8,000
# random low-rank matrices: the standard iteration stays in [0.67, 1.20] in fp32 and bf16. bf16 Gram
# iterations ("auto" picks them for wide matrices) overshoot on rank-deficient inputs, up to 2.11 (a 7x2
# of rank 2; 1.75 at 32x128): a known weakness of low-precision Gram iterations, left to the kernel work.
BANDS = {("float32", "standard"): (0.6, 1.25), ("float32", "gram"): (0.6, 1.25), ("float32", "auto"): (0.6, 1.25),
         ("bfloat16", "standard"): (0.6, 1.25), ("bfloat16", "gram"): (0.55, 2.3), ("bfloat16", "auto"): (0.55, 2.3)}


@st.composite
def matrices(draw):
    rows = draw(st.sampled_from([1, 2, 3, 7, 16, 33]))
    cols = draw(st.sampled_from([1, 2, 5, 16, 31, 64]))
    rank = draw(st.integers(0, min(rows, cols)))
    scale = 10.0 ** draw(st.integers(-30, 30))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g) if rank else torch.zeros(rows, cols)
    return m * scale, rank


# derandomize: the same 200 examples on every run (CI must not turn red on a new draw); searched with
# random draws while writing (4 x 2,000 examples).
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(matrices(), st.sampled_from(list(DTYPES)), st.sampled_from(["standard", "gram", "auto"]))
def test_newton_schulz_is_finite_and_lands_in_its_band(case, dtype, method):
    g, rank = case
    out = orthogonalize(g, 5, "quintic", DTYPES[dtype], method=method).double()
    assert out.shape == g.shape and torch.isfinite(out).all()
    if rank == 0:
        assert out.abs().max() == 0
        return
    s_in = torch.linalg.svdvals(g.double() / g.double().abs().max())
    s_out = torch.linalg.svdvals(out)
    strong = int((s_in > 1e-3 * s_in[0]).sum())
    if dtype != "float16":  # fp16 has 10 mantissa bits: only finiteness is promised
        low, high = BANDS[dtype, method]
        assert s_out[0] <= high, s_out
        if strong and s_in[strong - 1] > 0.05 * s_in[0]:  # a well-conditioned input reaches the band
            assert s_out[:strong].min() >= low, (s_in, s_out)
    if dtype == "float32":  # never more directions than the input has (bf16/fp16 rounding adds some)
        assert int((s_out > 1e-2).sum()) <= rank


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(-30, 30), st.sampled_from(list(DTYPES)))
def test_newton_schulz_ignores_the_scale(exponent, dtype):
    torch.manual_seed(0)
    g = torch.randn(12, 20)
    a = orthogonalize(g * 2.0 ** (exponent * 3), 5, "quintic", DTYPES[dtype]).float()
    b = orthogonalize(g, 5, "quintic", DTYPES[dtype]).float()
    assert torch.equal(a, b)  # scaling by a power of two is exact, and NS removes it exactly


# ---------------------------------------------------------------------------------------------------------------
# Determinism


def test_two_runs_with_one_seed_are_bit_identical():
    def run():
        model = mlp()
        optimizer = Muon(model, lr=0.05)
        for step in range(4):
            loss_of(model, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        return snapshot(model, optimizer)

    assert same(run(), run())
