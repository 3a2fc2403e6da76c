"""The overlapped (bucket-pipelined, asynchronous) exchange: the bucket plan, the pipeline's order and
its answer in one process with faked collectives, and bit-for-bit equality with the synchronous
exchange on 2 ranks (CPU, gloo) under DDP, FSDP2 and DeepSpeed ZeRO-1/2/3."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_muon.distributed import exchange, sharding
from hf_muon.distributed.layout import TensorLayout, exchanged_matrices, flat_sharded, replicated, row_sharded
from hf_muon.distributed.plan import PIPELINE_BUCKETS, assign_owners, plan_buckets
from hf_muon.kernels import orthogonalize
from test_distributed import HERE, launch_cases

# ---------------------------------------------------------------------------------------------------------------
# The bucket plan

LLAMA = [(512, 512), (128, 512), (128, 512), (512, 512), (1536, 512), (1536, 512), (512, 1536)] * 4


def test_buckets_cover_every_tensor_once_and_balance_each_owners_work():
    layouts = [flat_sharded(s, False, 2) for s in LLAMA]
    owners = assign_owners(layouts, 2, 5)
    buckets = plan_buckets(layouts, owners, 2, 5, 4, 256 * 2**20, PIPELINE_BUCKETS)
    assert sorted(i for b in buckets for i in b) == list(range(len(layouts)))
    assert all(b == sorted(b) for b in buckets)
    assert len(buckets) == PIPELINE_BUCKETS  # the model fits one bucket: the pipeline depth decides
    for r in range(2):  # each bucket holds about 1/n of every owner's Newton–Schulz work
        work = [sum(layouts[i].ns_flops(5) for i in b if owners[i] == r) for b in buckets]
        assert max(work) <= 1.3 * sum(work) / len(work) and min(work) >= 0.7 * sum(work) / len(work), (r, work)
    assert plan_buckets(layouts, owners, 2, 5, 4, 256 * 2**20, PIPELINE_BUCKETS) == buckets  # deterministic


def test_synchronous_plan_keeps_one_bucket_when_everything_fits_and_the_cap_holds_otherwise():
    layouts = [flat_sharded(s, False, 2) for s in LLAMA]
    owners = assign_owners(layouts, 2, 5)
    assert plan_buckets(layouts, owners, 2, 5, 4, 256 * 2**20) == [list(range(len(layouts)))]
    cap = 3 * 1536 * 512 * 4
    for depth in (1, PIPELINE_BUCKETS):
        buckets = plan_buckets(layouts, owners, 2, 5, 4, cap, depth)
        assert all(sum(layouts[i].numel * 4 for i in b) <= cap for b in buckets), depth
        assert sorted(i for b in buckets for i in b) == list(range(len(layouts)))


def test_a_tensor_larger_than_the_cap_still_gets_a_bucket():
    layouts = [replicated((64, 64), False, 2), replicated((8, 8), False, 2), replicated((8, 8), False, 2)]
    owners = assign_owners(layouts, 2, 5)
    buckets = plan_buckets(layouts, owners, 2, 5, 4, 100, PIPELINE_BUCKETS)
    assert sorted(i for b in buckets for i in b) == [0, 1, 2]


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([replicated((4, 4), False, 2)], [0], 2, 5, 4, 0)


# ---------------------------------------------------------------------------------------------------------------
# The pipeline in one process: W threads play the ranks, a fake all_to_all_single pairs their calls


class FakeCollectives:
    """``all_to_all_single`` among ``world`` threads, ``group`` being the caller's rank. The n-th call of
    every rank forms one collective (sizes checked against each other, as gloo would); an asynchronous
    one completes when waited for. Records each rank's events: ("issue", n), ("wait", n), ("ns", bucket)."""

    def __init__(self, world: int, timeout_s: float = 20.0) -> None:
        self.world, self.timeout_s = world, timeout_s
        self.cond = threading.Condition()
        self.calls: dict[int, dict[int, tuple]] = {}
        self.issued = [0] * world
        self.events: list[list[tuple]] = [[] for _ in range(world)]

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group=None, async_op=False):
        rank = group
        n = self.issued[rank]
        self.issued[rank] += 1
        with self.cond:
            self.calls.setdefault(n, {})[rank] = (list(input.split(input_split_sizes)), output, list(output_split_sizes))
            self.cond.notify_all()
        self.events[rank].append(("issue", n))
        work = FakeWork(self, rank, n)
        if async_op:
            return work
        work.wait()
        return None

    def complete(self, rank: int, n: int) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.calls[n]) == self.world, timeout=self.timeout_s):
                raise TimeoutError(f"rank {rank}: collective {n} never matched by the other ranks")
            _, output, sizes = self.calls[n][rank]
            parts = [self.calls[n][src][0][rank] for src in range(self.world)]
        assert [p.numel() for p in parts] == sizes, f"collective {n}: rank {rank} expects {sizes}"
        if parts:
            output.copy_(torch.cat(parts))
        self.events[rank].append(("wait", n))


