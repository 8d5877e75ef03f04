"""The seams the engine is built from: the registry, cache specs and their managers, settings
sections and aliases."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from anna.core.config import ALIASES, SECTION_FIELDS, ServeSettings
from anna.core.request import Request
from anna.core.sampling_params import SamplingParams
from anna.model.cache_spec import AttentionSpec, StateSpec, StateTensor
from anna.model.registry import ARCHITECTURES, model_class
from anna.platforms.cpu import CpuPlatform
from anna.runtime.cache_managers import CacheManagers
from anna.runtime.kv_cache import KVCacheManager
from anna.runtime.model_runner import allocate_caches
from anna.runtime.state_cache import StateCacheManager


def test_every_architecture_resolves_to_a_model_class_that_declares_its_caches():
    from anna.model.llama import LlamaForCausalLM

    assert model_class("Qwen2ForCausalLM") is LlamaForCausalLM
    for arch in ARCHITECTURES:
        cls = model_class(arch)
        assert callable(getattr(cls, "cache_specs", None)), arch


def test_llama_family_declares_paged_kv_per_layer(qwen2_dir, cache_dir):
    from anna import LLM

    engine = LLM(str(qwen2_dir), dtype="float32", device="cpu", cache_dir=str(cache_dir), max_model_len=64,
                 num_gpu_blocks_override=8).llm_engine
    cfg = engine.model_config
    specs = engine.runner.specs
    assert specs == [AttentionSpec(cfg.num_key_value_heads, cfg.head_dim, torch.float32, cfg.sliding_window)] \
        * cfg.num_hidden_layers
    assert engine.cache_plan.bytes_per_token == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert engine.cache_plan.bytes_per_sequence == 0 and engine.runner.caches.state is None


def test_caches_are_allocated_per_layer_as_declared():
    specs = [AttentionSpec(2, 8, torch.float32), StateSpec((StateTensor("h", (3, 4), torch.bfloat16),))]
    caches = allocate_caches(specs, CpuPlatform(torch.device("cpu")), num_blocks=5, block_size=16, num_slots=7,
                             zero=True)
    k, v = caches[0]
    assert k.shape == v.shape == (5, 2, 16, 8) and k.dtype == torch.float32
    assert caches[1]["h"].shape == (7, 3, 4) and caches[1]["h"].dtype == torch.bfloat16


def _request(i: int) -> Request:
    return Request(f"r{i}", list(range(10)), SamplingParams())


def test_state_slots_are_held_while_running_and_allocation_fails_as_a_value():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    caches = CacheManagers(kv, StateCacheManager(2))
    a, b, c = (_request(i) for i in range(3))
    assert caches.allocate_slots(a, 10) and caches.allocate_slots(b, 10)
    assert caches.state.slot("r0") != caches.state.slot("r1")
    assert caches.allocate_slots(a, 1)  # a running sequence keeps its slot
    free_blocks = kv.num_free_blocks
    assert not caches.allocate_slots(c, 1)  # no slot left: nothing changes
    assert kv.num_free_blocks == free_blocks and "r2" not in caches.state.slots
    caches.free(a)
    assert caches.allocate_slots(c, 1) and caches.state.num_free == 0
    caches.free(b), caches.free(c)
    assert caches.state.num_free == 2 and kv.num_free_blocks == kv.num_blocks


def test_a_state_slot_is_given_back_when_kv_blocks_run_out():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    caches = CacheManagers(kv, StateCacheManager(4))
    assert not caches.allocate_slots(_request(0), 100)
    assert caches.state.num_free == 4 and kv.num_free_blocks == 2


def test_a_model_with_state_layers_takes_prefix_hits_only_where_a_state_was_saved():
    """A cached KV prefix does not restore a recurrent state: without snapshots such a model
    computes from the start; with them, a hit ends at the last block whose state was saved."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _request(0)
    assert kv.allocate_slots(first, 10)
    kv.free(first)  # its two full blocks stay cached
    assert kv.get_computed_blocks(_request(1))[1] == 8
    assert CacheManagers(kv, StateCacheManager(2)).get_computed_blocks(_request(1)).num_tokens == 0
    caches = CacheManagers(kv, StateCacheManager(2, num_snapshots=2))
    assert caches.get_computed_blocks(_request(1)).num_tokens == 0  # no state saved yet
    second = _request(1)
    assert caches.allocate_slots(second, 4)
    save = caches.plan_save(second, 0, 4)  # a chunk ending on the first block boundary
    assert save is not None and save.dst >= 2  # a snapshot slot, after the running sequences' slots
    caches.saved(save, True)
    caches.free(second)
    hit = caches.get_computed_blocks(_request(1))
    assert hit.num_tokens == 4 and hit.state_snapshot == save.dst
    third = _request(1)
    assert caches.allocate_slots(third, 8)
    failed = caches.plan_save(third, 0, 8)  # planned, but its step failed: nothing kept
    caches.saved(failed, False)
    caches.free(third)
    assert caches.get_computed_blocks(_request(1)).num_tokens == 4


def test_every_setting_belongs_to_exactly_one_section():
    names = [f.name for f in dataclasses.fields(ServeSettings)]
    listed = [n for fields in SECTION_FIELDS.values() for n in fields]
    assert sorted(listed) == sorted(names)
    sections = ServeSettings(block_size=32, cpu_gemv_max_rows=16).resolve(env={}).sections
    assert sections.cache.block_size == 32 and sections.cpu.cpu_gemv_max_rows == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        sections.cache.block_size = 8


@pytest.mark.parametrize("env, field, value", [
    ({"ANNA_XPU_INT4_MATMUL": "packed"}, "int4_matmul", "packed"),
    ({"ANNA_XPU_INT4_GEMV_M_THRESHOLD": "64"}, "int4_gemv_m_threshold", 64),
    ({"ANNA_XPU_INT4_CACHE_LOAD_WORKERS": "3"}, "int4_cache_load_workers", 3),
    ({"ANNA_XPU_DISABLE_INT4_CACHE": "1"}, "disable_int4_cache", True),
])
def test_the_founding_manuals_names_are_aliases(env, field, value):
    resolved = ServeSettings().resolve(env=env)
    assert getattr(resolved, field) == value and next(iter(env)) in resolved.sources[field]
    # the primary name wins over the alias
    primary = "ANNA_" + field.upper()
    assert getattr(ServeSettings().resolve(env={**env, primary: str(value if value is not True else 0)}),
                   field) == (value if value is not True else False)


def test_alias_flags_and_keywords():
    import argparse

    from anna.cli.main import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    args = parser.parse_args(["--xpu-int4-matmul", "dequant", "--xpu-int4-gemv-m-threshold", "7",
                              "--xpu-int4-cache-load-workers", "2", "--xpu-disable-int4-cache"])
    s = settings_from_args(args).resolve(env={})
    assert (s.int4_matmul, s.int4_gemv_m_threshold, s.int4_cache_load_workers, s.disable_int4_cache) == \
        ("dequant", 7, 2, True)
    assert ALIASES["xpu_int4_matmul"] == "int4_matmul"
