"""The optimizer layer: param groups, the Muon/AdamW step, and the parameter split."""
