"""The policy trainer: FSDP2 policy with fp32 master weights, AdamW, the GRPO update.

Gradient normalisation: each minibatch's loss is the sum of per-token losses over the completion
tokens of every trainer rank, divided by that global token count. FSDP2 averages gradients over
the mesh, so each rank scales its share by the mesh size: the reduced gradient is then exactly
the gradient of the whole minibatch in one process, however it is split into micro-batches and ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.episode import EpisodeBatch
from grpo.loss import clipped_surrogate, token_sum
from grpo.packing import PackedRows, pack_episodes
from model import Transformer
from model.parallelize import parallelize


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup_steps` RL steps, then cosine decay to `min_lr_ratio` at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@dataclass
class _MicroBatch:
    rows: PackedRows
    old_logprobs: torch.Tensor | None = None


class Trainer:
    """Owns the sharded policy, its optimizer and LR schedule; `train(batch)` runs one RL step's updates."""

    def __init__(
        self,
        model: Transformer,
        mesh: DeviceMesh,
        device: torch.device,
        compute_dtype: torch.dtype,
        grpo: GRPOConfig,
        optim: OptimizerConfig,
        total_steps: int,
        micro_batch_size: int,
        temperature: float,
        activation_checkpointing: bool = False,
        compile: bool = False,
    ):
        self.mesh, self.device = mesh, device
        self.grpo, self.optim = grpo, optim
        self.micro_batch_size = micro_batch_size
        # Log-probs are those of the sampling distribution; greedy sampling scores at temperature 1.
        self.temperature = temperature if temperature > 0 else 1.0
        self.model = parallelize(model, mesh, compute_dtype, activation_checkpointing, compile)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=optim.lr,
            betas=tuple(optim.betas),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: lr_factor(step, optim.warmup_steps, total_steps, optim.min_lr_ratio),
        )
        self.group = mesh.get_group()

    def full_weights(self, dtype: torch.dtype) -> Iterator[tuple[str, tuple[slice, ...], torch.Tensor]]:
        """Whole parameters cast to dtype as engine weight updates, one at a time.
        Collective: every trainer rank must iterate."""
        for name, param in self.model.named_parameters():
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, (), tensor.detach().to(dtype)

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op, group=self.group)
        return tensor.tolist()

    def _micro_batches(self, batch: EpisodeBatch) -> list[list[_MicroBatch]]:
        """Split into `minibatches` minibatches of whole groups, each into packed micro-batches.

        Minibatch m holds the m-th slice of ALL trainer ranks' groups in prompt order, so the
        minibatches are those of a single process however the groups are spread over ranks. Every
        rank gets the same number of micro-batches per minibatch (padding with empty ones).
        """
        local_groups = torch.unique(batch.prompt_index, sorted=True).tolist()
        gathered: list[list[int]] = [[] for _ in range(dist.get_world_size(self.group))]
        dist.all_gather_object(gathered, local_groups, group=self.group)
        all_groups = torch.tensor(sorted(g for groups in gathered for g in groups), dtype=torch.long)
        minibatches = []
        for group_ids in torch.tensor_split(all_groups, self.grpo.minibatches):
            episodes = torch.isin(batch.prompt_index, group_ids).nonzero().flatten()
            chunks = [episodes[i : i + self.micro_batch_size] for i in range(0, len(episodes), self.micro_batch_size)]
            minibatches.append([_MicroBatch(pack_episodes(batch.select(c))) for c in chunks])
        counts = self._all_reduce([len(m) for m in minibatches], op=dist.ReduceOp.MAX)
        for micro_batches, count in zip(minibatches, counts):
            micro_batches.extend(_MicroBatch(None) for _ in range(int(count) - len(micro_batches)))
        return minibatches

    def _forward(self, rows: PackedRows | None):
        """Per-token log-probs and entropy [R, W] of a packed micro-batch (one pad token if empty)."""
        if rows is None:
            # An empty micro-batch still runs forward/backward: FSDP's collectives need every rank.
            tokens = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return self.model(tokens, targets=tokens, temperature=self.temperature)
        d = self.device
        return self.model(
            rows.tokens.to(d),
            positions=rows.positions.to(d),
            doc_ids=rows.doc_ids.to(d),
            targets=rows.targets.to(d),
            temperature=self.temperature,
        )

    def train(self, batch: EpisodeBatch) -> dict[str, float]:
        """One RL step on this rank's scored episodes (whole groups): num_iterations passes over the
        batch split into minibatches, one optimizer step per minibatch. Returns global metrics."""
        self.model.train()
        minibatches = self._micro_batches(batch)
        # π_old equals π_θ at the first update; it needs its own pass only when there are later ones.
        recompute_old = self.grpo.num_iterations > 1 or self.grpo.minibatches > 1
        if recompute_old:
            with torch.no_grad():
                # Empty micro-batches run too: every rank must join each FSDP all-gather.
                for mb in (mb for m in minibatches for mb in m):
                    logprobs = self._forward(mb.rows).logprobs
                    if mb.rows is not None:
                        mb.old_logprobs = logprobs
        sums = dict(loss=0.0, tokens=0.0, clipped=0.0, ratio=0.0, entropy=0.0, diff=0.0)
        maxima = dict(ratio=0.0, diff=0.0)
        grad_norms = []
        for iteration in range(self.grpo.num_iterations):
            for micro_batches in minibatches:
                local_tokens = sum(float(mb.rows.loss_mask.sum()) for mb in micro_batches if mb.rows is not None)
                global_tokens = max(self._all_reduce([local_tokens])[0], 1.0)
                for mb in micro_batches:
                    out = self._forward(mb.rows)
                    if mb.rows is None:
                        (out.logprobs.sum() * 0.0).backward()
                        continue
                    mask = mb.rows.loss_mask.to(self.device)
                    old = mb.old_logprobs if recompute_old else out.logprobs.detach()
                    terms = clipped_surrogate(
                        out.logprobs,
                        old,
                        mb.rows.advantages.to(self.device),
                        self.grpo.clip_eps_low,
                        self.grpo.clip_eps_high,
                    )
                    loss = token_sum(terms.loss, mask) / global_tokens
                    if self.grpo.entropy_coef:
                        loss = loss - self.grpo.entropy_coef * token_sum(out.entropy, mask) / global_tokens
                    (loss * self.mesh.size()).backward()
                    if iteration == 0:
                        diff = (old - mb.rows.gen_logprobs.to(self.device)).abs() * mask
                        sums["diff"] += float(diff.sum())
                        maxima["diff"] = max(maxima["diff"], float(diff.max()))
                    sums["loss"] += float(loss.detach())
                    sums["tokens"] += float(mask.sum())
                    sums["clipped"] += float(token_sum(terms.clipped.float(), mask))
                    sums["ratio"] += float(token_sum(terms.ratio, mask))
                    sums["entropy"] += float(token_sum(out.entropy.detach(), mask))
                    maxima["ratio"] = max(maxima["ratio"], float((terms.ratio * mask).max()))
                grad_norms.append(self._optimizer_step())
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()

        loss, tokens, clipped, ratio, entropy, diff = self._all_reduce(list(sums.values()))
        ratio_max, diff_max = self._all_reduce(list(maxima.values()), op=dist.ReduceOp.MAX)
        updates = self.grpo.num_iterations * self.grpo.minibatches
        first_pass_tokens = tokens / self.grpo.num_iterations
        return {
            "loss/policy": loss / updates,
            "loss/clip_frac": clipped / tokens,
            "loss/ratio_mean": ratio / tokens,
            "loss/ratio_max": ratio_max,
            "loss/entropy": entropy / tokens,
            "loss/grad_norm": sum(grad_norms) / len(grad_norms),
            "logprob_diff/mean": diff / first_pass_tokens,
            "logprob_diff/max": diff_max,
            "optimizer/lr": lr,
        }

    def _optimizer_step(self) -> float:
        max_norm = self.optim.max_grad_norm if self.optim.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)
