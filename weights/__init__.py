"""Checkpoints and tokenizers: reading the files people have, and preparing the default model."""
