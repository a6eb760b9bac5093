"""Training draft heads (`specdec train-heads`): above the engine, which it drives to self-distill the target.

    features.py   the training windows (standard library, the target's own answers) and the target's features
    losses.py     what Medusa and EAGLE heads learn, and their held-out top-1 agreement with the target
    train.py      setup, the training loop with checkpoints, the report

The heads themselves (modules, files) are `specdec.heads`, which imports nothing of this package.
"""

from specdec.training.features import prompt_split
from specdec.training.train import TrainConfig, train_heads

__all__ = ["TrainConfig", "prompt_split", "train_heads"]
