"""``hf-muon plan``: its figures against arithmetic done by hand, its exchange sizes against the real
exchange's counters, the CLI, and its messages on bad input.

Hand formulas (the kernel's FLOP model, ``newton_schulz.ns_matmuls``), for an ``m x n`` matrix with
``m = min(rows, cols)``, ``n = max(rows, cols)``, 5 quintic steps, fp32 (so the Gram iterations run as
one segment, no restarts):

* standard: every step computes ``A = X X^T`` (m x n x m), ``A @ A`` (m x m x m), ``B @ X`` (m x m x n):
  ``5 * (2*m*n*m + 2*m*m*m + 2*m*m*n)``;
* Gram: ``X X^T`` once and ``Q X`` once (2 products of 2*m*m*n) and 17 products of m x m x m (step 1:
  ``A @ A`` and the two of ``A <- B (A B)``; steps 2-4: those and ``Q <- B Q``; step 5: ``A @ A``, ``B Q``);
* the kernel picks Gram where it costs at most 0.9x the standard count (which one, per shape, is
  written next to each use below).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import hf_muon_cli

from hf_muon.distributed.exchange import ExchangeStats, exchange_volume, orthogonalize_distributed
from hf_muon.distributed.layout import group_flat_sharded
from hf_muon.planner.model import PRESET_DIR
from hf_muon.distributed.plan import PIPELINE_BUCKETS, assign_owners, plan_buckets
from hf_muon.planner import plan_for_shapes, plan_tensors
from hf_muon.planner.cost import _layouts
from hf_muon.planner.model import meta_model, model_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP32 = torch.float32


def standard(m: int, n: int) -> int:
    return 5 * (2 * m * n * m + 2 * m * m * m + 2 * m * m * n)


def gram(m: int, n: int) -> int:
    return 2 * (2 * m * m * n) + 17 * (2 * m * m * m)


# The choices the kernel makes on the shapes below (Gram iff gram <= 0.9 * standard):
#   64x64:  standard 7,864,320 vs Gram 9,961,472 (1.27) -> standard
#   32x64:  standard 1,638,400 vs Gram 1,376,256 (0.84) -> Gram
#   64x176: standard 17,039,360 vs Gram 11,796,480 (0.69) -> Gram
#   64x256: standard 23,592,960 vs Gram 13,107,200 (0.56) -> Gram
#   64x192: standard 18,350,080 vs Gram 12,058,624 (0.66) -> Gram
#   64x96:  standard 10,485,760 vs Gram 10,485,760 (1.0) -> standard
#   4x64:   standard 21,120 vs Gram 6,272 (0.30) -> Gram
assert standard(64, 64) == 7_864_320 and gram(64, 64) == 9_961_472
assert standard(32, 64) == 1_638_400 and gram(32, 64) == 1_376_256


def tiny_llama_config() -> dict:
    import transformers

    return transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=128).to_dict()


def tiny_llama():
    """GQA: 4 heads of 16, 2 KV heads -> k, v are 32 x 64."""
    import transformers

    return meta_model(transformers.LlamaConfig.from_dict({**tiny_llama_config(), "architectures": ["LlamaForCausalLM"]}))


def tiny_gpt2():
    """Fused c_attn (64 x 192 Conv1D) cut in q, k, v blocks of 64 x 64."""
    import transformers

    return meta_model(transformers.GPT2Config(
        n_embd=64, n_head=4, n_layer=2, n_positions=32, vocab_size=128, bos_token_id=0, eos_token_id=0,
        architectures=["GPT2LMHeadModel"]))


def tiny_mixtral():
    import transformers

    return meta_model(transformers.MixtralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=128, architectures=["MixtralForCausalLM"]))


def plans(model, layout: str, worlds: list[int], **options):
    return plan_tensors(model_tensors(model), layout, worlds, "h100-sxm", "ib-400g", ns_dtype=FP32, **options)


# ---- tiny Llama: per layer q, o 64x64; k, v 32x64; gate, up 176x64; down 64x176 -----------------------
LLAMA_NS = 2 * (2 * standard(64, 64) + 2 * gram(32, 64) + 3 * gram(64, 176))
LLAMA_MUON = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 176 * 64)  # 92,160
LLAMA_ADAMW = 128 * 64 + 64 * 128 + (2 * 2 + 1) * 64  # embeddings, untied head, 5 RMSNorm weights: 16,704


def test_llama_ddp_w2_by_hand():
    (p,) = plans(tiny_llama(), "ddp", [2])
    assert (p.muon_tensors, p.muon_params, p.adamw_params) == (14, LLAMA_MUON, LLAMA_ADAMW)
    assert p.ns_flops.mean * 2 == LLAMA_NS  # every matrix once, on its owner
    assert p.ns_flops.max < LLAMA_NS  # both ranks own some
    # DDP: no gather (every owner holds its tensor); the owner sends the fp32 result to the other rank
    assert p.exchange_sent.mean * 2 == 4 * LLAMA_MUON
    assert p.exchange_received.mean * 2 == 4 * LLAMA_MUON
    # ring all-reduce of the gradients, fp32 under DDP (autocast keeps parameters fp32):
    # 2 * (W-1)/W * params * 4 bytes
    assert p.backend_detail == {"gradient all-reduce": 2 * (1 / 2) * (LLAMA_MUON + LLAMA_ADAMW) * 4}
    # state: Muon one fp32 buffer, AdamW two; DDP keeps all of it on every rank
    assert p.state_bytes.max == 4 * (LLAMA_MUON + 2 * LLAMA_ADAMW) == 502_272
    assert p.adamw_state_bytes.max == 4 * 2 * (LLAMA_MUON + LLAMA_ADAMW) == 870_912


def test_llama_state_matches_optimizer_state_bytes():
    from hf_muon.optimizer.param_split import optimizer_state_bytes, split_parameters

    model = tiny_llama()
    expected = optimizer_state_bytes(split_parameters(model))
    (p,) = plans(model, "ddp", [1])
    assert (p.state_bytes.max, p.adamw_state_bytes.max) == (expected["hf_muon"], expected["all_adamw"])


@pytest.mark.parametrize("layout", ["fsdp2", "zero3"])
def test_llama_sharded_w2_by_hand(layout):
    (p,) = plans(tiny_llama(), layout, [2])
    assert p.ns_flops.mean * 2 == LLAMA_NS
    # every row count and element count is even: each rank holds half of every tensor. The owner
    # receives the other half (gather) and sends it back (result): per tensor n/2 fp32 each way.
    assert p.exchange_sent.min == p.exchange_sent.max == p.exchange_received.max
    assert p.exchange_sent.mean * 2 == 4 * LLAMA_MUON
    assert p.state_bytes.max == 4 * (LLAMA_MUON // 2 + 2 * (LLAMA_ADAMW // 2))  # 251,136
    assert p.backend_detail["gradient reduce-scatter"] == (1 / 2) * (LLAMA_MUON + LLAMA_ADAMW) * 2
    assert p.backend_detail["parameter all-gather (fwd + bwd)"] == 2 * (1 / 2) * (LLAMA_MUON + LLAMA_ADAMW) * 2


def test_llama_zero3_large_world_by_hand():
    world = 64
    (p,) = plans(tiny_llama(), "zero3", [world])
    # 14 tensors, 64 ranks: each tensor gets an owner of its own, 50 ranks idle
    assert p.busy_ranks == 14 and p.ns_flops.min == 0
    assert p.ns_flops.max == gram(64, 176) == 11_796_480
    assert any("50 of 64 ranks run no Newton–Schulz" in n for n in p.notes)
    # ZeRO-3 pieces of ceil(n/64): 64x64 -> 64 each, 32x64 -> 32, 176x64 -> 176. The owner receives
    # n minus its own piece and sends as much back; summed over ranks every byte is counted once sent.
    per_layer = 2 * (4096 - 64) + 2 * (2048 - 32) + 3 * (11264 - 176)
    assert p.exchange_sent.mean * world == pytest.approx(2 * 4 * 2 * per_layer)
    assert p.exchange_received.mean * world == pytest.approx(2 * 4 * 2 * per_layer)


def test_llama_ddp_large_world_by_hand():
    world = 64
    (p,) = plans(tiny_llama(), "ddp", [world])
    # DDP: each owner sends its result to the 63 others
    assert p.exchange_sent.mean * world == pytest.approx(4 * LLAMA_MUON * (world - 1))
    assert p.ns_flops.max == gram(64, 176)


def test_ddp_notes_when_each_rank_alone_would_be_faster():
    # 64 ranks of the tiny Llama: 8 all-to-alls of latency cost more than one rank's whole Newton–Schulz
    (p,) = plans(tiny_llama(), "ddp", [64])
    alone = LLAMA_NS / (67e12 * 0.6) + p.times.elementwise  # fp32 at 60% of the H100's 67 TFLOP/s
    assert alone < 0.9 * p.times.muon_overlapped
    (note,) = [n for n in p.notes if n.startswith("Muon(distributed=False) would be faster here")]
    assert f"instead of {p.times.muon_overlapped * 1e3:.1f} ms" in note
    # 2 ranks of a slow accelerator: Newton–Schulz dominates, and sharing it halves it: no note
    (q,) = plans(tiny_llama(), "ddp", [2], peak_tflops=1e-3)
    assert q.times.newton_schulz < 0.6 * LLAMA_NS / (1e9 * 0.6)
    assert not any("distributed=False" in n for n in q.notes)
    (z,) = plans(tiny_llama(), "zero3", [64])  # ranks hold pieces: they cannot go alone
    assert not any("distributed=False" in n for n in z.notes)
    # with the hardware's exchange_flops_per_byte (as the note says) Muon drops the exchange itself,
    # and the plan shows that step: all of the Newton–Schulz on every rank, nothing on the wire
    (alone,) = plans(tiny_llama(), "ddp", [64], exchange_flops_per_byte=p.hardware_flops_per_byte)
    assert f"Muon(exchange_flops_per_byte={p.hardware_flops_per_byte:.3g}) makes that choice itself" in note
    assert alone.ns_flops.min == alone.ns_flops.max == LLAMA_NS and alone.busy_ranks == 64
    assert alone.exchange_sent.max == 0 and alone.exchange_collectives == 0 and alone.exchanges == 0
    assert alone.times.muon_overlapped == pytest.approx(LLAMA_NS / (67e12 * 0.6) + alone.times.elementwise)
    assert any(n.startswith("every rank orthogonalizes every matrix itself") for n in alone.notes)
    (shared,) = plans(tiny_llama(), "ddp", [64], exchange_flops_per_byte=1e-9)  # nearly free links: exchange
    assert shared.exchange_sent.max > 0 and shared.ns_flops.max == gram(64, 176)


# ---- tiny GPT-2: c_attn 64x192 in three 64x64 blocks, c_proj 64x64, c_fc 64x256, mlp.c_proj 256x64 --------
def test_gpt2_fused_blocks_by_hand():
    (p,) = plans(tiny_gpt2(), "fsdp2", [2])
    blocks = 3 * standard(64, 64)  # not the whole 64x192's gram(64, 192)
    assert p.ns_flops.mean * 2 == 2 * (blocks + standard(64, 64) + 2 * gram(64, 256))
    assert p.matrices == 2 * (3 + 1 + 1 + 1)
    muon = 2 * (64 * 192 + 64 * 64 + 2 * 64 * 256)
    assert p.muon_params == muon
    assert p.exchange_sent.mean * 2 == 4 * muon  # halves each way, as above


def test_owners_weigh_a_fused_projection_at_its_blocks_cost():
    """What c_attn's owner runs (three 64x64 standard runs, 3 S = 23.6 MFLOP) is what the owner plan
    weighs, not the whole 64x192's Gram cost (12.1 MFLOP, less than an MLP matrix's 13.1). At 4 ranks
    the two c_attn go to two ranks with a c_proj each (4 S) and the four MLP matrices pair up on the
    other two (2 x 13.1 MFLOP). Weighed whole, c_attn was paired with an MLP matrix: 36.7 MFLOP."""
    s, mlp = standard(64, 64), gram(64, 256)
    (p,) = plans(tiny_gpt2(), "fsdp2", [4])
    assert p.ns_flops.max == 4 * s < 3 * s + mlp
    assert p.ns_flops.min == 2 * mlp


def test_layouts_with_blocks():
    from hf_muon.distributed.layout import exchanged_matrices, replicated, with_blocks

    fused, plain = replicated((192, 64), False, 2), replicated((64, 64), False, 2)
    blocked, same = with_blocks([fused, plain], [[(64, 64)] * 3, None])
    assert blocked.ns_matrices == [(64, 64)] * 3 and blocked.ns_flops(5) == 3 * standard(64, 64)
    assert same is plain and fused.ns_matrices == [(192, 64)]
    assert with_blocks([fused], None) == [fused]
    with pytest.raises(ValueError, match="2 block lists for 1 layouts"):
        with_blocks([fused], [None, None])
    # a stack's blocks are each expert's: 2 experts x (gate, up), and each expert an item of its own
    stack, = with_blocks([replicated((2, 128, 64), True, 2)], [[(64, 64)] * 2])
    assert stack.ns_matrices == [(64, 64)] * 4 and stack.ns_flops(5) == 4 * standard(64, 64)
    assert [item.layout.ns_matrices for item in exchanged_matrices([stack])] == [[(64, 64)] * 2] * 2


# ---- tiny Mixtral: the installed transformers' expert layout ---------------------------------------------
def test_mixtral_experts_by_hand():
    model = tiny_mixtral()
    tensors = model_tensors(model)
    attention = 2 * standard(64, 64) + 2 * gram(32, 64) + gram(4, 64)  # q, o, k, v, router (4 experts x 64)
    # gate and up (96x64 each) and down (64x96) of each of 4 experts, however they are stored: transformers 4
    # keeps per-expert Linears; transformers 5 one stacked [4, 192, 64] gate_up and one [4, 64, 96] down per
    # layer, each expert's gate | up matrix cut in its gate and up blocks (fused_blocks)
    experts = 4 * (2 * gram(64, 96) + standard(64, 96))
    matrices = 2 * (5 + 12)
    if hasattr(model.model.layers[0].mlp.experts, "gate_up_proj"):
        assert [len(g) for g in tensors.muon_groups] == [10, 4]
    (p,) = plans(model, "zero3", [2])
    assert p.ns_flops.mean * 2 == 2 * (attention + experts)
    assert p.matrices == matrices
    muon = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 4 * 64 + 4 * 3 * 96 * 64)
    assert p.muon_params == muon
    (big,) = plans(model, "zero3", [512])
    # ZeRO-3: each param group's flat partition has its own exchange and owner plan, so rank 0 takes
    # the largest matrix of each group (a q or o 64x64 and, on transformers 5, one gate_up expert:
    # a stack is exchanged matrix by matrix, each expert with its own owner) at once
    if hasattr(model.model.layers[0].mlp.experts, "gate_up_proj"):
        gate_up = 2 * gram(64, 96)  # one expert's gate and up blocks
        assert big.ns_flops.max == standard(64, 64) + gate_up
        assert big.busy_ranks == 2 * (4 + 4)  # the experts' 16 owners (a stack had one); q..router's 10 among them
        # FSDP2 shards dim 0 of a [4, r, c] stack: at 512 ranks ranks 0-3 each hold one expert of
        # every stack whole, and a matrix held whole by one rank is orthogonalized there (no traffic):
        # rank 0 takes expert 0 of both layers' gate_up and down; q..router's 10 go to other ranks.
        (one,) = plans(model, "fsdp2", [512])
        assert one.ns_flops.max == 2 * (gate_up + standard(64, 96)) and one.busy_ranks == 4 + 10
        ratio = (standard(64, 64) + gate_up) / (2 * (gate_up + standard(64, 96)))
        assert big.times.newton_schulz / one.times.newton_schulz == pytest.approx(ratio)
        # ranks 0-3 own 4 matrices each: the overlapped exchange pipelines them in 4 buckets; ZeRO-3's
        # two exchanges have one matrix per owner, a bucket each
        assert (one.buckets, big.buckets) == (4, 2)
    else:  # one group of single matrices: the largest is an expert's 64x96 (standard = Gram there)
        assert big.ns_flops.max == standard(64, 96)


def test_experts_held_whole_move_when_links_are_cheap_enough():
    model = tiny_mixtral()
    if not hasattr(model.model.layers[0].mlp.experts, "gate_up_proj"):
        pytest.skip("transformers 4 keeps each expert as its own Linear: no stacks for FSDP2 to leave whole")
    (pinned,) = plans(model, "fsdp2", [512])
    # an H100 (fp32: 67 TFLOP/s at 60%) against IB 400G (50 GB/s): 804 FLOPs per byte, so moving a
    # tiny expert costs far more than orthogonalizing it: ranks 0-3 keep theirs, and no note
    assert pinned.hardware_flops_per_byte == pytest.approx(67e12 * 0.6 / 50e9)
    assert pinned.exchange_flops_per_byte is None
    gate_up = 2 * gram(64, 96)  # one expert's gate and up blocks
    assert pinned.ns_flops.max == 2 * (gate_up + standard(64, 96)) and pinned.busy_ranks == 4 + 10
    assert not any("exchange_flops_per_byte" in note for note in pinned.notes)
    (moved,) = plans(model, "fsdp2", [512], exchange_flops_per_byte=1e-6)
    # nearly free links: each of the 26 matrices on its own rank, the largest (a gate_up expert) sets NS
    assert moved.busy_ranks == 26 and moved.ns_flops.max == gate_up
    # each holder moved its 2 gate_up experts and 1 of its 2 down experts (largest first; the last
    # one stays: moving it would only swap ranks), each sent whole to its owner and back, fp32
    moved_elements = 4 * (2 * 192 * 64 + 64 * 96)
    assert moved.exchange_sent.mean * 512 == pytest.approx(pinned.exchange_sent.mean * 512 + 2 * 4 * moved_elements)
    # a slow accelerator (1 GFLOP/s) on the same link: moving pays, and the plan says so and by how much
    (slow,) = plans(model, "fsdp2", [512], peak_tflops=1e-3, latency_us=0)
    (note,) = [note for note in slow.notes if "exchange_flops_per_byte" in note]
    assert "16 matrices are held whole by one rank" in note and "Muon(exchange_flops_per_byte=0.012)" in note
    (slow_moved,) = plans(model, "fsdp2", [512], peak_tflops=1e-3, latency_us=0, exchange_flops_per_byte=0.012)
    assert slow_moved.times.muon_overlapped < 0.5 * slow.times.muon_overlapped
    assert f"step {slow_moved.times.muon_overlapped * 1e3:.1f} ms instead of {slow.times.muon_overlapped * 1e3:.1f} ms" in note


# ---- ZeRO-1/2 layout: DeepSpeed's flatten, pad to 2*W, W equal partitions ----------------------------------
def test_zero12_layout_by_hand():
    # 24 + 30 = 54 elements, W = 4: padded to 56 (a multiple of 2 * 4), partitions of 14
    a, b = group_flat_sharded([(4, 6), (10, 3)], False, 4)
    assert a.ranges == ((0, 14), (14, 24), (0, 0), (0, 0))
    assert b.ranges == ((0, 0), (0, 4), (4, 18), (18, 30))  # flat 24..54: rank 1 to 28, rank 2 to 42


# ---- the planner's exchange sizes are the real exchange's counters ---------------------------------------
class _FakeWork:
    def wait(self):
        return None


def _measured_stats(layouts, owners, world, comm_dtype, buckets, monkeypatch):
    """Run the real exchange once per rank in this process, its collective replaced by one that only
    records the call: ``ExchangeStats`` counts what each rank would send and receive."""
    calls = []

    def fake_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                               async_op=False):
        calls.append((sum(output_split_sizes), sum(input_split_sizes)))
        output.zero_()
        return _FakeWork() if async_op else None

    monkeypatch.setattr(torch.distributed, "all_to_all_single", fake_all_to_all_single)
    stats = []
    for rank in range(world):
        pieces = [torch.zeros(end - start) for start, end in (lay.ranges[rank] for lay in layouts)]
        s = ExchangeStats()
        orthogonalize_distributed(pieces, layouts, owners, lambda wholes, _: [w.clone() for w in wholes],
                                  group=None, rank=rank, world=world, stats=s, buckets=buckets,
                                  comm_dtype=comm_dtype)
        stats.append(s)
    return stats, len(calls) // world


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "zero1", "zero3"])
@pytest.mark.parametrize("world", [2, 5])
@pytest.mark.parametrize("comm_dtype", [torch.float32, torch.bfloat16])
def test_exchange_volume_equals_exchange_stats(layout, world, comm_dtype, monkeypatch):
    tensors = model_tensors(tiny_mixtral())  # two groups: whole matrices, stacked experts
    bucket_bytes = 40_000  # several buckets
    most_buckets = 0
    for group in tensors.muon_groups:
        layouts = _layouts(layout, group, world)
        owners = assign_owners(layouts, world, 5, FP32)
        itemsize = torch.empty(0, dtype=comm_dtype).element_size()
        buckets = plan_buckets(layouts, owners, world, 5, itemsize, bucket_bytes, PIPELINE_BUCKETS, FP32)
        volume = exchange_volume(layouts, owners, world, itemsize, buckets, 4)
        stats, calls = _measured_stats(layouts, owners, world, comm_dtype, buckets, monkeypatch)
        assert volume.bytes_sent == [s.bytes_sent for s in stats]
        assert volume.bytes_received == [s.bytes_received for s in stats]
        assert len(volume.collective_bytes) == calls
        assert volume.buckets == len(buckets)
        assert sum(s.tensors_orthogonalized for s in stats) == len(layouts)
        most_buckets = max(most_buckets, len(buckets))
    assert most_buckets > 1  # the attention/dense group is cut in several buckets


def test_plan_for_shapes_one_process_has_no_exchange():
    shapes = [(64, 64), (32, 64), (176, 64)]
    p = plan_for_shapes(shapes, "ddp", 1, "h100-sxm", ns_dtype="fp32")
    assert p.ns_flops.max == standard(64, 64) + gram(32, 64) + gram(64, 176)
    assert p.exchange_collectives == 0 and p.times.exchange == 0
    # time = FLOPs / (67 TFLOP/s fp32 x 0.6) + element-wise bytes / 3.35 TB/s
    elements = 64 * 64 + 32 * 64 + 176 * 64
    assert p.times.muon_sum == pytest.approx(p.ns_flops.max / (67e12 * 0.6) + 40 * elements / 3.35e12)


def test_zero3_two_ranks_prediction_from_shapes():
    p = plan_for_shapes([(64, 64), (64, 64)], "zero3", 2, "h100-sxm", "ib-400g", ns_dtype="fp32")
    # one 64x64 per rank; each rank gathers the other half of its own (2048 fp32) and sends one half
    assert p.ns_flops.min == p.ns_flops.max == standard(64, 64)
    assert p.exchange_sent.max == p.exchange_received.max == 2 * 2048 * 4
    # two all-to-alls (one bucket): each moves 8 KiB per rank, at 50 GB/s plus 20 us each
    assert p.times.exchange == pytest.approx(2 * (2048 * 4 / 50e9 + 20e-6))
    assert p.times.muon_overlapped <= p.times.muon_sum


# ---- ZeRO-3 sub-groups: DeepSpeed's own rule, by hand, and a real 2-rank run --------------------------------
_DEEPSPEED_SUB_GROUPS = """
import json, sys, types
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
class Param:
    def __init__(self, index, numel):
        self.index, self.numel = index, numel
    def partition_numel(self):
        return self.numel
