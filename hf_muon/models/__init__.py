"""Model-aware pieces: what a model's structure says (fused projections, attention heads).

Nothing here is imported by ``import hf_muon``; each module imports torch, and transformers only
where it must (QK-clip registers attention functions with it).
"""
