"""The adapters to other libraries' environments (grpo/envs/adapters): verifiers 0.4 and skyrl-gym 0.4.

Each adapter's environments run through the real multi-turn rollout with a scripted engine: the
episode is the prompt, the sampled turns and the environment's messages in the chat template,
token for token, with the loss on the sampled tokens only; the reward is what the package's own
scoring gives the same conversation, computed here without the adapter; tool calls are counted.
A short training run drives a verifiers environment end to end. Tests of a package skip when it
is not installed (`pip install -e ".[verifiers,skyrl-gym]"`).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import json
import os
import sqlite3
import subprocess
import sys
import time

import pytest

from fixtures.hf import build_checkpoint, build_tokenizer
from grpo.data.digits import CharTokenizer
from grpo.data.files import render_prompt
from grpo.data.prompt import Prompt
from grpo.data.tokenizer import load_hf_tokenizer
from grpo.engine import Completion, SamplingParams
from grpo.envs import EnvironmentLoadError, make_environment
from grpo.envs.adapters.chat import ChatReplies
from grpo.envs.relay import DigitRelay
from grpo.rollout.conversation import EnvironmentFailure, generate_conversations
from tests.test_e2e import REPO, command, launch_env, metrics

FIXTURES = REPO / "tests" / "fixtures"
SMOLLM2 = REPO / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module", params=["fixture", "smollm2"])
def tokenizer(request, tmp_path_factory):
    """The test BPE with a ChatML template, and SmolLM2's own tokenizer where the checkout has it."""
    if request.param == "fixture":
        return load_hf_tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))
    if not SMOLLM2.exists():
        pytest.skip(f"no {SMOLLM2.relative_to(REPO)} (python scripts/get_smollm2.py makes it)")
    return load_hf_tokenizer(SMOLLM2)


@pytest.fixture
def verifiers(monkeypatch):
    """verifiers.v1, with the test environments importable by their taskset ids."""
    vf = pytest.importorskip("verifiers.v1", reason='needs verifiers: pip install -e ".[verifiers]"')
    monkeypatch.syspath_prepend(str(FIXTURES))
    return vf


class Scripted:
    """An engine whose sample s says scripts[s][k] as its k-th turn (each turn ends with <|im_end|>)."""

    def __init__(self, tokenizer, scripts: list[list[str]]):
        end = tokenizer.eos_ids[-1]
        self.scripts = [[tokenizer.encode(text) + [end] for text in turns] for turns in scripts]
        self.turns = collections.Counter()

    def generate(self, requests, sampling=None):
        out = []
        for r in requests:
            tokens = self.scripts[r.sample_index][self.turns[r.prompt_index, r.sample_index]]
            self.turns[r.prompt_index, r.sample_index] += 1
            out.append(Completion(r, list(tokens), [-0.5] * len(tokens), "eos", 1))
        return out


def converse(env, tokenizer, prompt: Prompt, scripts: list[list[str]], max_tokens: int = 400):
    engine = Scripted(tokenizer, scripts)
    batch, stats = generate_conversations(engine, env, [prompt], len(scripts), 1, tokenizer, tokenizer.pad_id,
                                          SamplingParams(max_new_tokens=64), max_tokens=max_tokens)
    return engine, batch, stats


def check_episode(batch, i: int, tokenizer, prompt: Prompt, engine: Scripted, heard: list[str]) -> None:
    """Episode i is the prompt, then model turn k and heard[k] in turn (the chat template's text
    after the turn, encoded), with the loss mask on exactly the model's tokens."""
    want, mask = list(prompt.token_ids), [False] * len(prompt.token_ids)
    for k, turn in enumerate(engine.scripts[i][: len(heard) + 1]):
        want, mask = want + turn, mask + [True] * len(turn)
        if k < len(heard):
            reply = tokenizer.encode(heard[k])
            want, mask = want + reply, mask + [False] * len(reply)
    n = int(batch.seq_lens[i])
    assert batch.tokens[i, :n].tolist() == want
    assert batch.loss_mask[i, :n].tolist() == mask


def chat_prompt(tokenizer, index: int, text: str, system: str = "") -> Prompt:
    return Prompt(index, text, "", render_prompt(text, tokenizer, system_prompt=system))


# --- env.args, missing packages, chat rendering (no adapter package needed) ------------------------------


