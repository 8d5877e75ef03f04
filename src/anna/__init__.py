"""Anna: an LLM inference server you can read, tune and trust."""

from anna.core.outputs import CompletionOutput, RequestOutput
from anna.core.sampling_params import SamplingParams, StructuredOutputsParams
from anna.inputs import TextPrompt, TokensPrompt
from anna.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt"]
__version__ = "0.1.0"
