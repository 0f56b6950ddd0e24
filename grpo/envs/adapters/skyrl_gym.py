"""`env.name = "skyrl_gym"`: a SkyRL-Gym text environment (`skyrl_gym.envs.base_text_env.BaseTextEnv`,
skyrl-gym 0.4), played by the run's model.

    [env]
    name = "skyrl_gym"
    args = {env_class = "gsm8k_multi_turn", env_config = {}, extras = {max_turns = 3}, max_turns = 8}

- `env_class`: a registered environment id (`skyrl_gym.registry`: gsm8k, gsm8k_multi_turn, aime,
  text2sql, lcb, search, ...) or "module:Class", a BaseTextEnv subclass of your own, imported from
  sys.path and registered under that name; a prompt record's own `env_class` field overrides it, as
  in a SkyRL dataset.
- `env_config`: the environment's config (an omegaconf DictConfig, as SkyRL passes it), e.g.
  `{db_path = "..."}` for text2sql.
- `extras`: defaults for every episode's `extras`; `max_turns`: the model turns of one episode at
  most (the adapter's cap; `env.max_turns` lowers it).

A prompt's record is a SkyRL dataset row: each episode's environment is made with `extras` = the
adapter's `extras`, then the record's fields other than the question and answer (`Prompt.metadata`),
with `reward_spec = {ground_truth = <the record's answer>}` unless the record has its own
`reward_spec`, and `extra_info = {}` unless given. `init` sees the question as the one user message.

Each model turn's decoded text is the action of `step`; the observation messages come back in the
run's chat template (see chat.py). The episode's reward, given when the environment says done, is
the sum of its steps' rewards (the turn-level rewards of e.g. gsm8k_multi_turn). A step whose
metadata names a tool (`tool_name`, as the tool-using environments report it) counts one tool call.

Not supported (one line at the episode): an `init` that rewrites the prompt (tandem has already
rendered it), and a `postprocessed_action` that differs from the model's text (the trainer keeps
exactly the tokens sampled).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import skyrl_gym
from omegaconf import OmegaConf

from grpo.data.prompt import Prompt
from grpo.envs.adapters.chat import ChatReplies
from grpo.envs.base import EnvReply
from grpo.scoring.calls import import_callable

_KEYS = ("env_class", "env_config", "extras", "max_turns")


@dataclass
class SkyRLEpisode:
    """An episode's state between tandem's calls: its environment and the sum of its steps' rewards."""

    env: Any
    reward: float = 0.0


class SkyRLGymEnvironment:
    """SkyRL-Gym environments behind tandem's `Environment` interface; one environment per episode."""

    name = "skyrl_gym"

    def __init__(self, tokenizer: Any, args: dict):
        unknown = sorted(set(args) - set(_KEYS))
        if unknown or "env_class" not in args:
            raise ValueError(f"env.args takes {', '.join(_KEYS)} (env_class required); got {sorted(args)}")
        self.env_class = str(args["env_class"])
        if ":" in self.env_class and self.env_class not in skyrl_gym.registry:
            skyrl_gym.register(id=self.env_class, entry_point=import_callable(self.env_class))
        if self.env_class not in skyrl_gym.registry:
            raise ValueError(f"env.args.env_class = {self.env_class!r} is not a registered SkyRL-Gym environment "
                             f"(registered: {', '.join(sorted(skyrl_gym.registry))})")
        self.env_config = OmegaConf.create(dict(args.get("env_config", {})))
        self.extras = dict(args.get("extras", {}))
        self.max_turns = int(args.get("max_turns", 10))
        self.replies = ChatReplies(tokenizer)

    def reset(self, prompt: Prompt) -> SkyRLEpisode:
        extras = {**self.extras, **prompt.metadata}
        extras.setdefault("reward_spec", {"ground_truth": prompt.answer})
        extras.setdefault("extra_info", {})
        env = skyrl_gym.make(extras.pop("env_class", self.env_class), env_config=self.env_config, extras=extras)
        chat = [{"role": "user", "content": prompt.text}]
        observation, _ = env.init(chat)
        if observation != chat:
            raise ValueError(f"{type(env).__name__}.init rewrites the prompt, which tandem cannot follow: "
                             "the prompt's tokens come from data.path")
        state = SkyRLEpisode(env)
        # Closed when tandem drops the episode, whether the environment ended it or a budget cut it short.
        weakref.finalize(state, env.close).atexit = False
        return state

    def step(self, state: SkyRLEpisode, turn: int, completion: str, completion_tokens: list[int]) -> EnvReply:
        out = state.env.step(completion)
        action = out.get("postprocessed_action")
        if action is not None and action != completion:
            raise ValueError(f"{type(state.env).__name__}.step rewrote the model's turn (postprocessed_action), "
                             "which tandem cannot follow: the trainer keeps the tokens sampled")
        state.reward += float(out["reward"])
        calls = int(bool((out.get("metadata") or {}).get("tool_name")))
        if out["done"]:
            return EnvReply(done=True, reward=state.reward, tool_calls=calls)
        return EnvReply(tokens=self.replies.tokens(list(out["observations"]), completion_tokens), tool_calls=calls)
