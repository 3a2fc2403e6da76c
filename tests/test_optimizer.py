"""hf_muon.Muon against the definitions it promises: torch.optim.Muon's update and torch.optim.AdamW's."""

import copy
import io
import math
import subprocess
import sys

import pytest
import torch
from torch import nn

from hf_muon import Muon
from hf_muon.kernels.newton_schulz import QUINTIC
from hf_muon.optimizer.muon import lr_scale, resolve_ns_dtype


def reference_muon_step(p, grad, buf, *, lr, wd, momentum=0.95, nesterov=True, steps=5, rule="match_rms_adamw"):
    """torch.optim.Muon's per-matrix update written out, in float32 throughout."""
    buf.lerp_(grad, 1 - momentum)
    u = grad.lerp(buf, momentum) if nesterov else buf.clone()
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / x.norm().clamp(min=1e-7)
    a, b, c = QUINTIC
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    o = x.T if u.shape[0] > u.shape[1] else x
    rows, cols = p.shape
    scale = 0.2 * math.sqrt(max(rows, cols)) if rule == "match_rms_adamw" else math.sqrt(max(1, rows / cols))
    p.mul_(1 - lr * wd)
    p.add_(o, alpha=-lr * scale)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_fp32_matches_reference_definition(nesterov, rule):
    torch.manual_seed(0)
    shapes = [(32, 16), (16, 48), (24, 24), (16, 48)]  # tall, wide, square, and a repeated shape (batched)
    params = [torch.randn(s) for s in shapes]
    ref = [p.clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    leaves = [nn.Parameter(p) for p in params]
    opt = Muon([{"params": leaves, "algorithm": "muon"}], lr=0.02, weight_decay=0.1, nesterov=nesterov,
               ns_dtype=torch.float32, adjust_lr=rule)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for leaf, g in zip(leaves, grads):
            leaf.grad = g.clone()
        opt.step()
        for r, g, b in zip(ref, grads, bufs):
            reference_muon_step(r, g, b, lr=0.02, wd=0.1, nesterov=nesterov, rule=rule)
    for leaf, r in zip(leaves, ref):
        assert rel(leaf.detach(), r) < 1e-5


@pytest.mark.parametrize("ns_dtype", [None, "bfloat16"])
def test_default_dtype_matches_torch_muon(ns_dtype):
    # None is the dtype policy (bf16, or fp32 on CPUs without bf16 matmul); torch.optim.Muon always uses bf16
    torch.manual_seed(0)
    shapes = [(64, 32), (32, 96), (48, 48)]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = Muon([{"params": ours, "algorithm": "muon"}], lr=0.01, weight_decay=0.1, ns_dtype=ns_dtype)
    ref = torch.optim.Muon(theirs, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        # bf16 vs bf16 (or fp32); batching, op order and Gram iterations differ at bf16 round-off
        assert rel(a.detach(), b.detach()) < 2e-2
        assert torch.allclose(a, b, atol=3e-2)


@pytest.mark.parametrize("foreach", [None, False, True])
def test_adamw_half_is_bit_for_bit_torch_adamw(foreach):
    torch.manual_seed(0)
    shapes = [(7,), (3,), ()]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    kw = dict(lr=3e-3, weight_decay=0.05, betas=(0.8, 0.99), eps=1e-7, foreach=foreach)
    opt = Muon([{"params": ours, "algorithm": "adamw"}], **kw)
    ref = torch.optim.AdamW(theirs, **kw)
    for _ in range(6):
        for a, b in zip(ours, theirs):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    for a, b in zip(ours, theirs):
        assert torch.equal(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"])


def test_adamw_lr_applies_to_adamw_half_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = Muon(model, lr=0.02, adamw_lr=3e-4)
    lrs = {g["algorithm"]: g["lr"] for g in opt.param_groups}
    assert lrs == {"muon": 0.02, "adamw": 3e-4}


def test_conv_weight_is_one_matrix_and_experts_one_per_expert():
    torch.manual_seed(0)
    conv = nn.Parameter(torch.randn(8, 3, 3, 3))
    experts = nn.Parameter(torch.randn(4, 12, 6))
    opt = Muon([{"params": [conv], "algorithm": "muon"},
                {"params": [experts], "algorithm": "muon", "stacked": True}],
               lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, ns_dtype=torch.float32)
    conv.grad, experts.grad = torch.randn_like(conv), torch.randn_like(experts)
    c0, e0 = conv.detach().clone(), experts.detach().clone()
    g_conv, g_exp = conv.grad.clone(), experts.grad.clone()
    opt.step()
    # conv: one 8 x 27 matrix; experts: 4 independent 12 x 6 matrices
    ref_c = c0.reshape(8, 27).clone()
    reference_muon_step(ref_c, g_conv.reshape(8, 27), torch.zeros(8, 27), lr=0.1, wd=0.0, momentum=0.0, nesterov=False)
    assert rel(conv.detach().reshape(8, 27), ref_c) < 1e-5
    for e in range(4):
        ref_e = e0[e].clone()
        reference_muon_step(ref_e, g_exp[e], torch.zeros(12, 6), lr=0.1, wd=0.0, momentum=0.0, nesterov=False)
        assert rel(experts.detach()[e], ref_e) < 1e-5


def test_same_shape_updates_of_different_dtypes_share_a_batch():
    from hf_muon.kernels.newton_schulz import orthogonalize
    from hf_muon.optimizer.muon import orthogonalize_all

    torch.manual_seed(0)
    updates = [torch.randn(16, 48), torch.randn(16, 48).to(torch.bfloat16), torch.randn(16, 48).half()]
    together = orthogonalize_all(updates, False, 5, "quintic", torch.float32)
    for u, o in zip(updates, together):
        assert o.dtype == torch.float32 and o.shape == u.shape
        assert torch.allclose(o, orthogonalize(u.float(), 5, "quintic", torch.float32), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mixed_precision_parameters_train(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(dtype)
    # AdamW's default eps=1e-8 is 0 in fp16 (so torch.optim.AdamW divides by zero too): use 1e-4 there
    opt = Muon(model, lr=1e-2, eps=1e-4 if dtype == torch.float16 else 1e-8)
    x = torch.randn(64, 16, dtype=dtype)
    y = torch.randn(64, 16, dtype=dtype)
    losses = []
    for _ in range(20):
        loss = (model(x).float() - y.float()).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(v.dtype == dtype for s in opt.state.values() for k, v in s.items() if k != "step")
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", ["muon", "adamw"])
def test_non_finite_gradients_leave_everything_untouched(bad, where):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = Muon(model, lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    (model[0].weight.grad if where == "muon" else model[1].bias.grad).view(-1)[3] = bad
    with pytest.warns(UserWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1
    after = opt.state_dict()
    for k, s in before["state"].items():
        for name, v in s.items():
            assert torch.equal(v, after["state"][k][name])
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)


def _train(model, opt, batches):
    for x in batches:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_state_dict_round_trip_and_resume_is_exact():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    batches = [torch.randn(5, 8) for _ in range(8)]

    straight = copy.deepcopy(base)
    opt = Muon(straight, lr=1e-2)
    _train(straight, opt, batches)

    first = copy.deepcopy(base)
    opt1 = Muon(first, lr=1e-2)
    _train(first, opt1, batches[:4])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)

    resumed = copy.deepcopy(base)
    resumed.load_state_dict(saved["model"])
    opt2 = Muon(resumed, lr=1e-2)
    opt2.load_state_dict(saved["opt"])
    assert opt2.state_dict()["param_groups"] == opt1.state_dict()["param_groups"]
    _train(resumed, opt2, batches[4:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_state_holds_momentum_for_muon_and_moments_for_adamw():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = Muon(model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    assert set(opt.state[model[0].weight]) == {"momentum_buffer"}
    for p in (model[0].bias, model[1].weight, model[1].bias):
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "lr must be"),
        (dict(momentum=1.0), "momentum must be in"),
        (dict(momentum=-0.1), "momentum must be in"),
        (dict(weight_decay=-1), "weight_decay"),
        (dict(ns_coefficients="cubic"), "ns_coefficients must be one of"),
        (dict(adjust_lr="spectral"), "adjust_lr must be one of"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_steps=5.0), "ns_steps"),
        (dict(ns_precondition="spectral"), "ns_precondition must be one of"),
        (dict(ns_dtype="int8"), "ns_dtype"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(adamw_lr=-1e-3), "adamw_lr"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Muon(nn.Linear(4, 4), **kwargs)


def test_complex_and_sparse_gradients_are_refused():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Muon([{"params": emb.parameters(), "algorithm": "adamw"}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    z = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    opt = Muon([{"params": [z], "algorithm": "muon"}])
    z.grad = torch.randn_like(z)
    with pytest.raises(ValueError, match="complex"):
        opt.step()


def test_pinned_muon_group_refuses_vectors_and_use_muon_key():
    with pytest.raises(ValueError, match="1-D"):
        Muon([{"params": [nn.Parameter(torch.zeros(3))], "algorithm": "muon"}])
    with pytest.raises(ValueError, match="use_muon"):
        Muon([{"params": [nn.Parameter(torch.zeros(3, 3))], "use_muon": True}])


def test_use_muon_attribute_is_removed_with_a_warning():
    lin = nn.Linear(4, 4)
    lin.weight.use_muon = True
    with pytest.warns(UserWarning, match="use_muon"):
        Muon(lin)
    assert not hasattr(lin.weight, "use_muon")


def test_bare_tensors_warn_that_embeddings_cannot_be_identified():
    params = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(4))]
    with pytest.warns(UserWarning, match="without their model"):
        opt = Muon(params)
    assert sorted(g["algorithm"] for g in opt.param_groups) == ["adamw", "muon"]


def test_a_pinned_muon_group_reads_stacked_experts_from_the_model():
    """A group pinned to 'muon' without 'stacked' holding a MoE's stacked experts orthogonalizes each
    expert on its own, as Muon(model) does (not the stack as one matrix); experts and a convolution in
    one such group are refused; 3-D tensors without their model are read as convolutions, with a
    warning that names 'stacked'."""
    import transformers as T

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(T.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=3, vocab_size=50))
    experts = [p for p in model.parameters() if p.ndim == 3]
    rest = [p for p in model.parameters() if p.ndim != 3]
    assert len(experts) == 2
    reference = copy.deepcopy(model)
    for a, b in zip(model.parameters(), reference.parameters()):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    Muon(reference, lr=0.1, weight_decay=0.0).step()
    model_before = [e.detach().clone() for e in experts]
    pinned = Muon([{"params": experts, "algorithm": "muon"}, {"params": rest}], model=model, lr=0.1, weight_decay=0.0)
    assert pinned.param_groups[0]["stacked"] is True
    pinned.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert not torch.equal(experts[0], model_before[0])

    conv = nn.Conv1d(4, 4, 3)
    both = nn.ModuleDict({"model": model, "conv": conv})
    with pytest.raises(ValueError, match="stacked MoE experts and other tensors .* a group of their own"):
        Muon([{"params": experts + [conv.weight], "algorithm": "muon"}], model=both)
    with pytest.warns(UserWarning, match=r"1 Muon tensor\(s\) of 3 or more dimensions without their model "
                                         r"\(\(3, 96, 32\)\): each is read as one matrix"):
        Muon([{"params": experts[:1], "algorithm": "muon"}])
    with pytest.warns(UserWarning, match=r"without their model.*\(3, 96, 32\).*'stacked': True"):
        Muon([nn.Parameter(torch.zeros(3, 96, 32))])
    assert Muon([{"params": experts[:1], "algorithm": "muon", "stacked": True}]).param_groups[0]["stacked"] is True
    # a state saved while such a group read the stack as one matrix: the model's stacks stay stacks
    old = Muon([{"params": experts, "algorithm": "muon", "stacked": False}, {"params": rest}], model=model)
    new = Muon([{"params": experts, "algorithm": "muon"}, {"params": rest}], model=model)
    with pytest.warns(UserWarning, match="group 0 was saved orthogonalizing its stacked experts as one matrix"):
        new.load_state_dict(old.state_dict())
    assert new.param_groups[0]["stacked"] is True


@pytest.mark.parametrize("shape", [(8, 0), (0, 8)])
def test_a_matrix_with_no_rows_or_columns_steps(shape):
    """``nn.Linear(0, 8)`` (or ``(8, 0)``) has nothing to orthogonalize: it steps like the others."""
    model = nn.Sequential(nn.Linear(shape[1], shape[0]), nn.Linear(shape[0], 4), nn.Linear(4, 4))
    opt = Muon(model, lr=0.1)
    before = model[2].weight.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert model[0].weight.shape == shape and not torch.equal(model[2].weight, before)
    # a fused weight with no rows: Phi-3's gate | up at intermediate_size=0, two empty blocks
    import transformers as T

    phi3 = T.AutoModelForCausalLM.from_config(T.Phi3Config(hidden_size=32, intermediate_size=0, num_hidden_layers=1,
                                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                                           pad_token_id=0))
    opt = Muon(phi3, lr=0.1)
    assert opt.fused_blocks()["model.layers.0.mlp.gate_up_proj.weight"].sizes() == [0, 0]
    phi3(torch.randint(0, 50, (1, 4))).logits.sum().backward()
    opt.step()


def test_meta_parameters_step():
    """A model on the meta device (a dry run of the optimizer's code) steps, as torch's optimizers do."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    opt = Muon(model, lr=0.1)
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt.step()
    assert opt.skipped_steps == 0 and all(p.is_meta for p in model.parameters())


def test_a_state_from_before_multihead_attention_got_muon_names_the_way_to_resume(tmp_path):
    """Checkpoints written while nn.MultiheadAttention's input projections were AdamW (stood in for by
    force_adamw) are refused, saying which force_adamw resumes them; with it they load."""
    from hf_muon.checkpoint import CheckpointError, load_portable, save_portable

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 32), nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
                          nn.Linear(32, 16))
    before = Muon(model, force_adamw=r"in_proj_weight$")
    model(torch.randint(0, 16, (2, 5))).sum().backward()
    before.step()
    save_portable(before, model, str(tmp_path))
    hint = r"force_adamw=r'\(in\|q\|k\|v\)_proj_weight\$'"
    with pytest.raises(ValueError, match="holds other parameters than when saved.*" + hint):
        Muon(model).load_state_dict(before.state_dict())
    with pytest.raises(CheckpointError, match="in_proj_weight: adamw in the checkpoint, muon now.*" + hint):
        load_portable(Muon(model), model, str(tmp_path))
    Muon(model, force_adamw=r"(in|q|k|v)_proj_weight$").load_state_dict(before.state_dict())
    load_portable(Muon(model, force_adamw=r"(in|q|k|v)_proj_weight$"), model, str(tmp_path))


def test_ns_dtype_policy(monkeypatch):
    from hf_muon.optimizer import muon

    monkeypatch.setattr(muon, "cpu_multiplies_bf16_natively", lambda: False)
    assert resolve_ns_dtype(None, torch.device("cpu")) == torch.float32
    monkeypatch.setattr(muon, "cpu_multiplies_bf16_natively", lambda: True)
    assert resolve_ns_dtype(None, torch.device("cpu")) == torch.bfloat16
    assert resolve_ns_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_ns_dtype("bf16", torch.device("cpu")) == torch.bfloat16


def test_lr_scale_rules():
    assert lr_scale(1024, 256, "match_rms_adamw") == pytest.approx(0.2 * 32)
    assert lr_scale(1024, 256, "original") == pytest.approx(2.0)
    assert lr_scale(256, 1024, "original") == pytest.approx(1.0)


def test_every_update_scales_with_lr():
    # DCP's optimizer-state loader runs one step with zero grads and lr=0: nothing may move.
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    opt = Muon(model, lr=0.0, weight_decay=0.1)
    model(torch.randn(2, 8)).sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_import_is_cheap_and_does_not_import_deepspeed():
    code = "import sys, hf_muon; print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_orthogonalize_fn_is_injectable():
    from hf_muon.kernels import orthogonalize

    calls = []

    def counting(G, steps, coefficients, dtype):
        calls.append((tuple(G.shape), steps, coefficients, dtype))
        return orthogonalize(G, steps, coefficients, dtype)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 16))
    reference = copy.deepcopy(model)
    batches = [torch.randn(5, 8) for _ in range(3)]
    _train(model, Muon(model, lr=1e-2, ns_dtype=torch.float32, orthogonalize_fn=counting), batches)
    _train(reference, Muon(reference, lr=1e-2, ns_dtype=torch.float32), batches)
    # one batched call per shape per step: (16, 8) alone, the two 16 x 16 together
    assert sorted(calls[:2]) == [((1, 16, 8), 5, "quintic", torch.float32), ((2, 16, 16), 5, "quintic", torch.float32)]
    assert len(calls) == 2 * len(batches)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    with pytest.raises(TypeError, match="orthogonalize_fn"):
        Muon(model, orthogonalize_fn="quintic")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))


@pytest.mark.parametrize("kwargs, steps, precondition", [
    ({}, 5, "frobenius"), (dict(ns_precondition="aol"), 4, "aol"), (dict(ns_precondition="frobenius"), 5, "frobenius"),
    (dict(ns_precondition="aol", ns_steps=5), 5, "aol"), (dict(ns_steps=3), 3, "frobenius")])
def test_ns_steps_follow_the_preconditioner_unless_given(kwargs, steps, precondition):
    opt = Muon(_mlp(), **kwargs)
    muon = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    assert all(g["ns_steps"] == steps and g["ns_precondition"] == precondition for g in muon)
    assert all(type(g["ns_steps"]) is int for g in opt.param_groups)
    # a group's own preconditioner picks its own default steps; its explicit steps win
    model = _mlp()
    opt = Muon([{"params": [model[0].weight], "algorithm": "muon", "ns_precondition": "aol"},
                {"params": [model[2].weight], "algorithm": "muon", "ns_steps": 7},
                {"params": [model[3].weight], "algorithm": "muon"}], ns_precondition="frobenius")
    assert [(g["ns_steps"], g["ns_precondition"]) for g in opt.param_groups] == [(4, "aol"), (7, "frobenius"),
                                                                                  (5, "frobenius")]


def test_aol_step_is_the_kernel_with_aol():
    """Muon(ns_precondition="aol") runs orthogonalize(..., 4, precondition="aol"): one step matches the
    reference update written with the kernel, and differs from the Frobenius default's."""
    from hf_muon.kernels import orthogonalize

    model = nn.Linear(24, 40, bias=False)
    grad = torch.randn(40, 24)
    expected = model.weight.detach() - 0.01 * lr_scale(40, 24, "match_rms_adamw") * orthogonalize(
        grad, 4, "quintic", torch.float32, precondition="aol")
    for precondition, same_as_expected in (("aol", True), ("frobenius", False)):
        p = nn.Parameter(model.weight.detach().clone())
        opt = Muon([{"params": [p], "algorithm": "muon"}], lr=0.01, weight_decay=0.0, momentum=0.0, nesterov=False,
                   ns_dtype=torch.float32, ns_precondition=precondition)
        p.grad = grad.clone()
        opt.step()
        assert torch.allclose(p.detach(), expected, atol=1e-6) == same_as_expected


def test_orthogonalize_fn_may_take_the_preconditioner():
    from hf_muon.kernels import orthogonalize

    seen = []

    def with_precondition(G, steps, coefficients, dtype, precondition="frobenius"):
        seen.append((steps, precondition))
        return orthogonalize(G, steps, coefficients, dtype, precondition=precondition)

    model = _mlp()
    _train(model, Muon(model, lr=1e-2, ns_precondition="aol", orthogonalize_fn=with_precondition),
           [torch.randn(5, 8)])
    assert seen and set(seen) == {(4, "aol")}
    with pytest.raises(ValueError, match="takes the keyword 'precondition'"):
        Muon(model, ns_precondition="aol", orthogonalize_fn=lambda G, steps, coefficients, dtype: G)


def test_state_saved_before_ns_precondition_existed_loads_as_frobenius():
    """An optimizer state_dict written before this option (groups without "ns_precondition") loads, and
    its groups keep running what they ran: Frobenius, with the steps they saved."""
    model = _mlp()
    opt = Muon(model, lr=1e-2, ns_precondition="aol")
    _train(model, opt, [torch.randn(5, 8)])
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        del group["ns_precondition"]
        group["ns_steps"] = 5
    fresh = Muon(model, lr=1e-2, ns_precondition="aol")
    fresh.load_state_dict(old)
    assert all(g["ns_precondition"] == "frobenius" and g["ns_steps"] == 5 for g in fresh.param_groups)
    _train(model, fresh, [torch.randn(5, 8)])


def test_optim_args_take_ns_precondition():
    from hf_muon.integrations.transformers import check_optim_args

    assert check_optim_args("ns_precondition=aol") == {"ns_precondition": "aol"}
    assert check_optim_args("ns_precondition=aol,ns_steps=6") == {"ns_precondition": "aol", "ns_steps": 6}
    with pytest.raises(ValueError, match="ns_precondition must be one of"):
        check_optim_args("ns_precondition=newton")
    assert check_optim_args("exchange_flops_per_byte=1.2e4") == {"exchange_flops_per_byte": 12000.0}
    with pytest.raises(ValueError, match="exchange_flops_per_byte must be a positive number"):
        check_optim_args("exchange_flops_per_byte=-1")
    assert check_optim_args("exchange_flops_per_byte=auto") == {"exchange_flops_per_byte": "auto"}
    with pytest.raises(ValueError, match=r'"auto" \(measured at the first step\) or None, got \'fast\''):
        Muon(nn.Linear(4, 4), exchange_flops_per_byte="fast")


def test_groups_keep_ns_dtype_by_name():
    # a torch.dtype in a group made torch.distributed.checkpoint's full optimizer state dict raise
    # "Unexpected value type <class 'torch.dtype'>"
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = Muon([{"params": [model[0].weight], "algorithm": "muon"},
                {"params": [model[1].weight], "algorithm": "muon", "ns_dtype": torch.float32},
                {"params": [model[0].bias, model[1].bias], "algorithm": "adamw"}], ns_dtype=torch.float64)
    assert [g["ns_dtype"] for g in opt.param_groups] == ["float64", "float32", "float64"]
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    assert full["param_groups"][0]["ns_dtype"] == "float64"
    # a state dict saved with the dtype itself (before) loads, and the group keeps the name
    saved = opt.state_dict()
    saved["param_groups"][0]["ns_dtype"] = torch.float64
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["ns_dtype"] == "float64"


def test_groups_added_later_follow_adamw_lr_and_the_naming():
    # AdamW groups added later took lr instead of adamw_lr; on Muon(model) (named groups) a group without
    # names failed with torch's "all optimizer param groups should be with/without names"
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    opt = Muon(model, lr=1e-2, adamw_lr=1e-3)
    with pytest.raises(ValueError, match="give the new group 'param_names'"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(4))], "algorithm": "adamw"})
    opt.add_param_group({"params": [nn.Parameter(torch.randn(4))], "param_names": ["scale"]})
    opt.add_param_group({"params": [nn.Parameter(torch.randn(4, 4))], "param_names": ["extra"], "algorithm": "muon"})
    assert [g["lr"] for g in opt.param_groups[-2:]] == [1e-3, 1e-2]
    unnamed = Muon(list(model.parameters()), model=model, adamw_lr=1e-3)
    with pytest.raises(ValueError, match="add the group without 'param_names'"):
        unnamed.add_param_group({"params": [nn.Parameter(torch.randn(4))], "param_names": ["s"]})


def test_a_state_of_the_other_construction_says_so():
    # the message blamed force_muon/force_adamw: the groups only came in another order. They are not
    # matched up by name: a learning-rate scheduler's state would keep the saved order (lrs swapped)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    opt = Muon(model)
    model[2](model[1](model[0](torch.tensor([1, 2])))).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match=r"same param groups in another order \(\['muon', 'adamw'\] when saved"):
        Muon(model.parameters()).load_state_dict(opt.state_dict())


def test_states_through_a_wrapper_load_by_their_model_names():
    """Names the user gave carry a wrapper's prefix (``_orig_mod.``), the model's own do not: a state of
    Muon(compiled.named_parameters()) loads into Muon(compiled.parameters()) and back (they were refused
    as "other parameters"), and another split of equal shapes is still refused."""
    model = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8))
    compiled = torch.compile(model)  # not run: only its names
    named = Muon(compiled.named_parameters(), lr=1e-2)
    assert named.param_groups[0]["param_names"][0].startswith("_orig_mod.")
    Muon(compiled.parameters(), lr=1e-2).load_state_dict(named.state_dict())
    Muon(compiled.named_parameters(), lr=1e-2).load_state_dict(Muon(compiled.parameters(), lr=1e-2).state_dict())
    with pytest.raises(ValueError, match="holds other parameters"):
        Muon(compiled.parameters(), force_adamw=r"^1\.").load_state_dict(
            Muon(compiled.named_parameters(), force_adamw=r"2\.weight").state_dict())


