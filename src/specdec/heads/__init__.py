"""Draft heads on the target itself (Medusa, EAGLE): the modules and their files. Training them is
`specdec.training`, above the engine."""

from specdec.heads.files import load_heads, save_heads
from specdec.heads.modules import EagleHead, HeadsConfig, MedusaHeads, target_fingerprint

__all__ = ["EagleHead", "HeadsConfig", "MedusaHeads", "load_heads", "save_heads", "target_fingerprint"]
