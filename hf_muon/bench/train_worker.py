"""Training worker of figures 2–4: a small Llama through ``Trainer``, timed, its memory and traffic counted.

    python -m hf_muon.bench.train_worker --spec spec.json --out DIR
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 -m hf_muon.bench.train_worker --spec spec.json --out DIR

``spec.json`` names the model, the data, the batch (micro-batch, gradient accumulation), the steps
(warm-up and measured) and the runs to make one after the other in this process, each a contender
and a ZeRO stage (``null`` without DeepSpeed); one run per process gives clean peak-memory figures:

* ``adamw``: ``torch.optim.AdamW`` (foreach) on one process; ``--optim adamw_torch`` under DeepSpeed
  (the client optimizer ZeRO wraps: DeepSpeed's AdamW baseline for that stage);
* ``hf_muon``: ``hf_muon.Muon`` (``--optim muon``);
* ``torch_muon``: ``torch.optim.Muon`` for the hidden matrices and ``torch.optim.AdamW`` for the
  rest, as one optimizer (one process only);
* ``ds_muon``: DeepSpeed's built-in Muon (``"optimizer": {"type": "Muon"}``; DeepSpeed only).

Each rank writes ``DIR/rank{R}.json`` after every run: per optimizer step wall time and
tokens/s, optimizer step time, bytes passed to collectives by operation, peak resident memory,
optimizer-state bytes, or ``failed: <reason>``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from . import commcount

COUNTER = commcount.install()  # before deepspeed is imported anywhere in this process

import torch  # noqa: E402

from ..recipes.corpus import EOS_ID, PAD_ID, VOCAB_SIZE, stdlib_files  # noqa: E402

CONTENDER_LABELS = {
    "adamw": "AdamW",
    "hf_muon": "hf_muon.Muon",
    "torch_muon": "torch.optim.Muon + AdamW",
    "ds_muon": "DeepSpeed Muon",
}


# ---------------------------------------------------------------------------------------- data, model
class ByteBlocks(torch.utils.data.Dataset):
    """Byte-level tokens of the pretraining recipe's default corpus (:func:`hf_muon.recipes.corpus.stdlib_files`:
    its train and eval files together), cut into ``seq_len`` blocks (labels = inputs, as causal LM)."""

    def __init__(self, seq_len: int, megabytes: float) -> None:
        ids: list[int] = []
        for path in stdlib_files(megabytes):
            ids += list(path.read_bytes()) + [EOS_ID]
        data = torch.tensor(ids[: len(ids) // seq_len * seq_len], dtype=torch.long)
        self.blocks = data.view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def build_model(m: dict[str, Any], seq_len: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=m["hidden_size"], num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_heads"], num_key_value_heads=m["num_kv_heads"],
        intermediate_size=m["intermediate_size"], max_position_embeddings=max(seq_len, 256),
        tie_word_embeddings=False, eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=PAD_ID, use_cache=False,
    )
    return LlamaForCausalLM(config)


# ------------------------------------------------------------------------------------------ optimizers
class TorchMuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on the hidden matrices and ``torch.optim.AdamW`` (foreach) on the rest, as the
    single optimizer ``Trainer`` needs. Its ``param_groups`` are the two optimizers' own group dicts,
    so the learning-rate scheduler reaches both; state lives in the two inner optimizers."""

    def __init__(self, muon_params: list, adamw_params: list, lr: float, weight_decay: float) -> None:
        self.muon = torch.optim.Muon(muon_params, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(adamw_params, lr=lr, weight_decay=weight_decay, foreach=True)
        super().__init__(list(muon_params) + list(adamw_params), {"lr": lr})
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.muon.load_state_dict(state_dict["muon"])
        self.adamw.load_state_dict(state_dict["adamw"])
        self.param_groups = self.muon.param_groups + self.adamw.param_groups


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def optimizer_state_bytes(opt: Any) -> int:
    """Bytes of tensors an optimizer keeps as state (momenta, moments, step counters)."""
    if isinstance(opt, TorchMuonWithAdamW):
        return optimizer_state_bytes(opt.muon) + optimizer_state_bytes(opt.adamw)
    return sum(_tensor_bytes(s) for s in getattr(opt, "state", {}).values())


def _module_of(obj: Any) -> str:
    module = type(obj).__module__
    return "hf_muon.bench.train_worker" if module == "__main__" else module


def client_optimizer(trainer: Any) -> Any:
    """The optimizer object holding the state: under DeepSpeed the ZeRO optimizer's client optimizer."""
    engine = getattr(trainer, "deepspeed", None) or getattr(trainer, "model_wrapped", None)
    zero = getattr(engine, "optimizer", None)
    if zero is not None and hasattr(zero, "optimizer") and zero.__class__.__module__.startswith("deepspeed"):
        return zero.optimizer
    opt = trainer.optimizer
    return getattr(opt, "optimizer", opt)


# ------------------------------------------------------------------------------------ measurement
class RssSampler:
    """The largest resident set size (from /proc/self/statm) seen while it runs, every ``period`` s."""

    def __init__(self, period: float = 0.02) -> None:
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def current() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.current())
            self._stop.wait(self.period)

    def __enter__(self) -> "RssSampler":
        self.peak = self.current()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def process_peak_rss() -> int:
    """This process's resident-memory high-water mark since it started (``VmHWM``).

    Not ``ru_maxrss``: Linux carries that across ``fork`` + ``exec``, so a worker started by a large
    parent (the benchmark process, after figure 1) would report the parent's size as its own peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


def make_callback(records: dict[str, list]):
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        """Wall time and collective bytes at each optimizer-step boundary; optimizer ``step()`` time."""

        def on_train_begin(self, args, state, control, **kw):
            records["boundaries"].append((time.perf_counter(), COUNTER.snapshot()["bytes"]))

        def on_pre_optimizer_step(self, args, state, control, **kw):
            records["_opt_start"] = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            records["optimizer_step_s"].append(time.perf_counter() - records.pop("_opt_start"))

        def on_step_end(self, args, state, control, **kw):
            records["boundaries"].append((time.perf_counter(), COUNTER.snapshot()["bytes"]))

    return StepRecorder()


def ds_config(stage: int, contender: str) -> dict[str, Any]:
    """The DeepSpeed config of a ZeRO ``stage`` run: the same for every contender but for the optimizer
    block of DeepSpeed's Muon. ZeRO-3 partitions every parameter (persistence threshold 0: the model is
    small) and runs with ``reduce_scatter: false`` for everyone, since DeepSpeed's Muon refuses it."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, reduce_scatter=False)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    if contender == "ds_muon":
        config["optimizer"] = {"type": "Muon", "params": {"lr": "auto", "weight_decay": "auto", "momentum": 0.95}}
    return config


