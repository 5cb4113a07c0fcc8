"""On-policy distillation (`rlvr distill teacher=...`, TRL's DistillationTrainer): the student samples
(GRPO's rollout stage, any sampler), a teacher scores the same tokens, and the update moves the
student's next-token distribution toward the teacher's at every completion position.  The math and
the teacher are here; the method's trainer is trainer.Distiller (GRPO's step with this objective).

For the student's distribution p_s and the teacher's p_t at one position, both over the whole
vocabulary from logits divided by the sampling temperature, the loss of that token is (TRL's
`beta`, here distill_beta; GKD, https://arxiv.org/abs/2306.13649, eq. 1):

    beta = 0:      KL(p_t || p_s) = sum_v p_t (log p_t - log p_s)            forward KL
    beta = 1:      KL(p_s || p_t) = sum_v p_s (log p_s - log p_t)            reverse KL
    0 < beta < 1:  beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t

summed over the completion tokens and divided by the step's completion tokens (every micro-batch's
and rank's: TRL's num_items_in_batch), so the gradient is a token mean whatever the split.  With
distill_reward_weight w > 0, w x GRPO's loss (loss_type's, on the verifier's group advantages) is
added: the mixed objective.  No reference model, no KL term (as TRL).

The [tokens, V] logits are never held whole: the student's and teacher's final hidden states at the
completion positions go through their output layers `chunk` tokens at a time, each chunk under
activation checkpointing, so a chunk's logits exist only while its terms are computed (forward) or
recomputed (backward).  Groups whose rewards are all equal are trained on like any other (the
divergence does not need a group), so num_generations may be 1 (TRL's DistillationTrainer samples one
completion per prompt; rlvr distill's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from rlvr.errors import ModelError
from rlvr.logprobs import packed_hidden, padded_inputs
from rlvr.types import Batch, Generation

__all__ = ["token_divergence", "completion_hidden", "hidden_terms", "distill_terms", "Head", "Teacher", "Distillation",
           "load_teacher"]

CHUNK = 256  # completion tokens whose logits are held at once (V = 49,152: 50 MB each for student and teacher in fp32)


def token_divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """[N, V] log-probs of the student and the teacher -> [N], each row's divergence (the module docstring)."""
    ps, pt = student_logp.exp(), teacher_logp.exp()
    if beta == 0.0:
        return (pt * (teacher_logp - student_logp)).sum(-1)
    if beta == 1.0:
        return (ps * (student_logp - teacher_logp)).sum(-1)
    mixture = torch.logaddexp(student_logp + math.log1p(-beta), teacher_logp + math.log(beta))
    return beta * (pt * (teacher_logp - mixture)).sum(-1) + (1 - beta) * (ps * (student_logp - mixture)).sum(-1)


def completion_hidden(model, batch: Batch) -> torch.Tensor:
    """[B, T, H]: the final hidden states (after the last norm) at the positions that predict each
    completion token, by the model's own decoder over left-padded prompt + right-padded completion (the
    layout of logprobs.padded_logprobs; a LoRA model's adapter applies)."""
    ids, mask, positions = padded_inputs(batch)
    out = model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    prompt, width = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    return out.last_hidden_state[:, prompt - 1 : prompt + width - 1]  # position t predicts completion token t + 1


@dataclass(frozen=True)
class Head:
    """A model's output layer as its own forward applies it: the linear map, then Gemma's
    final_logit_softcapping where the config has one."""

    linear: torch.nn.Module
    softcap: float | None = None

    @classmethod
    def of(cls, model) -> Head:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        return cls(model.get_output_embeddings(), getattr(config, "final_logit_softcapping", None))

    def logits(self, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
        z = torch.nn.functional.linear(hidden, self.linear.weight, self.linear.bias).float()
        if self.softcap:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z / temperature


class Teacher:
    """A frozen model that scores the student's completions: its hidden states at the completion positions."""

    def __init__(self, model):
        from rlvr.llama import LlamaRunner, on_fast_path

        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.head = Head.of(model)
        self.runner = LlamaRunner(model) if on_fast_path(model) else None

    @torch.no_grad()
    def hidden(self, batch: Batch) -> torch.Tensor:
        """[completion tokens, hidden] of `batch` (its completion_mask's), as `states`."""
        return states(self.model, batch, self.runner)


@dataclass(frozen=True)
class DistillTerms:
    """Per-token values of a micro-batch [B, T]: the divergence and the sampled token's log-prob (both
    with the student's gradient) and the student's entropy (no gradient); zero where the mask is off."""

    divergence: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


def hidden_terms(h_s: torch.Tensor, h_t: torch.Tensor, ids: torch.Tensor, student: Head, teacher: Head, beta: float,
                 temperature: float, chunk: int = CHUNK) -> DistillTerms:
    """[N, H_s] student and [N, H_t] teacher hidden states at N completion positions, the N sampled token
    ids -> DistillTerms of [N]: the divergence and the log-prob with the student's gradient (its hidden
    states' and output layer's), the student's entropy without, `chunk` positions' logits at a time."""
    def terms(hs, ht, y):
        logp_s = torch.log_softmax(student.logits(hs, temperature), dim=-1)
        with torch.no_grad():
            logp_t = torch.log_softmax(teacher.logits(ht, temperature), dim=-1)
            entropy = -(logp_s.exp() * logp_s).sum(-1)
        return token_divergence(logp_s, logp_t, beta), logp_s.gather(-1, y[:, None]).squeeze(-1), entropy

    parts = []
    for lo in range(0, ids.numel(), chunk):
        args = (h_s[lo : lo + chunk], h_t[lo : lo + chunk], ids[lo : lo + chunk])
        parts.append(checkpoint(terms, *args, use_reentrant=False) if torch.is_grad_enabled() else terms(*args))
    if not parts:
        empty = h_s.new_zeros(0, dtype=torch.float32)
        return DistillTerms(empty, empty, empty)
    return DistillTerms(*(torch.cat([p[i] for p in parts]) for i in range(3)))


def states(model, batch: Batch, runner=None) -> torch.Tensor:
    """[completion tokens, hidden]: the hidden states that predict `batch`'s completion tokens (its
    completion_mask's, row after row), by rlvr's forward (a llama.LlamaRunner: each group's prompt
    once, no padding) or else the model's own padded one."""
    if runner is not None:
        return packed_hidden(runner, batch)
    return completion_hidden(model, batch)[batch.completion_mask]


def distill_terms(student, teacher: Teacher, batch: Batch, beta: float, temperature: float, chunk: int = CHUNK,
                  runner=None) -> DistillTerms:
    """DistillTerms [B, T] of `batch`'s completion tokens (zero where the loss mask is off); `runner`: the
    student's llama.LlamaRunner when it is on rlvr's fast path."""
    mask = batch.completion_mask
    h_s = states(student, batch, runner)
    h_t = teacher.hidden(batch).to(h_s.device)
    found = hidden_terms(h_s, h_t, batch.completion_ids[mask], Head.of(student), teacher.head, beta, temperature, chunk)
    out = []
    for values in (found.divergence, found.logprobs, found.entropy):
        full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, values)
        out.append(full.masked_fill(~batch.loss_mask, 0.0))
    return DistillTerms(*out)


