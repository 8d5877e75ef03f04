"""Seeded "production-like" datasets for load mode: multi-turn conversations that grow turn by
turn (each turn's prompt extends the previous one), long system prompts shared across
conversations, tool definitions, assistant tool calls and tool results, and a cap on the
(estimated) tokens of each request."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = ["billing", "shipping", "returns", "accounts", "security", "analytics", "scheduling", "inventory"]
VERBS = ["check", "update", "summarize", "compare", "explain", "list", "cancel", "verify"]
FILLER = ("policy clause section customer order record ticket window region contract invoice schedule "
          "priority escalation audit threshold quota ledger").split()
TOOLS = [
    {"type": "function", "function": {"name": "lookup_order", "description": "Find an order by id",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]


def estimate_tokens(messages: list[dict]) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages) // 4


def system_prompt(rng: random.Random, index: int, words: int) -> str:
    body = " ".join(rng.choice(FILLER) for _ in range(words))
    return f"You are support agent #{index} of Example Corp. Follow every rule below.\n{body}"


def generate(seed: int, conversations: int, turns: int, system_prompts: int = 3, system_words: int = 600,
             max_tokens_per_request: int = 4096, answer_tokens: int = 128, tool_fraction: float = 0.3) -> list[dict]:
    rng = random.Random(seed)
    systems = [system_prompt(rng, i, system_words) for i in range(system_prompts)]
    rows = []
    for c in range(conversations):
        use_tools = rng.random() < tool_fraction
        messages = [{"role": "system", "content": systems[c % len(systems)]}]
        for t in range(turns):
            question = f"Please {rng.choice(VERBS)} the {rng.choice(TOPICS)} case {rng.randrange(10**4)} for me."
            turn = messages + [{"role": "user", "content": question}]
            if estimate_tokens(turn) + answer_tokens > max_tokens_per_request:
                break
            row = {"conversation": c, "turn": t, "messages": turn, "max_tokens": answer_tokens}
            if use_tools:
                row["tools"] = TOOLS
            rows.append(row)
            # what the conversation looks like when the next turn is sent
            messages = list(turn)
            if use_tools and t % 2 == 0:
                call_id = f"call_{c}_{t}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": "lookup_order", "arguments": json.dumps({"order_id": f"A{rng.randrange(10**6)}"})}}]})
                messages.append({"role": "tool", "tool_call_id": call_id,
                                 "content": json.dumps({"status": rng.choice(["shipped", "pending", "delivered"])})})
            else:
                messages.append({"role": "assistant", "content": " ".join(rng.choice(FILLER) for _ in range(40))})
    return rows


def write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
