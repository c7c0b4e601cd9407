"""The engine process and the wire between it and the front processes.

With ``--api_workers N`` (N > 1) one engine process owns the model and its batching (the
encoder batcher, the generation decode loop) and N front processes serve HTTP and gRPC: they
validate, tokenize, detokenize and render, and talk to the engine over ZeroMQ with msgpack
messages (:mod:`.messages`): token ids in, results or token deltas out.
"""

import signal

STOP_SIGNAL = signal.SIGUSR1
"""How the supervisor stops the engine, once the fronts have drained. The engine ignores
SIGTERM and SIGINT: when they reach the whole process group (Ctrl-C, ``kill -- -PGID``), the
fronts still drain their requests against a running engine."""
