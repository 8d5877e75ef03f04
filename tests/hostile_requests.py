"""Hand-written hostile and sloppy requests, one class of each attack or mistake seen against
servers like Anna. Each is (name, path, raw body bytes); the server must answer every one with a
2xx or OpenAI's error JSON with a 4xx, stay up, and serve the next request unchanged.

Shared by tests/test_server_hardening.py and benchmarks/soak.py.
"""

from __future__ import annotations

import json

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
MSG = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def hostile_requests() -> list[tuple[str, str, bytes]]:
    """Every case; small enough to run in seconds against a tiny model (max_tokens stays low)."""
    cases: list[tuple[str, str, bytes]] = []

    def add(name: str, path: str, body: bytes | dict) -> None:
        if isinstance(body, dict):
            body = _j({"max_tokens": 3, **body}) if path in (CHAT, COMPLETIONS) else _j(body)
        cases.append((name, path, body))

    # bodies that are not what a route takes
    for name, raw in [("empty", b""), ("not json", b"{nope"), ("json list", b"[1, 2]"), ("json string", b'"x"'),
                      ("json null", b"null"), ("json number", b"5"), ("truncated", b'{"prompt": "a'),
                      ("invalid utf-8", b"\xff\xfe{}"), ("invalid utf-8 in a string", b'{"prompt": "\xc3("}'),
                      ("utf-16", '{"prompt": "a"}'.encode("utf-16")), ("nul bytes", b'{"prompt": "a\x00"}')]:
        for path in (CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE):
            add(f"{name} ({path})", path, raw)
    # non-finite and oversized numbers
    for name, raw in [("NaN literal", b'{"prompt": "a", "temperature": NaN}'),
                      ("Infinity literal", b'{"prompt": "a", "repetition_penalty": Infinity}'),
                      ("-Infinity literal", b'{"prompt": "a", "presence_penalty": -Infinity}'),
                      ("1e999", b'{"prompt": "a", "top_p": 1e999}'),
                      ("NaN in logit_bias", b'{"prompt": "a", "logit_bias": {"5": NaN}}'),
                      ("5000-digit integer", b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}"),
                      ("1000-digit max_tokens", b'{"prompt": "a", "max_tokens": ' + b"9" * 1000 + b"}"),
                      ("30-digit n", b'{"prompt": "a", "n": ' + b"9" * 30 + b"}"),
                      ("30-digit top_k", b'{"prompt": "a", "max_tokens": 2, "top_k": ' + b"9" * 30 + b"}"),
                      ("huge token id", b'{"prompt": [' + b"9" * 40 + b"]}"),
                      ("huge stop token id", b'{"prompt": "a", "max_tokens": 2, "stop_token_ids": [' + b"9" * 40 + b"]}"),
                      ("huge allowed id", b'{"prompt": "a", "allowed_token_ids": [' + b"9" * 40 + b"]}"),
                      ("huge logit_bias key", b'{"prompt": "a", "logit_bias": {"' + b"9" * 40 + b'": 1}}'),
                      ("negative logit_bias key", b'{"prompt": "a", "logit_bias": {"-3": 1}}')]:
        add(name, COMPLETIONS, raw)
    add("huge detokenize id", DETOKENIZE, b'{"tokens": [' + b"9" * 40 + b"]}")
    for value in ("inf", "-inf", "nan", "1e999"):
        add(f"temperature {value!r} as a string", COMPLETIONS, {"prompt": "a", "temperature": value})
        add(f"repetition_penalty {value!r} as a string", COMPLETIONS, {"prompt": "a", "repetition_penalty": value})
    # deep nesting
    for depth in (70, 5000, 100_000):
        add(f"nested {depth} deep as the prompt", COMPLETIONS, b'{"prompt": ' + _nested(depth) + b"}")
        add(f"nested {depth} deep in chat_template_kwargs", CHAT,
            b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": ' + _nested(depth) + b"}}")
    schema: dict = {"type": "object"}
    for _ in range(80):
        schema = {"type": "object", "properties": {"a": schema}}
    add("schema nested 80 deep", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    # lone UTF-16 surrogates, which no UTF-8 encoder can carry
    for where, body in [("prompt", b'{"prompt": "a\\ud800b"}'),
                        ("chat content", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
                        ("bad_words", b'{"prompt": "a", "bad_words": ["\\ud800"]}'),
                        ("stop", b'{"prompt": "a", "stop": ["\\udbff"]}'),
                        ("model", b'{"prompt": "a", "model": "\\ud800"}'),
                        ("a key", b'{"prompt": "a", "\\ud800": 1}'),
                        ("logit_bias key", b'{"prompt": "a", "logit_bias": {"\\ud800": 1}}'),
                        ("a surrogate pair split across fields", b'{"prompt": "\\ud83d", "suffix": "\\ude00"}')]:
        add(f"lone surrogate in {where}", CHAT if "chat" in where else COMPLETIONS, body)
    add("lone surrogate in /tokenize", TOKENIZE, b'{"prompt": "\\ud800"}')
    add("lone surrogate in /tokenize messages", TOKENIZE, b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    add("lone surrogate in a tool name", CHAT,
        b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "\\ud800"}}]}')
    # tool_choice of every wrong shape
    for choice in ({"type": "function", "function": "get_weather"}, {"type": "function"}, {"function": {}},
                   {"function": {"name": 5}}, {"function": {"name": "nope"}}, "sometimes", 5, ["auto"], {"name": "x"}):
        add(f"tool_choice {json.dumps(choice)}", CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": choice})
    add("tool_choice required without tools", CHAT, {"messages": MSG, "tool_choice": "required"})
    add("tools not a list", CHAT, {"messages": MSG, "tools": {"type": "function"}})
    add("tool without a name", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {}}]})
    add("tool call arguments not JSON", CHAT, {"messages": [
        {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{not"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}]})
    # chat template variables that clash with the template call's own
    for key in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                "namespace", "range", "__class__"):
        add(f"chat_template_kwargs {key!r}", CHAT, {"messages": MSG, "chat_template_kwargs": {key: 1}})
    add("chat_template_kwargs not an object", CHAT, {"messages": MSG, "chat_template_kwargs": [1]})
    # content parts
    for part in ({"type": 5}, {"type": ["text"]}, {"type": {"a": 1}}, {"type": None}, {}, {"type": "text"},
                 {"type": "text", "text": 5}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "bogus"}):
        add(f"content part {json.dumps(part)}", CHAT, {"messages": [{"role": "user", "content": [part]}]})
    add("content parts not objects", CHAT, {"messages": [{"role": "user", "content": ["text", 5]}]})
    add("messages empty", CHAT, {"messages": []})
    add("messages not a list", CHAT, {"messages": "hi"})
    add("role unknown", CHAT, {"messages": [{"role": "wizard", "content": "x"}]})
    add("message without role", CHAT, {"messages": [{"content": "x"}]})
    # structured output
    for xg in ("yes", [1], 5, None):
        add(f"x-guidance {json.dumps(xg)}", CHAT, {"messages": MSG, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "x-guidance": xg}}}})
    add("guided_json x-guidance string", COMPLETIONS, {"prompt": "a", "guided_json": {"type": "object",
                                                                                    "x-guidance": "no"}})
    add("response_format not an object", CHAT, {"messages": MSG, "response_format": "json"})
    add("response_format type unknown", CHAT, {"messages": MSG, "response_format": {"type": "yaml"}})
    add("json_schema without schema", CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}})
    add("exploding regex", COMPLETIONS, {"prompt": "a", "guided_regex": "(a{1000}){1000}"})
    add("invalid regex", COMPLETIONS, {"prompt": "a", "guided_regex": "(("})
    add("invalid grammar", COMPLETIONS, {"prompt": "a", "guided_grammar": "start: ((("})
    add("empty choice", COMPLETIONS, {"prompt": "a", "guided_choice": []})
    add("two constraints", COMPLETIONS, {"prompt": "a", "guided_regex": "a", "guided_choice": ["a"]})
    add("structured_outputs unknown field", COMPLETIONS, {"prompt": "a", "structured_outputs": {"yaml": 1}})
    # sampling values at and past their limits
    for name, value in [("repetition_penalty", 1e-300), ("repetition_penalty", 1e-45), ("repetition_penalty", 1e300),
                        ("repetition_penalty", 0), ("temperature", 1e-300), ("temperature", 2), ("top_p", 1e-300),
                        ("min_p", 1), ("top_k", -2), ("presence_penalty", 2), ("frequency_penalty", -2),
                        ("max_tokens", 0), ("max_tokens", -1), ("n", 0), ("n", 1000), ("min_tokens", 400),
                        ("logprobs", 21), ("seed", -(2**63) - 1), ("seed", 2**64), ("truncate_prompt_tokens", 0)]:
        add(f"{name}={value!r}", COMPLETIONS, {"prompt": "hello", name: value, "temperature": 1.0, "seed": 1}
            if name not in ("temperature", "seed") else {"prompt": "hello", name: value})
    add("allowed_token_ids all bad words", COMPLETIONS,
        {"prompt": "a", "allowed_token_ids": [67], "bad_words": ["a"], "temperature": 1})
    add("allowed_token_ids empty", COMPLETIONS, {"prompt": "a", "allowed_token_ids": []})
    add("bad_words empty string", COMPLETIONS, {"prompt": "a", "bad_words": [""]})
    add("logit_bias not numbers", COMPLETIONS, {"prompt": "a", "logit_bias": {"5": "x"}})
    add("logit_bias -inf via -1e999", COMPLETIONS, b'{"prompt": "a", "logit_bias": {"5": -1e999}}')
    add("stop not strings", COMPLETIONS, {"prompt": "a", "stop": [5]})
    add("stream_options not an object", COMPLETIONS, {"prompt": "a", "stream": True, "stream_options": 5})
    add("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 3})
    # prompts
    for prompt in ("", [], [[]], [-1], [1, "a"], [[1], "a"], None, {"a": 1}, [800, 10**6]):
        add(f"prompt {json.dumps(prompt)}", COMPLETIONS, {"prompt": prompt})
    add("prompt past max_model_len", COMPLETIONS, {"prompt": list(range(3, 603))})
    add("suffix", COMPLETIONS, {"prompt": "a", "suffix": "b"})
    add("best_of", COMPLETIONS, {"prompt": "a", "best_of": 3})
    add("tokenize neither prompt nor messages", TOKENIZE, {})
    add("detokenize not ints", DETOKENIZE, {"tokens": ["a"]})
    add("detokenize negative", DETOKENIZE, {"tokens": [-1]})
    add("tokenize prompt not a string", TOKENIZE, {"prompt": 5})
    return cases


def runtime_failure_request(tokenizer_letter_ids: tuple[int, int]) -> dict:
    """A completion whose bans leave no token at its second step (known only while it runs):
    allowed {a, b}, bad_words "a" and "bb"; given the ids of a and b."""
    a, b = tokenizer_letter_ids
    return {"prompt": "x", "max_tokens": 6, "temperature": 1.0, "allowed_token_ids": [a, b], "bad_words": ["a", "bb"]}
