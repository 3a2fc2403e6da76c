"""A 2-rank gloo job made to end in the teardown race that aborts torch 2.13 CPU jobs (tests/test_clean_exit.py).

A gloo worker thread releases a finished collective after the caller's ``wait()`` returned; when the
work's thread-local state holds a Python object, the release takes the GIL, and if Python is
finalizing by then, CPython ends the thread and ``std::terminate`` aborts the process (SIGABRT). This
script widens that window: one CPU for the whole process, gloo's threads at the lowest priority, a
``TorchFunctionMode`` active around the collectives, and a reference that keeps the group alive after
``destroy_process_group`` (as DDP, FSDP state or a default argument do in real jobs). Ended the plain
way (``--plain``: ``destroy_process_group()`` and a normal exit) it aborts in about 1 launch of 4 here;
under ``hf_muon.run`` it must exit 0 every time. ``--fail`` raises at the end: the exit code must not be 0.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", action="store_true", help="end with destroy_process_group() and a normal exit")
    parser.add_argument("--fail", action="store_true", help="raise after the collectives")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    dist.init_process_group("gloo")
    try:  # Linux names gloo's threads; elsewhere the job is just less likely to hit the window
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() in ("pt_gloo_runloop", "gloo_tcp_loop"):
                    os.setpriority(os.PRIO_PROCESS, int(task), 19)
    except OSError:
        pass
    sys.hf_muon_test_group = dist.group.WORLD  # held past destroy_process_group, as real jobs do
    t = torch.ones(1000)
    with PassThrough():
        for _ in range(3):
            dist.all_reduce(t)
            dist.barrier()
    assert t[0].item() == dist.get_world_size() ** 3
    if args.fail:
        raise RuntimeError("failing on purpose after the collectives")
    if args.plain:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
