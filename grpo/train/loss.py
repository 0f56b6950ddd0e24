"""The GRPO loss family as pure functions on per-token tensors [B, T] (B rows, T tokens).

Policies (README, "How it works"): π_θ is being optimised, π_old is the trainer's policy
before this batch's first update, π_gen generated the tokens. The surrogate clips r = π_θ / π_old:

    l_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)

and the π_gen → π_old gap is corrected separately by truncated importance sampling (TIS).
Per loss token t of sequence i:

    L_t = w_t * l_t + kl_coef * k_t - entropy_coef * H_t

l_t is the clipped surrogate (dual-clipped for A < 0 when clip_ratio_c > 0: l_t = min(l_t, -c A));
w_t the TIS weight on w = π_old / π_gen (per token, or exp(Σ_t∈i log w_t) per sequence):
min(w, cap) ("truncate") or 1[w ≤ cap] ("mask"), 1 when tis_cap = 0; k_t the KL estimate
(`kl_penalty`); H_t the entropy of π_θ. KL and entropy terms are not importance-weighted. The
minibatch loss, with G = global_sequences and N = global_tokens:

    grpo    Σ_i (Σ_t∈i L_t / T_i) / G               DeepSeekMath, Shao et al. 2024
    dapo    Σ_t L_t / N                             Yu et al. 2025
    dr_grpo Σ_t L_t / (G · max_new_tokens)          Liu et al. 2025, "Understanding R1-Zero-like training"
    gspo    as grpo, with l_t = -min(s_i A_i, clip(s_i, 1 - gspo_eps_low, 1 + gspo_eps_high) A_i)
            for every t of i, s_i = exp(mean_t∈i (log π_θ - log π_old))    Zheng et al. 2025

so gspo's total is Σ_i (l_i · mean_t∈i w_t + mean_t∈i (KL and entropy terms)) / G (mean_t w_t =
w_i at the sequence level; dual clip applies to s_i). bnpo (Xiao et al. 2025) is defined per
micro-batch: its share is Σ_t L_t / T_mb / micro_batches / world_size, T_mb this micro-batch's loss
tokens, so that the minibatch loss is the mean over ranks and micro-batches of per-micro-batch
token means.

A row may pack several sequences: `seq_ids` [B, T] gives each token's sequence within the
micro-batch (-1 on padding) and `mask` [B, T] marks the tokens that carry loss. `policy_loss`
returns a micro-batch's *share* of the minibatch loss; the shares of all micro-batches on all ranks
sum to the minibatch loss, so its gradient does not depend on how the minibatch is split (bnpo, whose
loss is defined per micro-batch, is the one exception).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import torch

from grpo.config.sections import GRPOConfig, KLEstimator, LossType, TISLevel, TISMode

LOSS_TYPES = typing.get_args(LossType)
KL_ESTIMATORS = typing.get_args(KLEstimator)


@dataclass
class LossSettings:
    """Which loss of the family, and its constants.

    loss_type picks the aggregation (see `policy_loss`); clip_eps_low / clip_eps_high bound the
    token ratio (asymmetric "clip-higher", Yu et al. 2025 "DAPO"); clip_ratio_c is the dual-clip
    constant for A < 0 (0 = off, > 1 when on; Ye et al. 2020 "Mastering Complex Control in MOBA
    Games with Deep RL"); gspo_clip_eps_* bound GSPO's sequence ratio (Zheng et al. 2025 "Group
    Sequence Policy Optimization"); kl_estimator is one of Schulman 2020 "Approximating KL
    divergence"; tis_cap > 0 turns on truncated importance sampling on π_old / π_gen; max_new_tokens
    is dr_grpo's constant normaliser.
    """

    loss_type: LossType = "dapo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip_ratio_c: float = 0.0
    gspo_clip_eps_low: float = 3e-4
    gspo_clip_eps_high: float = 4e-4
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    tis_cap: float = 0.0
    tis_level: TISLevel = "token"
    tis_mode: TISMode = "truncate"
    max_new_tokens: int = 1

    @classmethod
    def from_config(cls, grpo: GRPOConfig, max_new_tokens: int) -> LossSettings:
        """The settings of the [grpo] section (the fields both share), with the generator's
        max_new_tokens. tis_cap = -1 (auto) means off here: the config loader resolves it by
        training.schedule, and a GRPOConfig built without the loader trains on its own generations."""
        shared = {f.name for f in dataclasses.fields(cls)} & {f.name for f in dataclasses.fields(grpo)}
        settings = {name: getattr(grpo, name) for name in shared}
        return cls(**settings | {"tis_cap": max(grpo.tis_cap, 0.0), "max_new_tokens": max_new_tokens})

    def __post_init__(self) -> None:
        for name, allowed in (
            ("loss_type", LOSS_TYPES),
            ("kl_estimator", KL_ESTIMATORS),
            ("tis_level", typing.get_args(TISLevel)),
            ("tis_mode", typing.get_args(TISMode)),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # c <= 1 would cap the loss of tokens whose ratio is still inside the trust region.
        if self.clip_ratio_c != 0 and self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c must be 0 (off) or > 1, got {self.clip_ratio_c}")
        if self.tis_cap < 0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Normalizers:
    """Counts that make a micro-batch's loss a share of the whole minibatch's loss."""

    global_tokens: float  # loss-carrying tokens of the minibatch over all trainer ranks
    global_sequences: float  # sequences (episodes) of the minibatch over all trainer ranks (those with ≥1 loss token)
    micro_batches: int  # micro-batches of this minibatch on this rank (bnpo averages over them)
    world_size: int  # trainer ranks (bnpo averages over ranks)


# LossTerms.stats keys that are sums over tokens or sequences (the one more, "ratio_max", is a max).
SUMMED_STATS = ("tokens", "clipped", "ratio_sum", "kl_sum", "entropy_sum", "tis_clipped", "tis_weight_sum", "sequences")


@dataclass
class LossTerms:
    """A micro-batch's share of the minibatch loss (scalar, with grad) and its logging statistics.

    stats are detached 0-d tensors, sums over this micro-batch's loss tokens unless stated:
    "tokens" (count), "clipped" (count of tokens whose clip binds), "ratio_sum", "ratio_max" (a max),
    "kl_sum" (the chosen estimator; 0 without a reference), "entropy_sum", "tis_clipped" (count of
    tokens with π_old / π_gen above the cap), "tis_weight_sum" (the weight applied to the surrogate;
    1 per token when TIS is off), "sequences" (count of sequences with ≥ 1 loss token).
    """

    loss: torch.Tensor
    stats: dict[str, torch.Tensor]


@dataclass
class SurrogateTerms:
    """Per-token loss [B, T] and the statistics logged with it ([B, T] each)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    clipped: torch.Tensor


def _surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    clip_ratio_c: float,
) -> SurrogateTerms:
    """Clipped surrogate of r = exp(log_ratio), dual-clipped for A < 0 when clip_ratio_c > 0. [B, T] each."""
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps_low, 1 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    # The clip is active where it lowers the objective: r above the band with A > 0, below it with A < 0.
    active = ((ratio > 1 + clip_eps_high) & (advantages > 0)) | ((ratio < 1 - clip_eps_low) & (advantages < 0))
    if clip_ratio_c > 0:
        # Dual clip: with A < 0 the loss |A| * max(r, clip(r)) grows without bound in r; cap it at c * |A|.
        dual = (advantages < 0) & (loss > -clip_ratio_c * advantages)
        loss = torch.where(dual, -clip_ratio_c * advantages, loss)
        active = active | dual
    return SurrogateTerms(loss=loss, ratio=ratio.detach(), clipped=active)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate [B, T] of KL(π_θ || π_ref) from samples of π_θ (Schulman 2020,
    "Approximating KL divergence"). With δ = log π_ref - log π_θ:
    k1 = -δ (unbiased, can be negative), k2 = δ² / 2, k3 = exp(δ) - δ - 1 (unbiased, ≥ 0)."""
    delta = ref_logprobs - logprobs
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        return torch.exp(delta) - delta - 1
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _sequence_sum(values: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """Per-sequence sums [num_seqs] of values [B, T]; values must be 0 where seq_ids is -1 (padding)."""
    return values.new_zeros(num_seqs).index_add(0, seq_ids.clamp(min=0).flatten(), values.flatten())


def _per_token(per_sequence: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Each token's sequence value [B, T] from per_sequence [S]; padding gets sequence 0's (callers mask it)."""
    return per_sequence[seq_ids.clamp(min=0)]


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_ids: torch.Tensor,
    settings: LossSettings,
    norm: Normalizers,
    num_seqs: int | None = None,
) -> LossTerms:
    """One micro-batch's share of the minibatch policy loss (the module docstring's formulas): its
    part of the minibatch loss's sum. All inputs [B, T].

    logprobs = log π_θ (with grad), old_logprobs = log π_old, gen_logprobs = log π_gen,
    ref_logprobs = log π_ref (needed when kl_coef > 0), entropy of π_θ per token, advantages per token
    (constant within a sequence), mask float {0, 1} (tokens that carry loss), seq_ids int64 (sequence
    index within the micro-batch, -1 on padding).

    Stats: see `LossTerms`. For gspo, "ratio_*" are over s_i repeated on each loss token of i, and
    "clipped" counts the loss tokens of sequences whose sequence clip binds, so that clipped / tokens
    stays a token fraction.
    """
    s = settings
    if s.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    valid = mask > 0
    dtype = logprobs.dtype
    # Prompt and padding positions hold arbitrary log-probs (gen_logprobs is 0 there); zeroing the
    # differences keeps every exp() finite so they cannot leak inf / NaN into the loss or its gradient.
    log_ratio = torch.where(valid, logprobs - old_logprobs, 0.0)
    # Known to the caller, it spares reading seq_ids back from the device.
    num_seqs = max(int(seq_ids.max()) + 1 if num_seqs is None else num_seqs, 1)
    seq_tokens = _sequence_sum(valid.to(dtype), seq_ids, num_seqs)
    surrogate = _policy_surrogate(log_ratio, advantages, seq_ids, seq_tokens, num_seqs, s)
    weight, over_cap = _tis_weight(old_logprobs, gen_logprobs, valid, seq_ids, num_seqs, s)
    per_token = weight * surrogate.loss

    kl = None
    if ref_logprobs is not None:
        # On loss tokens only: at a prompt or padding position log π_ref - log π_θ can exceed ~88,
        # where exp overflows fp32 and the masked-out inf still turns the gradient into NaN (0 · inf).
        kl = kl_penalty(torch.where(valid, logprobs, 0.0), torch.where(valid, ref_logprobs, 0.0), s.kl_estimator)
    if s.kl_coef > 0:
        per_token = per_token + s.kl_coef * kl
    if s.entropy_coef > 0:
        per_token = per_token - s.entropy_coef * entropy

    scale = _token_scale(valid, seq_tokens, seq_ids, s, norm)
    loss = torch.where(valid, per_token * scale, 0.0).sum()
    per_token_stats = {"tokens": torch.ones_like(log_ratio), "clipped": surrogate.clipped, "ratio_sum": surrogate.ratio,
                       "kl_sum": kl, "entropy_sum": entropy, "tis_clipped": over_cap, "tis_weight_sum": weight}
    return LossTerms(loss=loss, stats=_loss_stats(per_token_stats, surrogate.ratio, valid, seq_tokens))


