"""Settings: one resolver, explicit > env > profile > default, for every field; docs list every field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from anna.cli.main import build_parser, settings_from_args
from anna.core.config import PROFILE, SCHEDULER_PROFILES, ServeSettings, env_name, settings_fields

DOCS = Path(__file__).resolve().parent.parent / "docs" / "tuning.md"


# settings whose values have a structure of their own: a valid value that is not the default
STRUCTURED_SAMPLES = {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 3, '
                                            '"prompt_lookup_max": 4, "prompt_lookup_min": 2}'}


def sample_value(f: dataclasses.Field):
    default = f.metadata["default"]
    if f.name in STRUCTURED_SAMPLES:
        return f.metadata["parse"](STRUCTURED_SAMPLES[f.name])
    if f.metadata.get("choices"):
        return [c for c in f.metadata["choices"] if c != default][0] if len(f.metadata["choices"]) > 1 else default
    if default is PROFILE:
        default = SCHEDULER_PROFILES["throughput"][f.name]
    if isinstance(default, bool):
        return not default
    step = 3 if isinstance(default, int) else 0.5 if isinstance(default, float) else None
    if step is not None:
        maximum = f.metadata["maximum"]
        return default + step if maximum is None or default + step <= maximum else default - step
    return "x-" + str(default)


@pytest.mark.parametrize("f", settings_fields(), ids=lambda f: f.name)
def test_precedence_for_every_field(f):
    value = sample_value(f)
    other = sample_value(f) if isinstance(value, str) and not f.metadata.get("choices") else value
    env = {env_name(f): str(int(value) if isinstance(value, bool) else value)}
    resolved = ServeSettings().resolve(env=env)
    assert getattr(resolved, f.name) == value and resolved.sources[f.name] == "env"
    explicit = ServeSettings(**{f.name: other}).resolve(env={env_name(f): "garbage" if f.metadata.get("choices")
                                                             else env[env_name(f)]})
    assert getattr(explicit, f.name) == other and explicit.sources[f.name] == "cli"
    default = ServeSettings().resolve(env={})
    assert default.sources[f.name] in ("default", "profile")


def test_several_served_model_names():
    """vLLM's form --served-model-name A B, the comma form, and the environment variable."""
    from anna.server.common import served_names

    for argv in (["--served-model-name", "a", "b"], ["--served-model-name", "a,b"]):
        settings = settings_from_args(build_parser().parse_args(["serve", *argv])).resolve(env={})
        assert settings.served_model_name == "a,b" and served_names(settings) == ["a", "b"]
    settings = settings_from_args(build_parser().parse_args(["serve", "/m"])).resolve(
        env={"ANNA_SERVED_MODEL_NAME": "x, y"})
    assert served_names(settings) == ["x", "y"]
    assert served_names(ServeSettings(model="/m").resolve(env={})) == ["/m"]


def test_cli_flag_beats_env():
    args = build_parser().parse_args(["serve", "--max-num-seqs", "7", "--no-enable-prefix-caching"])
    resolved = settings_from_args(args).resolve(env={"ANNA_MAX_NUM_SEQS": "9", "ANNA_ENABLE_PREFIX_CACHING": "1",
                                                     "ANNA_BLOCK_SIZE": "32"})
    assert resolved.max_num_seqs == 7 and resolved.sources["max_num_seqs"] == "cli"
    assert resolved.enable_prefix_caching is False
    assert resolved.block_size == 32 and resolved.sources["block_size"] == "env"


def test_profile_fills_unset_fields_and_explicit_wins():
    r = ServeSettings(scheduler_profile="interactive").resolve(env={})
    assert r.prefill_interval_steps == 1 and r.sources["prefill_interval_steps"] == "profile"
    r = ServeSettings(scheduler_profile="interactive", prefill_interval_steps=9).resolve(env={})
    assert r.prefill_interval_steps == 9
    r = ServeSettings().resolve(env={"ANNA_SCHEDULER_PROFILE": "interactive", "ANNA_BATCH_WAIT_MS": "5"})
    assert r.long_prefill_token_threshold == 256 and r.batch_wait_ms == 5.0


@pytest.mark.parametrize("env, message", [
    ({"ANNA_MAX_NUM_SEQS": "lots"}, "max_num_seqs: 'lots' from ANNA_MAX_NUM_SEQS is not a valid int"),
    ({"ANNA_ENABLE_PREFIX_CACHING": "maybe"}, "enable_prefix_caching: 'maybe'"),
    ({"ANNA_DTYPE": "int3"}, "dtype: 'int3' from ANNA_DTYPE is not one of"),
    ({"ANNA_BLOCK_SIZE": "0"}, "block_size: 0 from ANNA_BLOCK_SIZE must be >= 1"),
    ({"ANNA_MAX_NUM_SEQS": "0"}, "max_num_seqs: 0 from ANNA_MAX_NUM_SEQS must be >= 1"),
    ({"ANNA_MAX_NUM_BATCHED_TOKENS": "0"}, "max_num_batched_tokens: 0 from ANNA_MAX_NUM_BATCHED_TOKENS must be >= 1"),
    ({"ANNA_MEMORY_UTILIZATION": "1.5"}, "memory_utilization: 1.5 from ANNA_MEMORY_UTILIZATION must be <= 1"),
    ({"ANNA_PORT": "99999"}, "port: 99999 from ANNA_PORT must be <= 65535"),
    ({"ANNA_PREFILL_INTERVAL_STEPS": "-1"}, "prefill_interval_steps: -1 from ANNA_PREFILL_INTERVAL_STEPS must be >= 0"),
])
def test_bad_env_values_name_the_field_and_variable(env, message):
    with pytest.raises(ValueError) as exc:
        ServeSettings().resolve(env=env)
    assert str(exc.value).startswith(message)


