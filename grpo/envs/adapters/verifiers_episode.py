"""One verifiers episode, its agent seat played by tandem's model turns (see verifiers.py for the mapping).

The env's `run()` drives the episode as it would with a real agent; the seat it is handed opens a
rollout of its own instead of a harness and an interception server: a trace, the task's tools
called in-process, and the `null` harness's chat loop, whose every model call waits for tandem's
next model turn. The episode is a coroutine on the adapter's event loop; it stops at each model
turn it asks for (an `Event` carrying the env's messages before it) and at its end (an `Event`
with the reward, or the error that ended it).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import time
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.dialects import parse_message
from verifiers.v1.mcp.server import _call_state  # how an in-process tool call sees the rollout's state
from verifiers.v1.session import call_hook, hook_boundary
from verifiers.v1.state import State, state_cls
from verifiers.v1.utils.decorators import discover_decorated, invoke

from grpo.data.prompt import Prompt

if TYPE_CHECKING:
    from grpo.envs.adapters.verifiers import VerifiersEnvironment

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass
class Event:
    """What an episode did after a model turn: asked for the next one after `messages`, or ended
    (`done` with `reward`, or `error`); the tool calls answered since the last event, and failed."""

    messages: list | None = None
    done: bool = False
    reward: float | None = None
    error: Exception | None = None
    tool_calls: int = 0
    tool_errors: int = 0


def prompt_text(task: vf.Task) -> str:
    """The task's prompt as tandem renders it: a string, or the text of a lone user message."""
    prompt = task.data.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], vf.UserMessage):
        prompt = prompt[0].content
    if not isinstance(prompt, str):
        raise ValueError(f"verifiers task {task.data.idx} has no text prompt (a prompt-less or multi-message task)")
    return prompt


async def serve_tools(toolsets: list[vf.Toolset], task: vf.Task | None = None) -> dict[str, tuple[vf.Toolset, Any]]:
    """Set tool servers up in-process (`task`: a rollout's own servers): {tool name as verifiers
    advertises it, `<server>_<tool>` or bare: (server, method)}."""
    tools = {}
    for toolset in toolsets:
        await toolset.setup()
        if task is not None:
            await toolset.setup_task(task.data)
        for fn in discover_decorated(toolset, "tool"):
            name = getattr(fn, "tool_name", None) or fn.__name__
            tools[f"{toolset.server_name}_{name}" if toolset.server_name else name] = (toolset, fn)
    return tools


def assistant_message(text: str, turn: int) -> vf.AssistantMessage:
    """The model's turn as an OpenAI-style tool-parsing server returns it: its well-formed tool
    calls, and the text before the first as its content (the whole text when it has none)."""
    calls = []
    for i, raw in enumerate(_CALL.findall(text)):
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict):
            calls.append(vf.ToolCall(id=f"call_{turn}_{i}", name=call["name"], arguments=json.dumps(call.get("arguments", {}))))
    content = text[: text.index("<tool_call>")].strip() if calls else text
    return vf.AssistantMessage(content=content or None, tool_calls=calls or None)


def _needs_runtime(fn: Any) -> bool:
    parameter = inspect.signature(fn).parameters.get("runtime")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _overridden(task: vf.Task, hook: str) -> bool:
    return getattr(type(task), hook) is not getattr(vf.Task, hook)


