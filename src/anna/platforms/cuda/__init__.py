"""NVIDIA GPUs: device memory from the driver, captured CUDA graphs for decode (graphs.py)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from anna.model.ops import ModelOps
from anna.platforms.base import Platform, no_graph_reason

log = logging.getLogger(__name__)


class CudaPlatform(Platform):
    name = "cuda"

    def capability(self) -> str:
        major, minor = torch.cuda.get_device_capability(self.device)
        return f"cuda-sm{major}{minor}"

    def decode_executor(self, choice: str, model: torch.nn.Module, ops: ModelOps, *, profiling: bool,
                        max_num_seqs: int, max_model_len: int, block_size: int) -> Any:
        """Captured graphs when asked for (auto stays eager until a GPU measurement says otherwise)."""
        if choice != "graph":
            return None
        why = no_graph_reason(profiling, model)
        if why is None and getattr(model.config, "linear_attention", None) is not None:
            why = "per-sequence state layers (Gated DeltaNet) are not captured"
        if why is not None:
            log.warning("decode_executor=graph: %s; running eager", why)
            return None
        from anna.platforms.cuda.graphs import GraphDecoder

        return GraphDecoder(model.forward, block_size=block_size, max_num_seqs=max_num_seqs,
                            max_model_len=max_model_len, device=self.device, capture=True)
