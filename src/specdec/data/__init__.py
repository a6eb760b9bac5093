"""Prompt sets shipped with specdec: Spec-Bench (Apache-2.0) and HumanEval (MIT); see README.md here."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
