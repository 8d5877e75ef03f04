"""The ``anna`` command. Engine flags are generated from ServeSettings, so every tunable has a
flag, an ``ANNA_*`` variable and a default, all shown by ``--help``."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from anna.core.config import (IGNORED_VLLM_ARGS, PROFILE, RENAMED_VLLM_ARGS, ServeSettings, alias_names,
                              env_name, field_type, settings_fields)


SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}  # vLLM's


def add_settings_flags(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    group = parser.add_argument_group("engine settings (flag > ANNA_* environment variable > default)")
    for f in settings_fields():
        if f.name in skip or not f.metadata.get("cli", True):
            continue
        default = f.metadata["default"]
        shown = "from --scheduler-profile" if default is PROFILE else repr(default)
        aliases = "".join(f", also --{a.replace('_', '-')} / ANNA_{a.upper()}" for a in alias_names(f))
        help_text = f"{f.metadata['help']} [default: {shown}; env: {env_name(f)}{aliases}]"
        flags = ["--" + name.replace("_", "-") for name in
                 [f.name] + [old for old, new in RENAMED_VLLM_ARGS.items() if new == f.name] + list(alias_names(f))]
        flags += SHORT_FLAGS.get(f.name, [])
        typ = field_type(f)
        if typ is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, type=typ, default=None, choices=f.metadata.get("choices"),
                               help=help_text, metavar=None if f.metadata.get("choices") else f.name.upper(),
                               nargs="+" if f.metadata.get("several") else None)
    vllm = parser.add_argument_group(
        "vLLM flags", "Accepted so that vLLM command lines run unchanged: --gpu-memory-utilization (= "
        "--memory-utilization), and, with no effect in Anna, " +
        ", ".join("--" + name.replace("_", "-") + (" VALUE" if takes_value else "")
                  for name, takes_value in IGNORED_VLLM_ARGS.items()) + ".")
    for name, takes_value in IGNORED_VLLM_ARGS.items():
        flag = "--" + name.replace("_", "-")
        if takes_value:
            vllm.add_argument(flag, dest=f"vllm_{name}", default=None, metavar="VALUE", help=argparse.SUPPRESS)
        else:
            vllm.add_argument(flag, dest=f"vllm_{name}", action="store_true", default=None, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    if getattr(args, "model_pos", None):
        args.model = args.model_pos
    for name in IGNORED_VLLM_ARGS:
        if getattr(args, f"vllm_{name}", None) is not None:
            logging.getLogger(__name__).info("--%s has no effect in Anna", name.replace("_", "-"))
    values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServeSettings)}
    return ServeSettings(**{name: ",".join(v) if isinstance(v, list) else v for name, v in values.items()})


def cmd_generate(args: argparse.Namespace) -> int:
    from anna.core.sampling_params import SamplingParams
    from anna.runtime.engine import LLMEngine

    engine = LLMEngine(settings_from_args(args).resolve(), show_progress=not args.quiet)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
                            stop=args.stop or None)
    engine.add_request("cli", args.prompt, params)
    printed = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.error is not None:
                raise out.error.as_exception()
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args).resolve()
    if settings.node_rank > 0:  # a tensor-parallel node that only runs its ranks; node 0 serves
        from anna.runtime.builder import serve_node_ranks

        return serve_node_ranks(settings)
    from anna.server.http_server import serve

    return serve(settings)


def cmd_tune(args: argparse.Namespace) -> int:
    """Measure the host's routing thresholds for this model again and store them (calibrate)."""
    from anna.runtime.builder import build_engine_parts

    settings = settings_from_args(args)
    parts = build_engine_parts(settings.resolve(), show_progress=not args.quiet, recalibrate=True)
    if parts.calibration is None:
        print(f"anna tune: nothing calibrated on {parts.platform.name} (see the log)", file=sys.stderr)
        return 1
    from anna.platforms.cpu.calibration import report

    print(report(parts.calibration))
    print("Used now (a flag or ANNA_* value wins over the calibrated one):")
    for name in parts.calibration.measurements:
        print(f"  {name} = {getattr(parts.settings, name)!r} ({parts.settings.sources[name]})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anna", description="Anna: an LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="Complete one prompt and print the text.",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("model_pos", nargs="?", metavar="MODEL", help="Model directory (default: the demo model).")
    gen.add_argument("--prompt", required=True, help="The text to complete (no chat template).")
    gen.add_argument("--max-tokens", type=int, default=64, help="Most tokens to generate.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy.")
    gen.add_argument("--top-p", type=float, default=1.0, help="Sample from the smallest set of tokens this likely.")
    gen.add_argument("--top-k", type=int, default=0, help="Sample from the k likeliest tokens; 0 = all.")
    gen.add_argument("--sampling-seed", type=int, default=None, help="Seed of this request's sampling.")
    gen.add_argument("--stop", action="append", help="A stop string (repeat the flag for several).")
    gen.add_argument("--ignore-eos", action="store_true", help="Generate max_tokens even past end-of-sequence.")
    gen.add_argument("--quiet", action="store_true", help="No progress bars or logs.")
    add_settings_flags(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.")
    serve.add_argument("model_pos", nargs="?", metavar="MODEL", help="Model directory (default: the demo model).")
    add_settings_flags(serve)
    serve.set_defaults(func=cmd_serve)

    tune = sub.add_parser("tune", help="Measure this host's matmul routing thresholds and prefill chunk size for a "
                                       "model again (as the first start on a new host does) and store them.")
    tune.add_argument("model_pos", nargs="?", metavar="MODEL", help="Model directory (default: the demo model).")
    tune.add_argument("--quiet", action="store_true", help="No progress bars or logs.")
    add_settings_flags(tune)
    tune.set_defaults(func=cmd_tune)

    from anna.bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = "warning" if getattr(args, "quiet", False) else (getattr(args, "log_level", None) or "info")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as exc:  # configuration and input errors: one clear line, no traceback
        print(f"anna: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
