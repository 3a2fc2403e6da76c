"""The overlapped exchange against the synchronous one, under DeepSpeed ZeRO-3 at 2 ranks on CPU.

    python benchmarks/exchange_overlap.py [--steps 6 --threads 1 --out runs/exchange_overlap.json]

Trains a Llama-like model (d=512, 4 layers, GQA 8/2, ff 1376: 11.1 M Muon parameters) with
``hf_muon.Muon`` under ZeRO-3 (gloo, ``DS_ACCELERATOR=cpu``), switching ``overlap_exchange`` step by
step through three modes: ``overlap`` (the default: pipelined, at least 4 buckets), ``sync`` (one
bucket at a time; here one bucket, as before the overlap existed) and ``split`` (synchronous on the
overlapped mode's buckets: the schedule is then the only difference). Per rank and mode, medians
over ``--steps`` steps after two warm-up steps of each:

* step: wall time of ``Muon.step`` (the Muon half with its exchange, and the AdamW half);
* NS: time inside Newton–Schulz during that step (in the synchronous modes nothing else runs then);
* exchange: the exchange that step ran (same layouts, owners, buckets, schedule) run again between
  steps on random pieces with a no-op Newton–Schulz;

so that the overlapped step reads against ``max(NS, exchange)`` (perfect overlap) and ``NS +
exchange`` (none) of the ``split`` mode, and against today's ``sync`` step. It also probes whether gloo's asynchronous ``all_to_all_single`` runs while this
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
    from hf_muon.distributed import sharding
    from hf_muon.distributed.plan import PIPELINE_BUCKETS
    from hf_muon.kernels import orthogonalize
    from hf_muon.optimizer.muon import resolve_ns_dtype

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

    # Each mode: (overlap_exchange, fewest buckets). "split" is the synchronous schedule on the
    # overlapped mode's buckets: against it the overlap is the schedule alone; against "sync" (today's
    # one bucket when everything fits) it is the whole change.
    modes = {"overlap": (True, PIPELINE_BUCKETS), "sync": (False, 1), "split": (False, PIPELINE_BUCKETS)}
    fewest = [1]
    real_plan = sharding.plan_buckets
    planned: dict[str, list[int]] = {}

    def plan(layouts, owners, world_, ns_steps, itemsize, cap, min_buckets, ns_dtype):
        buckets = real_plan(layouts, owners, world_, ns_steps, itemsize, cap, fewest[0], ns_dtype)
        planned[mode] = planned.get(mode, []) + [len(buckets)]
        return buckets

    sharding.plan_buckets = plan

    def exchange_alone() -> float:
        """The exchange the last step ran (same layouts, owners, buckets, schedule), on random pieces, NS a no-op."""
        total = 0.0
        for key, (exchange, _, _) in opt._partition_exchanges.items():
            pieces = [torch.randn(length) for _, length in opt._partitions[key[:3]][1].spans]
            dist.barrier()
            start = time.perf_counter()
            exchange(pieces, lambda wholes, which: wholes)
            total += time.perf_counter() - start
        return total

    rows = []
    names = list(modes)
    for step in range(len(modes) * (2 + args.steps)):
        mode = names[step % len(modes)]
        opt.overlap_exchange, fewest[0] = modes[mode]
        opt._partition_exchanges.clear()  # rebuilt (and re-planned) for this mode on the step
        planned.pop(mode, None)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        ns_seconds[0] = step_seconds[0] = 0.0
        moved = opt.exchange_stats.bytes_sent + opt.exchange_stats.bytes_received
        dist.barrier()  # both ranks enter the step together: its time is this rank's, not the other's lag
        engine.step()
        row = {"mode": mode, "step_s": step_seconds[0], "ns_s": ns_seconds[0],
               "bytes": opt.exchange_stats.bytes_sent + opt.exchange_stats.bytes_received - moved}
        row["exchange_s"] = exchange_alone()
        if step >= 2 * len(modes):
            rows.append(row)
    sharding.plan_buckets = real_plan

    result = {"ns_dtype": str(resolve_ns_dtype(None, torch.device("cpu"))), "probe": probe}
    for mode in modes:
        for key in ("step_s", "ns_s", "exchange_s", "bytes"):
            result[f"{mode}/{key}"] = statistics.median(r[key] for r in rows if r["mode"] == mode)
        result[f"{mode}/buckets"] = planned[mode]
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
    print(f"ZeRO-3, 2 ranks, d={D}, {LAYERS} layers, ff={FF}; medians of {args.steps} steps per mode, ms per rank")
    print(f"{'rank':<5} {'mode':<8} {'buckets':>8} {'step':>7} {'NS':>7} {'exchange':>9} {'max(NS,ex)':>11} {'NS+ex':>7}")
    for rank, r in enumerate(data["per_rank"]):
        for mode in ("overlap", "split", "sync"):
            ns, ex = r[f"{mode}/ns_s"], r[f"{mode}/exchange_s"]
            print(f"{rank:<5} {mode:<8} {str(r[f'{mode}/buckets']):>8} {1e3 * r[f'{mode}/step_s']:>7.1f} {1e3 * ns:>7.1f} "
                  f"{1e3 * ex:>9.1f} {1e3 * max(ns, ex):>11.1f} {1e3 * (ns + ex):>7.1f}")
    first = data["per_rank"][0]
    print("NS: time inside Newton–Schulz during the step (under 'overlap' the collectives run meanwhile); "
          "exchange: alone, NS a no-op")
    print(f"Newton–Schulz dtype: {first['ns_dtype']}; exchange MB per rank per step: {first['overlap/bytes'] / 1e6:.1f}")
    for rank, r in enumerate(data["per_rank"]):
        p = r["probe"]
        print(f"probe rank {rank}: matmuls {1e3 * p['compute_s']:.1f} ms, all_to_all of {p['all_to_all_mb']:.1f} MB "
              f"{1e3 * p['all_to_all_s']:.1f} ms, both together {1e3 * p['together_s']:.1f} ms")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
