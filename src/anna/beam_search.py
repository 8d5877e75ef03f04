"""Beam search for LLM.beam_search, as vLLM does it: every step extends each live beam by one
token (a request of one token with the 2 x beam_width likeliest next tokens' logprobs), and keeps
the beam_width likeliest extensions per prompt. All prompts' beams of a step run as one batch; a
beam's earlier tokens come from the prefix cache (the full blocks its parent computed), so a step
computes little more than each beam's last partial block. A beam that ends in EOS is complete; the
answer is the beam_width best of the complete and the live beams, by cumulative logprob divided by
length ** length_penalty (length counting the prompt, as vLLM counts it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from anna.core.outputs import Logprob
from anna.core.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from anna.llm import LLM


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's tokens, then the beam's
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per generated token: the candidates read
    cum_logprob: float = 0.0
    text: str | None = None  # the generated text (without a final EOS), filled in the answer
    finish_reason: str | None = None  # stop (EOS) or length


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


def beam_score(seq: BeamSearchSequence, length_penalty: float) -> float:
    return seq.cum_logprob / (len(seq.tokens) ** length_penalty)


def beam_search(llm: LLM, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """The beam_width best sequences for each prompt (token ids)."""
    engine = llm.llm_engine
    eos = set() if params.ignore_eos else set(engine.inputs.eos_token_ids)
    limit = engine.max_model_len
    step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, detokenize=False,
                          speculative=False, output_kind="final_only")
    live = [[BeamSearchSequence(list(ids))] for ids in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        batch = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not batch:
            break
        outputs = llm.generate([beam.tokens for _, beam in batch], step, use_tqdm=False)
        extensions: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), out in zip(batch, outputs):
            candidates = out.outputs[0].logprobs[0]
            for token, lp in candidates.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                         beam.cum_logprob + lp.logprob)
                if token in eos:
                    new.finish_reason = "stop"
                    done[i].append(new)
                else:
                    extensions[i].append(new)
        for i, found in enumerate(extensions):
            found.sort(key=lambda s: s.cum_logprob, reverse=True)
            live[i] = []
            for beam in found[:params.beam_width]:
                if len(beam.tokens) >= limit:  # no room for another token
                    beam.finish_reason = "length"
                    done[i].append(beam)
                else:
                    live[i].append(beam)
    tok = engine.tokenizer
    answers = []
    for ids, beams, finished in zip(prompts, live, done):
        for beam in beams:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(finished + beams, key=lambda s: beam_score(s, params.length_penalty),
                      reverse=True)[:params.beam_width]
        for beam in best:
            generated = beam.tokens[len(ids):]
            beam.text = tok.decode(generated[:-1] if beam.finish_reason == "stop" else generated)
        answers.append(BeamSearchOutput(best))
    return answers
