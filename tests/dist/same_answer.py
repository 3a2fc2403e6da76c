"""Run under ``torchrun --nproc_per_node W``: DDP or FSDP2 Muon must give the single-process answer.

    torchrun --nproc_per_node 2 tests/dist/same_answer.py --backend ddp --out result.json
    torchrun --nproc_per_node 2 tests/dist/same_answer.py --cases cases.json --out results.json

Every rank also trains the reference (one process's view: the whole batch, no exchange), so the
comparison needs no files. Rank 0 writes the figures the pytest side asserts on. ``--cases`` names a
JSON object of case names and their arguments: each case runs in turn in the same ranks (a launch's
start-up takes longer than a case) and the figures are written per case name. An argument
``measured_by:NAME`` stands for the FLOPs per byte that an earlier case NAME measured (``auto``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_muon import Muon
from hf_muon.distributed.layout import with_blocks
from hf_muon.distributed.plan import assign_owners, ns_load
from hf_muon.distributed.sharding import layouts_of
from hf_muon.models.fused import block_shapes, fused_blocks
from hf_muon.optimizer import muon as muon_module


class Block(nn.Module):
    """Mixed shapes on purpose: square, wide, tall, GQA-like narrow, a conv."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, d // 4, bias=False)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)
        self.conv = nn.Conv1d(d, d, 3, padding=1)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.q(h) + self.kv(h).repeat(1, 1, 4)
        h = h + self.down(torch.relu(self.up(h)))
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(self.norm(h))


class TorchLayer(nn.Module):
    """PyTorch's own transformer layer (``nn.MultiheadAttention``: q | k | v in one ``in_proj_weight``
    parameter) and a matrix with no rows (``nn.Linear(8, 0)``, which DeepSpeed leaves out of its groups)."""

    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, d)
        self.layer = nn.TransformerEncoderLayer(d, 4, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.narrow = nn.Linear(d, 8)
        self.empty = nn.Linear(8, 0)
        self.wide = nn.Linear(8, d)
        self.head = nn.Linear(d, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.layer(self.embed(ids))
        narrow = self.narrow(h)
        h = h + self.wide(torch.cat([narrow, self.empty(narrow)], -1))
        return self.head(h)


MODELS = ("block", "gpt2", "phi3", "neox", "falcon", "mixtral", "mixtral3", "torch_layer")


def build(name: str) -> nn.Module:
    """``block`` (the mixed shapes above) or a tiny model with fused projections that the optimizer
    orthogonalizes block by block: ``gpt2`` (q | k | v columns of a Conv1D), ``phi3`` (q | k | v rows
    of GQA sizes, gate | up), ``neox`` (q, k, v interleaved per head), ``falcon`` (per kv group);
    or ``mixtral`` (stacked experts on transformers 5: a param group of their own), or
    ``torch_layer`` (see :class:`TorchLayer`)."""
    if name == "block":
        return Block()
    if name == "torch_layer":
        return TorchLayer()
    import transformers as T

    common = dict(vocab_size=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    configs = {
        "gpt2": lambda: T.GPT2Config(n_embd=48, n_layer=2, n_head=4, n_positions=32, **no_dropout, **common),
        "phi3": lambda: T.Phi3Config(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=96, **common),
        "neox": lambda: T.GPTNeoXConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=96, **common),
        "falcon": lambda: T.FalconConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                         new_decoder_architecture=True, **common),
        "mixtral": lambda: T.MixtralConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, **common),
        # 3 experts: FSDP2 at 2 ranks leaves experts 0-1 of each stack whole on rank 0, expert 2 on rank 1;
        # large enough (intermediate 192) that the other matrices cannot even that out
        "mixtral3": lambda: T.MixtralConfig(hidden_size=48, intermediate_size=192, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
                                            num_experts_per_tok=2, **common),
    }
    return T.AutoModelForCausalLM.from_config(configs[name]())


