"""Model-aware pieces: what a model's structure says (fused projections, attention heads)."""
