"""``hf-muon bench``: Muon against AdamW, ``torch.optim.Muon`` and DeepSpeed's Muon on this machine.

One module per figure (``optimizer_step``: step time, Newton–Schulz FLOP/s and orthogonality;
``throughput``: end-to-end tokens/s through ``Trainer``, which also yields the memory and network
figures; ``memory``; ``network``; ``quality``: the learning-rate sweep), a training worker that the
throughput runs start as subprocesses (``train_worker``), a collective-byte counter
(``commcount``), the report writer (``report``) and the driver (``run``: presets, ``main``).
Nothing here is imported by ``import hf_muon``.
"""