def reference_accumulation(name: str, world: int, accumulation: int) -> int:
    """Micro-batches of the one-process reference. The transformers models see the ranks' own
    micro-batches, summed in one process: their updates amplify round-off (GPT-2: a full batch vs two
    halves, both in one process, differ by 3e-5 after 2 steps), so only the summation order may
    differ from the sharded run."""
    return 1 if name == "block" else world * accumulation


def sharded_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards on their own before the root."""
    if isinstance(model, Block):
        return [model.q, model.kv, model.up, model.down, model.conv]
    if isinstance(model, TorchLayer):
        return [model.layer]
    units: dict[str, nn.Module] = {}  # the outermost only: Mixtral's MoE block sits inside its layer
    for name, m in model.named_modules():
        if type(m).__name__.endswith(("Block", "DecoderLayer", "Layer")) and type(m).__name__ != "Block" \
                and not any(name.startswith(outer + ".") for outer in units):
            units[name] = m
    return list(units.values())


def wrap(backend: str, model: nn.Module, world: int, mesh_per_unit: bool = False) -> nn.Module:
    """``model`` under DDP, or sharded by FSDP2 (each of ``sharded_units`` then the root) over ``world``
    ranks. Build the optimizer on ``model`` afterwards: under FSDP2 it must see the DTensors.
    ``mesh_per_unit``: each unit gets a mesh of its own, equal to the others but another object (as
    ``fully_shard`` calls without ``mesh=`` give)."""
    if backend == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for module in sharded_units(model):
        fully_shard(module, mesh=init_device_mesh("cpu", (world,)) if mesh_per_unit else mesh)
    return fully_shard(model, mesh=mesh)


def matrices_per_step(opt) -> int:
    """Newton–Schulz runs one optimizer step makes: the matrices the owner plan costs (``ns_matrices`` of
    each Muon tensor's layout: one, a fused one's blocks, a stack's matrices times their blocks)."""
    from hf_muon.distributed.layout import replicated, with_blocks
    from hf_muon.models.fused import block_shapes

    count = 0
    for g, tensors, cuts in zip(opt.param_groups, opt._group_tensors, opt._group_blocks):
        if g["algorithm"] == "muon":
            shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in tensors]
            layouts = with_blocks([replicated(shape, g["stacked"], 1) for shape in shapes],
                                  [block_shapes(shape, cut) for shape, cut in zip(shapes, cuts)])
            count += sum(len(layout.ns_matrices) for layout in layouts)
    return count


def counting_newton_schulz():
    """``(fn, calls)``: a Newton–Schulz for ``Muon(orthogonalize_fn=fn)`` that counts the matrices it
    orthogonalizes in this process in ``calls["n"]`` and their FLOPs (the kernel's FLOP model, which
    the owner plan and ``hf-muon plan`` use) in ``calls["flops"]``."""
    from hf_muon.kernels import orthogonalize
    from hf_muon.kernels.newton_schulz import orthogonalize_flops

    calls = {"n": 0, "flops": 0}

    def counting(G, steps, coefficients, dtype, **k):
        count = G.shape[0] if G.ndim == 3 else 1
        calls["n"] += count
        calls["flops"] += count * orthogonalize_flops(G.shape[-2], G.shape[-1], steps, dtype or G.dtype,
                                                      precondition=k.get("precondition", "frobenius"))
        return orthogonalize(G, steps, coefficients, dtype, **k)

    return counting, calls


def flops_per_byte_arg(value: str) -> float | str:
    """``--exchange_flops_per_byte``: a number, or "auto" (Muon measures it)."""
    return value if value == "auto" else float(value)


def link_rate_figures(opt: Muon) -> list[float]:
    """What ``exchange_flops_per_byte="auto"`` measured: ``[how many rates, Newton–Schulz FLOP/s,
    link bytes/s, FLOPs per byte]`` of the first (zeros when none)."""
    rates = opt.link_rates
    first = rates[0] if rates else None
    return [len(rates), *((first.ns_flops_per_s, first.link_bytes_per_s, first.flops_per_byte) if first else (0, 0, 0))]


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    logits = getattr(out, "logits", out)  # a transformers model returns an output object
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


