"""Admission: authenticate, read and validate the body, count the prompt, apply the gate and the
tenant's limits. Nothing here forwards a byte upstream."""
