"""kvgate's verifier: deploy gate, canary probes, leak index, usage-drift and latency detectors.

Depends on ``tokenizer`` and ``config`` only (DESIGN.md).
"""