def train(model, opt, batches, accumulation: int, rank: int, world: int) -> None:
    for batch in batches:
        opt.zero_grad()
        local = batch.chunk(world)[rank] if world > 1 else batch
        for micro in local.chunk(accumulation):
            (loss_fn(model, micro) / accumulation).backward()
        opt.step()


def write_and_shut_down(rank: int, path: str, results: dict) -> None:
    """Rank 0 writes ``results`` as JSON to ``path``; then every rank ends the job cleanly."""
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()  # no rank tears gloo down while another still talks
    from hf_muon.launching import shutdown_process_group

    shutdown_process_group(exit_code=0)  # gloo's teardown at interpreter exit aborts now and then


def arguments() -> argparse.ArgumentParser:
    """One case's arguments (``--cases`` holds several cases' lists of them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["ddp", "fsdp2"], required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--comm_dtype", default=None)
    # DDP over an explicit process group: "new_group" of all ranks, or "per_rank" (each rank alone:
    # no exchange, every rank orthogonalizes every matrix)
    parser.add_argument("--process_group", choices=["default", "new_group", "per_rank"], default="default")
    parser.add_argument("--model", choices=MODELS, default="block")
    # "per_tensor": one param group per parameter (as a user's per-layer learning rates make), every
    # other matrix's with 4 Newton–Schulz steps
    parser.add_argument("--groups", choices=["model", "per_tensor"], default="model")
    parser.add_argument("--mesh_per_unit", action="store_true", help="FSDP2: a mesh object per sharded unit")
    parser.add_argument("--exchange_flops_per_byte", type=flops_per_byte_arg, default=None)
    # float64: the model, its updates and Newton–Schulz, so the two runs differ by float64 round-off
    # alone (short runs compare to a bound that holds on every CPU, whatever its fp32 kernels)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    # "original": a Conv1D's (GPT-2's) scale is read from its columns, also from its FSDP2 shards
    parser.add_argument("--adjust_lr", default="match_rms_adamw")
    parser.add_argument("--out", required=True)
    return parser


def run_case(args: argparse.Namespace, rank: int, world: int) -> dict:
    """Train ``args``' model in one process and under ``args.backend``; the figures of both ranks."""
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    base = build(args.model).to(dtype)
    batches = [torch.randint(0, 64, (8, 16)) for _ in range(args.steps)]
    # Newton–Schulz in the model's dtype, never the policy's bf16 (picked on CPUs with bf16 matmul): then
    # sharded and single-process runs agree to that dtype's round-off, and a larger gap is an exchange bug.
    opt_kwargs = dict(lr=2e-2, weight_decay=0.1, ns_dtype=dtype, adjust_lr=args.adjust_lr)

    def params_of(model: nn.Module):
        if args.groups == "model":
            return model
        # every other matrix with 4 Newton–Schulz steps: two families of groups, two exchanges
        return [{"params": [p], **({"ns_steps": 4} if p.ndim > 1 and i % 2 else {})}
                for i, p in enumerate(model.parameters())]

    reference = copy.deepcopy(base)
    train(reference, Muon(params_of(reference), distributed=False, **opt_kwargs), batches,
          reference_accumulation(args.model, world, args.accumulation), 0, 1)

    model = copy.deepcopy(base)
    comm_dtype = getattr(torch, args.comm_dtype) if args.comm_dtype else None
    counting, calls = counting_newton_schulz()
    opt_kwargs["orthogonalize_fn"] = counting
    if args.process_group == "new_group":
        opt_kwargs["process_group"] = dist.new_group(list(range(world)))
    elif args.process_group == "per_rank":  # every rank creates every group, in the same order
        opt_kwargs["process_group"] = [dist.new_group([r]) for r in range(world)][rank]
    wrapped = wrap(args.backend, model, world, args.mesh_per_unit)
    opt = Muon(params_of(model), comm_dtype=comm_dtype, exchange_flops_per_byte=args.exchange_flops_per_byte,
               **opt_kwargs)
    plans = {"n": 0}
    real_make_exchange = muon_module.make_exchange

    def counting_make_exchange(*a, **k):
        plans["n"] += 1
        return real_make_exchange(*a, **k)

    muon_module.make_exchange = counting_make_exchange
    try:
        train(wrapped, opt, batches, args.accumulation, rank, world)
    finally:
        muon_module.make_exchange = real_make_exchange

    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        worst = max(worst, ((full - q).abs().max() / q.abs().max()).item())
    muon_params = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    muon_numel = sum(p.numel() for p in muon_params)
    figures = torch.tensor(
        [worst, calls["n"], opt.exchange_stats.bytes_sent, opt.exchange_stats.bytes_received, calls["flops"],
         *link_rate_figures(opt)],
        dtype=torch.float64
    )
    gathered = [torch.zeros_like(figures) for _ in range(world)]
    dist.all_gather(gathered, figures)
    # the owner plan's Newton–Schulz per rank, fused projections costed block by block as they run
    cuts = fused_blocks(model, "block")
    layouts = with_blocks(layouts_of(muon_params, False, world),
                          [block_shapes(tuple(p.shape), cuts[id(p)][1]) if id(p) in cuts else None
                           for p in muon_params])
    load = ns_load(layouts, assign_owners(layouts, world, 5), world, 5)
    return {
        "world": world, "steps": args.steps, "muon_tensors": len(muon_params), "muon_numel": muon_numel,
        "ns_matrices": matrices_per_step(opt),
        "max_rel_diff": [g[0].item() for g in gathered], "ns_calls": [g[1].item() for g in gathered],
        "bytes_sent": [g[2].item() for g in gathered], "bytes_received": [g[3].item() for g in gathered],
        "ns_flops_per_rank": load, "muon_groups": sum(g["algorithm"] == "muon" for g in opt.param_groups),
        "stacked_groups": sum(g["algorithm"] == "muon" and g["stacked"] for g in opt.param_groups),
        "ns_flops_run": [g[4].item() for g in gathered], "exchange_plans": plans["n"],
        "link_rates": [g[5:].tolist() for g in gathered], "exchange_flops_per_byte": args.exchange_flops_per_byte,
    }


