"""The attention spectral analysis as a service: HTTP routes, report, figure, start-up, CLI.

The measurements themselves live in `model/` (analysis, spectral, attention_bounds), which
imports nothing from here; docs/analysis.md says what they are.
"""