class FakeWork:
    def __init__(self, fake: FakeCollectives, rank: int, n: int) -> None:
        self.fake, self.rank, self.n = fake, rank, n

    def wait(self) -> bool:
        self.fake.complete(self.rank, self.n)
        return True


def mixed_layouts(world: int) -> list[TensorLayout]:
    """Row blocks, ZeRO-3 splits, a tensor only rank 1 holds (owner elsewhere or there), replicated
    ones, one that straddles unevenly: 12 tensors, several shapes."""
    only_on_1 = TensorLayout((16, 24), False, ((0, 0), (0, 16 * 24)))
    uneven = TensorLayout((24, 16), False, ((0, 40), (40, 24 * 16)))
    return [row_sharded((32, 16), False, world), flat_sharded((16, 48), False, world), only_on_1,
            replicated((24, 24), False, world), uneven, flat_sharded((32, 16), False, world),
            row_sharded((16, 48), False, world), only_on_1, flat_sharded((24, 24), False, world),
            replicated((32, 16), False, world), flat_sharded((16, 24), False, world), uneven]


def newton_schulz(wholes, which):
    return [orthogonalize(w.reshape(1, w.shape[0], -1), 5, "quintic", torch.float32).reshape(w.shape) for w in wholes]


def run_ranks(fake: FakeCollectives, layouts, wholes, overlap: bool, comm_dtype=None, fail_at: tuple | None = None):
    """Every rank's exchange result (or the exception it raised), ranks run as threads."""
    world = fake.world
    owners = assign_owners(layouts, world, 5)
    buckets = plan_buckets(layouts, owners, world, 5, 4, 4 * 24 * 48, PIPELINE_BUCKETS)

    def rank_main(rank: int):
        pieces = [w.reshape(-1)[slice(*layout.ranges[rank])] for w, layout in zip(wholes, layouts)]

        def ns(whole, which):
            bucket = next(k for k, b in enumerate(buckets) if which[0] in b)
            fake.events[rank].append(("ns", bucket))
            if fail_at == (rank, bucket):
                raise RuntimeError("Newton-Schulz failed on purpose")
            return newton_schulz(whole, which)

        return exchange.orthogonalize_distributed(
            pieces, layouts, owners, ns, buckets=buckets, group=rank, rank=rank, world=world,
            stats=exchange.ExchangeStats(), comm_dtype=comm_dtype, overlap=overlap)

    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(rank_main, r) for r in range(world)]
        out = []
        for f in futures:
            try:
                out.append(f.result())
            except Exception as e:  # noqa: BLE001 - returned for the test to inspect
                out.append(e)
    return out, buckets


@pytest.fixture
def fake(monkeypatch):
    f = FakeCollectives(2)
    monkeypatch.setattr(exchange.dist, "all_to_all_single", f.all_to_all_single)
    return f


def gathered(results, layouts):
    return [torch.cat([results[r][i] for r in range(len(results))]) if not layout.holds_all(0) else results[0][i]
            for i, layout in enumerate(layouts)]


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16])
def test_overlapped_pipeline_gives_the_synchronous_answer_bit_for_bit(fake, comm_dtype):
    torch.manual_seed(0)
    layouts = mixed_layouts(2)
    wholes = [torch.randn(layout.shape) for layout in layouts]
    overlapped, buckets = run_ranks(fake, layouts, wholes, True, comm_dtype)
    assert len(buckets) >= 3
    fake2 = FakeCollectives(2)
    exchange.dist.all_to_all_single = fake2.all_to_all_single  # restored by the fixture's monkeypatch
    synchronous, _ = run_ranks(fake2, layouts, wholes, False, comm_dtype)
    for r in range(2):
        for a, b in zip(overlapped[r], synchronous[r]):
            assert a.dtype == b.dtype and torch.equal(a, b)
    if comm_dtype is None:  # fp32 on the wire: each rank's piece is exactly one process's answer
        expected = [o.reshape(-1) for o in newton_schulz(wholes, list(range(len(wholes))))]
        for r in range(2):
            for i, layout in enumerate(layouts):
                assert torch.equal(overlapped[r][i], expected[i][slice(*layout.ranges[r])]), (r, i)