def test_env_messages_follow_the_model_turn_in_the_chat_template(tokenizer):
    """After a turn the model ended (<|im_end|> sampled) the template's closing follows; after one cut
    by its token budget, the end-of-turn marker first."""
    replies = ChatReplies(tokenizer)
    hint = [{"role": "user", "content": "higher"}]
    assert replies.text(hint, model_ended_turn=True) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    assert replies.text(hint, model_ended_turn=False) == "<|im_end|>\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match=r"needs a checkpoint's tokenizer with a chat template \(model.path\)"):
        ChatReplies(CharTokenizer())


def make_relay(seed: int = 0) -> DigitRelay:
    return DigitRelay(seed=seed)


def test_env_args_go_to_factories_and_builtins_refuse_them():
    assert make_environment("tests.test_env_adapters:make_relay", 0, None, args={"seed": 7}).seed == 7
    with pytest.raises(EnvironmentLoadError, match=r"^env.name = 'digit_relay': takes no env.args; got \['seed'\]$"):
        make_environment("digit_relay", 0, None, args={"seed": 7})
    with pytest.raises(EnvironmentLoadError, match=r"^env.name = 'tests.test_env_adapters:make_relay' cannot take "
                                                   r"env.args \['colour'\]: got an unexpected keyword argument 'colour'$"):
        make_environment("tests.test_env_adapters:make_relay", 0, None, args={"colour": "red"})


@pytest.mark.parametrize(("name", "package", "extra"), [("verifiers", "verifiers.v1", "verifiers"),
                                                        ("skyrl_gym", "skyrl_gym", "skyrl-gym")])
def test_a_missing_adapter_package_is_one_line_naming_its_extra(monkeypatch, name, package, extra):
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    with pytest.raises(EnvironmentLoadError) as error:
        make_environment(name, 0, None, args={})
    message = str(error.value)
    assert message.startswith(f"env.name = '{name}': needs the {extra} package (")
    assert message.endswith(f'): pip install -e ".[{extra}]"') and "\n" not in message


# --- verifiers -------------------------------------------------------------------------------------------

ADD, MUL, HALF_ADD = ('{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "mul", "arguments": {"a": 2, "b": 3}}',
                      '{"name": "add", "arguments": {"a": 2}}')
CALL = f"<tool_call>{ADD}</tool_call>"
BAD_CALLS = f"<tool_call>{MUL}</tool_call><tool_call>{HALF_ADD}</tool_call>"


def package_reward(vf, turns: list[tuple[str | None, list[str]]], adds: int) -> float:
    """What verifiers' own scoring gives this conversation of task 0 (2 + 3): the task's rewards over
    its assistant turns (their text, the tool calls they make), `adds` in the rollout's state."""
    from verifiers.v1 import graph
    from verifiers_sums import SYSTEM, AddLog, SumData, SumTask

    task = SumTask(SumData(prompt="What is 2 + 3?", answer="5", system_prompt=SYSTEM))
    trace = vf.Trace(task=vf.TraceTask(type="SumTask", data=task.data), agent=vf.AgentInfo(config=vf.AgentConfig()),
                     state=AddLog(adds=adds))
    messages = [vf.SystemMessage(content=task.data.system_prompt), vf.UserMessage(content=task.data.prompt)]
    for content, calls in turns:
        calls = [vf.ToolCall(id=f"c{i}", name=json.loads(c)["name"], arguments=json.dumps(json.loads(c)["arguments"]))
                 for i, c in enumerate(calls)]
        message = vf.AssistantMessage(content=content, tool_calls=calls or None)
        response = vf.Response(id="r", created=0, model="m", message=message, finish_reason="stop")
        graph.prepare_turn(trace, list(messages)).commit(response)
        messages.append(message)
    asyncio.run(task.score(trace))
    return trace.reward


