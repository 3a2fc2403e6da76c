"""Training recipes shipped with hf_muon, runnable from any directory once the package is installed.

* :mod:`hf_muon.recipes.pretrain_clm`: pretrain a small byte-level Llama with the Hugging Face
  ``Trainer`` (``python -m hf_muon.recipes.pretrain_clm``, or with ``--optim muon`` through
  ``python -m hf_muon.run -m hf_muon.recipes.pretrain_clm``). ``examples/pretrain_clm.py`` is a thin
  script around it; figure 5 of ``hf-muon bench`` and ``examples/demo.py`` train it.
* :mod:`hf_muon.recipes.corpus`: its default corpus, a deterministic slice of the Python standard
  library's own source (present on every machine, so everything runs offline), byte-level.
* :mod:`hf_muon.recipes.curves`: loss curves from a ``Trainer``'s log history and the step at which a
  curve reaches a target loss.

Importing this package (or ``corpus``/``curves``) imports neither torch nor transformers.
"""
