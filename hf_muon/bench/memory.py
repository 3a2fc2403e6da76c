"""Figure 3: optimizer-state bytes on the Llama-like model, Muon vs AdamW (peak resident memory of
the training processes comes from the figure 2 runs).

The state is measured, not computed: the model is built, every parameter gets a gradient, each
optimizer takes one step, and the bytes of the tensors in its ``state`` are summed. The same
model with Llama's own 32,000-token vocabulary is given too, from ``hf_muon``'s parameter split on
the meta device (no memory used): with a large vocabulary the embeddings and the head, which stay
on AdamW, carry most of the state.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import ffn_width


def llama_config(spec: dict[str, int], vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=spec["d"], num_hidden_layers=spec["layers"],
                       num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                       intermediate_size=ffn_width(spec["d"]), tie_word_embeddings=False, use_cache=False)


def measured_state(spec: dict[str, int], vocab: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from ..optimizer.muon import Muon
    from .train_worker import optimizer_state_bytes

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(spec, vocab))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    out = {"vocab": vocab, "parameters": sum(p.numel() for p in model.parameters()),
           "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    makers = {
        "AdamW": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=True),
        "hf_muon.Muon": lambda: Muon(model, lr=1e-3, weight_decay=0.01),
    }
    for name, make in makers.items():
        opt = make()
        opt.step()
        out[name] = optimizer_state_bytes(opt)
        del opt
    out["muon_x_adamw"] = out["hf_muon.Muon"] / out["AdamW"]
    return out


def split_state(spec: dict[str, int], vocab: int) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    from ..optimizer.param_split import optimizer_state_bytes, split_parameters

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(spec, vocab))
    state = optimizer_state_bytes(split_parameters(model))
    return {"vocab": vocab, "parameters": state["muon_params"] + state["adamw_params"],
            "muon_parameters": state["muon_params"], "AdamW": state["all_adamw"], "hf_muon.Muon": state["hf_muon"],
            "muon_x_adamw": state["hf_muon"] / state["all_adamw"], "how": "from the parameter split (meta device)"}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    spec = cfg["llama_like"]
    return {"spec": spec, "measured": measured_state(spec, cfg["vocab"]),
            "llama_vocab": split_state(spec, 32000)}
