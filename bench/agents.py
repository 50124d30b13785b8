"""The ``agents`` workload: coding-agent sessions with long, growing contexts and subagent
fan-out, generated from an :class:`AgentShape` and a seed.

Every session's system prompt is one tool/instruction preamble shared by all sessions; its
first message is the session's own repository context and task, and every later turn a tool
result (a few hundred to a few thousand tokens) after the model's short answer, so prompts
grow from ``preamble + context`` by ``growth_tokens`` a turn. Every ``fanout_every`` turns a
session with ``fanout`` > 1 starts that many subagents at once (:class:`~bench.workloads.Fork`),
each from the session's whole history plus its own task, for ``subagent_turns`` turns of
its own; the session continues when they are done. Every request carries the session's key
(``prompt_cache_key`` and ``x-session-id``; subagents carry their parent's, so that affinity
can keep them beside its history) and its agent's own id (``x-agent-id``); ``key=False``
sends neither. Open loop (the default), every send time is planned in advance and histories
carry planned answers; closed loop, each request follows the answer it depends on. Shape
and defaults: docs/benchmarks.md, "Workloads".
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from bench.workloads import Conversation, Fork, Turn, Workload, text

PREFIX: Final = "agents_"
"""A shape field's name among the bench's settings: ``agents_<field>``."""


@dataclass(frozen=True, kw_only=True)
class AgentShape:
    """What the ``agents`` workload generates (each field is a ``--agents-*`` flag).

    :param sessions: top-level agent sessions.
    :param turns: turns of each session (its first carries its context and task).
    :param preamble_tokens: the tool/instruction preamble every session shares.
    :param context_tokens: each session's own repository context, in its first message.
    :param task_tokens: a task: the session's, after its context, and each subagent's.
    :param growth_tokens: mean tool result per turn, uniform in [1/4, 7/4] of it.
    :param output_tokens: mean answer, uniform in [1/2, 3/2] of it.
    :param think_s: mean tool time between an answer and the request that follows it
        (exponential, simulated s).
    :param fanout: subagents a burst starts at once (1: no subagents).
    :param fanout_every: a session bursts after every this many of its turns (never after
        its last).
    :param subagent_turns: turns of each subagent (the first is its task).
    :param closed_loop: each request waits for the answer it follows (plus the think time);
        else every send time is planned in advance.
    :param key: send the session key and agent id (False: measure routing without them).
    """

    sessions: int = 8
    turns: int = 32
    preamble_tokens: int = 3000
    context_tokens: int = 15000
    task_tokens: int = 200
    growth_tokens: int = 2500
    output_tokens: int = 100
    think_s: float = 3.0
    fanout: int = 1
    fanout_every: int = 8
    subagent_turns: int = 3
    closed_loop: bool = False
    key: bool = True

    def __post_init__(self) -> None:
        counts = ("sessions", "turns", "fanout", "fanout_every", "subagent_turns")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"agents {name} must be at least 1")
        tokens = ("preamble_tokens", "context_tokens", "task_tokens", "growth_tokens")
        for name in tokens:
            if getattr(self, name) < 0:
                raise ValueError(f"agents {name} must be >= 0")
        if self.output_tokens < 2:
            raise ValueError("agents output_tokens must be at least 2")
        if self.think_s < 0:
            raise ValueError("agents think_s must be >= 0")

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> AgentShape:
        """The shape of the ``agents_<field>`` entries of ``values`` (the bench's settings or
        a matrix cell's); a field without one keeps its default."""
        names = {f.name for f in dataclasses.fields(cls)}
        chosen = {k.removeprefix(PREFIX): v for k, v in values.items() if k.startswith(PREFIX)}
        return cls(**{k: v for k, v in chosen.items() if k in names})

    @property
    def bursts(self) -> int:
        """Fan-out bursts per session."""
        return 0 if self.fanout == 1 else (self.turns - 1) // self.fanout_every

    @property
    def requests(self) -> int:
        """Requests of the whole workload, subagents' included."""
        per_session = self.turns + self.bursts * self.fanout * self.subagent_turns
        return self.sessions * per_session


class _Draws:
    """The seeded draws of one workload: texts, lengths, think times, conversation ids; the
    planned answers from a stream of their own, so that the open and the closed loop send the
    same texts after the same think times."""

    def __init__(self, shape: AgentShape, seed: int) -> None:
        self.shape = shape
        self.rng = random.Random(f"agents:{seed}")
        self.answers = random.Random(f"agents-answers:{seed}")
        self.ids = itertools.count()

    def text(self, tokens: int) -> str:
        return text(self.rng, tokens)

    def answer(self, tokens: int) -> str:
        return text(self.answers, tokens)

    def growth(self) -> int:
        g = self.shape.growth_tokens
        return self.rng.randint(g // 4, g * 7 // 4)

    def output(self) -> int:
        o = self.shape.output_tokens
        return self.rng.randint(o // 2, o * 3 // 2)

    def think(self) -> float:
        mean = self.shape.think_s
        return self.rng.expovariate(1 / mean) if mean > 0 else 0.0


def agents(shape: AgentShape, seed: int) -> Workload:
    """The workload of ``shape`` for ``seed`` (module docstring); sessions all start at 0,
    their arrivals are assigned like any workload's
    (:func:`~bench.workloads.with_poisson_arrivals`)."""
    draws = _Draws(shape, seed)
    preamble = draws.text(shape.preamble_tokens)
    sessions = tuple(_session(draws, seed, i, preamble) for i in range(shape.sessions))
    return Workload("agents", sessions, {**dataclasses.asdict(shape), "seed": seed})


def _session(draws: _Draws, seed: int, index: int, preamble: str) -> Conversation:
    shape = draws.shape
    key = f"agents-{seed}-{index}" if shape.key else None
    first = f"{draws.text(shape.context_tokens)}\n{draws.text(shape.task_tokens)}"
    users = [first] + [draws.text(draws.growth()) for _ in range(shape.turns - 1)]
    session = _conversation(draws, index, preamble, users, key=key, agent=key)
    every = shape.fanout_every
    forks = tuple(_fork(draws, session, every - 1 + i * every, key) for i in range(shape.bursts))
    session = dataclasses.replace(session, forks=forks)
    return _planned(session, 0.0) if not shape.closed_loop else session


def _fork(draws: _Draws, parent: Conversation, after: int, key: str | None) -> Fork:
    """``fanout`` subagents after the parent's turn ``after``."""
    shape = draws.shape
    agents = []
    for k in range(shape.fanout):
        users = [draws.text(shape.task_tokens)]
        users += [draws.text(draws.growth()) for _ in range(shape.subagent_turns - 1)]
        agent = f"{key}/{after}.{k}" if key is not None else None
        agents.append(_conversation(draws, parent.group, None, users, key=key, agent=agent))
    return Fork(after, tuple(agents), think_s=draws.think())


def _conversation(
    draws: _Draws,
    group: int,
    system: str | None,
    users: list[str],
    *,
    key: str | None,
    agent: str | None,
) -> Conversation:
    """One agent's turns, their think times and (open loop) planned answers."""
    turns = tuple(Turn(user, draws.output()) for user in users)
    thinks = tuple(draws.think() for _ in turns[1:])
    answers = () if draws.shape.closed_loop else tuple(draws.answer(t.max_tokens) for t in turns)
    return Conversation(
        next(draws.ids),
        group,
        system,
        turns,
        think_s=thinks,
        key=key,
        agent=agent,
        answers=answers,
    )


def _planned(conversation: Conversation, at: float) -> Conversation:
    """``conversation`` with the open loop's send times, its first turn at ``at``: each
    request one think time after the planned send of the request it follows, the turn after
    a burst one think time after the burst's last planned send."""
    at_s = []
    forks = []
    for turn in range(len(conversation.turns)):
        if turn:
            at += conversation.think_s[turn - 1]
        at_s.append(at)
        for fork in conversation.forks_after(turn):
            agents = tuple(_planned(a, at + fork.think_s) for a in fork.agents)
            forks.append(dataclasses.replace(fork, agents=agents))
            at = max(a.at_s[-1] for a in agents)
    return dataclasses.replace(conversation, at_s=tuple(at_s), forks=tuple(forks))
