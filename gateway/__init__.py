"""kvgate's gateway: the FastAPI edge proxy (auth, admission, proxy, metrics) and the CLI.

Depends on ``verifier``, ``tokenizer`` and ``config``; never on ``gpu_backend`` (docs/design.md).
"""
