"""``anna.sampling_params``, where vLLM scripts import SamplingParams from (``vllm.sampling_params``)."""

from anna.core.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name, for SamplingParams(guided_decoding=...)

__all__ = ["SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams"]
