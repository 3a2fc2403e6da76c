"""Imported at interpreter start by ``hf_muon_autoregister.pth`` (installed beside the package) when the
process asks for Muon: ``--optim muon`` or ``--optim=muon`` in ``sys.argv``, or ``HF_MUON_REGISTER=1``
in the environment (what ``python -m hf_muon.run`` sets, for arguments that come from config files).
``HF_MUON_REGISTER=0`` turns both off. The process's children inherit the request (``HF_MUON_REGISTER=1``).

The decision is made in the one line of the .pth file itself, so a Python process that does not ask
for Muon imports nothing of hf_muon. Here the import hooks are installed: they register ``muon`` when
transformers' training arguments are imported, and do nothing if they never are. Nothing raised here
may stop the interpreter from starting: a failure is a warning.
"""

try:
    import os

    from .integrations.import_hook import register_when_transformers_loads

    # children (torch.multiprocessing.spawn, DataLoader workers, a later torch.load of training_args.bin
    # in a process they start) see no --optim muon on their command line: pass the request on, as
    # ``python -m hf_muon.run`` does
    os.environ.setdefault("HF_MUON_REGISTER", "1")
    register_when_transformers_loads()
except Exception as error:  # noqa: BLE001 - never break interpreter start-up
    import warnings

    warnings.warn(f"hf_muon could not set up --optim muon at start-up ({type(error).__name__}: {error}); "
                  "use `python -m hf_muon.run SCRIPT ...` or `import hf_muon` in the script instead")
