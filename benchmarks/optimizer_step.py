"""Figure 1 of ``hf-muon bench`` on its own: optimizer step time, Newton–Schulz FLOP/s against this
machine's matmul FLOP/s, and orthogonality error against an SVD's polar factor.

    python benchmarks/optimizer_step.py [--d 512 --ff 1376 --layers 4 --heads 8 --kv_heads 2 --repeats 5]
                                        [--device cuda] [--json result.json]

Contenders run in this process on the same tensors and gradients: torch.optim.AdamW (foreach),
hf_muon.Muon (Newton–Schulz in its policy dtype: bf16 on CPUs with native bf16 matmul, else fp32;
Gram iterations for wide matrices, Frobenius normalization, 5 steps), the same with
ns_precondition="aol" (4 steps), with ns_dtype=fp32 where the policy picks bf16, and torch.optim.Muon
(bf16, one matrix at a time).
``--device cuda`` runs it all on a GPU (Newton–Schulz in bf16 there, as ``torch.optim.Muon``): the
check for a lent GPU, one set per call. Timings on a shared machine are noisy: read the ratios.
The whole benchmark (all figures, report and plots) is ``hf-muon bench``.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP

from hf_muon.bench import optimizer_step  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--ff", type=int, default=None, help="MLP width (default: 8d/3 rounded up to 256)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget_s", type=float, default=30.0, help="stop repeating a contender after this (>= 2 runs)")
    parser.add_argument("--device", default="cpu", help="where the tensors live and the steps run (cpu, cuda, ...)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    spec = {"d": args.d, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "ff": args.ff}
    cfg = {"sets": {"set": spec}, "repeats": args.repeats, "min_repeats": 2, "budget_s": args.budget_s,
           "max_step_s": float("inf"), "ns_repeats": args.repeats, "device": args.device}
    result = optimizer_step.run(cfg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"spec": spec, **result}, f, indent=1)
    data = result["step_time"]["set"]
    print(f"\n{data['matrices']} matrices, {data['parameters'] / 1e6:.2f}M parameters, "
          f"on {result['device']}, {result['torch_threads']} CPU threads, Newton–Schulz in {result['ns_dtype']}")
    print(f"{'optimizer':<56} {'median ms':>10} {'min-max ms':>18} {'x AdamW':>8} {'x torch Muon':>13}")
    for name, row in data["contenders"].items():
        ratio = (row.get("x_torch_muon") or {}).get("median")
        print(f"{name:<56} {1e3 * row['median']:>10.1f} {1e3 * row['min']:>8.1f}-{1e3 * row['max']:<9.1f} "
              f"{row['x_adamw']:>8.2f} {'-' if ratio is None else f'{ratio:.3f}':>13}")
    eff = result["ns_efficiency"]["set"]["total"]
    for label, tot in eff.items():
        print(f"Newton–Schulz ({label} kernel): {1e3 * tot['ns_s']:.0f} ms, "
              f"{100 * tot['fraction_of_machine']:.0f}% of bare-matmul FLOP/s for the same products")
    for name, row in result["orthogonality"]["set"].items():
        print(f"{name:<72} error gaussian {row['gaussian']['relative_error']:.4g}, "
              f"low rank + noise {row['low_rank']['relative_error']:.4g}")


if __name__ == "__main__":
    main()
