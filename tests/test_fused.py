"""Fused projections orthogonalized per block: the blocks are the model's own (checked against its
attention), the update of each block is Newton–Schulz of that block alone, and it holds under
ZeRO-3 and FSDP2 (see test_distributed.py / test_zero.py for the launches)."""

import copy
import math
import warnings

import pytest
import torch
import transformers as T

from hf_muon import Muon
from hf_muon.kernels import orthogonalize
from hf_muon.models.fused import MODEL_TABLE, Blocks, fused_blocks
from hf_muon.optimizer.muon import lr_scale

D, HEADS, KV = 64, 8, 2


def tiny(name: str) -> torch.nn.Module:
    """One layer of each supported fused model, eager attention (its probabilities are compared)."""
    common = dict(vocab_size=100, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {
        "gpt2": lambda: T.GPT2Config(n_embd=D, n_layer=1, n_head=HEADS, **common),
        "bigcode_mq": lambda: T.GPTBigCodeConfig(n_embd=D, n_layer=1, n_head=HEADS, multi_query=True, **common),
        "bigcode": lambda: T.GPTBigCodeConfig(n_embd=D, n_layer=1, n_head=HEADS, multi_query=False, **common),
        "phi3": lambda: T.Phi3Config(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=KV,
                                     intermediate_size=96, **common),
        "neox": lambda: T.GPTNeoXConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS,
                                        intermediate_size=96, **common),
        "bloom": lambda: T.BloomConfig(hidden_size=D, n_layer=1, n_head=HEADS, **common),
        "falcon_new": lambda: T.FalconConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS, num_kv_heads=KV,
                                             new_decoder_architecture=True, **common),
        "falcon_mq": lambda: T.FalconConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS, multi_query=True,
                                            new_decoder_architecture=False, **common),
        "falcon": lambda: T.FalconConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS, multi_query=False,
                                         new_decoder_architecture=False, **common),
        "mpt": lambda: T.MptConfig(d_model=D, n_layers=1, n_heads=HEADS, **common),
        "imagegpt": lambda: T.ImageGPTConfig(n_embd=D, n_layer=1, n_head=HEADS, vocab_size=100, n_positions=32),
        "neox_japanese": lambda: T.GPTNeoXJapaneseConfig(hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=1,
                                                         intermediate_multiple_size=1, **common),
        "codegen": lambda: T.CodeGenConfig(n_embd=D, n_layer=1, n_head=HEADS, rotary_dim=4, n_positions=32, **common),
        "openai_gpt": lambda: T.OpenAIGPTConfig(n_embd=D, n_layer=1, n_head=HEADS, n_positions=32, vocab_size=100),
        "dbrx": lambda: T.DbrxConfig(d_model=D, n_heads=HEADS, n_layers=1, max_seq_len=32,
                                     attn_config={"kv_n_heads": KV, "rope_theta": 10000.0, "clip_qkv": 1e4},
                                     ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1}, **common),
    }
    torch.manual_seed(0)
    if name == "imagegpt":  # no AutoModelForCausalLM mapping
        return T.ImageGPTForCausalImageModeling._from_config(configs[name](), attn_implementation="eager")
    return T.AutoModelForCausalLM.from_config(configs[name](), attn_implementation="eager")


def attention(model, ids) -> torch.Tensor:
    model.eval()  # no dropout
    with torch.no_grad():
        return model(ids, output_attentions=True).attentions[0]  # [batch, heads, T, T]


def kv_heads(name: str) -> int:
    return {"phi3": KV, "falcon_new": KV, "falcon_mq": 1, "bigcode_mq": 1, "dbrx": KV}.get(name, HEADS)


@pytest.mark.parametrize("name", ["gpt2", "bigcode_mq", "bigcode", "phi3", "neox", "bloom", "falcon_new", "falcon_mq",
                                  "falcon", "mpt", "imagegpt", "neox_japanese", "dbrx", "codegen", "openai_gpt"])
