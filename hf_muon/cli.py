"""``hf-muon``: command-line tools.

    hf-muon inspect MODEL_DIR_OR_CONFIG   which parameters get Muon or AdamW, and optimizer-state bytes
    hf-muon run SCRIPT [ARGS...]          same as ``python -m hf_muon.run SCRIPT [ARGS...]``
    hf-muon bench [--quick] [...]         Muon vs AdamW, torch.optim.Muon and DeepSpeed's Muon on this machine
    hf-muon plan MODEL --layout L --world N[,N...]   projected cost of Muon on a cluster (FLOPs, traffic,
                                          memory, step time per rank), from the config alone
    hf-muon convert-checkpoint CKPT OUT   add hf_muon_state/ to a checkpoint that lacks it (resumable under any layout);
                                          --to deepspeed-universal: a DeepSpeed universal checkpoint instead
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def _build_model(path: str):
    """Build the model a config describes, on the meta device (no weights read, no memory used)."""
    from .planner.model import load_config, meta_model

    return meta_model(load_config(path), path)


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if unit else f"{int(n)}"
        n /= 1000
    return f"{n:.1f}P"


def describe_blocks(shape: tuple[int, ...], blocks) -> str:
    """``q 64x64 | k 16x64 | v 16x64``; heads summarised: ``q 8 heads of 8x64 | ...``."""
    parts: list[tuple[str, int, str]] = []  # (logical matrix, count, block shape)
    for name, (rows, cols) in zip(blocks.names, blocks.shapes(shape)):
        kind = name.split(".h")[0]
        if parts and parts[-1][0] == kind and parts[-1][2] == f"{rows}x{cols}" and ".h" in name:
            parts[-1] = (kind, parts[-1][1] + 1, parts[-1][2])
        else:
            parts.append((kind, 1, f"{rows}x{cols}"))
    return " | ".join(f"{kind} {n} heads of {s}" if n > 1 else f"{kind} {s}" for kind, n, s in parts)


def inspect_model(path: str, force_muon: str | None = None, force_adamw: str | None = None,
                  ns_split: str = "block") -> str:
    """The split of the model at ``path`` (a model folder or a config.json) as a text table, and the
    blocks fused projections are orthogonalized in (``ns_split``)."""
    from .models.fused import fused_blocks, unknown_fused_looking, unknown_layout_warning
    from .optimizer.param_split import optimizer_state_bytes, split_parameters

    for flag, pattern in (("--force_muon", force_muon), ("--force_adamw", force_adamw)):
        try:
            re.compile(pattern or "")
        except re.error as error:
            raise ValueError(f"{flag} {pattern!r} is not a valid regular expression ({error})") from None
    model = _build_model(path)
    split = split_parameters(model, force_muon, force_adamw)
    algorithm = {n: "muon" for n, _ in split.muon} | {n: "adamw" for n, _ in split.adamw}
    order = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    rows = sorted(((n, "x".join(map(str, p.shape)), p.numel(), algorithm[n], split.reasons[n])
                   for n, p in split.muon + split.adamw), key=lambda r: order[r[0]])
    width = max(len(r[0]) for r in rows)
    lines = [f"{type(model).__name__} from {path}", "",
             f"{'parameter':<{width}}  {'shape':>14}  {'params':>9}  {'optim':<5}  reason"]
    lines += [f"{n:<{width}}  {s:>14}  {_human(k):>9}  {a:<5}  {why}" for n, s, k, a, why in rows]
    state = optimizer_state_bytes(split)
    total = state["muon_params"] + state["adamw_params"]
    lines += [
        "",
        f"Muon:  {len(split.muon):4d} tensors, {_human(state['muon_params'])} parameters "
        f"({100 * state['muon_params'] / max(total, 1):.1f}%)",
        f"AdamW: {len(split.adamw):4d} tensors, {_human(state['adamw_params'])} parameters",
        f"Optimizer state (fp32): hf_muon {_human(state['hf_muon'])}B vs all-AdamW {_human(state['all_adamw'])}B "
        f"({state['hf_muon'] / max(state['all_adamw'], 1):.2f}x)",
    ]
    muon = {id(p) for _, p in split.muon}
    blocks = [(name, tuple(model.get_parameter(name).shape), b)
              for key, (name, b) in fused_blocks(model, ns_split).items() if key in muon]
    lines += ["", f"Newton–Schulz blocks (ns_split={ns_split}): "
              + (f"{len(blocks)} fused tensor{'s' if len(blocks) != 1 else ''}, each orthogonalized block by block"
                 if blocks else "none, whole matrices")]
    lines += [f"  {name:<{width}}  {describe_blocks(shape, b)}" for name, shape, b in blocks]
    unknown = [name for key, name in unknown_fused_looking(model).items() if key in muon]
    if unknown and ns_split != "none":
        lines += ["", "note: " + unknown_layout_warning(unknown).removeprefix("hf_muon: ")]
    return "\n".join(lines)


def _world_sizes(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world takes integers separated by commas (e.g. 64,1024), got {text!r}")
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"--world sizes must be >= 1, got {text!r}")
    return worlds


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from .kernels.newton_schulz import DEFAULT_NS_PRECONDITION, default_ns_steps
    from .planner.cost import LAYOUTS
    from .planner.presets import ACCELERATORS, CPU, INTERCONNECTS, LOOPBACK

    p.add_argument("model", help="a shipped preset (llama-3-8b, mixtral-8x7b), a model folder or config.json, "
                                 "or a model id already in the local Hugging Face cache (nothing is downloaded)")
    p.add_argument("--layout", required=True, choices=LAYOUTS)
    p.add_argument("--world", required=True, type=_world_sizes, help="world sizes, comma-separated (e.g. 64,1024)")
    p.add_argument("--accelerator", default="h100-sxm", choices=sorted(ACCELERATORS) + [CPU],
                   help="cpu: this machine's matmul rate and memory bandwidth, measured now on the plan's shapes")
    p.add_argument("--interconnect", default="ib-400g", choices=sorted(INTERCONNECTS) + [LOOPBACK],
                   help="loopback: 2 gloo processes on this machine, measured now (to check a CPU run)")
    p.add_argument("--peak_tflops", type=float, help="override the accelerator's matmul rate (TFLOP/s)")
    p.add_argument("--matmul_efficiency", type=float,
                   help="fraction of the matmul rate Newton–Schulz reaches (default 0.6; 0.94 of a measured rate)")
    p.add_argument("--link_gbs", type=float, help="override the link bandwidth (GB/s per GPU per direction)")
    p.add_argument("--latency_us", type=float, help="override the per-collective latency (microseconds)")
    p.add_argument("--ns_dtype", choices=["bf16", "fp16", "fp32"], help="as Muon's ns_dtype (default: its policy)")
    p.add_argument("--ns_steps", type=int, default=default_ns_steps(DEFAULT_NS_PRECONDITION),
                   help="as Muon's ns_steps (default: Muon's, %(default)s)")
    p.add_argument("--comm_dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the exchange's dtype on the wire (Muon's comm_dtype; default: the fp32 updates)")
    p.add_argument("--bucket_mib", type=float, default=256, help="Muon's bucket_bytes in MiB (default 256)")
    p.add_argument("--ns_split", default="block", choices=["block", "head", "none"], help="as Muon's ns_split")
    p.add_argument("--sub_group_size", type=int,
                   help="zero3 only: DeepSpeed's \"sub_group_size\", elements of each rank's partition "
                        "(default: DeepSpeed's, 1e9); ZeRO-3 steps each sub-group with its own exchange")
    p.add_argument("--no_overlap", action="store_true",
                   help="as Muon(overlap_exchange=False): the synchronous exchange's buckets (as few as bucket_mib allows)")
    p.add_argument("--exchange_flops_per_byte", type=float,
                   help="as Muon(exchange_flops_per_byte=...): let the owner plan move matrices held whole by one "
                        "rank (the plan notes the value for the accelerator and link when it would help)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON instead of tables")
    p.add_argument("--plot", metavar="FILE", help="save a plot of the projected step time against the world size")


def _plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import torch

    from .planner import plan_model
    from .planner.report import check_plot_path, plans_json, plans_text, plot_plans

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if not 0 < args.bucket_mib < float("inf"):
        parser.exit(2, f"hf-muon plan: --bucket_mib must be a finite number > 0, got {args.bucket_mib}\n")
    if args.plot:  # before the planning time is spent
        try:
            check_plot_path(args.plot)
        except ValueError as error:
            parser.exit(2, f"hf-muon plan: {error}\n")
    try:
        plans = plan_model(args.model, args.layout, args.world, args.accelerator, args.interconnect,
                           ns_split=args.ns_split, peak_tflops=args.peak_tflops, link_gbs=args.link_gbs,
                           latency_us=args.latency_us, ns_dtype=args.ns_dtype, ns_steps=args.ns_steps,
                           comm_dtype=dtypes[args.comm_dtype], bucket_bytes=int(args.bucket_mib * 2**20),
                           matmul_efficiency=args.matmul_efficiency, overlap=not args.no_overlap,
                           exchange_flops_per_byte=args.exchange_flops_per_byte,
                           **({} if args.sub_group_size is None else {"sub_group_size": args.sub_group_size}))
    except ValueError as error:
        parser.exit(2, f"hf-muon plan: {error}\n")
    except ArithmeticError as error:  # a config with a zero size, or sizes past any float
        parser.exit(2, f"hf-muon plan: the config's sizes cannot be planned ({type(error).__name__}: {error}): "
                       "check them\n")
    print(plans_json(plans) if args.json else plans_text(plans))
    if args.plot:
        plot_plans(plans, args.plot)
        if not args.json:
            print(f"\nplot: {args.plot}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``hf-muon`` console script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        from .run import main as run_main

        run_main(argv[1:])
        return
    if argv and argv[0] == "bench":
        from .bench.run import main as bench_main

        bench_main(argv[1:])
        return
    parser = argparse.ArgumentParser(prog="hf-muon", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="show which parameters get Muon and the optimizer-state bytes")
    p_inspect.add_argument("model", help="a model folder or config.json (a local path: nothing is downloaded)")
    p_inspect.add_argument("--force_muon", help="regex of parameter names to give Muon anyway")
    p_inspect.add_argument("--force_adamw", help="regex of parameter names to give AdamW anyway")
    p_inspect.add_argument("--ns_split", default="block", choices=["block", "head", "none"],
                           help="how fused projections are cut for Newton–Schulz (as Muon's ns_split)")
    sub.add_parser("run", help="run a training script with --optim muon registered (python -m hf_muon.run)")
    from .bench.run import add_arguments as add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="benchmark: step time, throughput, memory, traffic, quality; "
                                                     "writes results.json, report.md and PNGs"))
    _add_plan_arguments(sub.add_parser("plan", help="what Muon will cost per rank on a cluster: Newton–Schulz FLOPs, "
                                                    "exchange and backend traffic, memory, projected step time"))
    p_convert = sub.add_parser("convert-checkpoint", help="copy a Trainer checkpoint written without hf_muon_state/ "
                                                          "(older hf_muon) and add it, so any layout resumes from it")
    p_convert.add_argument("checkpoint", help="the checkpoint folder (checkpoint-N)")
    p_convert.add_argument("output", help="a new folder for the converted copy (or the same folder to add it in place)")
    p_convert.add_argument("--to", choices=["hf_muon", "deepspeed-universal"], default="hf_muon",
                           help="hf_muon: add hf_muon_state/ (any layout resumes from it through the Trainer); "
                                "deepspeed-universal: a DeepSpeed universal checkpoint for DeepSpeed's own loader "
                                "(\"checkpoint\": {\"load_universal\": true}; ZeRO-1/2 checkpoints)")
    args = parser.parse_args(argv)
    if args.command == "convert-checkpoint":
        from .checkpoint.convert import convert_checkpoint, to_deepspeed_universal
        from .checkpoint.portable import CheckpointError

        convert = to_deepspeed_universal if args.to == "deepspeed-universal" else convert_checkpoint
        try:
            print(convert(args.checkpoint, args.output))
        except CheckpointError as error:
            parser.exit(2, f"hf-muon convert-checkpoint: {error}\n")
        return
    if args.command == "plan":
        _plan(parser, args)
        return
    if args.command == "inspect":
        if not os.path.exists(args.model):
            parser.error(f"{args.model}: no such file or folder (hf-muon inspect reads local configs only)")
        try:
            print(inspect_model(args.model, args.force_muon, args.force_adamw, args.ns_split))
        except (ValueError, OSError, re.error) as error:  # a bad regex, a folder transformers cannot read
            parser.exit(2, f"hf-muon inspect: {error}\n")


if __name__ == "__main__":
    main()