out = []
for numels, size in json.load(sys.stdin):
    params = [Param(i, n) for i, n in enumerate(numels)]
    groups = Stage3._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=size), params)
    out.append([[p.index for p in g] for g in groups])
print(json.dumps(out))
"""


def test_zero3_sub_groups_are_deepspeeds():
    """``zero3_sub_groups`` cuts where DeepSpeed's own ``_create_fp16_sub_groups`` does, asked in a
    subprocess on stand-in parameters of the same per-rank partition sizes."""
    import json
    import random

    from hf_muon.planner.cost import zero3_sub_groups
    from hf_muon.planner.model import PlanTensor

    pytest.importorskip("deepspeed")
    gen = random.Random(0)
    cases = []
    for _ in range(300):
        world = gen.choice([1, 2, 3, 8])
        tensors = [PlanTensor(f"t{i}", (gen.randint(1, 40), gen.randint(1, 40))) for i in range(gen.randint(1, 12))]
        numels = [math.ceil(math.prod(t.shape) / world) for t in tensors]
        total = sum(numels)
        # None, tiny, a boundary hit exactly (the sum of a prefix), in between, the whole group, larger
        size = gen.choice([None, 1, sum(numels[:gen.randint(1, len(numels))]), gen.randint(1, total), total,
                           total + 1])
        cases.append((tensors, world, size, numels))
    result = subprocess.run([sys.executable, "-c", _DEEPSPEED_SUB_GROUPS], input=json.dumps(
        [(numels, size) for _, _, size, numels in cases]), capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    cut = 0
    for (tensors, world, size, _), expected in zip(cases, theirs):
        ours = [[int(t.name[1:]) for t in sub] for sub in zero3_sub_groups(tensors, world, size)]
        assert ours == expected, (world, size, [t.shape for t in tensors])
        cut += len(ours) > 1
    assert cut > 100  # most cases are cut, so the rule itself is compared


def test_zero3_sub_groups_by_hand():
    shapes = [(64, 64)] * 4  # 2048 elements of each on each of 2 ranks
    one = plan_for_shapes(shapes, "zero3", 2, "h100-sxm", ns_dtype="fp32")
    assert one.exchanges == 1 and one.ns_flops.max == 2 * standard(64, 64)  # two matrices per rank
    # 2 per sub-group (closed at 4096): each sub-group's plan gives each rank one matrix
    pairs = plan_for_shapes(shapes, "zero3", 2, "h100-sxm", ns_dtype="fp32", sub_group_size=4096)
    assert pairs.exchanges == 2 and pairs.ns_flops.max == 2 * standard(64, 64)
    assert pairs.times.newton_schulz == pytest.approx(one.times.newton_schulz)
    # all-to-alls, out and back per bucket: one exchange of 2 buckets (each owner's 2 matrices apart)
    # against 2 exchanges of one bucket (one matrix per owner)
    assert one.buckets == 2 and pairs.buckets == 2 and one.exchange_collectives == pairs.exchange_collectives == 4
    # one matrix per sub-group: four plans, each with one busy owner, run one after another
    singles = plan_for_shapes(shapes, "zero3", 2, "h100-sxm", ns_dtype="fp32", sub_group_size=2048)
    assert singles.exchanges == 4 and singles.exchange_collectives == 8
    assert singles.ns_flops.min + singles.ns_flops.max == 4 * standard(64, 64)
    assert singles.times.newton_schulz == pytest.approx(2 * one.times.newton_schulz)
    assert any("as 4 sub-groups" in note for note in singles.notes)
    assert any("as 2 sub-groups" in note for note in pairs.notes)
    assert not any("sub-groups" in note for note in one.notes)
    # the size counts each rank's partition: at 4 ranks, 1024 elements each, so 4096 keeps all four together
    assert plan_for_shapes(shapes, "zero3", 4, "h100-sxm", ns_dtype="fp32", sub_group_size=4096).exchanges == 1


@pytest.mark.slow
def test_zero3_sub_groups_match_a_deepspeed_run(tmp_path):
    """DeepSpeed ZeRO-3 at 2 ranks with a small ``sub_group_size``: the exchanges, each rank's
    Newton–Schulz FLOPs and bytes the planner predicts are those of the run; the uncut plan's are not."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "dist"))
    from same_answer import build

    from test_zero import run_zero

    steps, size = 2, 4000  # Block at W=2: partitions q 1152, kv 288, up 3456 | down 3456, conv 3456 | head 1536
    r = run_zero(tmp_path, 2, "--stages", "3", "--steps", str(steps), "--sub_group_size", str(size))["3"]
    assert max(r["max_rel_diff"]) <= 1e-5, r
    tensors = model_tensors(build("block"))
    cut, = plan_tensors(tensors, "zero3", [2], "h100-sxm", "ib-400g", ns_dtype=FP32, sub_group_size=size)
    whole, = plan_tensors(tensors, "zero3", [2], "h100-sxm", "ib-400g", ns_dtype=FP32)
    assert r["exchanges"] == [cut.exchanges] * 2 and cut.exchanges == 3
    per_step = sorted(f / steps for f in r["ns_flops"])
    assert per_step == [cut.ns_flops.min, cut.ns_flops.max]
    assert per_step != [whole.ns_flops.min, whole.ns_flops.max]  # the cut changes who owns what
    assert [b / steps for b in r["bytes_sent"]] == [cut.exchange_sent.max] * 2
    assert [b / steps for b in r["bytes_received"]] == [cut.exchange_received.max] * 2