def test_verifiers_tool_calls_are_answered_token_exact_and_scored_by_the_tasks_rewards(verifiers, tokenizer):
    """SingleAgentEnv over a taskset whose task has an `add` Toolset and two rewards (correct: 1,
    used_tool: 0.5, read from the tool's state): a call answered and a right answer (1.5), a wrong
    answer without tools (0), an unknown tool and a bad call answered as errors, then right (1.0)."""
    from verifiers_sums import SYSTEM

    env = make_environment("verifiers", 0, tokenizer, args={"taskset": {"id": "verifiers_sums"}})
    prompt = chat_prompt(tokenizer, 0, "What is 2 + 3?", SYSTEM)
    engine, batch, stats = converse(env, tokenizer, prompt, [[CALL, "5"], ["4"], [BAD_CALLS, "5"]])
    tool = "\n<|im_start|>tool\n{}<|im_end|>\n"
    assistant = "<|im_start|>assistant\n"
    check_episode(batch, 0, tokenizer, prompt, engine, [tool.format("5") + assistant])
    check_episode(batch, 1, tokenizer, prompt, engine, [])
    errors = (tool.format("error: unknown tool 'mul'")
              + tool.format("error: TypeError: Adder.add() missing 1 required positional argument: 'b'")[1:] + assistant)
    check_episode(batch, 2, tokenizer, prompt, engine, [errors])
    assert stats.turns == [2, 1, 2] and not batch.truncated.any()
    assert batch.tool_calls.tolist() == [1, 0, 2] and batch.tool_errors.tolist() == [0, 0, 2]
    assert batch.env_rewards.tolist() == [1.5, 0.0, 1.0]
    assert batch.env_rewards.tolist() == [package_reward(verifiers, [(None, [ADD]), ("5", [])], adds=1),
                                          package_reward(verifiers, [("4", [])], adds=0),
                                          package_reward(verifiers, [(None, [MUL, HALF_ADD]), ("5", [])], adds=0)]


def test_verifiers_env_run_answers_as_the_user_and_stops_end_scored_episodes(verifiers, tokenizer):
    """An Env whose own run() plays a game with the agent (interaction.turn(message), like verifiers'
    TextArena env): its hints come back as user turns; a solved game scores 1; the seat's max_turns
    (3) and the task's @vf.stop end a rollout, which the env still scores (0), never truncated."""
    args = {"taskset": {"id": "verifiers_guess"}, "player": {"max_turns": 3}}
    env = make_environment("verifiers", 0, tokenizer, args=args)
    assert env.max_turns == 3
    prompt = chat_prompt(tokenizer, 0, "Guess my number from 0 to 9.")  # task 0's target is 7
    engine, batch, stats = converse(env, tokenizer, prompt, [["3", "7"], ["9", "8", "6"], ["give up"]])
    hint = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    check_episode(batch, 0, tokenizer, prompt, engine, [hint.format("higher")])
    check_episode(batch, 1, tokenizer, prompt, engine, [hint.format("lower"), hint.format("lower")])
    check_episode(batch, 2, tokenizer, prompt, engine, [])
    assert stats.turns == [2, 3, 1] and stats.truncated_by_turns == 0 and not batch.truncated.any()
    assert batch.env_rewards.tolist() == [1.0, 0.0, 0.0]


def test_verifiers_episodes_cut_short_by_tandem_end_on_the_loop(verifiers, tokenizer):
    """An episode tandem truncates (its token budget) is never answered again: once the rollout
    drops it, its coroutine is cancelled rather than left waiting on the adapter's loop."""
    env = make_environment("verifiers", 0, tokenizer, args={"taskset": {"id": "verifiers_guess"}})
    prompt = chat_prompt(tokenizer, 0, "Guess my number from 0 to 9.")
    _, batch, _ = converse(env, tokenizer, prompt, [["1", "2"]] * 4, max_tokens=6)
    assert batch.truncated.all()
    del batch
    gc.collect()

    async def waiting() -> int:
        return sum(not task.done() for task in asyncio.all_tasks()) - 1  # this one

    deadline = time.monotonic() + 5
    while asyncio.run_coroutine_threadsafe(waiting(), env._loop).result() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert asyncio.run_coroutine_threadsafe(waiting(), env._loop).result() == 0


