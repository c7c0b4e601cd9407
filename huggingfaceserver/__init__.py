"""huggingfaceserver: serve Hugging Face models over KServe V1/V2 and OpenAI-compatible APIs."""

from ._kserve import import_kserve

import_kserve()  # first: KServe parses sys.argv when imported, and must not parse ours

__version__ = "0.1.0"