def test_many_ranks():
    (p,) = plans(tiny_llama(), "zero2", [4096])
    assert p.busy_ranks == 14 and p.world == 4096


# ---- errors ----------------------------------------------------------------------------------------------
def test_bad_inputs_api(tmp_path):
    from hf_muon.planner import plan_model

    with pytest.raises(ValueError, match="unknown layout"):
        plan_for_shapes([(4, 4)], "zero4", 1, "h100-sxm")
    with pytest.raises(ValueError, match=">= 1"):
        plan_for_shapes([(4, 4)], "ddp", 0, "h100-sxm")
    with pytest.raises(ValueError, match="unknown accelerator"):
        plan_for_shapes([(4, 4)], "ddp", 1, "tpu-v9")
    with pytest.raises(ValueError, match="unknown interconnect"):
        plan_for_shapes([(4, 4)], "ddp", 1, "h100-sxm", "carrier-pigeon")
    with pytest.raises(ValueError, match="without config.json"):
        plan_model(str(tmp_path), "ddp", [2])
    with pytest.raises(ValueError, match="not a shipped preset"):
        plan_model("no-such-model-xyz", "ddp", [2])


def _cli_process(*args: str, timeout: int = 300, **env_vars: str) -> subprocess.CompletedProcess:
    """``python -m hf_muon.cli plan ...`` as a user runs it (5 s of imports each time)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1",
           **env_vars}
    return subprocess.run([sys.executable, "-m", "hf_muon.cli", "plan", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The same command in this process; test_cli_llama_3_8b_zero3 runs the entry point as a process."""
    return hf_muon_cli("plan", *args)


