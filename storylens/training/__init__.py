"""Training storylens's own model: the recipe (AdamW, warm-up and cosine decay, EMA weights,
resumable), its atomic, validated checkpoints, and exporting a run as a model folder."""

from storylens.training.train import TrainConfig, export_checkpoint, train

__all__ = ["TrainConfig", "export_checkpoint", "train"]
