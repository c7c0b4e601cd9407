"""huggingfaceserver: serve Hugging Face models over KServe V1/V2 and OpenAI-compatible APIs."""

from . import _kserve  # noqa: F401 - first, so kserve never parses our argv

__version__ = "0.1.0"
