"""The bundled disaggregated engine (PyTorch): paged KV pool, prefill, decode, transfer, router.

Imports only ``config`` and ``tokenizer`` of kvgate. Run it with ``python -m gpu_backend``.
"""
