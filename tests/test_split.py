"""Which parameters get Muon, on real model families built from configs (and the real MiniLM)."""

import pytest
import torch
import transformers
from torch import nn

from hf_muon import Muon, split_parameters
from tests.conftest import hf_muon_cli, minilm_path


def names(pairs):
    return {n for n, _ in pairs}


def check_invariants(model, split):
    # every trainable tensor placed exactly once; Muon only gets matrices
    placed = names(split.muon) | names(split.adamw)
    assert not names(split.muon) & names(split.adamw)
    assert {id(p) for _, p in model.named_parameters()} == {id(p) for _, p in split.muon + split.adamw}
    assert all(p.ndim >= 2 for _, p in split.muon)
    assert set(split.reasons) == placed


def test_gpt2_conv1d_and_tied_wte():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    model = transformers.GPT2LMHeadModel(cfg)
    split = split_parameters(model)
    check_invariants(model, split)
    muon = names(split.muon)
    assert "transformer.h.0.attn.c_attn.weight" in muon and "transformer.h.1.mlp.c_proj.weight" in muon
    assert len(muon) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer
    adamw = names(split.adamw)
    assert {"transformer.wte.weight", "transformer.wpe.weight"} <= adamw
    assert "tied" in split.reasons["transformer.wte.weight"]


@pytest.mark.parametrize("tied", [True, False])
def test_llama_tied_and_untied(tied):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    split = split_parameters(model)
    check_invariants(model, split)
    assert len(split.muon) == 2 * 7  # q k v o gate up down
    adamw = names(split.adamw)
    assert "model.embed_tokens.weight" in adamw
    assert ("lm_head.weight" in adamw) is (not tied)
    assert all("norm" in n for n in adamw - {"model.embed_tokens.weight", "lm_head.weight"})


def test_real_minilm_with_classification_head():
    model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=3)
    split = split_parameters(model)
    check_invariants(model, split)
    adamw = names(split.adamw)
    assert {"classifier.weight", "bert.embeddings.word_embeddings.weight",
            "bert.embeddings.position_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"} <= adamw
    assert "head outside the model body" in split.reasons["classifier.weight"]
    assert "bert.encoder.layer.0.attention.self.query.weight" in names(split.muon)
    assert len([n for n in names(split.muon) if n.startswith("bert.encoder.")]) == 6 * 6


def test_t5_shared_embedding():
    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    model = transformers.T5ForConditionalGeneration(cfg)
    split = split_parameters(model)
    check_invariants(model, split)
    adamw = names(split.adamw)
    assert "shared.weight" in adamw
    assert not any("embed_tokens" in n or "shared" in n or "lm_head" in n for n in names(split.muon))
    assert not any("relative_attention_bias" in n for n in names(split.muon))
    assert "encoder.block.0.layer.0.SelfAttention.q.weight" in names(split.muon)


def test_vit_patch_conv_and_position_embedding():
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 image_size=16, patch_size=4, num_labels=5)
    model = transformers.ViTForImageClassification(cfg)
    split = split_parameters(model)
    check_invariants(model, split)
    adamw = names(split.adamw)
    assert {"vit.embeddings.patch_embeddings.projection.weight", "vit.embeddings.position_embeddings",
            "vit.embeddings.cls_token", "classifier.weight"} <= adamw
    assert "input embedding" in split.reasons["vit.embeddings.patch_embeddings.projection.weight"]
    # transformers 5 names it vit.layers.0.attention.q_proj, 4.x vit.encoder.layer.0.attention.attention.query
    queries = [n for n in names(split.muon) if ".0.attention." in n and n.endswith(("q_proj.weight", "query.weight"))]
    assert len(queries) == 1, sorted(names(split.muon))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_experts_are_stacked_matrices(family):
    if family == "mixtral":
        cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                          shared_expert_intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                          num_experts_per_tok=2)
        model = transformers.Qwen2MoeForCausalLM(cfg)
    split = split_parameters(model)
    check_invariants(model, split)
    stacked = [n for n, p in split.muon if p.ndim == 3]
    assert set(stacked) == split.stacked
    # transformers 5 stores each layer's experts as 3-D tensors; 4.x as one nn.Linear per expert
    experts_are_stacked = any(p.ndim == 3 for p in model.parameters())
    assert bool(stacked) == experts_are_stacked
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= names(split.adamw)
    # the optimizer runs one Newton–Schulz per expert and trains
    opt = Muon(model, lr=1e-2)
    assert any(g["stacked"] for g in opt.param_groups) == experts_are_stacked
    ids = torch.randint(0, 64, (2, 8))
    losses = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_plain_module_and_generator_input():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Conv1d(8, 4, 3))
    split = split_parameters(model)
    check_invariants(model, split)
    assert names(split.muon) == {"1.weight", "3.weight"}
    assert names(split.adamw) == {"0.weight", "1.bias", "2.weight", "2.bias", "3.bias"}
    # model.parameters() and model.named_parameters() carry the model: same split as Muon(model)
    for params in (model.parameters(), model.named_parameters(), model):
        opt = Muon(params)
        muon_ids = {id(p) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
        assert muon_ids == {id(model[1].weight), id(model[3].weight)}


def test_user_groups_are_split_by_the_model():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8))
    groups = [{"params": [model[0].weight, model[1].weight], "weight_decay": 0.1}, {"params": [model[1].bias]}]
    opt = Muon(groups, model=model)
    by_alg = {(g["algorithm"], g["weight_decay"]) : len(g["params"]) for g in opt.param_groups}
    assert by_alg == {("adamw", 0.1): 1, ("muon", 0.1): 1, ("adamw", 0.01): 1}