def test_each_head_block_is_what_the_models_attention_reads(name):
    """Perturb the weight's rows (columns for Conv1D) of one head block: a query head's block changes
    that head's attention only, a key head's block the query heads of its group, a value block none."""
    model = tiny(name)
    ids = torch.randint(1, 100, (1, 12))
    base = attention(model, ids)
    found = fused_blocks(model, "head")
    assert len(found) == 1 + (name == "phi3")  # Phi-3 also fuses gate | up
    (param_name, blocks), = [(n, b) for n, b in found.values() if "gate" not in b.names]
    weight = model.get_parameter(param_name)
    group = HEADS // kv_heads(name)
    assert sorted(torch.cat(blocks.indices()).tolist()) == list(range(weight.shape[blocks.axis]))
    for block, block_name in zip(blocks.indices(), blocks.names):
        perturbed = copy.deepcopy(model)
        w = perturbed.get_parameter(param_name)
        with torch.no_grad():
            w.index_add_(blocks.axis, block, torch.randn_like(w.index_select(blocks.axis, block)))
        changed = [not torch.allclose(a, b, atol=1e-6) for a, b in zip(attention(perturbed, ids)[0], base[0])]
        kind, head = block_name.split(".h")
        expected = {"q": [h == int(head) for h in range(HEADS)],
                    "k": [h // group == int(head) for h in range(HEADS)],
                    "v": [False] * HEADS}[kind]
        assert changed == expected, f"{name} {block_name}: heads changed {changed}"


def test_codegen_heads_that_span_two_model_parallel_groups():
    """CodeGen views qkv_proj's output as 4 groups of [q | v | k]; with 6 heads of 8 in d=48 a group
    holds 12 query rows, so heads 1 and 4 take rows from two groups. Each head block, cut across the
    groups, changes that head's attention only; the block split reads q, k and v from every group."""
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(
        T.CodeGenConfig(n_embd=48, n_layer=1, n_head=6, rotary_dim=4, n_positions=32, vocab_size=100,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0), attn_implementation="eager")
    (_, blocks), = fused_blocks(model, "block").values()
    assert blocks.names == ("q", "v", "k")
    assert blocks.segments[0] == ((0, 12), (36, 12), (72, 12), (108, 12))  # each group's first third
    ids = torch.randint(1, 100, (1, 12))
    base = attention(model, ids)
    (param_name, blocks), = fused_blocks(model, "head").values()
    assert [len(runs) for runs in blocks.segments[:6]] == [1, 2, 1, 1, 2, 1]
    for block, block_name in zip(blocks.indices(), blocks.names):
        if not block_name.startswith("q"):
            continue
        perturbed = copy.deepcopy(model)
        w = perturbed.get_parameter(param_name)
        with torch.no_grad():
            w.index_add_(0, block, torch.randn_like(w.index_select(0, block)))
        changed = [not torch.allclose(a, b, atol=1e-6) for a, b in zip(attention(perturbed, ids)[0], base[0])]
        assert changed == [h == int(block_name[3:]) for h in range(6)], f"{block_name}: heads changed {changed}"


def capture_attention_inputs():
    """Register an attention implementation that records the query, key and value it gets
    (``[batch, heads, tokens, head_dim]``) and runs SDPA; returns its name and the record."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = {}

    def capture(module, query, key, value, *args, **kwargs):
        seen.update(q=query.detach().clone(), k=key.detach().clone(), v=value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("hf_muon_capture", capture)
    return "hf_muon_capture", seen


def qkv_model(name: str, implementation: str):
    """A one-layer model with a ``[3, heads, head_dim]`` fused qkv, and a function running it."""
    torch.manual_seed(0)
    if name == "modernbert":
        model = T.AutoModel.from_config(T.ModernBertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                                           intermediate_size=48, vocab_size=100, pad_token_id=0,
                                                           bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                                           sep_token_id=2), attn_implementation=implementation)
        ids = torch.randint(3, 100, (1, 8))
        return model, lambda m: m(ids)
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    config = T.Qwen2VLVisionConfig(depth=1, embed_dim=32, num_heads=4, hidden_size=32, mlp_ratio=2, patch_size=2,
                                   temporal_patch_size=1, spatial_merge_size=1, in_channels=3)
    config._attn_implementation = implementation
    model = Qwen2VisionTransformerPretrainedModel._from_config(config)
    pixels, grid = torch.randn(16, 12), torch.tensor([[1, 4, 4]])
    return model, lambda m: m(pixels, grid_thw=grid)


@pytest.mark.parametrize("name", ["modernbert", "qwen2_vl_vision"])
def test_each_qkv_head_block_is_what_the_attention_gets(name):
    """ModernBERT's Wqkv and Qwen2-VL's vision qkv (``.reshape(..., 3, heads, -1)``): perturbing block
    ``q.h2`` changes query head 2 only and nothing of the keys and values, and so on."""
    implementation, seen = capture_attention_inputs()
    model, run = qkv_model(name, implementation)
    model.eval()
    with torch.no_grad():
        run(model)
    base = dict(seen)
    (param_name, blocks), = [(n, b) for n, b in fused_blocks(model, "head").values() if "q.h0" in b.names]
    assert len(blocks.names) == 12
    for block, block_name in zip(blocks.indices(), blocks.names):
        perturbed = copy.deepcopy(model)
        w = perturbed.get_parameter(param_name)
        with torch.no_grad():
            w.index_add_(0, block, torch.randn_like(w.index_select(0, block)))
            run(perturbed)
        kind, head = block_name.split(".h")
        for which in "qkv":
            changed = [not torch.equal(a, b) for a, b in zip(seen[which][0], base[which][0])]
            assert changed == [which == kind and h == int(head) for h in range(4)], f"{block_name}: {which} {changed}"


def module_case(name: str):
    """One attention-like module whose fused weight no whole model here can test through its attention
    probabilities, a function running it, and the record of what its ``forward`` reads from that
    weight's output, each ``[batch, heads, ...]``: q, k, v (and Qwen3-Next's z, b, a)."""
    from unittest import mock

    torch.manual_seed(0)
    seen: dict[str, torch.Tensor] = {}
    x = torch.randn(1, 6, D)
    rope = (torch.ones(1, 6, D // HEADS), torch.zeros(1, 6, D // HEADS))  # no rotation: heads stay apart
    if name in ("phi4_multimodal", "ergo"):  # q, k, v as the attention implementation gets them
        implementation, seen = capture_attention_inputs()
        if name == "phi4_multimodal":
            from transformers.models.phi4_multimodal.modeling_phi4_multimodal import Phi4MultimodalAttention as cls

            config = T.Phi4MultimodalConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV)
        else:
            from transformers.models.ergo.modeling_ergo import ErgoAttention as cls

            config = T.ErgoConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=1,
                                  layer_types=["full_attention"], global_attention_scale=None)
        config._attn_implementation = implementation
        module = cls(config, layer_idx=0)
        return module, lambda m: m(x, position_embeddings=rope, attention_mask=None), seen
    if name == "minimax":  # q, k, v as ``torch.split`` of the per-head view hands them on
        from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

        config = T.MiniMaxConfig(hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=2, block_size=4)
        module = MiniMaxLightningAttention(config, layer_idx=0)
        split = torch.split

        def recording_split(tensor, size, dim=0):
            out = split(tensor, size, dim)
            if dim == 3:
                seen.update((k, t.transpose(1, 2).clone()) for k, t in zip("qkv", out))
            return out

        def run(m):
            with mock.patch("torch.split", recording_split):
                m(x, position_embeddings=rope, attention_mask=None)
        return module, run, seen
    if name == "qwen3_5":  # q, k, v as the delta rule gets them (keys and values of other sizes)
        from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

        config = T.Qwen3_5TextConfig(hidden_size=D, linear_num_key_heads=4, linear_num_value_heads=4,
                                     linear_key_head_dim=8, linear_value_head_dim=12, num_hidden_layers=1)
        module = modeling.Qwen3_5GatedDeltaNet(config, layer_idx=0)
        rule = modeling.torch_chunk_gated_delta_rule

        def recording_rule(query, key, value, **kwargs):
            seen.update((k, t.transpose(1, 2).clone()) for k, t in zip("qkv", (query, key, value)))
            return rule(query, key, value, **kwargs)

        def run(m):
            with mock.patch.object(modeling, "torch_chunk_gated_delta_rule", recording_rule):
                m(x)
        return module, run, seen
    # Qwen3-Next: what ``fix_query_key_value_ordering`` reads from in_proj_qkvz and in_proj_ba
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = T.Qwen3NextConfig(hidden_size=D, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=6, num_hidden_layers=1)
    module = Qwen3NextGatedDeltaNet(config, layer_idx=0)
    ordering = Qwen3NextGatedDeltaNet.fix_query_key_value_ordering

    def recording_ordering(self, qkvz, ba):
        out = ordering(self, qkvz, ba)
        seen.update((k, t.transpose(1, 2).clone()) for k, t in zip(("q", "k", "v", "z", "b", "a"), out))
        return out

    def run(m):
        with mock.patch.object(Qwen3NextGatedDeltaNet, "fix_query_key_value_ordering", recording_ordering):
            m(x)
    return module, run, seen


@pytest.mark.parametrize("name", ["phi4_multimodal", "ergo", "minimax", "qwen3_5", "qwen3_next"])
def test_each_block_is_what_the_module_reads(name):
    """Perturbing block ``q.h2`` of the fused weight changes query head 2 and nothing else the module
    reads from it; a block not cut per head (Qwen3-Next's z, b, a) changes its own part only."""
    module, run, seen = module_case(name)
    module.eval()
    with torch.no_grad():
        run(module)
    base = dict(seen)
    found = fused_blocks(module, "head")
    assert found, f"{name}: no fused weight found"
    checked = set()
    for param_name, blocks in found.values():
        for block, block_name in zip(blocks.indices(), blocks.names):
            perturbed = copy.deepcopy(module)
            w = perturbed.get_parameter(param_name)
            with torch.no_grad():
                w.index_add_(blocks.axis, block, torch.randn_like(w.index_select(blocks.axis, block)))
                run(perturbed)
            kind, _, head = block_name.partition(".h")
            for which in base:
                changed = [not torch.equal(a, b) for a, b in zip(seen[which][0], base[which][0])]
                expected = [which == kind and (not head or h == int(head)) for h in range(len(changed))]
                assert changed == expected, f"{name} {param_name} {block_name}: {which} heads changed {changed}"
            checked.add(kind)
    assert checked == set(base), f"{name}: blocks of {sorted(checked)} for the parts {sorted(base)}"


def test_zamba2s_mlp_and_its_adapters_are_gate_then_up():
    """Zamba2's shared MLP adds each layer's low-rank adapter to ``gate_up_proj``'s output and reads
    ``gate, up = chunk(2)``: negating the up block of both weights negates the MLP's output exactly,
    negating the gate blocks does not."""
    from transformers.models.zamba2.modeling_zamba2 import Zamba2MLP

    torch.manual_seed(0)
    config = T.Zamba2Config(hidden_size=32, intermediate_size=48, adapter_rank=4, num_hidden_layers=2,
                            layers_block_type=["hybrid", "hybrid"], num_mem_blocks=1)
    mlp = Zamba2MLP(config, num_fwd_mem_blocks=2, block_id=0)
    found = fused_blocks(mlp, "block")
    assert sorted(n for n, _ in found.values()) == ["gate_up_proj.weight", "gate_up_proj_adapter_list.0.1.weight",
                                                    "gate_up_proj_adapter_list.1.1.weight"]
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        base = mlp(x, layer_idx=1)
        for kind in ("gate", "up"):
            flipped = copy.deepcopy(mlp)
            for param_name, blocks in found.values():
                flipped.get_parameter(param_name)[blocks.indices()[blocks.names.index(kind)]] *= -1
            assert torch.allclose(flipped(x, layer_idx=1), -base, atol=1e-6) == (kind == "up"), kind


@pytest.mark.parametrize("kdim", [None, 12])
def test_torch_multihead_attentions_projections_get_muon_per_block(kdim):
    """``nn.MultiheadAttention`` keeps q | k | v in ``in_proj_weight`` (or apart, where keys and values
    have other sizes): Muon, per block, and per head the heads its own ``forward`` reads (checked
    through ``need_weights``: perturbing ``q.h1`` changes head 1's attention only)."""
    from hf_muon.optimizer.param_split import split_parameters

    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True) if kdim is None else \
        torch.nn.Sequential(torch.nn.MultiheadAttention(32, 4, kdim=kdim, vdim=kdim, batch_first=True))
    model.eval()  # no dropout of the probabilities
    attention = model.self_attn if kdim is None else model[0]
    muon = {n for n, _ in split_parameters(model).muon}
    assert ({"self_attn.in_proj_weight"} if kdim is None else
            {"0.q_proj_weight", "0.k_proj_weight", "0.v_proj_weight"}) <= muon
    blocks = {n: b for n, b in fused_blocks(model, "block").values()}
    assert [b.names for b in blocks.values()] == ([("q", "k", "v")] if kdim is None else [])
    x, kv = torch.randn(1, 6, 32), torch.randn(1, 6, kdim or 32)

    def probabilities(m):
        with torch.no_grad():
            return m(x, kv, kv, need_weights=True, average_attn_weights=False)[1][0]  # [heads, T, S]

    base = probabilities(attention)
    for param_name, cut in fused_blocks(model, "head").values():
        for block, block_name in zip(cut.indices(), cut.names):
            perturbed = copy.deepcopy(model)
            w = perturbed.get_parameter(param_name)
            with torch.no_grad():
                w.index_add_(0, block, torch.randn_like(w.index_select(0, block)))
            head_attention = perturbed.self_attn if kdim is None else perturbed[0]
            changed = [not torch.allclose(a, b, atol=1e-6) for a, b in zip(probabilities(head_attention), base)]
            kind, head = block_name.split(".h")
            assert changed == [kind in "qk" and h == int(head) for h in range(4)], f"{param_name} {block_name}: {changed}"


