"""Imported at interpreter start by ``hf_muon_autoregister.pth`` when ``HF_MUON_REGISTER`` is set."""

from .integrations.import_hook import register_when_transformers_loads

register_when_transformers_loads()