def run_key(run: dict[str, Any]) -> str:
    return f"{run['contender']}@zero{run['zero_stage']}" if run.get("zero_stage") else run["contender"]


def train_one(contender: str, stage: int | None, spec: dict[str, Any], dataset: ByteBlocks,
              out_dir: Path) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from ..optimizer.muon import Muon
    from ..optimizer.param_split import split_parameters

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if stage is None and contender == "ds_muon":
        raise ValueError("DeepSpeed's Muon needs a DeepSpeed stage")
    if stage is not None and contender == "torch_muon":
        raise ValueError("torch.optim.Muon takes whole matrices; ZeRO hands the client flat partitions")
    model = build_model(spec["model"], spec["seq_len"], spec["seed"])
    lr, wd = spec["lr"], spec["weight_decay"]
    kwargs: dict[str, Any] = dict(
        output_dir=str(out_dir / f"trainer_{contender}_{stage}"), per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=spec["grad_accum"], max_steps=spec["warmup_steps"] + spec["measured_steps"],
        learning_rate=lr, weight_decay=wd, lr_scheduler_type="constant", logging_steps=10**6,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=spec["seed"],
        dataloader_num_workers=0, use_cpu=stage is None,
    )
    optimizers: tuple[Any, Any] = (None, None)
    if stage is not None:
        kwargs["deepspeed"] = ds_config(stage, contender)
        kwargs["optim"] = {"adamw": "adamw_torch", "hf_muon": "muon"}.get(contender, "adamw_torch")
        if world > 1:
            kwargs["accelerator_config"] = {"use_configured_state": True}
    elif contender == "adamw":
        optimizers = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=True), None)
    elif contender == "hf_muon":
        optimizers = (Muon(model, lr=lr, weight_decay=wd), None)
    elif contender == "torch_muon":
        split = split_parameters(model)
        optimizers = (TorchMuonWithAdamW([p for _, p in split.muon], [p for _, p in split.adamw], lr, wd), None)
    args = TrainingArguments(**kwargs)
    if args.world_size != world:
        raise RuntimeError(f"Trainer sees world size {args.world_size}, the launcher started {world} ranks")
    records: dict[str, list] = {"boundaries": [], "optimizer_step_s": []}
    trainer = Trainer(model=model, args=args, train_dataset=dataset, optimizers=optimizers,
                      callbacks=[make_callback(records)])
    gc.collect()
    rss_before = RssSampler.current()
    with RssSampler() as sampler:
        trainer.train()
    opt = client_optimizer(trainer)
    tokens_per_step = spec["micro_batch"] * spec["grad_accum"] * spec["seq_len"] * world
    marks = records["boundaries"]
    steps = []
    for (t0, b0), (t1, b1) in zip(marks, marks[1:]):
        delta = {op: b1.get(op, 0) - b0.get(op, 0) for op in set(b0) | set(b1)}
        steps.append({"seconds": t1 - t0, "tokens_per_s": tokens_per_step / (t1 - t0),
                      "collective_bytes": {op: n for op, n in delta.items() if n}})
    measured = steps[spec["warmup_steps"]:]
    exchange = getattr(opt, "exchange_stats", None)
    result = {
        "label": CONTENDER_LABELS[contender], "optimizer_class": f"{_module_of(opt)}.{type(opt).__name__}",
        "tokens_per_step": tokens_per_step, "world_size": world, "zero_stage": stage,
        "steps": steps, "measured_steps": measured,
        "optimizer_step_s": records["optimizer_step_s"][spec["warmup_steps"]:],
        "optimizer_state_bytes": optimizer_state_bytes(opt),
        # ZeRO-3 leaves each rank an empty placeholder: the whole count is in ds_numel
        "parameters": sum(getattr(p, "ds_numel", None) or p.numel() for p in model.parameters()),
        "rss_before_train_bytes": rss_before, "peak_rss_sampled_bytes": sampler.peak,
        "peak_rss_process_bytes": process_peak_rss(),
        "exchange_bytes_sent": getattr(exchange, "bytes_sent", None),
    }
    del trainer, opt, model, optimizers
    return result


