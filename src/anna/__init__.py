"""Anna: an LLM inference server you can read, tune and trust."""

from anna.beam_search import BeamSearchOutput, BeamSearchSequence
from anna.core.outputs import CompletionOutput, RequestOutput
from anna.core.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams
from anna.inputs import TextPrompt, TokensPrompt
from anna.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"