def test_modernberts_wi_is_input_then_gate():
    """``input, gate = self.Wi(x).chunk(2, dim=-1)``, output ``Wo(act(input) * gate)``: negating the
    gate block's rows negates the MLP's output exactly; negating the other block does not."""
    model, _ = qkv_model("modernbert", "sdpa")
    mlp = model.layers[0].mlp
    (name, blocks), = [(n, b) for n, b in fused_blocks(model, "block").values() if "gate" in b.names]
    assert name.endswith("mlp.Wi.weight") and blocks.names == ("up", "gate") and blocks.sizes() == [48, 48]
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        base = mlp(x)
        for block, block_name in zip(blocks.indices(), blocks.names):
            flipped = copy.deepcopy(mlp)
            flipped.Wi.weight[block] *= -1
            assert torch.allclose(flipped(x), -base, atol=1e-6) == (block_name == "gate"), block_name


def test_qkv_thirds_modules_view_their_qkv_as_three_parts():
    """Each module read as ``[3, heads, head_dim]`` does so in its own ``forward`` (read from the
    installed transformers' source; a release that changes one fails here)."""
    import re
    from pathlib import Path

    from hf_muon.models.fused import QKV_THIRDS

    files = sorted((Path(T.__file__).parent / "models").glob("*/modeling_*.py"))
    view = re.compile(r"self\.qkv\((\w+)\)[\s\S]{0,160}?\.(reshape|view)\([^)]*?,\s*3,\s*"
                      r"self\.(num_heads|num_attention_heads|groups)\b")
    checked = 0
    for key in QKV_THIRDS:
        stem, _, cls = key.rpartition(".")
        for path in files:
            if stem and path.stem != stem:
                continue
            text = path.read_text()
            start = text.find(f"\nclass {cls}(")
            if start < 0:
                continue
            end = text.find("\nclass ", start + 1)
            assert view.search(text[start:end if end > 0 else None]), f"{cls} ({path.name}) no longer reads qkv as [3, heads, ...]"
            checked += 1
            break
    assert checked >= 10, f"only {checked} of the modules found in this transformers"