def _policy_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, seq_ids: torch.Tensor, seq_tokens: torch.Tensor, num_seqs: int,
    s: LossSettings,
) -> SurrogateTerms:
    """The clipped surrogate [B, T] of `s.loss_type`: per token, or (gspo) on each sequence's mean
    log-ratio repeated on its tokens. seq_tokens [num_seqs] counts each sequence's loss tokens."""
    if s.loss_type == "gspo":
        seq_log_ratio = _sequence_sum(log_ratio, seq_ids, num_seqs) / seq_tokens.clamp(min=1)
        return _surrogate(
            _per_token(seq_log_ratio, seq_ids), advantages, s.gspo_clip_eps_low, s.gspo_clip_eps_high, s.clip_ratio_c
        )
    return _surrogate(log_ratio, advantages, s.clip_eps_low, s.clip_eps_high, s.clip_ratio_c)


def _loss_stats(
    per_token: dict[str, torch.Tensor | None], ratio: torch.Tensor, valid: torch.Tensor, seq_tokens: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`LossTerms.stats`: each per-token value [B, T] summed over the loss tokens, the largest ratio
    and the number of sequences with a loss token."""
    dtype = seq_tokens.dtype
    stats = {name: _masked_sum(values, valid, dtype) for name, values in per_token.items()}
    stats["ratio_max"] = torch.where(valid, ratio, 0.0).max()
    stats["sequences"] = (seq_tokens > 0).sum().to(dtype)
    return stats


def _masked_sum(values: torch.Tensor | None, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ values over the loss tokens, outside autograd, in `dtype` (0 for None: no such term)."""
    if values is None:
        return valid.new_zeros((), dtype=dtype)
    return torch.where(valid, values.detach().to(dtype), 0.0).sum()


def _tis_weight(
    old_logprobs: torch.Tensor,
    gen_logprobs: torch.Tensor,
    valid: torch.Tensor,
    seq_ids: torch.Tensor,
    num_seqs: int,
    s: LossSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS weight on w = π_old / π_gen and where w is over the cap, [B, T] each (no grad): the
    weight is 1 everywhere with tis_cap = 0."""
    if s.tis_cap <= 0:
        return torch.ones_like(old_logprobs), torch.zeros_like(valid)
    log_w = torch.where(valid, old_logprobs - gen_logprobs, 0.0).detach()
    if s.tis_level == "sequence":
        log_w = _per_token(_sequence_sum(log_w, seq_ids, num_seqs), seq_ids)
    w = torch.exp(log_w)
    over_cap = w > s.tis_cap
    weight = w.clamp(max=s.tis_cap) if s.tis_mode == "truncate" else (~over_cap).to(old_logprobs.dtype)
    return weight, over_cap


def _token_scale(
    valid: torch.Tensor, seq_tokens: torch.Tensor, seq_ids: torch.Tensor, s: LossSettings, norm: Normalizers
) -> torch.Tensor | float:
    """scale_t such that the loss type's share is Σ_t L_t · scale_t (a scalar or [B, T]); the
    max(·, 1) guards only make an empty minibatch's loss 0."""
    if s.loss_type == "dapo":
        return 1.0 / max(norm.global_tokens, 1.0)
    if s.loss_type == "dr_grpo":
        return 1.0 / (max(norm.global_sequences, 1.0) * s.max_new_tokens)
    if s.loss_type == "bnpo":
        return 1.0 / (valid.sum().clamp(min=1).to(seq_tokens.dtype) * norm.micro_batches * norm.world_size)
    # grpo, gspo: token mean within each sequence, then a share of the mean over sequences
    return 1.0 / (_per_token(seq_tokens, seq_ids).clamp(min=1) * max(norm.global_sequences, 1.0))
