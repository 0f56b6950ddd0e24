"""`env.name = "verifiers"`: a verifiers 0.4 environment (`verifiers.v1`), its agent played by the run's model.

    [env]
    name = "verifiers"
    args = {taskset = {id = "my_tasks"}, agent = {max_turns = 6}}

`env.args` is the environment's verifiers config, the `[env]` block of a verifiers run
(`vf.resolve_env_config`): `taskset.id` names the taskset (an installed package, or a module on
sys.path exporting its Taskset in `__all__`), `id` an Env to pair it with (default: the taskset's
own, else SingleAgentEnv), and the seat's `max_turns` caps an episode's model turns (default 10;
`env.max_turns` lowers it).

How a verifiers episode becomes a tandem one:
- Data: tandem's prompts come from data.path; prompt i is task i of the taskset (`task.data.idx`)
  and its text must be that task's prompt (checked when the env opens the rollout).
  `export_prompts` writes such a file and gives the system prompt to set as data.system_prompt.
- The env's own logic runs unchanged (`Env.setup`, `run`, `finalize`) on a background event loop,
  with its one agent seat played by the run's model (verifiers_episode.py): each model call the agent would make is one
  tandem model turn. The agent runs the `null` harness's chat loop: a turn with tool calls (written
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes / Qwen format) is answered
  with the results of the task's and the taskset's Toolset tools (called in-process, named as
  verifiers advertises them, `trace.state` shared with them as over verifiers' state channel); a
  turn without one ends the segment (`agent.run(task)`, or one `interaction.turn(message)`).
- What the env answers with (tool results, the user turns it sends with `turn(message)`) is
  appended in the run's chat template (chat.py). Before each model turn the turn cap and the task's
  Trace-level `@vf.stop`s run, as verifiers' interception does; a stopped rollout is still scored.
- Reward: once `run()` has returned, after the task's `@vf.reward`s (`Task.score`, no runtime) and
  `Env.finalize`, the trace's reward (its weighted sum) is the episode's `EnvReply.reward`.

Not supported (one line, at start-up or at the episode): several agent seats or rollouts per
episode (judge agents, best-of-n), tasks that need a runtime (`NEEDS_CONTAINER`; setup, finalize or
scoring hooks that take `runtime`), `@vf.intercept` hooks and Request/Response `@vf.stop`s,
prompt-less tasks or prompts other than one text user message, images, `interaction.send` / `steer`. Harness programs and their
built-in tools (bash, edit, search) do not run, and tool schemas are not rendered into the prompt
(tandem renders prompts from data.path: describe the tools in data.system_prompt).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import weakref
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.types import content_text

from grpo.data.prompt import Prompt
from grpo.envs.adapters.chat import ChatReplies
from grpo.envs.adapters.verifiers_episode import Episode, prompt_text, serve_tools
from grpo.envs.base import EnvReply

DEFAULT_MAX_TURNS = 10


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def load_env(args: dict) -> vf.Env:
    """The verifiers Env that `args` (its `[env]` config) describes; a ValueError saying what is wrong."""
    try:
        return vf.load_environment(vf.resolve_env_config(args))
    except Exception as error:  # pydantic, import and plugin errors alike become the one line
        raise ValueError(f"env.args do not give a verifiers env: {_one_line(error)}") from None


def export_prompts(args: dict, path: str | Path, count: int) -> str | None:
    """Write the first `count` tasks of the taskset `args` names as a JSONL file for data.path, in
    task order (`question`: the task's prompt, `answer`: its `answer` field or ""). Returns their
    system prompt for data.system_prompt (None: none); tasks with different ones are refused."""
    rows, systems = [], set()
    for task in itertools.islice(load_env(args).taskset, count):
        rows.append({"question": prompt_text(task), "answer": str(getattr(task.data, "answer", ""))})
        systems.add(task.data.system_prompt)
    if len(systems) > 1:
        raise ValueError("the tasks have different system prompts; tandem renders one (data.system_prompt)")
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return systems.pop() if systems else None


class _Handle:
    """An episode as tandem holds it: its state between calls (see `VerifiersEnvironment.reset`)."""

    def __init__(self, episode: Episode):
        self.episode = episode


class VerifiersEnvironment:
    """A verifiers Env behind tandem's `Environment` interface (see the module's docstring)."""

    name = "verifiers"

    def __init__(self, tokenizer: Any, args: dict):
        self.env = load_env(args)
        seats = agent_config_fields(self.env.config)
        if len(seats) != 1:
            raise ValueError(f"{type(self.env).__name__} has the agent seats {sorted(seats)}; the adapter plays one")
        ((self.seat, self.seat_config),) = seats.items()
        self.max_turns = self.seat_config.max_turns or DEFAULT_MAX_TURNS
        self.replies = ChatReplies(tokenizer)
        self.end_ids = set(tokenizer.eos_ids)
        self._tasks: list[vf.Task] = []
        self._stream = iter(self.env.taskset)
        self._lock = threading.Lock()
        # Episodes are coroutines suspended between tandem's calls, which come from several threads:
        # they all live on this one loop, and each call waits for its episode's next event there.
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True, name="tandem-verifiers").start()
        self.shared_tools = self._call(serve_tools(self.env.taskset.toolsets(self.env.taskset.config)))

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _task(self, index: int) -> vf.Task:
        if index < 0:
            raise ValueError(f"prompt {index} has no verifiers task (held-out prompts of this source have negative indices)")
        with self._lock:
            while len(self._tasks) <= index:
                task = next(self._stream, None)
                if task is None:
                    raise ValueError(f"prompt {index} has no verifiers task: the taskset has {len(self._tasks)}")
                self._tasks.append(task)
            return self._tasks[index]

    def reset(self, prompt: Prompt) -> _Handle:
        episode = Episode(self, self._task(prompt.index), prompt)
        event = self._call(episode.start())
        if event.error is not None:
            raise event.error
        if event.done:
            raise ValueError(f"the verifiers episode of prompt {prompt.index} ended before the model's first turn")
        # The episode's coroutine holds the episode, not this handle: when tandem drops the handle
        # (the episode done, or cut short by a turn or token budget), the coroutine is cancelled.
        handle = _Handle(episode)
        weakref.finalize(handle, self._loop.call_soon_threadsafe, episode.cancel).atexit = False
        return handle

    def step(self, state: _Handle, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        ended = bool(completion_tokens) and completion_tokens[-1] in self.end_ids
        event = self._call(state.episode.advance(completion, ended))
        counts = {"tool_calls": event.tool_calls, "tool_errors": event.tool_errors}
        if event.error is not None:
            raise event.error
        if event.done:
            return EnvReply(done=True, reward=event.reward, **counts)
        return EnvReply(tokens=self.replies.tokens([_chat(m) for m in event.messages], completion_tokens), **counts)


def _chat(message: Any) -> dict:
    """A verifiers message as the chat template takes it."""
    if not isinstance(message.content, str) and any(part.type != "text" for part in message.content):
        raise ValueError("the verifiers env answered with an image, which the adapter does not render")
    out = {"role": message.role, "content": content_text(message.content)}
    if isinstance(message, vf.ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out
