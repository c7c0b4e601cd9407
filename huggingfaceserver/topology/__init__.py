"""The process topology: the pod's limits, the layout they allow (one process, or front
processes before one engine process), the supervisor that starts and watches them, and the
engine's channel to the fronts."""