def test_a_state_from_before_ns_split_loads_as_whole_matrices():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    saved = Muon(model).state_dict()
    for group in saved["param_groups"]:
        del group["ns_split"]
    opt = Muon(model)
    opt.load_state_dict(saved)
    assert {g["ns_split"] for g in opt.param_groups} == {"none"}


def test_comm_dtype_is_checked_up_front():
    assert Muon(nn.Linear(4, 4), comm_dtype="bf16").comm_dtype == torch.bfloat16
    assert Muon(nn.Linear(4, 4), comm_dtype=torch.float16).comm_dtype == torch.float16
    assert Muon(nn.Linear(4, 4)).comm_dtype is None
    # an integer dtype trained silently wrong (2.9e-2 from one process); a misspelt name failed at the
    # first distributed step with an AttributeError
    for wrong in (torch.int8, "bfloat"):
        with pytest.raises(ValueError, match="comm_dtype must be None"):
            Muon(nn.Linear(4, 4), comm_dtype=wrong)


def test_summary_names_the_preconditioner():
    from hf_muon.optimizer.summary import describe_optimizer

    line = describe_optimizer(Muon(_mlp(), ns_precondition="aol", ns_dtype="fp32").param_groups, resolve_ns_dtype)
    assert "Newton–Schulz 4 quintic steps (aol) in float32" in line


