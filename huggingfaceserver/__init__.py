"""huggingfaceserver: serve Hugging Face models over KServe V1/V2 and OpenAI-compatible APIs."""

__version__ = "0.1.0"
