"""The embedded local stack (bundled engine + gateway as child processes) and its demo corpus."""
