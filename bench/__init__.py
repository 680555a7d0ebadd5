"""Reproducible comparisons with transformers, run side by side in one process."""