class Distillation:
    """The update's objective for rlvr distill (update.PolicyUpdate.objective): called per micro-batch,
    it returns the student's log-probs and entropy [B, T], the divergence's share of the step's loss, and
    the divergence's sum over the micro-batch's tokens (logged as `divergence`, a mean per token).
    `logprobs`: the update's logprobs.LogProbs, whose temperature, autocast and path (rlvr's fast path or
    the model's own forward) it takes."""

    def __init__(self, teacher: Teacher, beta: float, reward_weight: float, logprobs):
        self.teacher, self.beta, self.policy_weight, self.logprobs = teacher, beta, reward_weight, logprobs

    def __call__(self, model, micro: Batch, norm) -> tuple:
        lp = self.logprobs
        with lp.autocast(model):
            t = distill_terms(model, self.teacher, micro, self.beta, lp.temperature, runner=lp.runner(model) if lp.fast else None)
        loss = t.divergence.sum() / max(norm.num_tokens, 1.0)
        return t.logprobs, t.entropy, loss, {"divergence": t.divergence.detach().sum()}


def load_teacher(settings, model_settings, student, tokenizer, device, given=None) -> Teacher:
    """The teacher: `given` (a loaded model, DistillationTrainer(teacher_model=...)), else loaded from
    teacher_model_name_or_path in the student's dtype onto its device.  Refused unless its tokenizer
    (when it has its own) and its output layer's vocabulary are the student's."""
    from rlvr.models import load_model

    if given is None:
        model, teacher_tokenizer, _ = load_model(settings.teacher_model_name_or_path, model_settings.dtype, device,
                                                 settings.teacher_model_init_kwargs, model_settings.trust_remote_code)
        if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ModelError(f"teacher {settings.teacher_model_name_or_path!r} has another tokenizer than the student: "
                             "distillation compares next-token distributions over one vocabulary, so the teacher "
                             "must share the student's tokenizer")
    else:
        model = given.to(device)
    rows, own = model.get_output_embeddings().weight.shape[0], student.get_output_embeddings().weight.shape[0]
    if rows != own:
        raise ModelError(f"the teacher's output layer has {rows} rows and the student's {own}: distillation needs "
                         "the same vocabulary on both")
    return Teacher(model)


class DatasetCompletions:
    """GKD's off-policy steps (`lmbda` < 1; `sequences` not empty): before each generation a seeded coin decides, as TRL's GKD
    (on-policy when u <= lmbda), whether the step trains on the student's samples or on the dataset's own
    completions (rlvr sft's demonstrations, tokenised as it tokenises them), taken in a seeded order,
    `rows` per process (each process its own share).  A checkpoint part: the coin and the order."""

    def __init__(self, sequences: list, rows: int, lmbda: float, seed: int, pad_id: int, rank: int = 0, world_size: int = 1):
        from rlvr.tasks import PromptStream

        self.sequences, self.rows, self.lmbda, self.pad_id = sequences, rows, lmbda, pad_id
        self.rank, self.world_size = rank, world_size
        self.coin = torch.Generator().manual_seed(seed)
        self.order = PromptStream(list(range(len(sequences))), seed)

    def due(self) -> bool:
        """Whether the next step trains on the dataset's completions (probability 1 - lmbda)."""
        return torch.rand((), generator=self.coin).item() > self.lmbda

    def generation(self, epochs_done: float) -> Generation:
        """The next `rows` completions as a Generation (advantages 0, no sampler log-probs)."""
        from rlvr.finetune.data import to_batch

        taken = self.order.take(self.rows * self.world_size)[self.rank * self.rows : (self.rank + 1) * self.rows]
        batch = to_batch([self.sequences[i] for i in taken], self.pad_id)
        batch.sampler_logprobs = None  # not sampled: no engine to correct for
        tokens = float(batch.completion_mask.sum())
        metrics = {"distill/on_policy": 0.0, "completions/num_tokens": tokens,
                   "tokens/generation": float(batch.prompt_mask.sum()) + tokens}
        return Generation(batch, metrics, epochs_after=epochs_done)

    def state_dict(self) -> dict:
        return {"coin": self.coin.get_state(), "order": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.coin.set_state(state["coin"])
        self.order.load_state_dict(state["order"])
