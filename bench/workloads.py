"""Benchmark workloads: conversations of turns with arrival times, each reproducible by seed.

``gsp`` (SGLang's generated shared prefix), ``llmd`` (llm-d's shared prefix shape),
``multiturn`` (multi-round chat whose turns carry the engine's real answers), ``nosharing``,
``trace`` (a Mooncake JSONL trace, :mod:`bench.traces`) and ``agents`` (coding-agent sessions
with subagent fan-out, :mod:`bench.agents`); text is sized for the built-in byte-level
tokenizer, one character a token. Shapes and defaults: docs/benchmarks.md, "Workloads".
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import string
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

ALPHABET: Final = string.ascii_lowercase + "      "  # ~1 space per 5 letters: word-like
TRACE_BLOCK_TOKENS: Final = 512
WORKLOADS: Final = ("gsp", "llmd", "multiturn", "nosharing", "trace", "agents")


@dataclass(frozen=True, slots=True)
class Turn:
    """One user message (or raw prompt) and the number of tokens to generate for it."""

    user: str
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    """A sequence of turns sent one after the other.

    :param start_s: arrival of the first turn, simulated seconds after the run starts.
    :param group: which shared prefix it belongs to (reports only; -1: none).
    :param system: system prompt (chat requests); ignored when ``raw``.
    :param think_s: simulated seconds between an answer and the next turn, per turn.
    :param raw: send each turn as a ``/v1/completions`` prompt, without a chat template.
    :param key: session key, sent as ``prompt_cache_key`` and ``x-session-id`` (None: none).
    :param agent: this conversation's own agent id, sent as ``x-agent-id`` (None: none).
    :param forks: subagents it starts at once after some of its turns (:class:`Fork`).
    :param answers: planned answers (open loop): the history carries these instead of the
        engine's, so no turn waits for an answer; empty: each turn follows its answer.
    :param at_s: open loop: each turn's planned send time, simulated seconds after the start
        of the session it belongs to (its root conversation); empty: closed loop.
    """

    id: int
    group: int
    system: str | None
    turns: tuple[Turn, ...]
    start_s: float = 0.0
    think_s: tuple[float, ...] = ()
    raw: bool = False
    key: str | None = None
    agent: str | None = None
    forks: tuple[Fork, ...] = ()
    answers: tuple[str, ...] = ()
    at_s: tuple[float, ...] = ()

    @property
    def requests(self) -> int:
        """Its turns and those of every subagent it starts."""
        return len(self.turns) + sum(a.requests for f in self.forks for a in f.agents)

    def forks_after(self, turn: int) -> Iterator[Fork]:
        """The forks that start when ``turn`` is answered."""
        return (fork for fork in self.forks if fork.after == turn)


@dataclass(frozen=True, slots=True)
class Fork:
    """Subagents a conversation starts at once, ``think_s`` after its turn ``after`` is
    answered: each carries the parent's whole history so far, then its own turns (the first
    one its task). The parent's next turn follows the last subagent's last answer (closed
    loop) or planned send (open loop), its own think time later.
    """

    after: int
    agents: tuple[Conversation, ...]
    think_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    """Conversations (ordered by start) and how they were made.

    :param timed: arrival times come from the workload (a trace), not from a rate.
    """

    name: str
    conversations: tuple[Conversation, ...]
    params: dict[str, Any] = field(default_factory=dict)
    timed: bool = False

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.conversations)

    def describe(self) -> str:
        shown = ", ".join(f"{k}={v}" for k, v in self.params.items() if k != "trace")
        return f"{self.name} ({shown})" if shown else self.name


def text(rng: random.Random, tokens: int) -> str:
    """``tokens`` characters of word-like ASCII (``tokens`` byte-level tokens)."""
    return "".join(rng.choices(ALPHABET, k=tokens))


def shared_prefix(
    *,
    groups: int,
    prompts_per_group: int,
    system_tokens: int,
    question_tokens: int,
    output_tokens: int,
    seed: int,
    name: str = "gsp",
    shuffle: bool = True,
) -> Workload:
    """``groups`` system prompts, each followed by ``prompts_per_group`` distinct questions."""
    rng = random.Random(f"{name}:{seed}")
    systems = [text(rng, system_tokens) for _ in range(groups)]
    pairs = [
        (g, text(rng, question_tokens)) for g in range(groups) for _ in range(prompts_per_group)
    ]
    if shuffle:
        rng.shuffle(pairs)
    conversations = tuple(
        Conversation(i, g, systems[g], (Turn(question, output_tokens),))
        for i, (g, question) in enumerate(pairs)
    )
    params = {
        "groups": groups,
        "prompts_per_group": prompts_per_group,
        "system_tokens": system_tokens,
        "question_tokens": question_tokens,
        "output_tokens": output_tokens,
        "seed": seed,
    }
    return Workload(name, conversations, params)


def no_sharing(
    *, requests: int, system_tokens: int, question_tokens: int, output_tokens: int, seed: int
) -> Workload:
    """``requests`` conversations whose prompts share nothing (not even a first block)."""
    rng = random.Random(f"nosharing:{seed}")
    conversations = tuple(
        Conversation(
            i,
            -1,
            f"{i:08x} {text(rng, max(0, system_tokens - 9))}",
            (Turn(text(rng, question_tokens), output_tokens),),
        )
        for i in range(requests)
    )
    params = {
        "requests": requests,
        "system_tokens": system_tokens,
        "question_tokens": question_tokens,
        "output_tokens": output_tokens,
        "seed": seed,
    }
    return Workload("nosharing", conversations, params)


def multi_turn(
    *,
    users: int,
    rounds: int,
    system_tokens: int,
    context_tokens: int,
    question_tokens: int,
    output_tokens: int,
    think_s: float,
    seed: int,
) -> Workload:
    """``users`` conversations of ``rounds`` turns behind one shared system prompt.

    The first user message carries a private context document of ``context_tokens``; think
    times between an answer and the next question are exponential with mean ``think_s``.
    """
    rng = random.Random(f"multiturn:{seed}")
    system = text(rng, system_tokens)
    conversations = []
    for i in range(users):
        context = text(rng, context_tokens)
        turns = [Turn(f"{context}\n{text(rng, question_tokens)}", output_tokens)]
        turns += [Turn(text(rng, question_tokens), output_tokens) for _ in range(rounds - 1)]
        thinks = tuple(rng.expovariate(1 / think_s) if think_s > 0 else 0.0 for _ in turns[1:])
        conversations.append(Conversation(i, i, system, tuple(turns), think_s=thinks))
    params = {
        "users": users,
        "rounds": rounds,
        "system_tokens": system_tokens,
        "context_tokens": context_tokens,
        "question_tokens": question_tokens,
        "output_tokens": output_tokens,
        "think_s": think_s,
        "seed": seed,
    }
    return Workload("multiturn", tuple(conversations), params)


def block_text(hash_id: int, seed: int = 0) -> str:
    """The 512 tokens (characters) a trace hash id stands for; the same id, the same text."""
    return text(random.Random(f"mooncake:{seed}:{hash_id}"), TRACE_BLOCK_TOKENS)


def trace_prompt(input_length: int, hash_ids: Iterable[int], seed: int = 0) -> str:
    """A prompt of exactly ``input_length`` tokens whose 512-token blocks follow ``hash_ids``.

    Block ``i`` of the prompt is :func:`block_text` of ``hash_ids[i]``; the last id covers
    what is left (a partial block). Requests sharing leading hash ids share those tokens.
    """
    parts: list[str] = []
    left = input_length
    for hash_id in hash_ids:
        if left <= 0:
            break
        parts.append(block_text(hash_id, seed)[:left])
        left -= TRACE_BLOCK_TOKENS
    if left > 0:  # the trace lists fewer ids than its length needs: fill, unshared
        tail = random.Random(f"mooncake-tail:{seed}:{input_length}:{list(hash_ids)}")
        parts.append(text(tail, left))
    return "".join(parts)


def read_trace(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a Mooncake JSONL trace (``timestamp`` ms, lengths, ``hash_ids``)."""
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in record:
                    raise ValueError(f"{path}:{number}: no {key!r} field")
            yield record