def run_cases(parser: argparse.ArgumentParser, run_case) -> None:
    """The ranks' main: the case on the command line, or with ``--cases FILE --out F`` each case of
    FILE (``{name: [arguments]}``) in turn in the same ranks; ``run_case(args, rank, world)`` gives a
    case's figures and rank 0 writes them (per case name). An argument ``measured_by:NAME`` becomes
    the FLOPs per byte in case NAME's ``link_rates`` figures (``same_answer.py``'s)."""
    if "--cases" in sys.argv[1:]:
        many = argparse.ArgumentParser()
        many.add_argument("--cases", required=True, help="a JSON file: {case name: [its arguments]}")
        many.add_argument("--out", required=True)
        top = many.parse_args()
        with open(top.cases) as f:
            cases = json.load(f)
    else:
        top, cases = parser.parse_args(), None
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # fail, never hang
    rank, world = dist.get_rank(), dist.get_world_size()
    if cases is None:
        results = run_case(top, rank, world)
    else:
        results = {}
        for name, argv in cases.items():
            argv = [repr(results[a.removeprefix("measured_by:")]["link_rates"][0][3]) if a.startswith("measured_by:")
                    else a for a in argv]
            if rank == 0:
                print(f"case {name!r}", flush=True)  # the case a failure's traceback belongs to
            results[name] = run_case(parser.parse_args([*argv, "--out", top.out]), rank, world)
    write_and_shut_down(rank, top.out, results)


if __name__ == "__main__":
    run_cases(arguments(), run_case)