def test_zero_init_hidden_shapes_are_read_through_the_provider():
    # zero.Init leaves p.shape [0] and keeps the real one in ds_shape: still a hidden matrix for Muon
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6))
    for p in model.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    opt = Muon(model)
    assert {g["algorithm"]: len(g["params"]) for g in opt.param_groups} == {"muon": 1, "adamw": 3}


def test_a_registered_layout_provider_binds_flat_tensors():
    # The optimizer knows no backend: any provider that recognises a flat tensor drives it.
    from hf_muon.distributed.layout import replicated
    from hf_muon.distributed.providers import FlatPartition, LayoutProvider, register_provider, unregister_provider

    torch.manual_seed(0)
    shapes = [(6, 4), (3, 5), (6, 4)]
    matrices = [nn.Parameter(torch.randn(s)) for s in shapes]
    reference = [nn.Parameter(m.detach().clone()) for m in matrices]
    flat = nn.Parameter(torch.cat([m.detach().reshape(-1) for m in matrices]))

    class Flattener(LayoutProvider):
        name = "toy flattener"

        def bind(self, t, group_matrices, stacked):
            if t is not flat:
                return None
            assert group_matrices == matrices
            offsets = [0]
            for s in shapes:
                offsets.append(offsets[-1] + math.prod(s))
            spans = tuple((o, math.prod(s)) for o, s in zip(offsets, shapes))
            return FlatPartition(spans, tuple(replicated(s, stacked, 1) for s in shapes), None, 0, 1, self.name)

    provider = Flattener()
    register_provider(provider)
    try:
        kw = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
        opt = Muon([{"params": matrices, "algorithm": "muon"}], **kw)
        ref = Muon([{"params": reference, "algorithm": "muon"}], **kw)
        opt.param_groups[0]["params"] = [flat]  # what a backend that flattens does
        for _ in range(3):
            grads = [torch.randn(s) for s in shapes]
            flat.grad = torch.cat([g.reshape(-1) for g in grads])
            for r, g in zip(reference, grads):
                r.grad = g.clone()
            opt.step()
            ref.step()
        assert set(opt.state[flat]) == {"momentum_buffer"}  # state keyed by, and shaped like, the flat tensor
        assert torch.allclose(flat.detach(), torch.cat([r.detach().reshape(-1) for r in reference]), atol=1e-6)
    finally:
        unregister_provider(provider)


