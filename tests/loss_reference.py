"""The loss family's minibatch loss written out as Python loops over sequences and tokens of scalar
torch ops (autograd on the loop gives the formula's gradient): the independent expectation that
grpo/train/loss.py policy_loss is checked against."""

from __future__ import annotations

import math

import torch

from grpo.train.loss import LossSettings, Normalizers


def _surrogate(r, a: float, eps_low: float, eps_high: float, c: float):
    """-min(r A, clip(r) A), then min(., -c A) for A < 0 when dual clip is on; r a 0-d tensor."""
    clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)  # a float once clamped: no gradient through it
    loss = -min(r * a, clipped_r * a)
    if c > 0 and a < 0:
        loss = min(loss, -c * a)
    return loss


def kl_term(logprob, ref: float, estimator: str):
    d = ref - logprob
    return {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[estimator]


def reference_loss(t: dict, s: LossSettings, norm: Normalizers):
    """The minibatch-loss share of one micro-batch, token by token."""
    lp, old, gen, ref, ent = t["logprobs"], t["old"], t["gen"], t["ref"], t["entropy"]
    seqs: dict[int, list[tuple[int, int]]] = {}
    for r in range(lp.shape[0]):
        for c in range(lp.shape[1]):
            if float(t["mask"][r, c]) == 1.0:
                seqs.setdefault(int(t["seq_ids"][r, c]), []).append((r, c))
    micro_batch_tokens = sum(len(toks) for toks in seqs.values())
    total = torch.zeros((), dtype=lp.dtype)
    for toks in seqs.values():
        a = float(t["advantages"][toks[0]])
        n = len(toks)
        if s.loss_type == "gspo":
            s_i = torch.exp(sum(lp[k] - old[k] for k in toks) / n)
            seq_surrogate = _surrogate(s_i, a, s.gspo_clip_eps_low, s.gspo_clip_eps_high, s.clip_ratio_c)
        seq_w = math.exp(sum(float(old[k] - gen[k]) for k in toks))
        seq_total = 0.0
        for k in toks:
            if s.loss_type == "gspo":
                surrogate = seq_surrogate
            else:
                surrogate = _surrogate(torch.exp(lp[k] - old[k]), a, s.clip_eps_low, s.clip_eps_high, s.clip_ratio_c)
            weight = 1.0
            if s.tis_cap > 0:
                w = seq_w if s.tis_level == "sequence" else math.exp(float(old[k] - gen[k]))
                weight = min(w, s.tis_cap) if s.tis_mode == "truncate" else (0.0 if w > s.tis_cap else 1.0)
            term = weight * surrogate
            if s.kl_coef > 0:
                term = term + s.kl_coef * kl_term(lp[k], float(ref[k]), s.kl_estimator)
            term = term - s.entropy_coef * ent[k]
            seq_total = seq_total + term
        if s.loss_type in ("grpo", "gspo"):
            total = total + seq_total / n / norm.global_sequences
        elif s.loss_type == "dapo":
            total = total + seq_total / norm.global_tokens
        elif s.loss_type == "dr_grpo":
            total = total + seq_total / (norm.global_sequences * s.max_new_tokens)
        else:  # bnpo
            total = total + seq_total / micro_batch_tokens / norm.micro_batches / norm.world_size
    return total


def grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """d loss / d leaf, zeros for leaves the loss does not use (entropy without a bonus)."""
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]


def loss_kwargs(t: dict) -> dict:
    return dict(
        logprobs=t["logprobs"],
        old_logprobs=t["old"],
        gen_logprobs=t["gen"],
        ref_logprobs=t["ref"],
        entropy=t["entropy"],
        advantages=t["advantages"],
        mask=t["mask"],
        seq_ids=t["seq_ids"],
    )
