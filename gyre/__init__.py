"""Gyre: Slurm-native online RL for LLM agents on xLong tasks."""

__version__ = "0.1.0"
