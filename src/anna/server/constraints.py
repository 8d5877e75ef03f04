"""What an HTTP request asks to constrain its output to, as one StructuredOutputsParams.

Sources, in order: a forced tool call (``tool_choice: "required"`` or a named function), OpenAI's
``response_format``, vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` or their newer form ``structured_outputs: {"json" | "regex" | "choice" | "grammar" |
"json_object": ...}``. A request may use one of them.
"""

from __future__ import annotations

import json

from anna.core.sampling_params import StructuredOutputsParams
from anna.runtime.engine import LLMEngine
from anna.runtime.structured_output import json_schema_of
from anna.server.protocol import APIError, SamplingFields
from anna.server.text_pool import TextPool
from anna.server.tool_parsers import TOOL_GRAMMAR_START

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


# A reasoning model's <think>...</think> block, allowed before the constrained answer; its text is
# free and ends at the first </think> (the rule's stop string), as the reasoning parser reads it.
THINK_FIRST = ('start: think? answer\n'
               'think: WS? "<think>" think_text WS?\n'
               'think_text[stop="</think>"]: /(.|\\n)*/\n'
               'WS: /[ \\t\\r\\n]+/\n')


# The same when the prompt itself opened <think> (Qwen3.5's template): the output starts inside it.
THINK_OPENED = ('start: think answer\n'
                'think: think_text WS?\n'
                'think_text[stop="</think>"]: /(.|\\n)*/\n'
                'WS: /[ \\t\\r\\n]+/\n')


def after_reasoning(spec: StructuredOutputsParams, prompt: str = "none") -> StructuredOutputsParams:
    """The same constraint, applied after an optional reasoning block (--reasoning-parser), or
    after the rest of the one the prompt opened (``prompt``: reasoning.prompt_reasoning; a prompt
    that closed the block leaves the answer alone): JSON answers and forced tool calls; regexes,
    choices and user grammars are left as they are."""
    if prompt == "closed":
        return spec
    head = THINK_OPENED if prompt == "open" else THINK_FIRST
    if spec.json is not None or spec.json_object:
        return StructuredOutputsParams(grammar=head + f"answer: %json {json.dumps(json_schema_of(spec))}\n")
    if spec.grammar is not None and spec.grammar.startswith(TOOL_GRAMMAR_START):
        return StructuredOutputsParams(grammar=head + "answer" + spec.grammar[len("start"):])
    return spec


def request_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The constraint in ``response_format`` or the guided_* fields, and the field to blame for errors."""
    given = [name for name in (*GUIDED_FIELDS, "structured_outputs") if getattr(req, name) is not None]
    fmt = req.response_format
    fmt_type = None
    if fmt is not None:
        fmt_type = fmt.get("type")
        if fmt_type not in ("text", "json_object", "json_schema"):
            raise APIError(400, f"response_format: type must be text, json_object or json_schema (got {fmt_type!r})",
                           param="response_format")
        if fmt_type != "text":
            given.insert(0, "response_format")
    if len(given) > 1:
        raise APIError(400, f"{given[1]}: only one of response_format and guided_* may be given "
                       f"(got {', '.join(given)})", param=given[1])
    if not given:
        return None, ""
    field = given[0]
    try:
        if field == "structured_outputs":
            fields = req.structured_outputs or {}
            unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise ValueError(f"unknown field {unknown[0]!r}")
            return StructuredOutputsParams(**fields), field
        if field != "response_format":
            return StructuredOutputsParams(**{GUIDED_FIELDS[field]: getattr(req, field)}), field
        if fmt_type == "json_object":
            return StructuredOutputsParams(json_object=True), field
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format: json_schema needs {'name': ..., 'schema': {...}}",
                           param="response_format")
        return StructuredOutputsParams(json=spec["schema"]), field
    except ValueError as exc:
        raise APIError(400, f"{field}: {str(exc).split(': ', 1)[-1]}", param=field) from None


async def compile_constraint(pool: TextPool, engine: LLMEngine, spec: StructuredOutputsParams | None,
                             field: str) -> None:
    """Compile (or find in the cache) off the event loop and off the engine thread, so that an
    invalid constraint is a 400 before any response starts and a slow one stalls nobody else."""
    if spec is None:
        return
    try:
        await pool.run(engine.structured.compile, spec, field)
    except ValueError as exc:
        raise APIError(400, str(exc), param=field) from None