def test_unknown_fused_looking_weights_are_warned_about():
    """A module hf_muon has no layout for, holding ``qkv``: warned (orthogonalized whole), unless frozen."""
    class MyAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16)

    model = torch.nn.Sequential(MyAttention(), torch.nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"1 Muon weight\(s\) look fused .* 0\.qkv\.weight \(MyAttention\)"):
        Muon(model, lr=0.02)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(model, lr=0.02, force_adamw=r"qkv")  # not Muon's: nothing to warn about
        Muon(model, lr=0.02, ns_split="none")  # whole matrices asked for
        model[0].qkv.requires_grad_(False)
        Muon(model, lr=0.02)
        Muon(tiny("phi3"), lr=0.02)
        Muon(tiny("codegen"), lr=0.02, ns_split="head")


@pytest.mark.parametrize("saved_split,built_split", [("block", "none"), ("none", "block"), ("block", "head")])
def test_a_loaded_state_cuts_as_its_saved_ns_split(saved_split, built_split):
    """load_state_dict put the saved ns_split in the group (and in later state_dicts) while the blocks
    stayed the constructor's: a GPT-2 saved with "block" and loaded into "none" trained as "none"."""
    model = tiny("gpt2")
    name = "transformer.h.0.attn.c_attn.weight"
    saved = Muon(model, lr=0.1, ns_split=saved_split).state_dict()
    loaded = Muon(model, lr=0.1, ns_split=built_split)
    loaded.load_state_dict(saved)
    assert loaded.param_groups[0]["ns_split"] == saved_split
    want = Muon(model, lr=0.1, ns_split=saved_split).fused_blocks()
    assert loaded.fused_blocks() == want and (name in want) == (saved_split != "none")
    updates = []
    for opt in (loaded, Muon(model, lr=0.1, ns_split=saved_split)):
        m = copy.deepcopy(model)
        torch.manual_seed(1)
        grads = {n: torch.randn_like(p) for n, p in m.named_parameters()}
        weight = model.get_parameter(name)
        before = weight.detach().clone()
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        updates.append(before - weight.detach())
        with torch.no_grad():
            weight.copy_(before)
    torch.testing.assert_close(updates[0], updates[1])


