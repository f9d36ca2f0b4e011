"""The relay: the upstream client and registry, the forward of an admitted request, the SSE and
JSON response relay, and the finish step (settle, verify, log)."""