def test_cli_llama_3_8b_zero3(tmp_path):
    result = _cli_process("llama-3-8b", "--layout", "zero3", "--world", "64,1024", "--plot", str(tmp_path / "plan.png"))
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "llama-3-8b (LlamaForCausalLM): zero3, 64 ranks of h100-sxm over ib-400g" in out
    assert "Muon: 224 tensors (224 matrices, 6.98 B parameters)" in out
    assert "800 of 1024 ranks run no Newton–Schulz" in out
    assert "projected optimizer step" in out and "summary" in out
    assert (tmp_path / "plan.png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["no-such-model-xyz", "--layout", "ddp", "--world", "2"], "not a shipped preset"),
    (["llama-3-8b", "--layout", "zero4", "--world", "2"], "invalid choice: 'zero4'"),
    (["llama-3-8b", "--layout", "ddp", "--world", "0"], "--world sizes must be >= 1"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--accelerator", "tpu"], "invalid choice: 'tpu'"),
    (["llama-3-8b", "--layout", "zero2", "--world", "2", "--sub_group_size", "1000"], "a DeepSpeed ZeRO-3 setting"),
    (["llama-3-8b", "--layout", "zero3", "--world", "2", "--sub_group_size", "0"], "sub_group_size must be"),
    (["llama-3-8b", "--layout", "fsdp2", "--world", "2", "--exchange_flops_per_byte", "0"],
     "exchange_flops_per_byte must be a positive number"),
    # accepted before: a negative latency printed a step of -0.0 ms, 500 steps a plan Muon would refuse
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--latency_us", "-5"], "--latency_us must be a number >= 0"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--ns_steps", "500"], "ns_steps must be an integer in [1, 100)"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--bucket_mib", "-5"],
     "--bucket_mib must be a finite number > 0, got -5.0"),
    # accepted before: nan printed a step of nan s, inf a note recommending a value Muon refuses
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--bucket_mib", "inf"], "--bucket_mib must be a finite number"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--peak_tflops", "nan"], "--peak_tflops must be a finite number"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--link_gbs", "inf"], "--link_gbs must be a finite number"),
    (["no/such/config.json", "--layout", "ddp", "--world", "2"], "no/such/config.json: no such file or folder"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--plot", "plan.xyz"], "--plot plan.xyz: give a file name ending in"),
    (["llama-3-8b", "--layout", "ddp", "--world", "2", "--plot", "/no/such/folder/plan.png"], "no folder /no/such/folder"),
])
def test_cli_bad_inputs(args, message):
    result = _cli(*args)
    assert result.returncode == 2
    assert message in result.stderr