def test_the_summary_counts_the_matrices_newton_schulz_runs_on(caplog):
    """The start-up line counted one method per tensor (Phi-3: "gram 4, standard 4" where 14 matrices
    run) and counted frozen tensors as trained."""
    import re

    model = tiny("phi3")  # qkv_proj: 3 blocks, o_proj, gate_up_proj: 2 blocks, down_proj
    model.model.layers[0].self_attn.o_proj.weight.requires_grad_(False)
    with caplog.at_level("INFO", logger="hf_muon"):
        Muon(model, lr=0.02)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Muon "))
    assert line.startswith("Muon 3 tensors (") and ", 6 matrices), AdamW" in line
    assert sum(int(n) for n in re.findall(r"(?:gram|standard) (\d+)", line)) == 6
    assert line.endswith("; 1 frozen tensors (4.10K params) not trained; 2 fused tensors in 5 blocks (ns_split=block)")


def test_blocks_cover_every_row_once_and_name_the_logical_matrices():
    found = fused_blocks(tiny("phi3"), "block")
    names = sorted(b.names for _, b in found.values())
    assert names == [("gate", "up"), ("q", "k", "v")]
    for _, blocks in found.values():
        assert sorted(i for runs in blocks.segments for s, n in runs for i in range(s, s + n)) == list(range(sum(blocks.sizes())))
    assert fused_blocks(tiny("phi3"), "none") == {}
    with pytest.raises(ValueError, match="ns_split must be one of"):
        fused_blocks(tiny("phi3"), "rows")


def test_phi3_mlps_copies_are_cut_in_gate_and_up():
    """GLM (and other copies of Phi3MLP) keep gate | up in one gate_up_proj: it was orthogonalized whole."""
    model = T.GlmForCausalLM(T.GlmConfig(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=8,
                                         num_hidden_layers=1, intermediate_size=96, vocab_size=100, pad_token_id=0))
    (name, blocks), = fused_blocks(model, "block").values()
    assert name == "model.layers.0.mlp.gate_up_proj.weight" and blocks.names == ("gate", "up")
    assert blocks.sizes() == [96, 96] and blocks.axis == 0


def test_head_split_also_cuts_separate_projections():
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS,
                                             num_key_value_heads=KV, intermediate_size=96, vocab_size=100))
    assert fused_blocks(model, "block") == {}
    heads = {name.rsplit(".", 2)[-2]: len(b.names) for name, b in fused_blocks(model, "head").values()}
    assert heads == {"q_proj": HEADS, "k_proj": KV, "v_proj": KV}


def test_head_split_reads_each_modules_own_head_size():
    """Swin keeps a tuple of heads per stage in its config (each attention its own count); a module
    with values of another head size (MiMo-V2-Flash's ``v_head_dim``) cuts them by it; a module with
    no head size to read, or blocks that do not hold whole heads, is refused with what to pass."""
    swin = T.SwinModel(T.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                                    window_size=2))
    heads = sorted({len(b.names) for name, b in fused_blocks(swin, "head").values() if "q_proj" in name})
    assert heads == [2, 4]

    class MyAttention(torch.nn.Module):
        def __init__(self, head_dim, v_head_dim=None):
            super().__init__()
            self.head_dim, self.v_head_dim = head_dim, v_head_dim
            self.q_proj, self.k_proj = torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
            self.v_proj = torch.nn.Linear(32, 4 * (v_head_dim or 4))

    found = fused_blocks(torch.nn.Sequential(MyAttention(8, v_head_dim=6)), "head")
    assert {name: b.sizes() for name, b in found.values()} == {
        "0.q_proj.weight": [8] * 4, "0.k_proj.weight": [8] * 2, "0.v_proj.weight": [6] * 4}
    with pytest.warns(UserWarning, match=r"1 attention module\(s\) keep no head size .* 0 \(MyAttention\)"):
        assert fused_blocks(torch.nn.Sequential(MyAttention(None)), "head") == {}  # whole, not by a config's heads

    class ProjectedAgain(MyAttention):  # Aria's cross-attention: an nn.MultiheadAttention projects q, k, v again
        def __init__(self):
            super().__init__(8)
            self.attention = torch.nn.MultiheadAttention(32, 4, kdim=16, vdim=16)

    found = fused_blocks(torch.nn.Sequential(ProjectedAgain()), "head")
    assert sorted(n for n, _ in found.values()) == ["0.attention.k_proj_weight", "0.attention.q_proj_weight",
                                                    "0.attention.v_proj_weight"]
    with pytest.raises(ValueError, match="'q' of 32 rows does not hold whole heads of 12.*ns_split='block'"):
        fused_blocks(torch.nn.Sequential(MyAttention(12)), "head")


@pytest.mark.slow
def test_every_transformers_model_is_cut_or_refused_with_a_reason():
    """Every model type of the installed transformers that builds from its default config (on the meta
    device) is cut by each ``ns_split`` without an error other than hf_muon's own refusal, and the
    fused-looking weights hf_muon has no layout for are listed (warned about), not a crash."""
    from transformers import CONFIG_MAPPING, AutoModel, AutoModelForCausalLM

    from hf_muon.models.fused import unknown_fused_looking

    built, failures, refused, unknown, headless = 0, [], [], {}, set()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        T.logging.set_verbosity_error()
        for model_type in sorted(CONFIG_MAPPING.keys()):
            model = None
            for auto in (AutoModelForCausalLM, AutoModel):
                try:
                    config = CONFIG_MAPPING[model_type]()
                    with torch.device("meta"):
                        model = auto.from_config(config)
                    break
                except Exception:  # sub-model configs, optional libraries (timm, natten), invalid defaults
                    continue
            if model is None:
                continue
            built += 1
            for split in ("block", "head"):
                seen.clear()
                try:
                    fused_blocks(model, split)
                except ValueError as error:
                    (refused if str(error).startswith("hf_muon:") else failures).append(f"{model_type} {split}: {error}")
                except Exception as error:
                    failures.append(f"{model_type} {split}: {error!r}")
                if any(str(w.message).startswith("hf_muon:") for w in seen):
                    headless.add(model_type)
            found = unknown_fused_looking(model)
            if found:
                unknown[model_type] = sorted(found.values())[:2]
            del model
    assert built >= 300, f"only {built} model types built"
    assert not failures, "\n".join(failures)
    if T.__version__ == "5.25.0":  # this release: every fused-looking weight has a layout, every model is cut
        assert not unknown, unknown
        assert not refused, "\n".join(refused)
        assert headless == {"groupvit"}, headless  # its single-head assignment attention keeps no head size


def polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / a.norm() / b.norm())


def one_step_update(model, split: str, param_name: str):
    """The update one Muon step from a random gradient makes to ``param_name`` (no momentum, fp32 NS)."""
    model = copy.deepcopy(model)
    opt = Muon(model, lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=torch.float32, ns_split=split)
    torch.manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    w = model.get_parameter(param_name)
    before, grad = w.detach().clone(), w.grad.clone()
    opt.step()
    return before - w.detach(), grad, opt


@pytest.mark.parametrize("name", ["gpt2", "phi3", "neox", "falcon_new"])
def test_each_block_gets_newton_schulz_of_its_own_gradient(name):
    model = tiny(name)
    (param_name, blocks), = [(n, b) for n, b in fused_blocks(model, "block").values() if "q" in b.names]
    update, grad, opt = one_step_update(model, "block", param_name)
    assert param_name in opt.fused_blocks()
    for u, g, (rows, cols) in zip(blocks.split(update), blocks.split(grad), blocks.shapes(tuple(grad.shape))):
        expected = 0.1 * lr_scale(rows, cols, "match_rms_adamw") * orthogonalize(g, 5, "quintic", torch.float32)
        torch.testing.assert_close(u, expected, rtol=1e-4, atol=1e-6)
        assert cosine(u, polar(g)) > 0.97  # its own block's polar factor (0.98 measured)
    # the whole-matrix update (ns_split="none") follows the fused matrix's polar factor instead
    whole, _, opt = one_step_update(model, "none", param_name)
    assert opt.fused_blocks() == {}
    assert cosine(whole, polar(grad)) > 0.97
    assert min(cosine(u, polar(g)) for u, g in zip(blocks.split(whole), blocks.split(grad))) < 0.95


def tiny_moe(name: str) -> torch.nn.Module:
    """One layer of a transformers 5 MoE with stacked experts: gate | up rows (Mixtral, Qwen3-MoE), gate |
    up columns (Llama 4, used as x @ W[e]) or interleaved columns (GPT-OSS, with per-expert biases)."""
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    configs = {
        "mixtral": lambda: T.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common),
        "qwen3_moe": lambda: T.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=48, num_experts=4,
                                              num_experts_per_tok=2, **common),
        "llama4": lambda: T.Llama4TextConfig(intermediate_size=24, intermediate_size_mlp=48, num_local_experts=4,
                                             **common),
        "gpt_oss": lambda: T.GptOssConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common),
    }
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(configs[name]())
    if not any(type(m).__name__.endswith("Experts") and getattr(m, "gate_up_proj", None) is not None
               for m in model.modules()):
        pytest.skip(f"transformers {T.__version__} keeps {name}'s experts as Linears of their own, not stacked")
    return model