def test_regex_overrides():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    split = split_parameters(model, force_muon=r"^0\.weight$", force_adamw=r"^2\.")
    assert names(split.muon) == {"0.weight", "1.weight"}
    assert "force_muon override" in split.reasons["0.weight"]
    assert "2.weight" in names(split.adamw)
    with pytest.raises(ValueError, match="Muon needs a matrix"):
        split_parameters(model, force_muon=r"bias")
    with pytest.raises(ValueError, match="both force_muon and force_adamw"):
        split_parameters(model, force_muon=r"1\.weight", force_adamw=r"1\.")
    # a regex that matches nothing (a typo) left the split as it was, silently
    with pytest.raises(ValueError, match=r"force_adamw='q_prj' matches no parameter of Sequential \(names look like 0"):
        split_parameters(model, force_adamw="q_prj")


def test_a_wrapped_model_is_split_as_the_model(tmp_path):
    """Muon(DDP(model).parameters()), the order of PyTorch's tutorial: the wrapper forwards no accessor,
    so the untied LM head went to Muon silently, and Phi-3's fused blocks failed on config=None."""
    import torch.distributed as dist

    cfg = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                  pad_token_id=0)
    model = transformers.Phi3ForCausalLM(cfg)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(model)
        assert split_parameters(wrapped).algorithm_of() == split_parameters(model).algorithm_of()
        assert "lm_head.weight" in names(split_parameters(wrapped).adamw)
        opt = Muon(wrapped.parameters())
        assert len(opt.fused_blocks()) == len(Muon(model).fused_blocks()) == 2
        compiled = torch.compile(model)
        assert split_parameters(compiled).algorithm_of() == split_parameters(model).algorithm_of()
    finally:
        dist.destroy_process_group()


def test_inspect_cli_prints_the_split(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    run = hf_muon_cli("inspect", str(tmp_path))  # test_fused runs the entry point as a process
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "model.layers.0.self_attn.q_proj.weight" in out and "muon" in out
    assert "lm_head.weight" in out and "output embedding" in out
    assert "optimizer state" in out.lower()
    # mistakes end with a message, not a traceback (a bad regex, one that matches nothing, no model_type)
    for args, message in ((["--force_muon", "("], "--force_muon '(' is not a valid regular expression (missing )"),
                          (["--force_adamw", "q_prj"], "force_adamw='q_prj' matches no parameter")):
        run = hf_muon_cli("inspect", str(tmp_path), *args)
        assert run.returncode == 2 and run.stderr.startswith("hf-muon inspect: ") and message in run.stderr, run.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    run = hf_muon_cli("inspect", str(tmp_path / "empty"))
    assert run.returncode == 2 and "is not a config transformers can read" in run.stderr, run.stderr
    assert "Should have a `model_type` key" in run.stderr
    # a config the model class itself refuses (a pad id beyond the vocabulary: an AssertionError inside)
    transformers.Phi3Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                            intermediate_size=96, vocab_size=256).save_pretrained(tmp_path / "refused")
    run = hf_muon_cli("inspect", str(tmp_path / "refused"))
    assert run.returncode == 2 and "hf-muon inspect: transformers cannot build a Phi3Config model" in run.stderr, \
        run.stderr
    minilm = hf_muon_cli("inspect", minilm_path())
    assert minilm.returncode == 0
    assert "embeddings.word_embeddings.weight" in minilm.stdout and "input embedding" in minilm.stdout