def test_cli_reads_a_model_id_from_the_local_cache(tmp_path):
    """``org/name`` as the Hugging Face cache holds it (nothing downloaded), not taken for a path."""
    snapshot = tmp_path / "hub" / "models--someorg--tiny-llama" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text(json.dumps({**tiny_llama_config(), "architectures": ["LlamaForCausalLM"]}))
    result = _cli_process("someorg/tiny-llama", "--layout", "ddp", "--world", "2", HF_HOME=str(tmp_path))
    assert result.returncode == 0 and "someorg/tiny-llama (LlamaForCausalLM): ddp, 2 ranks" in result.stdout, \
        result.stderr[-2000:]


def test_cli_configs_it_cannot_plan_say_what_to_fix(tmp_path):
    """Configs that are not JSON, that name a class transformers lacks or cannot build from them, or
    that hold sizes it refuses: a message and exit status 2, not a traceback."""
    llama = json.loads((PRESET_DIR / "llama-3-8b.json").read_text())
    cases = {
        "truncated.json": ('{"model_type": "llama", "hidden_size": ', "is not a config transformers can read"),
        "class.json": (json.dumps({**llama, "architectures": ["NotAClassForCausalLM"]}),
                       "names the class 'NotAClassForCausalLM' in 'architectures', which transformers"),
        "mismatch.json": (json.dumps({**llama, "architectures": ["GPT2LMHeadModel"]}),
                          "transformers cannot build a LlamaConfig model from"),
        "heads.json": (json.dumps({**llama, "hidden_size": 64, "num_attention_heads": 5}),
                       "heads.json is not a config transformers can read"),
        "zero.json": (json.dumps({**llama, "hidden_size": 0}), "transformers cannot build a LlamaConfig model"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        result = _cli(str(tmp_path / name), "--layout", "ddp", "--world", "2")
        assert result.returncode == 2 and message in result.stderr, (name, result.stderr[-2000:])


def test_a_config_without_architectures_is_planned_with_its_lm_head(tmp_path):
    """What training builds: the causal-LM class (``lm_head`` on AdamW), not the bare ``AutoModel``;
    one rank exchanges nothing and says so."""
    llama = json.loads((PRESET_DIR / "llama-3-8b.json").read_text())
    del llama["architectures"]
    (tmp_path / "config.json").write_text(json.dumps(llama))
    bare, preset = (json.loads(_cli(model, "--layout", "ddp", "--world", "1", "--json").stdout)[0]
                    for model in (str(tmp_path), "llama-3-8b"))
    assert bare["adamw_params"] == preset["adamw_params"] == 2 * 128256 * 4096 + 65 * 4096
    assert "nothing exchanged" in _cli("llama-3-8b", "--layout", "ddp", "--world", "1").stdout


def test_cli_mixtral_fsdp2_experts_held_whole():
    """Mixtral-8x7B under FSDP2 at 64 ranks: ranks 0-7 hold one expert of every stack. The default plan
    notes what moving some would save; --exchange_flops_per_byte plans it."""
    default = _cli("mixtral-8x7b", "--layout", "fsdp2", "--world", "64", "--json")
    assert default.returncode == 0, default.stderr
    (pinned,) = json.loads(default.stdout)
    (note,) = [n for n in pinned["notes"] if "exchange_flops_per_byte" in n]
    ratio = pinned["hardware_flops_per_byte"]
    assert ratio == pytest.approx(989e12 * 0.6 / 50e9) and f"Muon(exchange_flops_per_byte={ratio:.3g})" in note
    moved = _cli("mixtral-8x7b", "--layout", "fsdp2", "--world", "64", "--exchange_flops_per_byte", str(ratio))
    assert moved.returncode == 0, moved.stderr
    assert f"owner plan: matrices held whole by one rank may move at {ratio:.3g} FLOP per byte" in moved.stdout
    step = re.search(r"^total .* ([0-9.]+) ms +[0-9.]+ ms$", moved.stdout, re.M).group(1)
    assert f"step {step} ms instead of" in note
    assert float(step) < 0.8 * pinned["times"]["muon_overlapped"] * 1e3


def test_cli_folder_without_config(tmp_path):
    result = _cli(str(tmp_path), "--layout", "ddp", "--world", "2")
    assert result.returncode == 2 and "without config.json" in result.stderr


def test_cli_json_on_a_config_file(tmp_path):
    import json

    import transformers

    transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=128,
                             architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    result = _cli(str(tmp_path / "config.json"), "--layout", "fsdp2", "--world", "2,64", "--json",
                  "--ns_dtype", "fp32")
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(result.stdout)
    assert [d["world"] for d in data] == [2, 64]
    assert data[0]["ns_flops"]["mean"] * 2 == LLAMA_NS
    assert math.isclose(data[1]["ns_flops"]["max"], gram(64, 176))


@pytest.mark.slow
def test_loopback_link_is_measured():
    from hf_muon.planner.presets import interconnect

    link = interconnect("loopback")
    assert link.bandwidth > 0 and link.latency > 0 and link.name.startswith("loopback (measured")
    from hf_muon.planner.cost import plan, shapes_tensors
    from hf_muon.planner.presets import ACCELERATORS

    p = plan(shapes_tensors([(64, 64), (64, 64)]), "zero3", 2, ACCELERATORS["h100-sxm"], link, ns_dtype=FP32)
    assert p.times.exchange == pytest.approx(2 * (2048 * 4 / link.bandwidth + link.latency))
