"""What a training job optimises and how it is scored: batches (from the teacher store, or scored
by the target in the step), the loss of a batch, and the held-out acceptance that selects the
checkpoint; the loop gets an `Objective`'s `make_batches`, `loss_sum` and `evaluate`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from transformers import PreTrainedModel

from specdecode.models.draft_vocab import draft_vocab_ids
from specdecode.models.feature_drafter import FeatureDrafter
from specdecode.training.config import TrainJobConfig
from specdecode.training.feature_training import (
    feature_regression_sum,
    frozen_head_rows,
    pass_positions,
    regression_weight,
)
from specdecode.training.loop import Batch
from specdecode.training.losses import get_loss
from specdecode.training.sequences import TrainSequence, generate_continuations
from specdecode.training.store import TeacherStore
from specdecode.training.teacher import (
    TeacherCache,
    dense_teacher_logits,
    heldout_targets,
    pad_batch,
    padded_features,
    score_topk,
)

# Training sequences whose greedy agreement each evaluation also reports (`Objective.evaluate`).
TRAIN_SAMPLE = 16

# Sequences and the target's outputs on them: a store on disk, or a cache in memory (a test's).
TeacherData = TeacherCache | TeacherStore


def drop_positions_without_teacher(
    positions: torch.Tensor, topk_ids: torch.Tensor, topk_logits: torch.Tensor, vocab_to_draft: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Drop the loss positions (`[B, T]` bool, their `[P, k]` top-k ids and logits in row-major
    order) whose top k holds no draft id (`vocab_to_draft` `[V]`: -1): they have no teacher over
    the drafter's vocabulary. Returns the positions left and their `[P', k]` ids and logits."""
    usable = (vocab_to_draft[topk_ids.long()] >= 0).any(-1)
    return positions.masked_scatter(positions, usable), topk_ids[usable], topk_logits[usable]


@dataclass
class Teacher:
    """What the job learns from: the frozen target and the training and held-out sequences with its
    outputs on them (stored, or computed in the step by `scorer`)."""

    target: PreTrainedModel
    train_cache: TeacherData
    heldout: TeacherData
    pad_id: int
    eos: list[int]
    # the top-k target logits per position (0: none, e.g. finetune or a feature drafter)
    topk: int
    # whether the drafter reads the target's features (a feature drafter)
    features: bool
    # online: the target (in the data's precision) scoring each training batch; None: offline (stored)
    scorer: PreTrainedModel | None = None
    # the target layers a feature drafter reads (`target_features`), for the online forward
    layers: Sequence[int] | None = None


