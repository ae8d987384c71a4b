"""BERT-family pretraining: the encoder, the DeepSpeed training loop, checkpoints, export and the CLI."""

__version__ = "0.1.0"