@pytest.mark.parametrize("dtypes", [("bf16", "fp32", "fp32", "bf16"), ("bf16",) * 4])
def test_every_rank_applies_the_bits_that_came_over_the_wire(fake, dtypes):
    """bf16 updates orthogonalized in float32: the owner used to keep its float32 result while the other
    ranks got it rounded to the wire's bf16, so DDP replicas drifted apart (1 bf16 ulp after 3 steps),
    and a first bf16 tensor put every fp32 update of the exchange on the wire in bf16. Now the wire
    carries the widest of the pieces' dtypes and the owner's result goes through it too."""
    torch.manual_seed(0)
    width = {"bf16": torch.bfloat16, "fp32": torch.float32}
    layouts = [replicated((24, 24), False, 2), replicated((32, 16), False, 2), row_sharded((16, 48), False, 2),
               replicated((16, 24), False, 2)]
    wholes = [torch.randn(layout.shape).to(width[d]) for layout, d in zip(layouts, dtypes)]
    wire = torch.float32 if "fp32" in dtypes else torch.bfloat16
    assert exchange.widest_dtype([w.reshape(-1) for w in wholes]) == wire
    out, _ = run_ranks(fake, layouts, wholes, True)
    expected = [o.float().reshape(-1).to(wire) for o in newton_schulz([w.float() for w in wholes], [0, 1, 2, 3])]
    for i, layout in enumerate(layouts):
        for r in range(2):  # owner or not: the same bits, in the wire's dtype
            assert out[r][i].dtype == wire and torch.equal(out[r][i], expected[i][slice(*layout.ranges[r])]), (i, r)


def test_pipeline_order_overlaps_next_gather_and_previous_scatter_with_newton_schulz(fake):
    torch.manual_seed(0)
    layouts = mixed_layouts(2)
    results, buckets = run_ranks(fake, layouts, [torch.randn(layout.shape) for layout in layouts], True)
    assert not any(isinstance(r, Exception) for r in results), results
    n = len(buckets)
    owners = assign_owners(layouts, 2, 5)
    # a bucket whose tensors all sit whole on their owners gathers nothing (no collective at all)
    travels = {f"g{k}": exchange._travels(layouts, owners, [i for i in b if not layouts[i].holds_all(owners[i])], 2)
               for k, b in enumerate(buckets)} | {f"s{k}": exchange._travels(layouts, owners, b, 2)
                                                  for k, b in enumerate(buckets)}
    assert sum(travels.values()) >= 2 * n - 1
    # the collectives, on every rank: gather 0 | gather 1, scatter 0 | gather 2, scatter 1 | ... | scatter n-1
    order = ["g0"] + [x for k in range(1, n) for x in (f"g{k}", f"s{k - 1}")] + [f"s{n - 1}"]
    order = [x for x in order if travels[x]]
    for rank in range(2):
        events = fake.events[rank]
        at = {e: i for i, e in enumerate((kind, order[x] if kind != "ns" else x) for kind, x in events)}
        for k in range(n):
            ns = at[("ns", k)]
            if k + 1 < n and travels[f"g{k + 1}"]:  # bucket k+1's pieces are on the way while bucket k is orthogonalized
                assert at[("issue", f"g{k + 1}")] < ns < at[("wait", f"g{k + 1}")], (rank, k, events)
            if k > 0 and travels[f"s{k - 1}"]:  # and bucket k-1's results are coming back
                assert at[("issue", f"s{k - 1}")] < ns < at[("wait", f"s{k - 1}")], (rank, k, events)
        in_flight, most = set(), 0
        for kind, x in events:
            if kind == "issue":
                in_flight.add(x)
            elif kind == "wait":
                in_flight.discard(x)
            most = max(most, len(in_flight))
        assert most <= 3 and not in_flight, (rank, events)


def test_an_error_in_newton_schulz_propagates_after_the_collectives_in_flight_finish(fake):
    torch.manual_seed(0)
    layouts = mixed_layouts(2)
    fake.timeout_s = 2.0  # rank 1 then waits for a collective rank 0 never issues: in a real job rank 0's exit ends it
    results, buckets = run_ranks(fake, layouts, [torch.randn(layout.shape) for layout in layouts], True,
                                 fail_at=(0, 1))
    assert isinstance(results[0], RuntimeError) and "on purpose" in str(results[0])
    events = fake.events[0]
    failed = events.index(("ns", 1))
    pending = {x for kind, x in events[:failed] if kind == "issue"} - {x for kind, x in events[:failed] if kind == "wait"}
    assert pending  # collectives were in flight when Newton–Schulz failed (bucket 2's gather, bucket 0's scatter) ...
    assert pending <= {x for kind, x in events[failed:] if kind == "wait"}  # ... and were waited for before raising
    assert not [e for e in events[failed + 1:] if e[0] in ("issue", "ns")]  # nothing new was started
    assert isinstance(results[1], TimeoutError)


