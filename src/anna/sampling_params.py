"""``anna.sampling_params``, where vLLM scripts import SamplingParams from (``vllm.sampling_params``)."""

from anna.core.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
