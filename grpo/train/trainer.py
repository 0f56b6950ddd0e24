"""The policy trainer: fp32 master weights (FSDP2-sharded over several ranks), bf16 compute, AdamW,
the GRPO update. On one rank the masters are not wrapped in FSDP2: `OneRankMixedPrecision` does
the same arithmetic without its host-side bookkeeping (model/mixed_precision.py).

Gradient normalisation: each minibatch's loss is the sum of per-token losses over the completion
tokens of every trainer rank, divided by that global token count. FSDP2 averages gradients over
the mesh, so each rank scales its share by the mesh size: the reduced gradient is then exactly
the gradient of the whole minibatch in one process, however it is split into micro-batches and ranks.

Non-finite updates: an optimizer step whose minibatch loss or global gradient norm is NaN or inf is
skipped on every trainer rank alike (weights and optimizer state untouched), counted in the
"train/skipped_updates" metric and described in `Trainer.last_skip_reason`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from grpo.config import GRPOConfig, OptimizerConfig
from grpo.distributed.collectives import all_reduce
from grpo.rollout.episode import EpisodeBatch
from grpo.train.loss import LossSettings, Normalizers, policy_loss
from grpo.train.optim import build_optimizer, clip_gradients
from grpo.train.packing import PackedRows, concat_rows, micro_batch_episodes, pack_episodes
from grpo.train.tally import Tally
from model import Transformer
from model.attention import to_device
from model.lora import LoRASpec, apply_lora
from model.mixed_precision import OneRankMixedPrecision
from model.parallelize import parallelize

# Micro-batches per no-grad forward by default. Those passes keep no activations, so a forward of
# four holds about what one training micro-batch keeps for its backward; and a small model's
# forward waits on the host at every layer (on one H200 at the Qwen3-0.6B shape, a 16k-token
# forward takes the host longer to launch than the device to run), so fewer, larger ones are faster.
FROZEN_PASS_MICRO_BATCHES = 4


@dataclass
class _MicroBatch:
    """Packed rows of one forward/backward (None: an empty micro-batch that keeps ranks in step)."""

    rows: PackedRows | None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


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
        micro_batch_tokens: int,
        temperature: float,
        max_new_tokens: int,
        activation_checkpointing: bool = False,
        compile: bool = False,
        reference: Transformer | None = None,
        fsdp_on_one_rank: bool = False,
        lora: LoRASpec | None = None,
        frozen_pass_tokens: int = 0,
        share_prompts: bool = False,
    ):
        """`model` and `reference` (needed when grpo.kl_coef > 0: the frozen policy the KL penalty
        pulls toward) are fp32 models on this rank's device; both get sharded over `mesh`.
        micro_batch_tokens: the most tokens (prompt + completion) one forward/backward packs.
        frozen_pass_tokens: the most tokens one no-grad forward (π_old's and the reference's
        log-probs) packs, in whole micro-batches; 0 = FROZEN_PASS_MICRO_BATCHES micro-batches.
        share_prompts: pack a prompt's episodes with the prompt once (packing.py pack_episodes).
        fsdp_on_one_rank: wrap a one-rank mesh in FSDP2 anyway (the reference the one-rank path
        is tested against).
        lora: train low-rank adapters of a frozen base instead (model/lora.py); the base is cast
        to compute_dtype and gets neither masters nor optimizer state."""
        self.mesh, self.device = mesh, device
        self.grpo, self.optim = grpo, optim
        self.micro_batch_tokens, self.share_prompts = micro_batch_tokens, share_prompts
        # Whole micro-batches per frozen forward: a count, not a token sum, so that every rank runs
        # the same number of forwards (FSDP's all-gathers need every rank).
        self.frozen_group = (
            max(1, frozen_pass_tokens // micro_batch_tokens) if frozen_pass_tokens else FROZEN_PASS_MICRO_BATCHES
        )
        # Log-probs are those of the sampling distribution; greedy sampling scores at temperature 1.
        self.temperature = temperature if temperature > 0 else 1.0
        if (reference is not None) != (grpo.kl_coef > 0):
            raise ValueError("a reference model is needed exactly when grpo.kl_coef > 0")
        self.lora = lora
        structure = None
        if lora is not None:
            structure = functools.partial(apply_lora, spec=lora, base_dtype=compute_dtype)
            structure(model)
        self._wrap(model, reference, compute_dtype, activation_checkpointing, compile, fsdp_on_one_rank, structure)
        self.loss_settings = LossSettings.from_config(grpo, max_new_tokens)
        # What changes when the policy trains: everything, or with LoRA the adapters and the extra
        # trainable parameters (all that a step's weight sync sends and a checkpoint holds).
        self.trained_names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], optim, total_steps, device
        )
        self.group = mesh.get_group()
        # Why the last train() call skipped an update ("" when it skipped none).
        self.last_skip_reason = ""

    def _wrap(self, model: Transformer, reference: Transformer | None, compute_dtype: torch.dtype,
              activation_checkpointing: bool, compile: bool, fsdp_on_one_rank: bool,
              structure: Callable[[Transformer], None] | None) -> None:
        """`model` becomes the fp32 masters (what the optimizer steps, checkpoints hold and weight
        sync sends) and `policy` what runs forward: FSDP2 over several ranks, the plain compute copy
        on one (model/mixed_precision.py); the reference likewise, frozen."""
        self.one_rank: OneRankMixedPrecision | None = None
        self.reference = None
        if self.mesh.size() == 1 and not fsdp_on_one_rank:
            self.one_rank = OneRankMixedPrecision(model, compute_dtype, activation_checkpointing, compile, structure)
            self.model, self.policy = model, self.one_rank
            if reference is not None:
                # Frozen: its compute-dtype cast is all FSDP2 would have made of it on one rank.
                self.reference = reference.requires_grad_(False).to(compute_dtype).eval()
                self.reference.keep_rope_on(self.device)
        else:
            self.model = self.policy = parallelize(model, self.mesh, compute_dtype, activation_checkpointing, compile)
            if reference is not None:
                self.reference = parallelize(reference.requires_grad_(False), self.mesh, compute_dtype).eval()

    def full_weights(
        self, dtype: torch.dtype, names: Collection[str] | None = None
    ) -> Iterator[tuple[str, tuple[slice, ...], torch.Tensor]]:
        """Whole parameters (those in `names`, default all) cast to dtype as engine weight updates,
        one at a time. Collective: every trainer rank must iterate."""
        for name, param in self.model.named_parameters():
            if names is not None and name not in names:
                continue
            tensor = param.full_tensor() if isinstance(param, DTensor) else param
            yield name, (), tensor.detach().to(dtype)

    def _micro_batches(self, batch: EpisodeBatch) -> list[list[_MicroBatch]]:
        """Split into `minibatches` minibatches of whole groups, each into packed micro-batches of
        at most micro_batch_tokens tokens (first fit, longest episodes first).

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
            chunks = micro_batch_episodes(batch, episodes, self.micro_batch_tokens, self.share_prompts)
            minibatches.append([
                _MicroBatch(pack_episodes(batch.select(c), mask_truncated=self.grpo.mask_truncated,
                                          share_prompts=self.share_prompts))
                for c in chunks
            ])
        counts = all_reduce(dict(enumerate(len(m) for m in minibatches)), self.group, dist.ReduceOp.MAX, self.device)
        for micro_batches, count in zip(minibatches, counts.values()):
            micro_batches.extend(_MicroBatch(None) for _ in range(int(count) - len(micro_batches)))
        return minibatches

    def _forward(self, rows: PackedRows | None, model: Transformer | None = None):
        """Per-token log-probs and entropy [R, W] of a packed micro-batch (one pad token if empty),
        under the policy or the given model; 0 at tokens that carry no loss (the output head skips
        them: every use of the log-probs is masked by the loss)."""
        model = self.policy if model is None else model
        if rows is None:
            # An empty micro-batch still runs forward/backward: FSDP's collectives need every rank.
            tokens = torch.zeros((1, 1), dtype=torch.long, device=self.device)
            return model(tokens, targets=tokens, temperature=self.temperature)
        return model(
            self._to_device(rows.tokens),
            positions=self._to_device(rows.positions),
            # Left on the host: the model reads only the sequence layout from it.
            doc_ids=rows.doc_ids,
            targets=self._to_device(rows.targets),
            temperature=self.temperature,
            group_ids=rows.group_ids,
            head_mask=rows.loss_mask > 0,
        )

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor on the training device, copied without making the host wait for the device."""
        return to_device(tensor, self.device)

    def train(self, batch: EpisodeBatch) -> dict[str, float]:
        """One RL step on this rank's scored episodes (whole groups): num_iterations passes over the
        batch split into minibatches, one optimizer step per minibatch. Returns global metrics."""
        self.policy.train()
        if self.one_rank is not None:
            self.one_rank.prepare()
        try:
            return self._train(batch)
        finally:
            if self.one_rank is not None:
                self.one_rank.release()

    def _train(self, batch: EpisodeBatch) -> dict[str, float]:
        minibatches = self._micro_batches(batch)
        # π_old equals π_θ at the first update; it needs its own pass only when there are later ones.
        recompute_old = self.grpo.num_iterations > 1 or self.grpo.minibatches > 1
        self._frozen_passes([mb for m in minibatches for mb in m], recompute_old)
        # Summed and maximal statistics stay on the device until the step ends: reading them per
        # micro-batch would make the host wait for the device every time.
        tally = Tally(self.device)
        # Global minibatch losses and gradient norms of the updates that were applied.
        losses: list[float] = []
        grad_norms: list[float] = []
        skipped = 0
        self.last_skip_reason = ""
        updates = self.grpo.num_iterations * self.grpo.minibatches
        norms = [self._normalizers(micro_batches) for micro_batches in minibatches]
        for iteration in range(self.grpo.num_iterations):
            for m, (micro_batches, norm) in enumerate(zip(minibatches, norms)):
                local_loss = torch.zeros((), dtype=torch.float64, device=self.device)
                for mb in micro_batches:
                    local_loss += self._backward(mb, norm, recompute_old, tally, first_iteration=iteration == 0)
                loss, grad_norm, reason = self._update(local_loss)
                if reason:
                    skipped += 1
                    self.last_skip_reason = f"{reason} in update {iteration * len(minibatches) + m + 1} of {updates}"
                else:
                    losses.append(loss)
                    grad_norms.append(grad_norm)
        # The schedule follows RL steps, not applied updates: a skipped update does not delay it.
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        return self._metrics(tally, losses, grad_norms, skipped, lr)

    @torch.no_grad()
    def _frozen_passes(self, micro_batches: list[_MicroBatch], recompute_old: bool) -> None:
        """π_old's log-probs (when recompute_old) and the reference's (with a KL term) for every
        micro-batch, before any update, `frozen_group` micro-batches per forward. Empty micro-batches
        run too: every rank must join each FSDP all-gather."""
        if not recompute_old and self.reference is None:
            return
        for start in range(0, len(micro_batches), self.frozen_group):
            chunk = micro_batches[start : start + self.frozen_group]
            rows, widths = concat_rows([mb.rows for mb in chunk])
            if recompute_old:
                for mb, logprobs in zip(chunk, _split_columns(self._forward(rows).logprobs, widths)):
                    mb.old_logprobs = logprobs
            if self.reference is not None:
                for mb, logprobs in zip(chunk, _split_columns(self._forward(rows, self.reference).logprobs, widths)):
                    mb.ref_logprobs = logprobs

    def _backward(
        self, mb: _MicroBatch, norm: Normalizers, recompute_old: bool, tally: Tally, first_iteration: bool
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch's share of the minibatch loss; returns that share
        (0-d, detached) and adds its statistics (and, in the first iteration, the generator-trainer
        log-prob gap) to `tally`."""
        out = self._forward(mb.rows)
        if mb.rows is None:
            (out.logprobs.sum() * 0.0).backward()
            return torch.zeros((), dtype=torch.float64, device=self.device)
        rows = mb.rows
        mask = self._to_device(rows.loss_mask)
        gen = self._to_device(rows.gen_logprobs)
        old = mb.old_logprobs if recompute_old else out.logprobs.detach()
        terms = policy_loss(
            out.logprobs,
            old,
            gen,
            mb.ref_logprobs,
            out.entropy,
            self._to_device(rows.advantages),
            mask,
            self._to_device(rows.doc_ids),
            self.loss_settings,
            norm,
            num_seqs=int(rows.doc_ids.max()) + 1,
        )
        (terms.loss * norm.world_size).backward()
        if self.one_rank is not None:
            self.one_rank.accumulate()
        if self.share_prompts:
            # A fill, not a copy from the host: a copy would wait for the work queued before it.
            tally.add("packed_tokens", torch.full((), float(rows.tokens.shape[1]), device=self.device))
        for key, value in terms.stats.items():
            if key == "ratio_max":
                tally.max("ratio_max", value)
            else:
                tally.add(key, value)
        if first_iteration:
            diff = (old - gen).abs() * mask
            tally.add("diff_sum", diff.sum())
            tally.max("diff_max", diff.max())
            tally.add("diff_exact", ((old == gen) & (mask > 0)).sum())
        return terms.loss.detach()

    def _metrics(
        self, tally: Tally, losses: list[float], grad_norms: list[float], skipped: int, lr: float
    ) -> dict[str, float]:
        """The step's training metrics, reduced over the trainer ranks."""
        summed, maxima = tally.global_values(self.group)
        diff_total = summed.get("diff_sum", 0.0)
        ratio_max, diff_max = maxima.get("ratio_max", 0.0), maxima.get("diff_max", 0.0)
        tokens = max(summed.get("tokens", 0.0), 1.0)
        metrics = {
            "loss/policy": _mean(losses),
            "loss/clip_frac": summed.get("clipped", 0.0) / tokens,
            "loss/ratio_mean": summed.get("ratio_sum", 0.0) / tokens,
            "loss/ratio_max": ratio_max,
            "loss/entropy": summed.get("entropy_sum", 0.0) / tokens,
            "loss/grad_norm": _mean(grad_norms),
            "logprob_diff/mean": diff_total / (tokens / self.grpo.num_iterations),
            "logprob_diff/max": diff_max,
            "logprob_diff/exact_frac": summed.get("diff_exact", 0.0) / (tokens / self.grpo.num_iterations),
            "optimizer/lr": lr,
            "train/skipped_updates": float(skipped),
            "train/loss_tokens": summed.get("tokens", 0.0),
        }
        if self.reference is not None:
            metrics["loss/kl"] = summed.get("kl_sum", 0.0) / tokens
        if self.share_prompts:
            metrics["train/tokens_computed"] = summed.get("packed_tokens", 0.0)
        if self.loss_settings.tis_cap > 0:
            metrics["tis/clipped_frac"] = summed.get("tis_clipped", 0.0) / tokens
            metrics["tis/mean_weight"] = summed.get("tis_weight_sum", 0.0) / tokens
        return metrics

    def _normalizers(self, micro_batches: list[_MicroBatch]) -> Normalizers:
        """Global token and sequence counts of one minibatch (all trainer ranks)."""
        tokens = sequences = 0.0
        for mb in micro_batches:
            if mb.rows is None:
                continue
            tokens += float(mb.rows.loss_mask.sum())
            carrying = mb.rows.doc_ids[mb.rows.loss_mask > 0]
            sequences += float(torch.unique(carrying).numel())
        totals = all_reduce({"tokens": tokens, "sequences": sequences}, self.group, device=self.device)
        return Normalizers(
            global_tokens=max(totals["tokens"], 1.0),
            global_sequences=max(totals["sequences"], 1.0),
            micro_batches=len(micro_batches),
            world_size=self.mesh.size(),
        )

    def _update(self, local_loss: torch.Tensor) -> tuple[float, float, str]:
        """Apply one minibatch's accumulated gradients, unless its loss or their global norm is
        non-finite. Returns (global minibatch loss, global gradient norm, "" or why
        the update was skipped); every trainer rank returns the same. Collective."""
        # The loss is this rank's share: summing the shares makes it global, and a NaN or inf on any
        # rank then reaches every rank, so all decide alike (the gradient norm is global already).
        loss = local_loss.clone()
        dist.all_reduce(loss, group=self.group)
        loss = float(loss)
        if not math.isfinite(loss):
            self._zero_grad()
            return loss, float("nan"), f"non-finite loss ({loss})"
        grad_norm = self._optimizer_step()
        return loss, grad_norm, "" if math.isfinite(grad_norm) else f"non-finite gradient norm ({grad_norm})"

    def _optimizer_step(self) -> float:
        """Clip and apply the accumulated gradients, or only discard them when their global norm is
        non-finite; returns that norm."""
        norm = float(clip_gradients(self.model.parameters(), self.optim.max_grad_norm, self.group, self.device))
        if math.isfinite(norm):
            self.optimizer.step()
            if self.one_rank is not None:
                self.one_rank.invalidate()
        # Also when skipped: those gradients (NaN, or scaled by a NaN clip factor) must not reach the next update.
        self._zero_grad()
        return norm

    def _zero_grad(self) -> None:
        if self.one_rank is not None:
            self.one_rank.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)


def _split_columns(row: torch.Tensor, widths: list[int]) -> list[torch.Tensor | None]:
    """row [1, sum(widths)] cut into consecutive [1, w] views; None where w is 0."""
    parts = row.split([w for w in widths if w], dim=1) if any(widths) else []
    it = iter(parts)
    return [next(it) if w else None for w in widths]


def _mean(values: list[float]) -> float:
    """Mean of values; NaN for none (the metrics logger drops NaN)."""
    return sum(values) / len(values) if values else float("nan")
