"""Load a checkpoint into a model, shard by shard, with a pre-read pipeline.

While the main thread copies one shard into the model (converting dtype, moving to the device),
``weight_load_pipeline_workers`` background threads already read the next shards from disk.
A pre-quantized checkpoint's layers pass through its converter (weights/prequantized.py); a
GGUF model directory (weights/gguf_checkpoint.py) is read tensor by tensor from its one file.
Pickle-based checkpoints (.bin/.pt) are never opened: unpickling runs arbitrary code.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from anna.model.config import ModelConfig, ModelLoadError
from anna.model.ops import ModelOps
from anna.model.registry import model_class
from anna.parallel.collectives import Collectives
from anna.parallel.sharding import TensorParallelShard
from anna.platforms import Platform
from anna.weights import int4_cache as int4_cache_mod
from anna.weights.gguf_checkpoint import GGUF_LM_HEAD_KEY, LINK_NAME, GGUFTensors, describe_conversion
from anna.weights.prequantized import CheckpointConverter, checkpoint_quantization

log = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory, in load order (a GGUF model directory: its file)."""
    if (model_dir / LINK_NAME).exists():
        return [model_dir / LINK_NAME]
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc!r})") from None
        files = [model_dir / n for n in names]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"{model_dir}: only pickle checkpoints found ({', '.join(pickles)}). Anna loads safetensors only, "
            "because unpickling can run arbitrary code; convert the checkpoint to safetensors first")
    raise ModelLoadError(f"{model_dir}: no model.safetensors or model-*-of-*.safetensors found")


def _load_safetensors(model: torch.nn.Module, files: list[Path], cfg: ModelConfig, pipeline_workers: int,
                      show_progress: bool) -> tuple[set[str], list[str]]:
    """Every shard into the model (the next ones read meanwhile); the names loaded and log lines."""
    quant = checkpoint_quantization(cfg.raw, str(files[0].parent / "config.json"))
    converter = CheckpointConverter(quant) if quant is not None else None
    loaded: set[str] = set()
    workers = max(1, pipeline_workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="anna-weights") as pool:
        pending: dict[int, Future] = {}
        bar = tqdm(total=len(files), desc="Loading shards", unit="shard", disable=not show_progress)
        for i in range(len(files)):
            for j in range(i, min(len(files), i + workers + 1)):  # keep the next shards reading
                if j not in pending:
                    pending[j] = pool.submit(_read_shard, files[j])
            tensors = pending.pop(i).result()
            items = converter.convert(tensors.items()) if converter is not None else tensors.items()
            loaded |= model.load_weights(items, str(files[i]))
            del tensors, items
            bar.update(1)
        bar.close()
    return loaded, converter.finish(str(files[0].parent)) if converter is not None else []


def _load_gguf(model: torch.nn.Module, path: Path, cfg: ModelConfig, ops: ModelOps) -> tuple[set[str], list[str]]:
    tensors = GGUFTensors(path.resolve(), cfg.raw)
    loaded = model.load_weights(tensors, str(path.resolve()))
    q = ops.quant
    lm_head = (cfg.raw[GGUF_LM_HEAD_KEY], q.lm_head_method, q.group_size(q.lm_head_method)) if q.lm_head_method \
        else None
    notes = describe_conversion(tensors.types, q.method, q.group_size(q.method), lm_head)
    if tensors.skipped:
        notes.append(f"GGUF tensors not loaded: {', '.join(tensors.skipped)}")
    return loaded, notes


def _read_shard(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from None


@dataclass(frozen=True)
class TensorParallelLoad:
    """Which rank's share to load, and the collectives its layers sum and gather through."""

    shard: TensorParallelShard
    comm: Collectives


@dataclass
class Int4CacheOptions:
    enabled: bool = True
    directory: str = ""  # empty: {model}/.anna/int4_cache
    load_workers: int = 8
    user_cache_dir: str = "~/.cache/anna"


def load_model(model_dir: str | Path, cfg: ModelConfig, *, dtype: torch.dtype, platform: Platform, ops: ModelOps,
               max_positions: int, pipeline_workers: int = 2, activation_dtype: torch.dtype | None = None,
               show_progress: bool = True, int4_cache: Int4CacheOptions | None = None,
               huge_pages: bool = False, tensor_parallel: TensorParallelLoad | None = None) -> torch.nn.Module:
    """Build the registry's model class for the config's architecture, with ``ops``, and fill it.
    ``huge_pages``: on CPU, the loaded weights move onto transparent huge pages. ``tensor_parallel``:
    build and load only this rank's share (parallel/sharding.py)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    start = time.perf_counter()
    device = platform.device
    shard = tensor_parallel.shard if tensor_parallel is not None else None
    with torch.device(device):
        model = model_class(cfg.architecture)(shard.local_config(cfg) if shard else cfg, dtype, max_positions, ops,
                                              activation_dtype)
    if shard is not None:
        shard.apply(model, cfg, tensor_parallel.comm)
    entry = None
    cache = int4_cache or Int4CacheOptions()
    if ops.quant.method == "int4" and cache.enabled:
        root = int4_cache_mod.cache_root(model_dir, cache.directory, cache.user_cache_dir)
        entry = root / int4_cache_mod.cache_key(files, ops.quant.int4_group_size, platform.capability(),
                                                platform.kernel_layout(ops),
                                                (*(("mtp",) if cfg.load_mtp else ()),
                                                 *((f"lm_head:{ops.quant.lm_head_method}:{ops.quant.int8_group_size}",)
                                                   if ops.quant.lm_head_method else ()),
                                                 *((f"tp:{shard.rank}/{shard.size}",) if shard else ())))
        state = int4_cache_mod.load_entry(entry, cache.load_workers)
        if state is not None:
            model.load_state_dict(state, strict=True)
            model.interleave_for_cpu_kernels(converted=True)
            log.info("Loaded the int4 layout from %s in %.2f s", entry, time.perf_counter() - start)
            platform.place_weights(model, huge_pages)
            return model
    needed = set(model.checkpoint_targets())
    if files[0].name == LINK_NAME:
        loaded, notes = _load_gguf(model, files[0], cfg, ops)
    else:
        loaded, notes = _load_safetensors(model, files, cfg, pipeline_workers, show_progress)
    missing = sorted(needed - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{model_dir}: checkpoint is missing tensors: {shown}")
    for line in [*notes, *model.skipped_parts()]:
        log.info("%s", line)
    elapsed = time.perf_counter() - start
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers(recurse=True)]}.values()
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    log.info("Loaded %d shard(s), %.1f MiB of weights on %s in %.2f s", len(files), nbytes / 2**20, device, elapsed)
    model.interleave_for_cpu_kernels()
    if entry is not None:
        try:
            int4_cache_mod.save_entry(entry, model.state_dict(), cache.load_workers)
            log.info("Saved the int4 layout cache to %s", entry)
        except OSError as exc:
            log.warning("Could not write the int4 layout cache to %s (%s)", entry, exc)
    platform.place_weights(model, huge_pages)
    return model