def test_help_shows_default_and_env_for_every_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in settings_fields():
        assert env_name(f) in text, f.name


def test_every_cli_option_has_help_text():
    """Every option of every subcommand (anna serve, generate, bench serve/dataset/compare) says what it does."""
    import argparse

    def parsers(parser: argparse.ArgumentParser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    missing = [f"{p.prog} {a.option_strings or a.dest}" for p in parsers(build_parser()) for a in p._actions
               if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not missing, missing


def test_tuning_doc_lists_every_setting():
    doc = DOCS.read_text()
    for f in settings_fields():
        assert env_name(f) in doc, f"{f.name} is missing from docs/tuning.md"


def test_torchinductor_cache_dir_rule():
    """A TORCHINDUCTOR_CACHE_DIR the user set is used; the temporary one torch injects on import is not."""
    from anna.core.config import torch_default_inductor_dir

    default = ServeSettings().resolve(env={}).torchinductor_cache_dir
    injected = ServeSettings().resolve(env={"TORCHINDUCTOR_CACHE_DIR": torch_default_inductor_dir()})
    assert injected.torchinductor_cache_dir == default and injected.sources["torchinductor_cache_dir"] == "default"
    user = ServeSettings().resolve(env={"TORCHINDUCTOR_CACHE_DIR": "/data/inductor"})
    assert user.torchinductor_cache_dir == "/data/inductor"
    assert user.sources["torchinductor_cache_dir"] == "env TORCHINDUCTOR_CACHE_DIR"
    anna_env = ServeSettings().resolve(env={"TORCHINDUCTOR_CACHE_DIR": "/data/inductor",
                                            "ANNA_TORCHINDUCTOR_CACHE_DIR": "/anna/inductor"})
    assert anna_env.torchinductor_cache_dir == "/anna/inductor"
    cli = ServeSettings(torchinductor_cache_dir="/cli").resolve(env={"TORCHINDUCTOR_CACHE_DIR": "/data/inductor"})
    assert cli.torchinductor_cache_dir == "/cli"


def test_cpu_kernel_compiler_rule():
    """CC, the compilers' own variable, is the default; Anna's variable and the flag win over it."""
    assert ServeSettings().resolve(env={}).cpu_kernel_compiler == ""
    cc = ServeSettings().resolve(env={"CC": "clang"})
    assert cc.cpu_kernel_compiler == "clang" and cc.sources["cpu_kernel_compiler"] == "env CC"
    anna_env = ServeSettings().resolve(env={"CC": "clang", "ANNA_CPU_KERNEL_COMPILER": "gcc-12"})
    assert anna_env.cpu_kernel_compiler == "gcc-12"
    assert ServeSettings(cpu_kernel_compiler="tcc").resolve(env={"CC": "clang"}).cpu_kernel_compiler == "tcc"


def test_torch_really_injects_the_value_treated_as_unset(tmp_path):
    """The rule above rests on what torch does at import; check it in a clean process."""
    import os
    import subprocess
    import sys

    code = ("import os, torch._inductor.config, torch._inductor.codecache\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
            "cache_dir()\n"
            "from anna.core.config import ServeSettings\n"
            "r = ServeSettings().resolve()\n"
            "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR', ''))\n"
            "print(r.sources['torchinductor_cache_dir'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ANNA_TORCHINDUCTOR_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    injected, source = out.stdout.split()
    assert injected  # torch filled the variable in ...
    assert source == "default"  # ... and Anna did not take it for the user's


def test_vllm_command_lines_parse(caplog):
    args = build_parser().parse_args([
        "serve", "/m", "--gpu-memory-utilization", "0.5", "--trust-remote-code", "--swap-space", "4",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "-tp", "1", "--max-num-seqs", "32"])
    with caplog.at_level("INFO"):
        settings = settings_from_args(args).resolve(env={})
    assert (settings.memory_utilization, settings.max_num_seqs, settings.model) == (0.5, 32, "/m")
    assert "--swap-space has no effect in Anna" in caplog.text and "--trust-remote-code" in caplog.text
    assert settings.tensor_parallel_size == 1
    parsed = settings_from_args(build_parser().parse_args(["serve", "-tp", "2"])).resolve(env={})
    assert (parsed.tensor_parallel_size, parsed.sources["tensor_parallel_size"]) == (2, "cli")