def _reset_between_contenders() -> None:
    """Forget the previous contender's Accelerate state (its DeepSpeed plugin), keep the process group."""
    try:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=False)
    except Exception:  # noqa: BLE001 - best effort: a stale state shows up as a failed contender
        pass
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    import hf_muon  # noqa: F401  (registers --optim muon with transformers)

    rank = int(os.environ.get("RANK", "0"))
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / f"rank{rank}.json"
    dataset = ByteBlocks(spec["seq_len"], spec["corpus_mb"])
    results: dict[str, Any] = {"rank": rank, "spec": spec, "runs": {}}
    for run in spec["runs"]:
        key, contender, stage = run_key(run), run["contender"], run.get("zero_stage")
        start = time.perf_counter()
        try:
            results["runs"][key] = train_one(contender, stage, spec, dataset, args.out)
        except Exception as exc:  # noqa: BLE001 - reported as "failed: <reason>" in the report
            traceback.print_exc()
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            results["runs"][key] = {"label": CONTENDER_LABELS[contender], "zero_stage": stage,
                                    "failed": f"{type(exc).__name__}: {message}"[:400]}
        results["runs"][key]["wall_s"] = time.perf_counter() - start
        out_file.write_text(json.dumps(results, indent=1))
        print(f"[rank {rank}] {key}: {'failed' if 'failed' in results['runs'][key] else 'done'} "
              f"in {time.perf_counter() - start:.0f} s", flush=True)
        _reset_between_contenders()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    from hf_muon.launching import shutdown_process_group

    shutdown_process_group(exit_code=0)  # a gloo job's teardown at interpreter exit aborts now and then