# ---------------------------------------------------------------------------------------------------------------
# Stacked tensors (a MoE layer's experts, [experts, rows, cols]): exchanged matrix by matrix


def test_a_stacks_matrices_are_cut_at_each_ranks_range():
    # ZeRO-3 splits 3 x 384 elements in halves of 576: rank 0 holds expert 0 and half of expert 1
    items = exchanged_matrices([flat_sharded((16, 24), False, 2), flat_sharded((3, 16, 24), True, 2)])
    assert [(i.source, i.offset) for i in items] == [(0, 0), (1, 0), (1, 384), (1, 768)]
    assert items[0].layout == flat_sharded((16, 24), False, 2)
    assert all(i.layout.shape == (16, 24) and not i.layout.stacked for i in items[1:])
    held = [tuple((lo, hi) if hi > lo else None for lo, hi in i.layout.ranges) for i in items[1:]]
    assert held == [((0, 384), None), ((0, 192), (192, 384)), (None, (0, 384))]


def exchange_in_threads(layouts, wholes, stats, **options):
    """``sharding.exchange_over`` on 2 ranks played by threads (the ``fake`` collectives): each rank's
    result, and per rank the ``(tensor index, shape)`` of every matrix its Newton–Schulz saw. The
    result is checked against the single-process answer here."""
    seen: list[list[tuple]] = [[], []]

    def rank_main(rank: int):
        def ns(whole, which):
            seen[rank].extend((i, tuple(w.shape)) for w, i in zip(whole, which))
            return [orthogonalize(w if w.ndim == 3 else w[None], 5, "quintic", torch.float32).view(w.shape)
                    for w in whole]

        exchange_fn = sharding.exchange_over(layouts, rank, rank, 2, 5, stats[rank], bucket_bytes=4096, **options)
        return exchange_fn([w.reshape(-1)[slice(*layout.ranges[rank])] for w, layout in zip(wholes, layouts)], ns)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(rank_main, range(2)))
    for rank in range(2):
        for i, (w, layout) in enumerate(zip(wholes, layouts)):
            expected = orthogonalize(w if w.ndim == 3 else w[None], 5, "quintic", torch.float32).reshape(-1)
            torch.testing.assert_close(results[rank][i], expected[slice(*layout.ranges[rank])], rtol=1e-5, atol=1e-6)
    return seen


def test_a_stacks_experts_get_their_own_owners_and_the_single_process_answer(fake):
    """DDP's replicated stack spreads over both ranks (it had one owner, which gathered all of it);
    ZeRO-3's split stack leaves experts 0 and 2 where they lie; FSDP2's dim-0 shards are whole
    experts, orthogonalized in place."""
    torch.manual_seed(0)
    layouts = [replicated((4, 16, 24), True, 2), flat_sharded((3, 16, 24), True, 2), row_sharded((4, 8, 16), True, 2),
               flat_sharded((16, 24), False, 2)]
    wholes = [torch.randn(layout.shape) for layout in layouts]
    seen = exchange_in_threads(layouts, wholes, [exchange.ExchangeStats(), exchange.ExchangeStats()])
    # no owner got a whole stack: each expert came alone, as a stack of one
    assert all(shape[0] == 1 for mine in seen for i, shape in mine if layouts[i].stacked)
    assert all(sum(i == 0 for i, _ in mine) >= 1 for mine in seen)  # the replicated stack kept both ranks busy
    assert sorted(i for mine in seen for i, _ in mine) == [0] * 4 + [1] * 3 + [2] * 4 + [3]  # each matrix once
    assert sum(i == 2 for i, _ in seen[0]) == sum(i == 2 for i, _ in seen[1]) == 2  # FSDP2's experts stay put


