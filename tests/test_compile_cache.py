"""The compiled blocks skip Inductor's on-disk graph caches (model/parallelize.py `compile_afresh`:
graphs loaded from them trained slower on the GPU), unless the launch's environment names a cache
setting. Three processes share one cache folder: two that keep the caches (the second loads the
first's graphs, so the cache works here) and one with the default, which loads none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Compiles a one-layer model's blocks, runs a forward and backward, and prints the cache counters.
SCRIPT = """
import json, torch
from torch._dynamo.utils import counters
from model.args import ModelArgs
from model.model import Transformer
from model.parallelize import compile_blocks
model = Transformer(ModelArgs(n_layers=1), dtype=torch.float32)
model.init_weights()
compile_blocks(model)
model(torch.randint(0, 32, (2, 8))).sum().backward()
print(json.dumps({"graph_hits": counters["inductor"]["fxgraph_cache_hit"],
                  "autograd_hits": counters["aot_autograd"]["autograd_cache_hit"]}))
"""


def cache_hits(cache_dir: Path, **env: str) -> dict[str, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    environment.update(env, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=environment, capture_output=True, text=True,
                            timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_compiled_blocks_load_no_graph_from_the_cache_unless_the_environment_asks(tmp_path):
    assert cache_hits(tmp_path, TORCHINDUCTOR_FX_GRAPH_CACHE="1") == {"graph_hits": 0, "autograd_hits": 0}
    kept = cache_hits(tmp_path, TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    assert kept["graph_hits"] > 0 and kept["autograd_hits"] > 0, "the environment's choice is kept"
    assert cache_hits(tmp_path) == {"graph_hits": 0, "autograd_hits": 0}
