"""Episodes for people: samples.jsonl records and the multi-turn metrics of a step."""

from __future__ import annotations

from collections.abc import Callable

from grpo.data.prompt import Prompt
from grpo.rollout.episode import EpisodeBatch


def episode_samples(
    episodes: EpisodeBatch, prompts: dict[int, Prompt], decode: Callable[[list[int]], str], with_turns: bool
) -> list[dict]:
    """One record per episode: prompt, completion, reward, advantage, finish; with_turns adds the
    whole conversation as the trainer trained on it, each turn's role ("model" or "env"), text and
    token ids."""
    records = []
    for i in range(len(episodes)):
        record = {
            "prompt": prompts[int(episodes.prompt_index[i])].text,
            "completion": decode(episodes.completion(i)),
            "reward": float(episodes.rewards[i]),
            "advantage": float(episodes.advantages[i]),
            "finish": "length" if bool(episodes.truncated[i]) else "stop",
        }
        if with_turns:
            record["turns"] = [
                {"role": "model" if sampled else "env", "text": decode(ids), "tokens": ids}
                for sampled, ids in episodes.turns(i)
            ]
        records.append(record)
    return records


def multi_turn_metrics(episodes: EpisodeBatch) -> dict[str, float]:
    """Means over these episodes (grpo.observe.metrics reduces them over ranks, weighted by count)."""
    n = max(len(episodes), 1)
    return {
        "episode/turns_mean": float(episodes.model_turns.sum()) / n,
        "env/seconds_mean": float(episodes.env_seconds.sum()) / n,
        "env/failed_frac": float(episodes.env_failed.sum()) / n,
        "env/tool_calls_mean": float(episodes.tool_calls.sum()) / n,
        "env/tool_errors_mean": float(episodes.tool_errors.sum()) / n,
        "env/turn_limited_frac": float(episodes.turn_limited.sum()) / n,
    }
