"""Throughput benchmark: the server against plain runtimes (and peer servers) on the same models.

``python -m bench`` (or ``make bench``) builds the models offline, measures the raw
transformers ceiling, starts the server as a user does, loads it with closed-loop clients and
writes ``BENCHMARKS.md``.
"""