@dataclass
class Objective:
    """The loss and the held-out score of one job; `model` is the accelerate-prepared drafter
    wrapper (`DrafterLogits` or `FeatureDrafterLogits`), set once it exists."""

    cfg: TrainJobConfig
    job: str
    teacher: Teacher
    drafter: PreTrainedModel | FeatureDrafter
    accelerator: Accelerator
    model: torch.nn.Module | None = None
    draft_ids: torch.Tensor = field(init=False)
    vocab_to_draft: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        target, train = self.teacher.target, self.cfg.train
        self.draft_ids = draft_vocab_ids(self.drafter)
        self.vocab_to_draft = torch.full((target.config.get_text_config().vocab_size,), -1, dtype=torch.long)
        self.vocab_to_draft[self.draft_ids] = torch.arange(len(self.draft_ids))
        self.loss_fn = get_loss(self.cfg.loss.name)
        self.loss_kwargs = {"beta": self.cfg.loss.beta} if self.cfg.loss.name == "jsd" else {}
        self.tau = 1.0 if train.temperature == 0 else train.temperature
        # each process scores its share of the held-out sequences once, at the selection temperature
        heldout = self.teacher.heldout.sequences
        self.my_indices = self._share(len(heldout))
        self.select_tau = train.select_temperature or 1.0
        mine = [heldout[i] for i in self.my_indices]
        self.heldout_p: torch.Tensor | None
        self.heldout_argmax: torch.Tensor | None
        self.heldout_p, self.heldout_argmax = (
            heldout_targets(target, mine, self.draft_ids, self.select_tau, self.teacher.pad_id)
            if mine
            else (None, None)
        )
        # the first TRAIN_SAMPLE training sequences (greedy): training agreement far above held-out
        # tells a run short of data from one short of steps or capacity (both low)
        sample = self.teacher.train_cache.sequences[:TRAIN_SAMPLE]
        self.train_indices = self._share(len(sample))
        sampled = [sample[i] for i in self.train_indices]
        self.train_argmax = (
            heldout_targets(target, sampled, self.draft_ids, 1.0, self.teacher.pad_id)[1] if sampled else None
        )
        if self.teacher.features:  # the distillation teacher is the frozen head on the cached features
            self.teacher_weight, self.teacher_bias = frozen_head_rows(target.get_output_embeddings(), self.draft_ids)
            assert isinstance(self.drafter, FeatureDrafter)  # a teacher with features trains a feature drafter
            self.feature_weight = regression_weight(train.feature_loss_weight, self.drafter)

    def _share(self, count: int) -> list[int]:
        """This process's share of `count` evaluated sequences. A sharded target scores all of them on
        every process (its forwards are collective); the pooled ratios are the same."""
        everything = list(range(count))
        if self.cfg.train.shard_target:
            return everything
        return everything[self.accelerator.process_index :: self.accelerator.num_processes]

    def micro_batches(self, sequences: list[TrainSequence], scored: TeacherCache, picks: list[int]) -> list[Batch]:
        """`grad_accum` micro-batches of `sequences`, which are `scored`'s sequences `picks`."""
        size = len(sequences) // self.cfg.train.grad_accum
        return [
            self._micro_batch(sequences[s : s + size], scored, picks[s : s + size])
            for s in range(0, len(sequences), size)
        ]

    def _micro_batch(self, sequences: list[TrainSequence], scored: TeacherCache, picks: list[int]) -> Batch:
        input_ids, attention_mask, positions = pad_batch(sequences, self.teacher.pad_id)
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if self.teacher.features:  # the distillation teacher is then the frozen head on them (loss_sum)
            batch["features"] = padded_features(scored, picks, input_ids.shape[1])
        if self.job == "finetune":
            labels = torch.cat([self.vocab_to_draft[input_ids[:, 1:]], torch.full_like(input_ids[:, :1], -1)], 1)
            positions = positions & (labels >= 0)
            batch["labels"] = labels
        elif not self.teacher.features:
            # `[P, k]` in the row-major order of `positions`, as the cache stores them
            picked = scored.select(picks)
            positions, ids, logits = drop_positions_without_teacher(
                positions, picked.topk_ids, picked.topk_logits, self.vocab_to_draft
            )
            batch |= {"topk_ids": ids, "topk_logits": logits}
        return batch | {"positions": positions}

    def teacher_outputs(
        self, data: TeacherData, indices: list[int], scorer: PreTrainedModel | None, topk: int
    ) -> TeacherCache:
        """The target's outputs (`topk` logits, or features) on `data`'s sequences `indices`, as a
        cache of those only: read from `data` (offline), or `scorer`'s forward now (online)."""
        if scorer is None:
            return data.select(indices)
        sequences = [data.sequences[i] for i in indices]
        return score_topk(scorer, sequences, topk, self.teacher.pad_id, features=self.teacher.layers)

    def make_batches(self, indices: list[int], step: int, on_policy: bool) -> list[Batch]:
        """The micro-batches of one step: stored sequences `indices`, or on-policy continuations of their prompts."""
        cache, train = self.teacher.train_cache, self.cfg.train
        if not on_policy:
            scored = self.teacher_outputs(cache, indices, self.teacher.scorer, self.teacher.topk)
            return self.micro_batches(scored.sequences, scored, list(range(len(indices))))
        # GKD: the drafter writes the continuations, the target scores them now (not cacheable)
        prompts = [cache.sequences[i].tokens[: cache.sequences[i].response_start] for i in indices]
        seed = train.seed + 7919 * step + 104_729 * self.accelerator.process_index
        drafter = self.accelerator.unwrap_model(self.model).drafter
        responses = generate_continuations(drafter, prompts, train, self.teacher.eos, seed)[0]
        # an empty continuation stays: 0 counted tokens, but every process keeps `grad_accum` micro-batches
        sequences = [TrainSequence(p + r, len(p)) for p, r in zip(prompts, responses)]
        scored = score_topk(self.teacher.target, sequences, self.teacher.topk, self.teacher.pad_id)
        return self.micro_batches(sequences, scored, list(range(len(sequences))))

    def loss_sum(self, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The batch's summed loss (the loop divides by the tokens counted on all processes)."""
        if self.teacher.features:
            return self._feature_loss_sum(module, batch)
        positions = batch["positions"]
        student = module(batch["input_ids"], batch["attention_mask"], positions)  # [P, K]
        if self.job == "finetune":
            return self._token_loss_sum(student, batch["labels"][positions])
        vocab_to_draft = self.vocab_to_draft.to(student.device)
        return self._token_loss_sum(
            student, dense_teacher_logits(batch["topk_ids"], batch["topk_logits"], vocab_to_draft, student.shape[-1])
        )

    def _token_loss_sum(self, student: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The summed token loss of `[P, K]` logits against the next tokens `[P]` (finetune) or the
        teacher's `[P, K]` logits (distill)."""
        if self.job == "finetune":
            return F.cross_entropy(student, target, reduction="sum")
        return self.loss_fn(student, target, None, temperature=self.tau, reduction="sum", **self.loss_kwargs)

    def _feature_loss_sum(self, module: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """Token loss of every unrolled pass (vs the frozen head on the target's features, or the
        next token) plus the weighted regression of the target's feature, at the loss positions."""
        positions = batch["positions"]
        logits, predicted = module(
            batch["input_ids"], batch["attention_mask"], batch["features"], positions
        )  # [S, P, K|H]
        scored = pass_positions(positions, logits.shape[0])[:, positions]  # [S, P]
        # [P, H]: the last state, which the drafter predicts and the head reads (the last slot of n·H)
        features = batch["features"][positions][:, -predicted.shape[-1] :]
        if self.job == "distill":
            bias = None if self.teacher_bias is None else self.teacher_bias.to(logits.device)
            target = F.linear(features, self.teacher_weight.to(logits.device), bias)  # [P, K]
        else:
            target = batch["labels"][positions]  # [P]
        total = logits.new_zeros(())
        for j in range(logits.shape[0]):
            mine = scored[j]
            total = total + self._token_loss_sum(logits[j][mine], target[mine])
            if self.feature_weight:
                total = total + self.feature_weight * feature_regression_sum(predicted[j][mine], features[mine])
        return total

    def _chunks(
        self, module: torch.nn.Module, cache: TeacherData, indices: list[int], scorer: PreTrainedModel | None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, slice]]:
        """`_scored_logits` of `cache`'s sequences `indices`, 8 at a time, with the rows of their P
        positions among all of `indices`' loss positions."""
        row = 0
        for start in range(0, len(indices), 8):
            logits, scored = self._scored_logits(module, cache, indices[start : start + 8], scorer)
            yield logits, scored, slice(row, row + logits.shape[1])
            row += logits.shape[1]

    def _scored_logits(
        self, module: torch.nn.Module, cache: TeacherData, indices: list[int], scorer: PreTrainedModel | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[S, P, K]` drafter logits at the loss positions of `cache`'s sequences `indices` (S unrolled
        passes, 1 but for a feature drafter) and the `[S, P]` mask of positions each pass can score."""
        device = self.accelerator.device
        scored = self.teacher_outputs(cache, indices, scorer, 0) if self.teacher.features else None
        sequences = scored.sequences if scored is not None else [cache.sequences[i] for i in indices]
        input_ids, attention_mask, positions = pad_batch(sequences, self.teacher.pad_id)
        input_ids, attention_mask, positions = input_ids.to(device), attention_mask.to(device), positions.to(device)
        if scored is None:
            logits = module(input_ids, attention_mask, positions).unsqueeze(0)
            return logits, torch.ones(logits.shape[:2], dtype=torch.bool, device=logits.device)
        features = padded_features(scored, range(len(indices)), input_ids.shape[1]).to(device)
        logits, _ = module(input_ids, attention_mask, features, positions)
        return logits, pass_positions(positions, logits.shape[0])[:, positions]

    def _greedy_hits(
        self,
        module: torch.nn.Module,
        cache: TeacherData,
        indices: list[int],
        argmax: torch.Tensor,
        scorer: PreTrainedModel | None,
    ) -> torch.Tensor:
        """`[2]`: the scored positions (all passes) of `cache`'s sequences `indices` where the drafter's
        argmax is the target's `argmax` `[P]`, and all scored positions."""
        totals = torch.zeros(2, device=self.accelerator.device)
        for logits, scored, rows in self._chunks(module, cache, indices, scorer):
            greedy = self._agrees(logits, argmax[rows])
            totals += torch.stack([greedy[scored].sum().float(), scored.sum().float()])
        return totals

    def _agrees(self, logits: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
        """`[S, P]` bool: the drafter's argmax of `[S, P, K]` `logits` is the target's `argmax` `[P]`."""
        return self.draft_ids.to(logits.device)[logits.argmax(-1)] == argmax.to(logits.device).unsqueeze(0)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out acceptance, all processes and unrolled passes pooled: `greedy` (argmax agreement),
        `expected` (mean Σ_v min(p, q) at the selection temperature), `score` (the one selection
        uses) and `train_greedy` (on the first `TRAIN_SAMPLE` training sequences)."""
        module = self.accelerator.unwrap_model(self.model)
        module.eval()
        totals = torch.zeros(5, device=self.accelerator.device)
        heldout_scorer = self.teacher.target if self.teacher.scorer is not None else None
        if self.train_indices and self.train_argmax is not None:
            totals[3:] = self._greedy_hits(
                module, self.teacher.train_cache, self.train_indices, self.train_argmax, self.teacher.scorer
            )
        for logits, scored, rows in self._chunks(module, self.teacher.heldout, self.my_indices, heldout_scorer):
            assert self.heldout_p is not None and self.heldout_argmax is not None  # set where there are indices
            p = self.heldout_p[rows].to(logits.device, torch.float32)
            greedy = self._agrees(logits, self.heldout_argmax[rows]).float()
            q = logits.float().div(self.select_tau).softmax(-1)
            expected = torch.minimum(p.unsqueeze(0), q).sum(-1)
            totals[:3] += torch.stack([expected[scored].sum(), greedy[scored].sum(), scored.sum().float()])
        module.train()
        summed = self.accelerator.gather_for_metrics(totals.unsqueeze(0)).sum(0)
        expected, greedy = (summed[:2] / summed[2].clamp_min(1)).tolist()
        train_greedy = float(summed[3] / summed[4].clamp_min(1))
        score = greedy if self.cfg.train.select_temperature == 0 else expected
        return {"score": score, "greedy": greedy, "expected": expected, "train_greedy": train_greedy}
