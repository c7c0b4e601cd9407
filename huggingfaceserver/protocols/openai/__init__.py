"""OpenAI-compatible API: request and response models, errors."""
