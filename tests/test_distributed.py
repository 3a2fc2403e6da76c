"""Owner-rank Newton–Schulz across ranks (CPU, gloo): same answer as one process, once per matrix,
balanced FLOPs, about 2 * P_muon / W elements of traffic per rank per step."""

import json
import os
import sys

import pytest
import torch

from hf_muon.distributed.layout import TensorLayout, flat_sharded, replicated, row_sharded
from hf_muon.distributed.plan import assign_owners, ns_load
from hf_muon.launching import free_port, run

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def torchrun(script, args, nproc=2, timeout=300, env=None):
    """Run ``script`` on ``nproc`` local ranks; on a hang, stop torchrun and its workers and fail.

    A free port can be taken by another process between our probe and torchrun's bind: that one
    failure is retried once with a new port."""
    def command():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args]

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    result = run(command, timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, f"{script} {args} failed or hung ({timeout}s):\n{result.output[-4000:]}"
    return result.output


# The single-process answer's bound by the dtype of the model and Newton–Schulz. Under DDP the averaged
# gradients round apart from one process's and Newton–Schulz carries that on: in fp32 the block model's
# first 3 steps reach 8.5e-6 on an AVX512-BF16 Xeon and 1.08e-5 on an EPYC without AVX512 (other fp32
# kernels), so its short runs go in float64: 1.5e-14 on the Xeon, nothing to do with the CPU's fp32 kernels.
SAME_ANSWER_BOUND = {"float32": 1e-5, "float64": 1e-12}


BACKENDS = ("ddp", "fsdp2")
RATE_CASES = [("fsdp2", "mixtral3", "float32"), ("ddp", "block", "float64")]
FUSED_CASES = [("ddp", "gpt2"), ("fsdp2", "gpt2"), ("fsdp2", "phi3"), ("fsdp2", "neox"), ("fsdp2", "falcon")]
PROCESS_GROUPS = ("new_group", "per_rank")


def rate_case(backend: str, model: str, dtype: str) -> list[str]:
    return ["--backend", backend, "--model", model, "--steps", "3", "--dtype", dtype]


# Every same-answer run of this file, by name: one 2-rank launch runs them in turn (a launch's
# start-up, about 7 s here, is longer than most cases). The tests below read their cases' figures.
SAME_ANSWER_CASES = {
    # first: in a process that has sharded a model before, later models' DTensors were seen holding
    # equal mesh objects made earlier, so a fresh process shows best units holding equal meshes that
    # are different objects (with the family keyed by the object, this case fails first: [28, 0] NS calls)
    "fsdp2-mesh-per-unit-per-tensor-groups": ["--backend", "fsdp2", "--groups", "per_tensor", "--steps", "4",
                                              "--mesh_per_unit"],
    **{f"{b}-accumulation-{a}": ["--backend", b, "--accumulation", str(a)] for b in BACKENDS for a in (1, 4)},
    **{f"{b}-per-tensor-groups": ["--backend", b, "--groups", "per_tensor", "--steps", "4"] for b in BACKENDS},
    **{f"{b}-mixtral": ["--backend", b, "--model", "mixtral", "--steps", "3"] for b in BACKENDS},
    "fsdp2-mixtral3-kept": ["--backend", "fsdp2", "--model", "mixtral3", "--steps", "3"],
    "fsdp2-mixtral3-moved": ["--backend", "fsdp2", "--model", "mixtral3", "--steps", "3",
                             "--exchange_flops_per_byte", "1e-6"],
    "ddp-alone": ["--backend", "ddp", "--steps", "3", "--dtype", "float64", "--exchange_flops_per_byte", "1e12"],
    "ddp-shared": ["--backend", "ddp", "--steps", "3", "--dtype", "float64", "--exchange_flops_per_byte", "1e-6"],
    **{name: args for b, m, d in RATE_CASES for name, args in [
        (f"{b}-{m}-{d}-auto", [*rate_case(b, m, d), "--exchange_flops_per_byte", "auto"]),
        # the number the case above measured, passed as a user would pass it
        (f"{b}-{m}-{d}-given", [*rate_case(b, m, d), "--exchange_flops_per_byte", f"measured_by:{b}-{m}-{d}-auto"])]},
    # FSDP2's GPT-2 with adjust_lr="original": its Conv1D weights are read [in, out] from their shards too
    **{f"{b}-{m}-fused": ["--backend", b, "--model", m, "--steps", "4",
                          *(["--adjust_lr", "original"] if (b, m) == ("fsdp2", "gpt2") else [])]
       for b, m in FUSED_CASES},
    "fsdp2-bf16-wire": ["--backend", "fsdp2", "--comm_dtype", "bfloat16"],
    **{f"ddp-{mode}": ["--backend", "ddp", "--process_group", mode] for mode in PROCESS_GROUPS},
}


def launch_cases(script, folder, cases: dict[str, list[str]], nproc=2, timeout=900, env=None) -> dict[str, dict]:
    """``tests/dist/<script> --cases``: every case (name: its arguments) in turn in one launch of
    ``nproc`` ranks; each case's figures by name."""
    (folder / "cases.json").write_text(json.dumps(cases))
    out = folder / "results.json"
    torchrun(os.path.join(HERE, "dist", script), ["--cases", str(folder / "cases.json"), "--out", str(out)], nproc,
             timeout, env)
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def same_answers(tmp_path_factory) -> dict[str, dict]:
    """Each of ``SAME_ANSWER_CASES``' figures (``same_answer.py``'s JSON), by case name."""
    return launch_cases("same_answer.py", tmp_path_factory.mktemp("same_answer"), SAME_ANSWER_CASES)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulation", [1, 4])
def test_same_answer_as_one_process(same_answers, backend, accumulation):
    r = same_answers[f"{backend}-accumulation-{accumulation}"]
    assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
    # each Muon matrix orthogonalized exactly once per optimizer step across all ranks
    assert sum(r["ns_calls"]) == r["muon_tensors"] * r["steps"]
    # each rank's share of Newton–Schulz FLOPs within 15% of total / W
    flops = r["ns_flops_per_rank"]
    assert max(abs(f - sum(flops) / len(flops)) for f in flops) <= 0.15 * sum(flops) / len(flops)
    # traffic: about 2 * P_muon / W elements (sent + received) per rank per step, fp32 on the wire
    for sent, received in zip(r["bytes_sent"], r["bytes_received"]):
        elements = (sent + received) / 4 / r["steps"]
        assert 0.85 * 2 * r["muon_numel"] / r["world"] <= elements <= 1.15 * 2 * r["muon_numel"] / r["world"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", [*BACKENDS, "fsdp2-mesh-per-unit"])
def test_param_groups_share_one_exchange(same_answers, backend):
    """One param group per parameter (as per-layer learning rates make), every other matrix's with 4
    Newton–Schulz steps: the groups whose plans cost alike share one exchange (each group's own would
    put every group's busiest owner on the step's critical path), so two exchanges, each planned
    at the first step and reused; each matrix is orthogonalized once, with its group's settings, and
    the answer is the single process's. FSDP2 units sharded over meshes of their own (equal, but
    different objects, as fully_shard calls without mesh= give) share the exchange too: keyed by the
    mesh object, each group became an exchange of its own, all owned by rank 0."""
    r = same_answers[f"{backend}-per-tensor-groups"]
    assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
    assert r["muon_groups"] >= 5
    assert sum(r["ns_calls"]) == r["muon_tensors"] * r["steps"]
    assert min(r["ns_calls"]) > 0
    assert r["exchange_plans"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_stacked_experts_share_the_exchange(same_answers, backend):
    """Mixtral (transformers 5 stacks each layer's experts in one tensor: a param group of its own):
    the stacked group and the plain matrices' group share one exchange, each expert is orthogonalized
    once, and the answer is the single process's."""
    r = same_answers[f"{backend}-mixtral"]
    assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
    assert r["stacked_groups"] >= 1 and r["muon_groups"] >= 2
    assert r["exchange_plans"] == 1
    assert min(r["ns_calls"]) > 0
    assert sum(r["ns_calls"]) == r["ns_matrices"] * r["steps"] > r["muon_tensors"] * r["steps"]  # each expert once


@pytest.mark.slow
def test_experts_held_whole_move_under_fsdp2_with_exchange_flops_per_byte(same_answers):
    """A 3-expert Mixtral under FSDP2 at 2 ranks: rank 0 holds experts 0-1 of every stack whole, rank 1
    expert 2, and the other matrices cannot even that out. By default each expert is orthogonalized
    where it lies; with Muon(exchange_flops_per_byte=1e-6) (nearly free links) the owner plan moves one
    gate_up expert (384 x 48: its gate and up blocks, two Newton–Schulz runs) to rank 1, which gathers it
    and sends its result back: same answer."""
    steps = 3
    kept, moved = same_answers["fsdp2-mixtral3-kept"], same_answers["fsdp2-mixtral3-moved"]
    for r in (kept, moved):
        assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
        assert sum(r["ns_calls"]) == r["ns_matrices"] * steps  # each matrix once per step
    assert moved["ns_calls"] == [kept["ns_calls"][0] - 2 * steps, kept["ns_calls"][1] + 2 * steps]
    expert = 384 * 48 * 4  # fp32 bytes: out to rank 1 (rank 0 sends), back to rank 0 (rank 1 sends)
    for rank in range(2):
        assert moved["bytes_sent"][rank] == kept["bytes_sent"][rank] + steps * expert
        assert moved["bytes_received"][rank] == kept["bytes_received"][rank] + steps * expert


@pytest.mark.slow
def test_ddp_ranks_go_alone_when_the_exchange_does_not_pay(same_answers):
    """DDP at 2 ranks with exchange_flops_per_byte=1e12 (a link a trillion times slower than Newton–Schulz):
    no exchange is made, each rank orthogonalizes every matrix itself, nothing is sent, same answer.
    At 1e-6 the exchange pays and each matrix is orthogonalized once, on its owner."""
    alone, shared = same_answers["ddp-alone"], same_answers["ddp-shared"]  # 3 steps in float64
    for r in (alone, shared):
        assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float64"]
    assert alone["ns_calls"] == [alone["ns_matrices"] * 3] * 2  # every matrix on every rank
    assert alone["bytes_sent"] == alone["bytes_received"] == [0, 0]
    assert sum(shared["ns_calls"]) == shared["ns_matrices"] * 3 and min(shared["bytes_sent"]) > 0


@pytest.mark.slow
def test_link_rates_are_measured_alike_when_ranks_arrive_apart(tmp_path):
    """Rank 1 comes to the measurement a second late, so rank 0's first all-to-all takes over a second:
    each rank still makes the same collective calls (a rank that timed fewer repeats after a slow
    first call would leave the other waiting in a barrier) and ends with the same rates."""
    out = tmp_path / "rates.json"
    torchrun(os.path.join(HERE, "dist", "link_rates.py"), ["--late_s", "1.5", "--out", str(out)], 2, timeout=120)
    r = json.loads(out.read_text())
    assert r["ranks"] == [0, 1] and r["rates"][0] == r["rates"][1]
    ns_rate, link_rate, flops_per_byte = r["rates"][0]
    assert ns_rate > 1e8 and link_rate > 1e6 and flops_per_byte == ns_rate / link_rate


@pytest.mark.slow
@pytest.mark.parametrize("backend, model, dtype", RATE_CASES)
def test_measured_link_rates_agree_over_ranks_and_plan_as_the_number_passed(same_answers, backend, model, dtype):
    """Muon(exchange_flops_per_byte="auto") times the plan's Newton–Schulz products and an all-to-all
    at the first step and takes the slowest rank's times, so both ranks hold the very same rates
    (their own timings differ) and plan alike; measured once; passing the measured number plans
    the same exchange (the same Newton–Schulz per rank and bytes); the single-process answer."""
    auto = same_answers[f"{backend}-{model}-{dtype}-auto"]
    count, ns_rate, link_rate, flops_per_byte = auto["link_rates"][0]
    assert auto["link_rates"][1] == auto["link_rates"][0] and count == 1
    assert 1e8 < ns_rate < 1e15 and 1e6 < link_rate < 1e12  # FLOP/s, bytes/s: CPU to GPU, loopback to NVLink
    assert flops_per_byte == ns_rate / link_rate
    given = same_answers[f"{backend}-{model}-{dtype}-given"]
    assert given["exchange_flops_per_byte"] == flops_per_byte  # passed as repr(flops_per_byte)
    assert given["link_rates"] == [[0, 0, 0, 0]] * 2  # a number: nothing measured
    for r in (auto, given):
        assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND[dtype]
        assert sum(r["ns_calls"]) in (r["ns_matrices"] * 3, r["ns_matrices"] * 3 * 2)  # once, or (DDP alone) per rank
    for key in ("ns_calls", "bytes_sent", "bytes_received"):
        assert auto[key] == given[key], key


@pytest.mark.slow
@pytest.mark.parametrize("backend, model", FUSED_CASES)
def test_fused_blocks_give_the_single_process_answer(same_answers, backend, model):
    """Fused projections (GPT-2's Conv1D c_attn: FSDP2 shards its rows, the blocks are columns; Phi-3's
    GQA row blocks and gate | up; GPT-NeoX's per-head interleaving; Falcon's kv groups): the owner
    gathers the whole matrix, then orthogonalizes each block apart, as one process does."""
    r = same_answers[f"{backend}-{model}-fused"]
    assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
    assert r["ns_matrices"] > r["muon_tensors"]  # the blocks, not the fused matrices, were orthogonalized
    assert sum(r["ns_calls"]) == r["ns_matrices"] * r["steps"]
    # each rank ran what the owner plan gave it, with each fused projection costed as its blocks
    assert r["ns_flops_run"] == pytest.approx([f * r["steps"] for f in r["ns_flops_per_rank"]], rel=1e-12)


@pytest.mark.slow
def test_bf16_exchange_halves_traffic(same_answers):
    r = same_answers["fsdp2-bf16-wire"]
    # bf16 on the wire rounds each update to 8 bits of mantissa; measured here: 2.0e-2 after 10 steps
    assert max(r["max_rel_diff"]) <= 3e-2
    for sent in r["bytes_sent"]:
        assert sent / 2 / r["steps"] == pytest.approx(r["muon_numel"] / r["world"], rel=0.01)


def test_layouts_cover_each_tensor_exactly():
    for make in (replicated, row_sharded, flat_sharded):
        for world in (1, 2, 3, 5):
            layout = make((7, 5), False, world)
            assert len(layout.ranges) == world
            if make is replicated:
                assert all(r == (0, 35) for r in layout.ranges)
            else:
                covered = [i for start, end in layout.ranges for i in range(start, end)]
                assert covered == list(range(35))


def test_owner_plan_balances_flops_not_counts():
    # a Llama-like block: 4 square, 2 narrow (GQA) and 3 big MLP matrices per layer, 4 layers
    d, kv, ffn = 512, 128, 1536
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn)] * 4
    for world in (2, 3, 4):
        layouts = [replicated(s, False, world) for s in shapes]
        load = ns_load(layouts, assign_owners(layouts, world, 5), world, 5)
        mean = sum(load) / world
        assert max(load) <= 1.15 * mean and min(load) >= 0.85 * mean


def test_owner_plan_keeps_a_tensor_where_it_lives_whole():
    # ZeRO-1/2: a matrix wholly inside one rank's partition is orthogonalized there
    whole_on_1 = type(flat_sharded((4, 4), False, 2))((4, 4), False, ((0, 0), (0, 16)))
    layouts = [whole_on_1, flat_sharded((8, 8), False, 2)]
    assert assign_owners(layouts, 2, 5)[0] == 1


def test_owner_plan_moves_tensors_held_whole_only_when_links_are_cheap_enough():
    """4 matrices held whole by rank 0 of 4 (FSDP2's dim-0 shards of a small expert stack at large W).
    c: one matrix's Newton–Schulz FLOPs; a move sends 64 x 64 elements out and back: 2 n elements
    on both ranks' links, costing ``flops_per_byte * 4 * 2 n`` FLOPs in the cost model."""
    on_0 = TensorLayout((64, 64), False, ((0, 64 * 64),) + ((0, 0),) * 3)
    layouts = [on_0] * 4
    c, n = on_0.ns_flops(5), on_0.numel
    per_byte = c / (2 * n * 4)  # a move's link time equals one matrix's Newton–Schulz
    assert assign_owners(layouts, 4, 5) == [0, 0, 0, 0]  # Muon's default: never moved
    assert assign_owners(layouts, 4, 5, flops_per_byte=1e9) == [0, 0, 0, 0]  # links too slow
    # nearly free links: rank 0's largest-time state gives one matrix to each idle rank in turn,
    # until every rank has one (a fourth move would give rank 1 2c > c)
    assert assign_owners(layouts, 4, 5, flops_per_byte=1e-3 * per_byte) == [1, 2, 3, 0]
    # a move costs c of link time: 4c -> 3c (1 moved), -> 2c (2 moved: max(2c NS, 2c link)); a third
    # would leave rank 0 max(c, 3c) = 3c > 2c
    assert assign_owners(layouts, 4, 5, flops_per_byte=per_byte) == [1, 2, 0, 0]
    # the synchronous exchange adds link time to NS time: 3c + c is no shorter than 4c
    assert assign_owners(layouts, 4, 5, flops_per_byte=per_byte, overlap=False) == [0, 0, 0, 0]
    assert assign_owners(layouts, 4, 5, flops_per_byte=1e-3 * per_byte, overlap=False) == [1, 2, 3, 0]
    # the link is counted in bytes: bf16 on the wire halves a move's cost, so a third move pays off
    # (rank 0 with 2 moved: max(2c, c) = 2c; with 3: max(c, 1.5c) = 1.5c; a fourth: 2c)
    assert assign_owners(layouts, 4, 5, flops_per_byte=per_byte, itemsize=2) == [1, 2, 3, 0]
    with pytest.raises(ValueError, match="flops_per_byte must be > 0"):
        assign_owners(layouts, 4, 5, flops_per_byte=0.0)


def test_exchange_pays_by_hand():
    """4 equal matrices on 4 DDP ranks: one owner each, one bucket whose return all-to-all has each
    owner send its result to 3 ranks and receive 3 (3 n elements per direction). Exchanged:
    max(c, 3 n s f) overlapped, c + 3 n s f synchronous (s bytes per element); alone: 4 c. The
    decision is exchange_over's: no exchange (None) when alone is faster."""
    from hf_muon.distributed.exchange import ExchangeStats
    from hf_muon.distributed.sharding import exchange_over

    layouts = [replicated((64, 64), False, 4)] * 4
    c, n = layouts[0].ns_flops(5), layouts[0].numel
    even = c / (3 * n)  # f at which 3 n 4 f = 4 c

    def pays(f, comm_dtype=None, overlap=True, lays=layouts):
        return exchange_over(lays, None, 0, 4, 5, ExchangeStats(), comm_dtype=comm_dtype, overlap=overlap,
                             flops_per_byte=f) is not None

    assert pays(0.9 * even) and not pays(1.1 * even)
    assert pays(1.1 * even, torch.bfloat16)  # bf16 on the wire halves the link's part
    # synchronous: c + 12 n f < 4 c needs f < c / (4 n) = 0.75 even
    assert not pays(0.9 * even, overlap=False) and pays(0.7 * even, overlap=False)
    # without the setting, or with a sharded tensor among them (its ranks cannot go alone): exchanged
    assert pays(None) and pays(1e9, lays=[replicated((64, 64), False, 4)] * 3 + [row_sharded((64, 64), False, 4)])


def test_owner_plan_costs_what_the_kernel_runs():
    # One cost model: a layout's cost is the kernel's (Gram iterations for wide matrices, their bf16
    # restarts), in the Newton–Schulz dtype, not a formula of its own.
    import torch

    from hf_muon.kernels import ns_flops, orthogonalize_flops, resolve_method

    wide = replicated((512, 1536), False, 2)
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve_method(512, 1536, 5, dtype) == "gram"
        assert wide.ns_flops(5, dtype) == ns_flops(512, 1536, 5, "gram", dtype) == orthogonalize_flops(512, 1536, 5, dtype)
    assert wide.ns_flops(5, torch.bfloat16) > wide.ns_flops(5, torch.float32)  # the bf16 restart costs
    assert wide.ns_flops(5) < 0.7 * ns_flops(512, 1536, 5, "standard")
    experts = replicated((4, 32, 96), True, 2)
    assert experts.ns_flops(5) == 4 * orthogonalize_flops(32, 96, 5)
    layouts = [replicated((512, 512), False, 2), replicated((512, 1536), False, 2), replicated((512, 512), False, 2)]
    for dtype in (torch.float32, torch.bfloat16):
        owners = assign_owners(layouts, 2, 5, dtype)
        assert owners == assign_owners(layouts, 2, 5, dtype)  # deterministic
        load = ns_load(layouts, owners, 2, 5, dtype)
        assert sum(load) == sum(layout.ns_flops(5, dtype) for layout in layouts)


def test_owner_plan_dtype_does_not_depend_on_this_cpu(monkeypatch):
    # Ranks on different CPUs (one with bf16 matmul, one without) must plan the same owners.
    import torch

    from hf_muon.optimizer import muon

    for native in (False, True):
        monkeypatch.setattr(muon, "cpu_multiplies_bf16_natively", lambda: native)
        assert muon.plan_ns_dtype(None) == torch.bfloat16
        assert muon.plan_ns_dtype("fp32") == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("mode", PROCESS_GROUPS)
def test_ddp_exchange_runs_over_the_given_process_group(same_answers, mode):
    r = same_answers[f"ddp-{mode}"]
    assert max(r["max_rel_diff"]) <= SAME_ANSWER_BOUND["float32"]
    if mode == "new_group":  # a group of all ranks: the default world's behaviour
        assert sum(r["ns_calls"]) == r["muon_tensors"] * r["steps"]
        assert all(sent > 0 for sent in r["bytes_sent"])
    else:  # each rank its own group: nothing exchanged, every rank orthogonalizes every matrix
        assert r["ns_calls"] == [r["muon_tensors"] * r["steps"]] * r["world"]
        assert r["bytes_sent"] == r["bytes_received"] == [0] * r["world"]


@pytest.fixture(scope="module")
def exchange_edges(tmp_path_factory) -> dict[str, dict]:
    """``exchange_edges.py``'s figures (one launch for its three checks)."""
    out = tmp_path_factory.mktemp("edges") / "edges.json"
    torchrun(os.path.join(HERE, "dist", "exchange_edges.py"), ["--out", str(out)])
    return json.loads(out.read_text())


@pytest.mark.slow
def test_distributed_false_on_fsdp2_shards_is_refused(exchange_edges):
    # it ran Newton–Schulz on each rank's rows: updates the size of the update itself off, silently
    assert "Leave distributed=True" in exchange_edges["distributed_false_fsdp2"]["refused"]


@pytest.mark.slow
def test_a_plain_tensor_beside_fsdp2_trains_to_the_single_process_answer(exchange_edges):
    # a learned scalar in its own AdamW group used to stop the first step ("mixes DTensor and plain tensors")
    assert exchange_edges["plain_beside_fsdp2"]["max_diff"] <= SAME_ANSWER_BOUND["float64"]


@pytest.mark.slow
def test_replicas_of_bf16_matrices_stay_equal_bit_for_bit(exchange_edges):
    r = exchange_edges["replicas_bf16"]
    assert r["replicas_max_diff"] == 0  # was 1 bf16 ulp (9.8e-4) after 3 steps
    assert r["fp32_max_rel_diff"] <= SAME_ANSWER_BOUND["float32"]  # was 5.5e-5: fp32 updates went in bf16
