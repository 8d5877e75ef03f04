"""Synthetic tasks for the built-in demo model: what it is trained on and what its quality is measured on.

Each task is a chat (a user message and the answer the model should give), seeded, with no data to
download:

- ``retrieval``: the archive of ``anna bench``'s passcode scenarios (the same record lines, the same
  question), with the passcode line at any depth. The answer is the passcode.
- ``copy``: a passage of words to repeat exactly: the workload of n-gram and draft speculation.
- ``edit``: the same passage with every occurrence of one word replaced by another.
- ``arithmetic``: the sum of two numbers below 100, as ``anna bench``'s warm-up question asks.

``benchmarks/train_tiny_model.py`` trains on them and ``benchmarks/quality_bench.py`` scores them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from anna.bench.scenarios import WARMUP, WORDS, passcode_question

TASKS = ("retrieval", "copy", "edit", "arithmetic")

# The passages' vocabulary: short common words, so that a passage of a few hundred tokens is a few
# hundred words and its tokens (each word one token with the trained tokenizer) are easy to copy.
PASSAGE_WORDS = (
    "the of and to in is was it for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words called just "
    "where most know get through back much before go good new write our used me man too any day same right "
    "look think also around another came come work three word must because does part even place well such "
    "here take why things help put years different away again off went old number great tell men say small "
    "every found still between name should home big give air line set own under read last never us left end "
    "along while might next sound below saw something thought both few those always looked show large often "
    "together asked house world going want school important until form food keep children feet land side "
    "without boy once animals life enough took sometimes four head above kind began almost live page got "
    "earth need far hand high year mother light parts country father let night following picture being study "
    "second eyes soon times story boys since white days ever paper hard near sentence better best across "
    "during today others however sure means knew try told young miles sun ways thing whole hear example heard "
    "several change answer room sea against top turned learn point city play toward five using himself usually"
).split()


@dataclass
class Chat:
    task: str
    prompt: str  # the user message
    answer: str  # the assistant's reply, without the end-of-turn token


def archive_at_depth(rng: random.Random, lines: int, passcode: str, depth: float) -> str:
    """``anna bench``'s archive (``archive_text``) with the passcode line at ``depth`` (0 first, 1 last)."""
    where = min(lines - 1, int(depth * lines))
    out = []
    for i in range(lines):
        if i == where:
            out.append(f"Record {i:05d}: IMPORTANT - the passcode is {passcode}. Remember it.")
        else:
            out.append(f"Record {i:05d}: " + " ".join(rng.choice(WORDS) for _ in range(10)) + ".")
    return "\n".join(out)


def retrieval(rng: random.Random, lines: int) -> Chat:
    passcode = f"{rng.randrange(10**5, 10**6)}"
    return Chat("retrieval", passcode_question(archive_at_depth(rng, lines, passcode, rng.random())), passcode)


def passage(rng: random.Random, words: int) -> str:
    """Sentences of random words, a few to a line."""
    out, line = [], []
    while words > 0:
        n = min(words, rng.randint(4, 12))
        sentence = " ".join(rng.choice(PASSAGE_WORDS) for _ in range(n))
        line.append(sentence[0].upper() + sentence[1:] + rng.choice(".,;.?!"))
        words -= n
        if rng.random() < 0.3:
            out.append(" ".join(line))
            line = []
    if line:
        out.append(" ".join(line))
    return "\n".join(out)


def copy(rng: random.Random, words: int) -> Chat:
    text = passage(rng, words)
    return Chat("copy", f"Repeat the following text exactly.\n\n{text}", text)


def edit(rng: random.Random, words: int) -> Chat:
    text = passage(rng, words)
    # a word with punctuation after it or a capital is another token: only bare lower-case words change
    present = sorted({w for w in text.split() if w in PASSAGE_WORDS}) or PASSAGE_WORDS
    old = rng.choice(present)
    new = rng.choice([w for w in PASSAGE_WORDS if w != old])
    edited = "\n".join(" ".join(new if w == old else w for w in line.split(" ")) for line in text.split("\n"))
    return Chat("edit", f"Repeat the following text, replacing every \"{old}\" with \"{new}\".\n\n{text}", edited)


def arithmetic(rng: random.Random) -> Chat:
    a, b = rng.randrange(100), rng.randrange(100)
    return Chat("arithmetic", WARMUP.replace("17", str(a), 1).replace("25", str(b), 1), str(a + b))