def test_verifiers_refusals_are_one_line(verifiers, tokenizer):
    """An unknown taskset at start-up; at the episode, a prompt that is not its task's, and a task
    scored by a hook that needs a runtime."""
    from verifiers_sums import SYSTEM

    with pytest.raises(EnvironmentLoadError, match=r"^env.name = 'verifiers': env.args do not give a verifiers env: "
                                                   r"taskset 'no_such_tasks' not found"):
        make_environment("verifiers", 0, tokenizer, args={"taskset": {"id": "no_such_tasks"}})
    env = make_environment("verifiers", 0, tokenizer, args={"taskset": {"id": "verifiers_sums"}})
    with pytest.raises(EnvironmentFailure, match=r"reset raised ValueError\(\"prompt 1 is not the prompt of verifiers "
                                                 r"task 1: data.path must list the taskset's prompts in task order"):
        converse(env, tokenizer, chat_prompt(tokenizer, 1, "What is 2 + 3?"), [["5"]])
    plugged = {"rewards": {"in_sandbox": {"fn": "verifiers_sums:in_sandbox"}}}  # a reward taking `runtime`
    env = make_environment("verifiers", 0, tokenizer, args={"taskset": {"id": "verifiers_sums", "task": plugged}})
    with pytest.raises(EnvironmentFailure, match=r"reset raised ValueError\(.SumTask needs what the adapter does not run "
                                                 r"\(a runtime, @vf.intercept, a Request or Response @vf.stop\): in_sandbox"):
        converse(env, tokenizer, chat_prompt(tokenizer, 0, "What is 2 + 3?", SYSTEM), [["5"]])


