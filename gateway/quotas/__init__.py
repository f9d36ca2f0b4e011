"""Per-tenant quotas (RPM, TPM, concurrency) in Redis or in-process: the stage contract, the
stores and their Lua scripts."""
