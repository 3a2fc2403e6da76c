"""The overlapped exchange against the synchronous one, under DeepSpeed ZeRO-3 at 2 ranks on CPU.

    python benchmarks/exchange_overlap.py [--steps 6 --threads 1 --out runs/exchange_overlap.json]

Trains a Llama-like model (d=512, 4 layers, GQA 8/2, ff 1376: 11.1 M Muon parameters) with
``hf_muon.Muon`` under ZeRO-3 (gloo, ``DS_ACCELERATOR=cpu``), switching ``overlap_exchange`` step by
step (overlapped, synchronous, overlapped, ...), and reports per rank, medians over ``--steps`` steps
of each mode after two warm-up steps of each:

* step: wall time of ``Muon.step`` (the Muon half with its exchange, and the AdamW half), per mode;
* NS: time inside Newton–Schulz during the synchronous steps (nothing else runs then);
* exchange: the same exchange (same layouts, owners and buckets) run with a no-op Newton–Schulz on
  random pieces between steps, per mode (synchronous: today's one bucket; overlapped: its buckets);

so that the overlapped step reads against ``max(NS, exchange)`` (perfect overlap) and ``NS +
exchange`` (none). It also probes whether gloo's asynchronous ``all_to_all_single`` runs while this
rank computes: a matmul loop alone, the all-to-all alone, and both together.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

D, LAYERS, FF, VOCAB = 512, 4, 1376, 512


def probe_overlap(dist, torch, numel: int = 16 * 2**20, repeats: int = 5) -> dict:
    """Seconds for: an async ``all_to_all_single`` of ``numel`` fp32 alone, as many 512x512 matmuls as
    take about as long alone, and the two together (the collective issued, the matmuls run, then
    waited). Together close to the longer one alone: the collective ran meanwhile; close to the sum:
    it did not. Medians of ``repeats``."""
    world = dist.get_world_size()
    send, recv = torch.randn(numel), torch.empty(numel)
    a = torch.randn(512, 512)

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    comm = statistics.median(timed(lambda: dist.all_to_all_single(recv, send, async_op=True).wait()) for _ in range(repeats))
    one = statistics.median(timed(lambda: a @ a) for _ in range(repeats))
    count = torch.tensor([max(1, round(comm / one))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)  # the same loop on every rank

    def compute():
        for _ in range(int(count)):
            a @ a

    def both():
        work = dist.all_to_all_single(recv, send, async_op=True)
        compute()
        work.wait()

    alone, together = [], []
    for _ in range(repeats):
        alone.append(timed(compute))
        together.append(timed(both))
    return {"compute_s": statistics.median(alone), "all_to_all_s": comm, "together_s": statistics.median(together),
            "all_to_all_mb": numel * 4 / 1e6 * (world - 1) / world}


def worker(args: argparse.Namespace) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_muon import Muon
    from hf_muon.distributed.plan import PIPELINE_BUCKETS, assign_owners, plan_buckets
    from hf_muon.kernels import orthogonalize
    from hf_muon.optimizer.muon import plan_ns_dtype, resolve_ns_dtype

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    probe = probe_overlap(dist, torch)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config)
    ns_seconds = [0.0]

    def timed_ns(*a, **k):
        start = time.perf_counter()
        try:
            return orthogonalize(*a, **k)
        finally:
            ns_seconds[0] += time.perf_counter() - start

    opt = Muon(model, lr=1e-3, weight_decay=0.01, orthogonalize_fn=timed_ns)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    step_seconds = [0.0]
    real_step = opt.step

    def timed_step(*a, **k):  # DeepSpeed's stage-3 optimizer calls our step once per sub-group
        start = time.perf_counter()
        try:
            return real_step(*a, **k)
        finally:
            step_seconds[0] += time.perf_counter() - start

    opt.step = timed_step
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(rank))

    def exchange_alone(overlap: bool) -> float:
        """The exchange this mode ran in its last step, on random pieces of the same sizes, NS a no-op."""
        total = 0.0
        for key, (exchange, _, _) in opt._partition_exchanges.items():
            if key[-1] != overlap:
                continue
            pieces = [torch.randn(length) for _, length in opt._partitions[key[:3]][1].spans]
            dist.barrier()
            start = time.perf_counter()
            exchange(pieces, lambda wholes, which: wholes)
            total += time.perf_counter() - start
        return total

    def buckets(overlap: bool) -> list[int]:
        """How many buckets each partition's exchange cuts in this mode (the plan ``exchange_over`` makes)."""
        counts = []
        for _, part in opt._partitions.values():
            layouts = list(part.layouts)
            owners = assign_owners(layouts, part.world, 5, plan_ns_dtype(None))
            counts.append(len(plan_buckets(layouts, owners, part.world, 5, 4, opt.bucket_bytes,
                                           PIPELINE_BUCKETS if overlap else 1, plan_ns_dtype(None))))
        return counts

    rows = []
    for step in range(2 * (2 + args.steps)):
        overlap = step % 2 == 0
        opt.overlap_exchange = overlap
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        ns_seconds[0] = step_seconds[0] = 0.0
        moved = opt.exchange_stats.bytes_sent + opt.exchange_stats.bytes_received
        dist.barrier()  # both ranks enter the step together: its time is this rank's, not the other's lag
        engine.step()
        row = {"overlap": overlap, "step_s": step_seconds[0], "ns_s": ns_seconds[0],
               "bytes": opt.exchange_stats.bytes_sent + opt.exchange_stats.bytes_received - moved}
        row["exchange_s"] = exchange_alone(overlap)
        if step >= 4:
            rows.append(row)

    def median(key: str, overlap: bool) -> float:
        return statistics.median(r[key] for r in rows if r["overlap"] == overlap)

    result = {
        "step_overlap_s": median("step_s", True), "step_sync_s": median("step_s", False),
        "ns_sync_s": median("ns_s", False), "ns_overlap_s": median("ns_s", True),
        "exchange_sync_s": median("exchange_s", False), "exchange_overlap_s": median("exchange_s", True),
        "exchange_bytes_per_step": median("bytes", True), "ns_dtype": str(resolve_ns_dtype(None, torch.device("cpu"))),
        "probe": probe, "buckets_overlap": buckets(True), "buckets_sync": buckets(False),
    }
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"per_rank": gathered, "steps": args.steps}))
    from hf_muon.launching import shutdown_process_group

    shutdown_process_group(exit_code=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per mode")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--out", default="runs/exchange_overlap.json")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from hf_muon.launching import free_port, run

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")

        def cmd():
            return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                    "127.0.0.1", "--master_port", str(free_port()), __file__, "--worker", "--steps",
                    str(args.steps), "--out", out]

        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(args.threads)}
        result = run(cmd, 900, env=env)
        if result.returncode != 0:
            raise SystemExit(f"the benchmark failed ({'timed out' if result.timed_out else result.returncode}):\n"
                             + result.output[-3000:])
        data = json.loads(Path(out).read_text())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"ZeRO-3, 2 ranks, d={D}, {LAYERS} layers, ff={FF}; medians of {args.steps} steps per mode (ms)")
    print(f"{'rank':<5} {'step overlap':>13} {'step sync':>10} {'NS':>7} {'exchange':>9} {'max(NS,ex)':>11} "
          f"{'NS+ex':>7} {'ex. overlap':>12} {'NS overlap':>11}")
    for rank, r in enumerate(data["per_rank"]):
        ns, ex = r["ns_sync_s"], r["exchange_sync_s"]
        print(f"{rank:<5} {1e3 * r['step_overlap_s']:>13.1f} {1e3 * r['step_sync_s']:>10.1f} {1e3 * ns:>7.1f} "
              f"{1e3 * ex:>9.1f} {1e3 * max(ns, ex):>11.1f} {1e3 * (ns + ex):>7.1f} "
              f"{1e3 * r['exchange_overlap_s']:>12.1f} {1e3 * r['ns_overlap_s']:>11.1f}")
    first = data["per_rank"][0]
    print(f"Newton–Schulz dtype: {first['ns_dtype']}; exchange MB per rank per step: "
          f"{first['exchange_bytes_per_step'] / 1e6:.1f}; buckets overlapped {first['buckets_overlap']}, "
          f"synchronous {first['buckets_sync']}")
    for rank, r in enumerate(data["per_rank"]):
        p = r["probe"]
        print(f"probe rank {rank}: matmuls {1e3 * p['compute_s']:.1f} ms, all_to_all of {p['all_to_all_mb']:.1f} MB "
              f"{1e3 * p['all_to_all_s']:.1f} ms, both together {1e3 * p['together_s']:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
