"""The vLLM backend (optional extra): engine-level API only."""