@pytest.mark.parametrize("flops_per_byte", [None, 1e-6])
def test_experts_held_whole_by_one_rank_move_only_when_asked_with_the_same_answer(fake, flops_per_byte):
    """A 4-expert stack held whole by rank 0 and a matrix both hold (FSDP2 at more ranks than experts
    leaves such stacks on a few ranks): by default rank 0 orthogonalizes every expert; with cheap
    links (``flops_per_byte``) rank 1 takes some and gets them through the exchange; same answer."""
    torch.manual_seed(0)
    stack = TensorLayout((4, 16, 24), True, ((0, 4 * 16 * 24), (0, 0)))
    layouts = [stack, replicated((16, 24), False, 2)]
    wholes = [torch.randn(layout.shape) for layout in layouts]
    stats = [exchange.ExchangeStats(), exchange.ExchangeStats()]
    seen = exchange_in_threads(layouts, wholes, stats, flops_per_byte=flops_per_byte)
    moved = sum(i == 0 for i, _ in seen[1])
    assert sum(i == 0 for i, _ in seen[0]) + moved == 4  # each expert once
    expert = 16 * 24 * 4  # fp32 bytes of one expert
    if flops_per_byte is None:
        assert moved == 0 and stats[1].bytes_received == 0  # rank 1 owns the plain matrix, which it holds
    else:  # 5 matrices of equal cost (c) on 2 ranks: from (4c, c) one move gives (3c, 2c); a second (2c, 3c)
        assert moved == 1
        assert stats[1].bytes_received == expert and stats[0].bytes_sent == expert  # the expert went out whole


# ---------------------------------------------------------------------------------------------------------------
# 2 ranks, gloo: overlapped == synchronous, bit for bit


TORCH_MODELS = ["block", "gpt2"]
ZERO_CASES = [("block", "zero1,zero2,zero3"), ("gpt2", "zero3")]


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory) -> dict[str, dict]:
    return launch_cases("overlap_same_bits.py", tmp_path_factory.mktemp("overlap_torch"),
                        {model: ["--backends", "ddp,fsdp2", "--model", model] for model in TORCH_MODELS})


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    return launch_cases("overlap_same_bits.py", tmp_path_factory.mktemp("overlap_zero"),
                        {model: ["--backends", stages, "--model", model] for model, stages in ZERO_CASES},
                        env={"DS_ACCELERATOR": "cpu"})


def check_same_bits(results):
    assert results, "no case ran"
    for case, r in results.items():
        assert r["buckets"] >= 3, (case, r)  # several buckets: the pipeline really ran
        assert r["same_plan"], (case, r)  # both modes cut the same buckets, so the comparison is of the schedule
        assert r["identical"] == [True, True], (case, r)
        assert r["bytes_equal"] == [True, True], (case, r)  # ExchangeStats counts the same bytes
        assert all(b > 0 for b in r["bytes_sent"]), (case, r)


@pytest.mark.slow
@pytest.mark.parametrize("model", TORCH_MODELS)
def test_overlapped_exchange_matches_synchronous_under_ddp_and_fsdp2(torch_runs, model):
    results = torch_runs[model]
    assert sorted(results) == ["ddp/bf16", "ddp/fp32", "fsdp2/bf16", "fsdp2/fp32"]
    check_same_bits(results)


@pytest.mark.slow
@pytest.mark.parametrize("model, stages", ZERO_CASES)
def test_overlapped_exchange_matches_synchronous_under_zero(zero_runs, model, stages):
    """ZeRO-1/2 split the block model's flat partition inside matrices (some straddle both ranks, others
    lie wholly on one: the other rank holds nothing of them); GPT-2's fused blocks under ZeRO-3. (Under
    ZeRO-1/2 no GPT-2 matrix straddles the two partitions here: nothing would travel.)"""
    results = zero_runs[model]
    assert sorted(results) == sorted(f"{stage}/{wire}" for stage in stages.split(",") for wire in ("bf16", "fp32"))
    check_same_bits(results)
    if model == "block":
        assert all(r["some_rank_holds_nothing"] for case, r in results.items() if not case.startswith("zero3"))


@pytest.mark.slow
def test_an_error_in_newton_schulz_ends_a_2_rank_job_instead_of_hanging(tmp_path):
    from test_distributed import ROOT
    from hf_muon.launching import free_port, run
    import sys

    cmd = lambda: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",  # noqa: E731
                   "127.0.0.1", "--master_port", str(free_port()), os.path.join(HERE, "dist", "overlap_same_bits.py"),
                   "--out", str(tmp_path / "x.json"), "--backends", "fsdp2", "--fail_on_rank", "0"]
    result = run(cmd, 300, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    assert not result.timed_out and result.returncode not in (0, None), result.output[-3000:]
    assert "Newton-Schulz failed on purpose" in result.output, result.output[-3000:]