def test_verifiers_env_trains_end_to_end(verifiers, tmp_path):
    """Two colocated GRPO steps of the tiny checkpoint on the guessing env, its prompts written by
    export_prompts, selected by env.name and env.args on the command line: the run finishes and its
    metrics carry the turns and the env's reward."""
    from grpo.envs.adapters.verifiers import export_prompts

    args = {"taskset": {"id": "verifiers_guess"}, "player": {"max_turns": 3}}
    data = tmp_path / "guess.jsonl"
    assert export_prompts(args, data, count=8) is None  # no system prompt
    assert [json.loads(line)["question"] for line in data.read_text().splitlines()] == ["Guess my number from 0 to 9."] * 8
    checkpoint = build_checkpoint(tmp_path / "qwen3-tiny")
    out = tmp_path / "run"
    toml_args = "{taskset = {id = \"verifiers_guess\"}, player = {max_turns = 3}}"
    run = [f"--model.path={checkpoint}", f"--data.path={data}", "--training.steps=2", "--data.prompts_per_step=2",
           "--grpo.group_size=2", "--eval.num_prompts=2", "--generation.max_new_tokens=3", "--env.name=verifiers",
           f"--env.args={toml_args}", "--env.max_tokens=48", '--rewards.functions=["env_reward"]',
           "--rewards.num_workers=0", "--parallelism.mode=colocated", "--metrics.progress_bar=false",
           f"--job.output_dir={out}"]
    environ = {**launch_env(), "PYTHONPATH": f"{FIXTURES}{os.pathsep}{launch_env()['PYTHONPATH']}"}
    result = subprocess.run(command(run, None), cwd=REPO, env=environ, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        # multi-turn, and every episode ended by the env (scored), none by tandem's turn budget (a
        # final guess cut at generation.max_new_tokens counts as truncated, so that share may be > 0)
        assert 1 < row["episode/turns_mean"] <= 3 and row["env/turn_limited_frac"] == 0.0
        assert 0.0 <= row["reward/env_reward"] <= 1.0 and row["env/failed_frac"] == 0.0


# --- skyrl-gym -------------------------------------------------------------------------------------------


@pytest.fixture
def skyrl_gym():
    return pytest.importorskip("skyrl_gym", reason='needs skyrl-gym: pip install -e ".[skyrl-gym]"')


def replay(gym, env_class: str, env_config, extras: dict, actions: list[str]) -> tuple[list[str], float]:
    """The package's own run of these actions: each step's observation text and the summed reward."""
    env = gym.make(env_class, env_config=env_config, extras=extras)
    env.init([])
    observations, reward = [], 0.0
    for action in actions:
        out = env.step(action)
        reward += out["reward"]
        observations += [m["content"] for m in out["observations"]]
    return observations, reward


def test_skyrl_gym_multi_turn_gsm8k_is_token_exact_and_sums_its_turn_rewards(skyrl_gym, tokenizer):
    """The packaged gsm8k_multi_turn: the record's answer is the ground truth; its follow-up
    questions come back as user turns; the reward is the sum of its turn rewards (1 when right,
    0.2 / max_turns for a well-formed wrong answer)."""
    env = make_environment("skyrl_gym", 0, tokenizer, args={"env_class": "gsm8k_multi_turn", "extras": {"max_turns": 3}})
    prompt = chat_prompt(tokenizer, 0, "Natalia sold 48 clips in April and half as many in May. How many in total?")
    prompt.answer = "72"
    scripts = [["About 70.", "#### 72"], ["#### 70", "#### 71", "#### 71"]]
    engine, batch, stats = converse(env, tokenizer, prompt, scripts)
    extras = {"max_turns": 3, "reward_spec": {"ground_truth": "72"}, "extra_info": {}}
    user = "\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    for i, actions in enumerate(scripts):
        observations, reward = replay(skyrl_gym, "gsm8k_multi_turn", None, extras, actions)
        check_episode(batch, i, tokenizer, prompt, engine, [user.format(o) for o in observations])
        assert batch.env_rewards[i].item() == pytest.approx(reward)
    assert stats.turns == [2, 3] and batch.env_rewards.tolist() == pytest.approx([1.0, 0.2])


def test_skyrl_gym_text2sql_runs_its_sql_tool_and_scores_with_its_own_checker(skyrl_gym, tokenizer, tmp_path):
    """The packaged text2sql over a SQLite database written here (record fields db_id and data go to
    extras, the answer is the gold SQL): a query is a tool call whose result comes back as a user
    turn; the solution is scored by the package's execution match (1)."""
    database = tmp_path / "spider" / "database" / "shop"
    database.mkdir(parents=True)
    with sqlite3.connect(database / "shop.sqlite") as db:
        db.execute("CREATE TABLE items (name TEXT, price REAL)")
        db.executemany("INSERT INTO items VALUES (?, ?)", [("pen", 1.5), ("book", 12.0), ("lamp", 30.0)])
    args = {"env_class": "text2sql", "env_config": {"db_path": str(tmp_path)}, "extras": {"max_turns": 3}}
    env = make_environment("skyrl_gym", 0, tokenizer, args=args)
    gold = "SELECT name FROM items WHERE price > 10"
    prompt = chat_prompt(tokenizer, 0, "Which items cost more than 10?")
    prompt.answer, prompt.metadata = gold, {"db_id": "shop", "data": "spider"}
    actions = ["<think>list them</think><sql>SELECT name, price FROM items</sql>",
               f"<think>book and lamp</think><solution>{gold}</solution>"]
    engine, batch, stats = converse(env, tokenizer, prompt, [actions])
    from omegaconf import OmegaConf

    extras = {"max_turns": 3, "db_id": "shop", "data": "spider", "reward_spec": {"ground_truth": gold}, "extra_info": {}}
    observations, reward = replay(skyrl_gym, "text2sql", OmegaConf.create({"db_path": str(tmp_path)}), extras, actions)
    assert "book" in observations[0] and "lamp" in observations[0]
    check_episode(batch, 0, tokenizer, prompt, engine, ["\n<|im_start|>user\n" + observations[0]
                                                        + "<|im_end|>\n<|im_start|>assistant\n"])
    assert batch.env_rewards.tolist() == [reward] == [1.0]
    assert stats.turns == [2] and batch.tool_calls.tolist() == [1]


def test_skyrl_gym_own_env_classes_load_and_prompt_rewrites_are_refused(skyrl_gym, tokenizer):
    """env_class "module:Class" registers a BaseTextEnv of one's own; one whose init rewrites the
    prompt fails its episode with one line (the prompt's tokens are fixed by data.path)."""
    name = "tests.fixtures.skyrl_envs:SystemPrompted"
    env = make_environment("skyrl_gym", 0, tokenizer, args={"env_class": name})
    assert name in skyrl_gym.registry
    with pytest.raises(EnvironmentFailure, match=r"reset raised ValueError\(\"SystemPrompted.init rewrites the prompt, "
                                                 r"which tandem cannot follow"):
        converse(env, tokenizer, chat_prompt(tokenizer, 0, "hello"), [["hi"]])
    with pytest.raises(EnvironmentLoadError, match=r"^env.name = 'skyrl_gym': env.args.env_class = 'nope' is not a "
                                                   r"registered SkyRL-Gym environment \(registered: aime, "):
        make_environment("skyrl_gym", 0, tokenizer, args={"env_class": "nope"})

