"""Anna: an LLM inference server you can read, tune and trust."""

from anna.core.outputs import CompletionOutput, RequestOutput
from anna.core.sampling_params import SamplingParams
from anna.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
