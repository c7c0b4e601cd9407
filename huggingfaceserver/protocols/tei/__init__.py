"""text-embeddings-inference's HTTP API: its routes, bodies and response shapes, on the served
encoder model."""