def test_optimizer_and_lower_layers_import_no_integration():
    # Layers point one way: kernels <- distributed <- optimizer <- integrations (only the root
    # package wires a provider in, by module path).
    import ast
    import pathlib

    import hf_muon

    root = pathlib.Path(hf_muon.__file__).parent
    forbidden = {"kernels": ("integrations", "optimizer", "distributed", "deepspeed"),
                 "distributed": ("integrations", "optimizer", "deepspeed"),
                 "optimizer": ("integrations", "deepspeed")}
    for layer, banned in forbidden.items():
        for path in (root / layer).glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    parts = name.lstrip(".").split(".")
                    assert not any(b in parts for b in banned), f"{path.name} imports {name}"


@pytest.fixture
def gloo_world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:hf_muon.Muon got tensors without their model")
def test_groups_with_the_same_newton_schulz_settings_share_batches():
    from hf_muon.kernels import orthogonalize

    batches = []

    def counting(G, *a, **k):
        batches.append(tuple(G.shape))
        return orthogonalize(G, *a, **k)

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16, bias=False) for _ in range(3)] + [nn.Linear(16, 8, bias=False)]
    reference = copy.deepcopy(layers)
    # per-layer learning rates; the last group orthogonalizes with 4 steps
    settings = [dict(lr=0.01), dict(lr=0.02), dict(lr=0.03), dict(lr=0.02, ns_steps=4)]
    opt = Muon([{"params": [layer.weight], **kw} for layer, kw in zip(layers, settings)],
               ns_dtype=torch.float32, orthogonalize_fn=counting, weight_decay=0.1)
    alone = [Muon([layer.weight], ns_dtype=torch.float32, weight_decay=0.1, **kw)
             for layer, kw in zip(reference, settings)]
    for step in range(2):
        x = torch.randn(5, 16)
        for group_layers, optimizers in ((layers, [opt]), (reference, alone)):
            for o in optimizers:
                o.zero_grad()
            sum(layer(x).pow(2).mean() for layer in group_layers).backward()
            for o in optimizers:
                o.step()
    # one batch of the three 16x16 matrices (three groups), one for the 4-step group's, per step
    assert sorted(batches) == sorted([(3, 16, 16), (1, 8, 16)] * 2)
    for layer, ref in zip(layers, reference):
        torch.testing.assert_close(layer.weight, ref.weight, rtol=1e-5, atol=1e-6)