def mooncake(
    path: Path, *, speedup: float, max_requests: int | None, seed: int, skip: int = 0
) -> Workload:
    """Replay ``path``: arrivals at ``timestamp / speedup``, one raw prompt per record; from
    record ``skip`` on (the first of them at time 0)."""
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    if skip < 0:
        raise ValueError("skip must be >= 0")
    stop = None if max_requests is None else skip + max(0, max_requests)
    records = list(itertools.islice(read_trace(path), skip, stop))
    first = min((int(r["timestamp"]) for r in records), default=0)
    conversations = []
    for i, record in enumerate(sorted(records, key=lambda r: int(r["timestamp"]))):
        ids = [int(h) for h in record["hash_ids"]]
        prompt = trace_prompt(int(record["input_length"]), ids, seed)
        conversations.append(
            Conversation(
                i,
                ids[0] if ids else -1,
                None,
                (Turn(prompt, max(1, int(record["output_length"]))),),
                start_s=(int(record["timestamp"]) - first) / 1000.0 / speedup,
                raw=True,
            )
        )
    params = {
        "trace": str(path),
        "requests": len(conversations),
        "speedup": speedup,
        "max_requests": max_requests,
        **({"from": skip} if skip else {}),
    }
    return Workload("trace", tuple(conversations), params, timed=True)


