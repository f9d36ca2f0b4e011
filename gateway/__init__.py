"""kvgate's gateway: the edge proxy (auth, admission, proxy, metrics; a Starlette app under uvicorn) and the CLI.

Depends on ``verifier``, ``tokenizer`` and ``config``; never on ``gpu_backend`` (docs/design.md).
"""
