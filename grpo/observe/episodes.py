"""Episodes for people: samples.jsonl records, and the per-episode metrics of a step."""

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


def episode_metrics(
    episodes: EpisodeBatch, step: int, reward_sums: dict[str, float], multi_turn: bool
) -> dict[str, float]:
    """Per-episode means of a rank's episodes at `step` (weighted by the episode count when reduced
    over ranks): rewards (reward_sums: each reward function's sum), lengths, truncation, the
    conversations' turns (multi_turn), and staleness, the updates between an episode's weights and
    the ones it trains."""
    n = len(episodes)
    # Versions count applied updates; step s trains after s - 1 of them.
    staleness = (step - 1 - episodes.version).double()
    return {
        "reward/mean": float(episodes.rewards.sum()) / max(n, 1),
        **{f"reward/{name}": total / max(n, 1) for name, total in reward_sums.items()},
        "episode/length_mean": float(episodes.completion_lens.sum()) / max(n, 1),
        "episode/truncated_frac": float(episodes.truncated.sum()) / max(n, 1),
        **(multi_turn_metrics(episodes) if multi_turn else {}),
        "staleness/mean": float(staleness.sum()) / max(n, 1),
        "staleness/max": float(staleness.max()) if n else 0.0,
    }
