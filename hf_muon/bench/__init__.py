"""``hf-muon bench``: Muon against AdamW, ``torch.optim.Muon`` and DeepSpeed's Muon on this machine.

One module per figure: ``optimizer_step`` (1: step time, Newton–Schulz FLOP/s, orthogonality),
``throughput`` (2: tokens/s through ``Trainer``; its runs also give the peak memory of figure 3
and the collective bytes of figure 4), ``memory`` (3: optimizer state), ``network`` (4: traffic
table from the runs of 2) and ``quality`` (5: learning-rate sweep); the workers those start as
subprocesses (``train_worker``, ``quality_worker``), the collective-byte counter (``commcount``),
the report writer (``report``) and the driver (``run``: presets, ``main``).
Nothing here is imported by ``import hf_muon``.
"""
