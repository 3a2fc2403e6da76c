"""Checkpoints of ``hf_muon.Muon`` that move between layouts (one process, DDP, FSDP2, ZeRO-1/2/3)."""

from .portable import (CheckpointError, has_portable_state, load_portable, portable_dir, read_meta,
                       save_portable)

__all__ = ["CheckpointError", "has_portable_state", "load_portable", "portable_dir", "read_meta", "save_portable"]