def test_exchange_is_planned_once_until_its_tensors_change(gloo_world_of_one, monkeypatch):
    from hf_muon.optimizer import muon

    plans, link_costs = [], []
    real = muon.make_exchange
    monkeypatch.setattr(muon, "make_exchange", lambda params, *a, **k: plans.append(len(params))
                        or link_costs.append(k["flops_per_byte"]) or real(params, *a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = Muon(model, lr=1e-2)
    muon_groups = sum(g["algorithm"] == "muon" for g in opt.param_groups)
    _train(model, opt, [torch.randn(5, 8) for _ in range(3)])
    assert len(plans) == muon_groups  # planned at the first step, then reused
    model[2].weight.requires_grad_(False)  # the group's tensors with gradients change: planned again
    model[2].weight.grad = None
    _train(model, opt, [torch.randn(5, 8) for _ in range(2)])
    assert len(plans) == muon_groups + 1 and plans[-1] == plans[0] - 1
    opt.param_groups[0]["ns_steps"] = 4  # a setting the plan costs changes: planned again
    _train(model, opt, [torch.randn(5, 8)])
    assert len(plans) == muon_groups + 2
    opt.exchange_stats = type(opt.exchange_stats)()  # counters reset: the exchange counts into the new ones
    _train(model, opt, [torch.randn(5, 8)])
    assert len(plans) == muon_groups + 3
    opt.exchange_flops_per_byte = 1e4  # the owner plan's link cost: planned again, with it
    _train(model, opt, [torch.randn(5, 8)])
    assert len(plans) == muon_groups + 4 and link_costs[-1] == 1e4 and set(link_costs[:-1]) == {None}
    _train(model, opt, [torch.randn(5, 8)])
    assert len(plans) == muon_groups + 4
    opt.exchange_flops_per_byte = "auto"  # planned again, with what measures the rates when planning
    _train(model, opt, [torch.randn(5, 8)])
    assert len(plans) == muon_groups + 5 and callable(link_costs[-1])
    assert link_costs[-1]([], None, 1, 4) is None and opt.link_rates == []  # a world of one: no link to measure


def test_process_group_is_used_for_replicated_parameters(gloo_world_of_one, monkeypatch):
    from hf_muon.optimizer import muon

    dist = gloo_world_of_one
    group = dist.new_group([0])
    seen = []
    real = muon.make_exchange
    monkeypatch.setattr(muon, "make_exchange", lambda *a, **k: seen.append(a[-1]) or real(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    batches = [torch.randn(5, 8) for _ in range(3)]
    opt = Muon(model, lr=1e-2, process_group=group)
    assert opt.process_group is group
    _train(model, opt, batches)
    _train(reference, Muon(reference, lr=1e-2, distributed=False), batches)
    assert seen and all(g is group for g in seen)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    with pytest.raises(ValueError, match="distributed=True"):
        Muon(model, process_group=group, distributed=False)


def test_process_group_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(ValueError, match="not initialized"):
        Muon(nn.Linear(4, 4), process_group=object())


def test_a_renamed_deepspeed_internal_gives_a_clear_error():
    from hf_muon.integrations.compat import IncompatibleVersionError
    from hf_muon.integrations.deepspeed_zero import PROVIDER

    class RenamedStage3:  # a ZeRO-3 optimizer of a DeepSpeed that renamed its flat partitions
        fp32_flat_groups = []

    p = nn.Parameter(torch.zeros(4, 4))
    p._z3_optimizer = RenamedStage3()
    with pytest.raises(IncompatibleVersionError, match="fp32_partitioned_groups_flat.*tested with"):
        PROVIDER.bind(torch.zeros(8), [p], False)
    assert PROVIDER.bind(torch.zeros(8), [nn.Parameter(torch.zeros(4, 4))], False) is None  # not DeepSpeed's