class Episode:
    """The env's run of one task. `start` and `advance` (awaited on the adapter's loop) return at
    the next model turn it asks for, or at its end; `cancel` ends it where it waits."""

    def __init__(self, adapter: VerifiersEnvironment, task: vf.Task, prompt: Prompt):
        self.adapter, self.task, self.prompt = adapter, task, prompt
        self.rollout: vf.Task | None = None  # the task the env hands its seat
        self.trace: vf.Trace | None = None
        self.messages: list = []  # the rollout's conversation so far
        self.tools: dict[str, tuple[vf.Toolset, Any]] = {}
        self.stops: list = []
        self._events: asyncio.Queue[Event] | None = None
        self._answer: asyncio.Future | None = None
        self._runner: asyncio.Task | None = None
        self._calls = self._errors = 0

    async def start(self) -> Event:
        self._events = asyncio.Queue()
        self._runner = asyncio.create_task(self._play())
        return await self._events.get()

    async def advance(self, text: str, ended: bool) -> Event:
        """Hand the episode the model's turn (its text; whether it sampled its end-of-turn)."""
        self._answer.set_result((text, ended))
        return await self._events.get()

    def cancel(self) -> None:
        if self._runner is not None:
            self._runner.cancel()

    def _emit(self, event: Event) -> None:
        event.tool_calls, event.tool_errors, self._calls, self._errors = self._calls, self._errors, 0, 0
        self._events.put_nowait(event)

    async def _play(self) -> None:
        env, seat = self.adapter.env, _Seat(self)
        agents = types.SimpleNamespace(**{self.adapter.seat: seat})
        try:
            await env.setup(agents)
            await env.run(self.task, agents)
            if self.trace is None:
                raise ValueError(f"{type(env).__name__}.run() ran no agent")
            episode = vf.Episode(env=vf.EnvInfo(id=env.config.env_id), task=self.trace.task, traces=[self.trace])
            await env.finalize(self.task, episode)
            self._emit(Event(done=True, reward=self.trace.reward))
        except Exception as error:
            self._emit(Event(error=error))

    async def open(self, task: vf.Task) -> None:
        """Begin the rollout of `task` the env hands its seat: checks, trace, tools, task setup."""
        if self.trace is not None:
            raise ValueError("the env runs its agent more than once per episode; a tandem episode is one conversation")
        text, kind = prompt_text(task), type(task).__name__
        if text != self.prompt.text:
            raise ValueError(f"prompt {self.prompt.index} is not the prompt of verifiers task {task.data.idx}: data.path "
                             "must list the taskset's prompts in task order (see export_prompts)")
        stops = task.hooks("stop")
        unsupported = [fn for fn in stops if hook_boundary(fn, allow_trace=True) is not vf.Trace]
        unsupported += discover_decorated(task, "intercept")
        unsupported += [fn for fn in [*task.hooks("reward"), *task.hooks("metric")] if _needs_runtime(fn)]
        unsupported += [getattr(task, name) for name in ("setup", "finalize")
                        if _overridden(task, name) and _needs_runtime(getattr(task, name))]
        if task.NEEDS_CONTAINER or unsupported:
            names = ", ".join(fn.__name__ for fn in unsupported) or "NEEDS_CONTAINER"
            raise ValueError(f"{kind} needs what the adapter does not run (a runtime, @vf.intercept, a Request or "
                             f"Response @vf.stop): {names}")
        self.rollout, self.stops = task, stops
        self.trace = vf.Trace(task=vf.TraceTask(type=kind, data=task.data, key=task.key, hash=task.hash),
                              state=state_cls(type(task))(),
                              agent=vf.AgentInfo(config=self.adapter.seat_config, name=self.adapter.seat))
        system = [vf.SystemMessage(content=task.data.system_prompt)] if task.data.system_prompt else []
        self.messages = [*system, vf.UserMessage(content=text)]
        self.tools = {**self.adapter.shared_tools, **await serve_tools(type(task).toolsets(task.config), task)}
        if _overridden(task, "setup"):
            await invoke(task.setup, {"trace": self.trace})

    async def close(self, condition: str) -> None:
        """End the rollout as verifiers does: its stop condition, the task's finalize and scoring."""
        if self.trace.stop_condition is None:
            self.trace.stop(condition)
        if _overridden(self.rollout, "finalize"):
            await invoke(self.rollout.finalize, {"trace": self.trace})
        await self.rollout.score(self.trace)
        self.trace.is_completed = self.trace.ok = True

    async def refused(self) -> str | None:
        """The turn cap and the Trace-level @stops, before a model turn: the stop condition, if any."""
        if self.trace.stop_condition is None and self.trace.num_turns >= self.adapter.max_turns:
            self.trace.stop("max_turns")
        for stop in self.stops:
            if self.trace.stop_condition is None and await call_hook(stop, {vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
        return self.trace.stop_condition

    async def model_turn(self, before: list) -> vf.AssistantMessage:
        """The model's next turn, after the env's messages `before` (none before the first)."""
        self.messages += before
        self._answer = asyncio.get_running_loop().create_future()
        self._emit(Event(messages=before))
        text, ended = await self._answer
        message = assistant_message(text, self.trace.num_turns)
        finish = "tool_calls" if message.tool_calls else "stop" if ended else "length"
        response = vf.Response(id=f"{self.trace.id}-{self.trace.num_turns}", created=int(time.time()), model="tandem",
                               message=message, finish_reason=finish)
        graph.prepare_turn(self.trace, list(self.messages)).commit(response)
        self.messages.append(message)
        return message

    async def call_tools(self, calls: list[vf.ToolCall]) -> list[vf.ToolMessage]:
        results = []
        for call in calls:
            content, failed = await self._call_tool(call)
            self._calls, self._errors = self._calls + 1, self._errors + failed
            results.append(vf.ToolMessage(tool_call_id=call.id, name=call.name, content=content))
        return results

    async def _call_tool(self, call: vf.ToolCall) -> tuple[str, bool]:
        """(result text, whether the call failed); a failure is text the model reads, as over MCP."""
        if call.name not in self.tools:
            return f"error: unknown tool {call.name!r}", True
        toolset, fn = self.tools[call.name]
        # As over verifiers' state channel: the tool sees trace.state in its own State type, and
        # what it leaves there becomes trace.state again.
        own = state_cls(type(toolset))
        state = own.model_validate_json(self.trace.state.model_dump_json()) if own is not State else State()
        token = _call_state.set(state)
        try:
            arguments = json.loads(call.arguments)
            result = await fn(**arguments) if inspect.iscoroutinefunction(fn) else await asyncio.to_thread(fn, **arguments)
        except Exception as error:
            return f"error: {type(error).__name__}: {error}", True
        finally:
            _call_state.reset(token)
        if own is not State:
            self.trace.state = type(self.trace.state).model_validate_json(state.model_dump_json())
        return (result if isinstance(result, str) else json.dumps(result, default=str)), False


class _Exchange:
    """What the env sees as `agent.interaction(task)`: one `turn` per segment of the chat loop."""

    def __init__(self, episode: Episode):
        self._episode = episode
        self._started = False

    @property
    def trace(self) -> vf.Trace:
        return self._episode.trace

    async def turn(self, message: str | list | None = None) -> vf.Segment:
        """The model's segment after the user's `message` (none for a prompted task's first turn):
        model turns until one without tool calls; terminated when a stop refuses the first."""
        if (message is None) == self._started:
            raise ValueError("a prompted task's first turn() is bare and each later one carries the user's message")
        self._started = True
        messages = [message] if isinstance(message, str) else message or []
        before = [vf.UserMessage(content=m) if isinstance(m, str) else parse_message(m) if isinstance(m, dict) else m
                  for m in messages]
        produced: list = []
        while not await self._episode.refused():
            reply = await self._episode.model_turn(before)
            produced.append(reply)
            if not reply.tool_calls:
                break
            before = await self._episode.call_tools(reply.tool_calls)
            produced += before
        return vf.Segment(messages=produced, terminated=not produced)


class _Seat:
    """What the env sees as its agent (`agents.<seat>`): rollouts whose model turns are tandem's."""

    trainable = True

    def __init__(self, episode: Episode):
        self._episode = episode

    async def run(self, task: vf.Task) -> vf.Trace:
        await self._episode.open(task)
        await _Exchange(self._episode).turn()
        await self._episode.close("agent_completed")
        return self._episode.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task: vf.Task) -> AsyncIterator[_Exchange]:
        await self._episode.open(task)
        yield _Exchange(self._episode)
        await self._episode.close("user_closed")