def with_poisson_arrivals(workload: Workload, rate: float, seed: int) -> Workload:
    """Conversation starts as a Poisson process of ``rate`` requests per simulated second.

    Multi-turn conversations (agent sessions: with their subagents' requests) start at
    ``rate / requests per conversation``, so requests arrive at about ``rate`` once many
    conversations overlap; a subagent's and an open loop's planned sends move with the start
    of their session.
    """
    if rate <= 0:
        raise ValueError("rate must be positive")
    turns = workload.requests / max(1, len(workload.conversations))
    rng = random.Random(f"arrivals:{seed}")
    at, out = 0.0, []
    for conversation in workload.conversations:
        out.append(dataclasses.replace(conversation, start_s=at))
        at += rng.expovariate(rate / turns)
    return dataclasses.replace(workload, conversations=tuple(out), timed=False)


def planned_span(workload: Workload) -> float:
    """Simulated seconds from the start to the last planned send (0: nothing planned)."""

    def last(conversation: Conversation) -> float:
        agents = (a for f in conversation.forks for a in f.agents)
        return max((conversation.at_s[-1], *(last(a) for a in agents)))

    return max((c.start_s + last(c) for c in workload.conversations if c.at_s), default=0.0)


def messages(
    conversation: Conversation,
    turn: int,
    answers: Sequence[str],
    inherited: Sequence[dict[str, str]] = (),
) -> list[dict[str, str]]:
    """The chat messages of ``turn``: system (or a subagent's ``inherited`` history, its
    parent's messages), then every earlier turn and its answer."""
    out = list(inherited)
    if not inherited and conversation.system is not None:
        out.append({"role": "system", "content": conversation.system})
    for i in range(turn):
        out.append({"role": "user", "content": conversation.turns[i].user})
        out.append({"role": "assistant", "content": answers[i]})
    out.append({"role": "user", "content": conversation.turns[turn].user})
    return out


def history(
    conversation: Conversation,
    turn: int,
    answers: Sequence[str],
    inherited: Sequence[dict[str, str]] = (),
) -> list[dict[str, str]]:
    """The messages through ``turn`` and its answer: what a fork after ``turn`` inherits."""
    out = messages(conversation, turn, answers, inherited)
    out.append({"role": "assistant", "content": answers[turn]})
    return out


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a walk through a session (:func:`walk`)."""

    conversation: Conversation
    turn: int
    messages: list[dict[str, str]]
    at_s: float  # planned send, simulated s after the session's start (0: closed loop)


def walk(
    conversation: Conversation,
    stand_in: Callable[[Turn], str],
    inherited: Sequence[dict[str, str]] = (),
) -> Iterator[Request]:
    """Every request of ``conversation`` and its subagents in the order a closed loop sends
    them: each turn, then the subagents forked after it (one after the other), then the next
    turn. Histories carry the planned answers, else ``stand_in`` of the turn."""
    answers: list[str] = []
    for turn, spec in enumerate(conversation.turns):
        at_s = conversation.at_s[turn] if conversation.at_s else 0.0
        yield Request(conversation, turn, messages(conversation, turn, answers, inherited), at_s)
        answers.append(conversation.answers[turn] if conversation.answers else stand_in(spec))
        for fork in conversation.forks_after(turn):
            base = history(conversation, turn, answers, inherited)
            for agent in fork.agents:
                yield from walk(agent, stand_in, base)