def expert_output(experts: torch.nn.Module, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e``'s output for tokens ``x`` ``[tokens, hidden]``, routing weight 1."""
    with torch.no_grad():
        if name == "llama4":  # inputs sorted per expert: [experts * tokens, hidden]
            stacked = torch.zeros(experts.num_experts, *x.shape)
            stacked[e] = x
            return experts(stacked.view(-1, x.shape[1])).view(experts.num_experts, *x.shape)[e]
        index, weight = torch.full((len(x), 1), e), torch.ones(len(x), 1)
        return experts(x, index, weight)


MOE = ["mixtral", "qwen3_moe", "llama4", "gpt_oss"]


@pytest.mark.parametrize("name", MOE)
def test_stacked_experts_gate_and_up_are_what_the_experts_read(name):
    """Zero one expert's gate block (and its bias columns): that expert's output is its down bias alone
    (act(0) = 0); a block that mixed gate and up columns would leave some of it."""
    model = tiny_moe(name)
    (param_name, blocks), = fused_blocks(model, "block").values()
    assert blocks.names == ("gate", "up") and blocks.sizes() == [24, 24]
    experts = model.get_submodule(param_name.rsplit(".", 1)[0])
    x = torch.randn(5, 32)
    e = 2
    assert expert_output(experts, name, e, x).abs().max() > 1e-3
    with torch.no_grad():
        experts.gate_up_proj[e].index_fill_(blocks.axis, blocks.indices()[0], 0.0)
        bias = getattr(experts, "gate_up_proj_bias", None)
        if bias is not None:  # [experts, 2 * I]: the same columns
            bias[e].index_fill_(0, blocks.indices()[0], 0.0)
    down_bias = getattr(experts, "down_proj_bias", None)
    expected = down_bias[e].detach().expand(5, -1) if down_bias is not None else torch.zeros(5, 32)
    torch.testing.assert_close(expert_output(experts, name, e, x), expected)


@pytest.mark.parametrize("name", MOE)
def test_each_experts_gate_and_up_get_newton_schulz_of_their_own_gradient(name):
    """Each expert's gate and up blocks (transformers 5 keeps them in one gate_up_proj matrix per expert)
    are orthogonalized on their own, at their own shape's scale; GPT-OSS's per-expert biases go to AdamW."""
    model = tiny_moe(name)
    (param_name, blocks), = fused_blocks(model, "block").values()
    update, grad, opt = one_step_update(model, "block", param_name)
    assert list(opt.fused_blocks()) == [param_name]
    for e in range(grad.shape[0]):
        for u, g, (rows, cols) in zip(blocks.split(update[e]), blocks.split(grad[e]), blocks.shapes(tuple(grad.shape))):
            expected = 0.1 * lr_scale(rows, cols, "match_rms_adamw") * orthogonalize(g, 5, "quintic", torch.float32)
            torch.testing.assert_close(u, expected, rtol=1e-4, atol=1e-6)
    muon = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    assert not any(id(p) in muon for n, p in model.named_parameters() if n.endswith("_bias"))


@pytest.mark.parametrize("name", ["mixtral", "llama4"])
def test_experts_used_as_x_at_w_take_the_original_scale_by_their_outputs(name):
    """Llama 4 stores its experts [in, out] (x @ W[e]): down_proj [I=24, H=32] maps 24 -> 32, so
    adjust_lr="original" gives sqrt(32 / 24); Mixtral's [out, in] down_proj [32, 24] the same map."""
    model = tiny_moe(name)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    opt = Muon(model, lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=torch.float32,
               adjust_lr="original")
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = experts.down_proj.detach().clone()
    opt.step()
    expected = -math.sqrt(32 / 24) * orthogonalize(experts.down_proj.grad, 5, "quintic", torch.float32)
    torch.testing.assert_close(experts.down_proj.detach() - before, expected, rtol=1e-4, atol=1e-6)


def test_blocks_of_other_shapes_get_their_own_learning_rate_scale():
    """Falcon's new architecture: q is 64 rows, k and v 16 each; with adjust_lr="original" the
    scales differ per block (sqrt(max(1, rows / cols)) is 1 for all three here, so use a tall layout)."""
    blocks = Blocks(1, (((0, 4),), ((4, 60),)), ("a", "b"))  # columns 4 and 60 of a 64 x 64 weight
    from hf_muon.optimizer.muon import block_lr_scales

    scale, relative = block_lr_scales((64, 64), blocks, "original")
    assert scale == lr_scale(64, 4, "original") and relative == [1.0, lr_scale(64, 60, "original") / scale]
    w = torch.nn.Parameter(torch.zeros(64, 64))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    model[0].weight = w
    opt = Muon([{"params": [w], "algorithm": "muon"}], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0,
               ns_dtype=torch.float32, adjust_lr="original")
    opt._group_blocks[0] = [blocks]  # what fused_blocks() would give a model that stores it so
    torch.manual_seed(0)
    w.grad = torch.randn(64, 64)
    g = w.grad.clone()
    opt.step()
    for part, grad_part, (rows, cols) in zip(blocks.split(-w.detach()), blocks.split(g), blocks.shapes((64, 64))):
        torch.testing.assert_close(part, lr_scale(rows, cols, "original") * orthogonalize(grad_part, 5, "quintic", torch.float32))


@pytest.mark.parametrize("construction", ["model", "parameters", "model="])
def test_conv1d_weights_take_the_original_scale_by_their_outputs(construction):
    """transformers' Conv1D stores [in, out]: adjust_lr="original" (sqrt(max(1, fan_out / fan_in))) read
    its rows as outputs and gave GPT-2's c_fc (d -> 4d) 1 instead of 2 and c_proj (4d -> d) 2 instead
    of 1; an nn.Linear of the same map gets the same update, transposed."""
    model = tiny("gpt2")
    mlp = model.transformer.h[0].mlp
    linear = torch.nn.Sequential(torch.nn.Linear(D, 4 * D, bias=False), torch.nn.Linear(4 * D, D, bias=False))
    with torch.no_grad():
        linear[0].weight.copy_(mlp.c_fc.weight.T)
        linear[1].weight.copy_(mlp.c_proj.weight.T)
    kwargs = dict(lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype=torch.float32,
                  adjust_lr="original", ns_split="none")
    params = {"model": model, "parameters": model.parameters(), "model=": list(model.parameters())}[construction]
    opt = Muon(params, **({"model": model} if construction == "model=" else {}), **kwargs)
    theirs = Muon(linear, **kwargs)
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    for conv, lin in zip((mlp.c_fc, mlp.c_proj), linear):
        lin.weight.grad = conv.weight.grad.T.clone()
    before = [w.detach().clone() for w in (mlp.c_fc.weight, mlp.c_proj.weight, model.transformer.h[0].attn.c_attn.weight)]
    opt.step()
    theirs.step()
    for conv, lin, fan_out, fan_in in ((mlp.c_fc, linear[0], 4 * D, D), (mlp.c_proj, linear[1], D, 4 * D)):
        torch.testing.assert_close(conv.weight.detach().T, lin.weight.detach(), rtol=1e-5, atol=1e-6)
        update = conv.weight.detach() - before[(mlp.c_fc, mlp.c_proj).index(conv)]
        expected = -math.sqrt(max(1.0, fan_out / fan_in)) * orthogonalize(conv.weight.grad, 5, "quintic", torch.float32)
        torch.testing.assert_close(update, expected, rtol=1e-4, atol=1e-6)
    # c_attn (d -> 3d, ns_split="none": whole): sqrt(3)
    c_attn = model.transformer.h[0].attn.c_attn.weight
    expected = -math.sqrt(3.0) * orthogonalize(c_attn.grad, 5, "quintic", torch.float32)
    torch.testing.assert_close(c_attn.detach() - before[2], expected, rtol=1e-4, atol=1e-6)


def test_a_group_added_later_gets_its_fused_blocks_and_orientation():
    """The model was dropped after construction, so a group added later was orthogonalized whole (and
    read [out, in])."""
    model = tiny("gpt2")
    attn, mlp = model.transformer.h[0].attn, model.transformer.h[0].mlp
    opt = Muon([{"params": [mlp.c_proj.weight], "algorithm": "muon"}], model=model, adjust_lr="original")
    assert opt.fused_blocks() == {}
    opt.add_param_group({"params": [attn.c_attn.weight, mlp.c_fc.weight], "algorithm": "muon"})
    assert list(opt.fused_blocks()) == ["transformer.h.0.attn.c_attn.weight"]
    assert opt._group_in_by_out == [[True], [True, True]]
    del model, attn, mlp
    import gc

    gc.collect()  # the optimizer does not keep the model alive
    assert opt._source_model() is None


def test_gpt2_cross_attention_query_is_cut_per_head_too():
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=D, n_layer=1, n_head=HEADS, add_cross_attention=True, vocab_size=100))
    heads = {n.split(".", 3)[-1]: b.names for n, b in fused_blocks(model, "head").values()}
    assert heads["crossattention.q_attn.weight"] == tuple(f"q.h{i}" for i in range(HEADS))
    assert len(heads["crossattention.c_attn.weight"]) == 2 * HEADS
    assert "crossattention.q_attn.weight" not in {n.split(".", 3)[-1] for n, _ in fused_blocks(model, "block").values()}


