"""What operators see and set: metrics, the access log, tenants and their reload, the live pool
watcher, and the OpenAI-shaped error bodies."""
