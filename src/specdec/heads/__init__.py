"""Draft heads on the target itself (Medusa, EAGLE): modules, files, training."""

from specdec.heads.modules import EagleHead, HeadsConfig, MedusaHeads, load_heads, save_heads, target_fingerprint

__all__ = ["EagleHead", "HeadsConfig", "MedusaHeads", "load_heads", "save_heads", "target_fingerprint"]