def test_decision_transformer_and_a_composite_models_blocks():
    """DecisionTransformer's attention is a copy of GPT-2's, not a subclass: it was orthogonalized whole.
    A composite model (Llava) has no heads in its own config: Phi-3 inside it failed with a TypeError."""
    dt = T.DecisionTransformerModel(T.DecisionTransformerConfig(state_dim=3, act_dim=2, hidden_size=D, n_layer=1,
                                                                n_head=HEADS))
    (name, blocks), = fused_blocks(dt, "block").values()
    assert name == "encoder.h.0.attn.c_attn.weight" and blocks.axis == 1 and blocks.sizes() == [D] * 3
    assert list(Muon(dt).fused_blocks()) == [name]
    text = T.Phi3Config(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=1,
                        intermediate_size=96, vocab_size=100, pad_token_id=0)
    vision = T.CLIPVisionConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=20,
                                image_size=8, patch_size=4)
    llava = T.LlavaForConditionalGeneration(T.LlavaConfig(text_config=text, vision_config=vision, image_token_id=5))
    found = {n.rsplit(".", 2)[-2]: b.sizes() for n, b in fused_blocks(llava, "block").values()}
    assert found == {"qkv_proj": [D, KV * D // HEADS, KV * D // HEADS], "gate_up_proj": [96, 96]}
    heads = {n.split(".")[1] + "." + n.rsplit(".", 2)[-2]: len(b.sizes()) for n, b in fused_blocks(llava, "head").values()}
    assert heads == {"vision_tower.q_proj": 2, "vision_tower.k_proj": 2, "vision_tower.v_proj": 2,
                     "language_model.qkv_proj": HEADS + 2 * KV, "language_model.gate_up_proj": 2}
    Muon(llava, ns_split="head")


def test_trainer_reads_blocks_and_ns_split_option(tmp_path):
    from hf_muon.integrations.transformers import muon_cls_and_kwargs

    model = tiny("gpt2")
    for optim_args, expected in ((None, 1), ("ns_split=none", 0), ("ns_split=head", 1)):
        args = T.TrainingArguments(output_dir=str(tmp_path), optim="muon", optim_args=optim_args, report_to=[])
        cls, kwargs = muon_cls_and_kwargs(args, model)
        opt = cls(**kwargs)
        assert len(opt.fused_blocks()) == expected
    with pytest.raises(ValueError, match="ns_split must be one of"):
        Muon(model, ns_split="columns")


def test_readme_lists_every_supported_model():
    import os

    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    for models, modules, _ in MODEL_TABLE:
        assert f"| {models} | {modules} |" in readme, f"README's fused-projection table misses {models}"


def test_inspect_cli_shows_the_blocks(tmp_path):
    import subprocess
    import sys

    from tests.conftest import hf_muon_cli

    tiny("phi3").config.save_pretrained(tmp_path)
    run = [sys.executable, "-m", "hf_muon.cli", "inspect", str(tmp_path)]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout  # the entry point, once
    assert "Newton–Schulz blocks (ns_split=block): 2 fused tensors" in out
    assert "q 64x64 | k 16x64 | v 16x64" in out and "gate 96x64 | up 96x64" in out
    heads = hf_muon_cli("inspect", str(tmp_path), "--ns_split", "head")
    assert heads.returncode == 0 and "q 8 heads of 8x64 | k 2 heads of 8x64 | v 2 heads of 8x64" in heads.stdout
    none = hf_muon_cli("inspect", str(tmp_path), "--ns_split", "none")
    assert none.returncode == 0 and "none, whole matrices" in none.stdout


def test_trainer_trains_gpt2_with_its_fused_blocks(tmp_path):
    """End to end: --optim muon on a GPT-2 trains with c_attn cut into q, k, v (default ns_split)."""
    import os
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "scripts"))
    try:
        from train_tiny import Bytes
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    data = Bytes(open(os.path.join(here, "test_fused.py"), "rb").read() * 2)
    args = T.TrainingArguments(output_dir=str(tmp_path), optim="muon", learning_rate=1e-2, max_steps=12,
                               logging_steps=4, per_device_train_batch_size=8, report_to="none", save_strategy="no",
                               use_cpu=True)
    trainer = T.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    opt = trainer.optimizer.optimizer
    assert sorted(opt.fused_blocks()) == [f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0] - 0.5, losses
