"""Split ``<think>...</think>`` reasoning from the answer, whole or while streaming.

Output that starts (after optional whitespace) with ``<think>`` is reasoning until ``</think>``;
anything else is content. Some chat templates (Qwen3.5's) write the block's start into the
prompt: then the output starts inside the reasoning and only ``</think>`` appears ("open"); with
thinking turned off they write a whole empty block, and the output is the answer ("closed").
Text that could still turn into a tag is held back until decided.
"""

from __future__ import annotations

from anna.server.tool_parsers import _longest_partial_suffix


class ThinkReasoningParser:
    START, END = "<think>", "</think>"

    def __init__(self, prompt: str = "none") -> None:
        """``prompt``: what the prompt left (prompt_reasoning): none, open or closed."""
        # start -> reasoning -> after_end -> content, or start -> content
        self.state = {"none": "start", "open": "reasoning", "closed": "content"}[prompt]
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Consume new text; return (reasoning delta, content delta)."""
        self.buffer += delta
        reasoning = content = ""
        if self.state == "start":
            stripped = self.buffer.lstrip()
            if stripped.startswith(self.START):
                self.buffer = stripped[len(self.START):]
                self.state = "reasoning"
            elif self.START.startswith(stripped):
                return "", ""  # undecided
            else:
                self.state = "content"
        if self.state == "reasoning":
            idx = self.buffer.find(self.END)
            if idx == -1:
                keep = _longest_partial_suffix(self.buffer, self.END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning = self.buffer[:idx]
            self.buffer = self.buffer[idx + len(self.END):]
            self.state = "after_end"
        if self.state == "after_end":  # drop the newlines between </think> and the answer
            self.buffer = self.buffer.lstrip("\n")
            if self.buffer:
                self.state = "content"
        if self.state == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return rest, ""
        return "", rest


def prompt_reasoning(prompt: str) -> str:
    """What a rendered prompt leaves the output to do: "open" (it ends inside a reasoning block:
    its last <think> is not closed), "closed" (it ends with a whole block: the output is the
    answer), or "none" (the output may start a block of its own)."""
    start = prompt.rfind(ThinkReasoningParser.START)
    if start != -1 and prompt.find(ThinkReasoningParser.END, start) == -1:
        return "open"
    return "closed" if prompt.rstrip().endswith(ThinkReasoningParser.END) else "none"


REASONING_PARSERS = {"think": ThinkReasoningParser, "qwen3": ThinkReasoningParser,
                     "deepseek_r1": ThinkReasoningParser}
