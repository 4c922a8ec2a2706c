"""Batch types: what loaders hand out and objectives consume.

A batch is a small frozen dataclass of tensors. Each objective declares the batch type it takes
(`Objective.batch_type`); new training methods add a type here (pairs for preference data, token
weights for RL) instead of changing the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100  # a target that carries no loss (padding, prompt tokens, positions past a document)


class PaddedRows:
    """What every batch of right-padded rows reports: where it lives, the real (non-padding) input
    tokens throughput counts, and its rows (`input_ids` (rows, T) and `real_tokens` of the subclass)."""

    input_ids: torch.Tensor
    real_tokens: int

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        return self.real_tokens

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)


def _count(batch: TokenBatch | ChatBatch) -> int:
    """The batch's loss-carrying targets: the count it carries, else counted (a synchronisation when the
    targets are on an accelerator)."""
    if batch.n_targets is not None:
        return batch.n_targets
    return int((batch.targets != IGNORE_INDEX).sum())


def _host_count(batch: TokenBatch | ChatBatch) -> int | None:
    """The count to carry to another device: known, or counted now while the targets are on the host."""
    if batch.n_targets is None and batch.targets.device.type == "cpu":
        return _count(batch)
    return batch.n_targets


@dataclass(frozen=True)
class TokenBatch:
    """Next-token prediction: `input_ids` (B, T) and `targets` (B, T), targets[i] = the token after
    input_ids[i], IGNORE_INDEX where no loss is taken."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    # The targets that are not IGNORE_INDEX, counted on the host before the batch moved to its device
    # (None: not counted yet), so the step's loss normaliser needs no device-to-host synchronisation.
    n_targets: int | None = field(default=None, compare=False)

    @classmethod
    def of(cls, batch: TokenBatch | tuple[torch.Tensor, torch.Tensor]) -> TokenBatch:
        """A TokenBatch from itself or an (inputs, targets) pair."""
        if isinstance(batch, TokenBatch):
            return batch
        x, y = batch
        return cls(x, y)

    @classmethod
    def cat(cls, batches: list[TokenBatch]) -> TokenBatch:
        """One batch of all rows of `batches` (a pipeline runs a step's micro-batches as one)."""
        return cls(torch.cat([b.input_ids for b in batches]), torch.cat([b.targets for b in batches]))

    def __iter__(self):
        """Unpacks as `x, y = batch` (inputs, targets), like the pair it replaces."""
        return iter((self.input_ids, self.targets))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device, non_blocking=non_blocking),
                          self.targets.to(device, non_blocking=non_blocking), _host_count(self))

    def target_count(self) -> int:
        """Targets that carry a loss (not IGNORE_INDEX)."""
        return _count(self)

    def pin_memory(self) -> TokenBatch:
        """A copy in page-locked host memory, whose copy to a GPU runs asynchronously."""
        return TokenBatch(self.input_ids.pin_memory(), self.targets.pin_memory(), _host_count(self))

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    @property
    def num_tokens(self) -> int:
        """Input tokens (what throughput counts)."""
        return self.input_ids.numel()

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)


@dataclass(frozen=True)
class ChatBatch(PaddedRows):
    """Fine-tuning rows: `input_ids`, `targets` (B, T) as in TokenBatch, and for packed rows
    `position_ids` (B, T), restarting at 0 with each conversation, and `segment_ids` (B, T), the
    conversation each position belongs to (-1 for padding): attention never crosses a segment.
    Unpacked rows hold one right-padded conversation each and need neither (causal attention never
    reaches the padding after a token). `real_tokens` counts the positions that are not padding."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    real_tokens: int = 0
    n_targets: int | None = field(default=None, compare=False)  # as TokenBatch.n_targets

    def __iter__(self):
        return iter((self.input_ids, self.targets))

    @classmethod
    def cat(cls, batches: list[ChatBatch]) -> ChatBatch:
        packed = batches[0].segment_ids is not None
        width = max(b.input_ids.size(1) for b in batches)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.size(1)), value=v)  # noqa: E731
        return cls(
            torch.cat([pad(b.input_ids, 0) for b in batches]),
            torch.cat([pad(b.targets, IGNORE_INDEX) for b in batches]),
            torch.cat([pad(b.position_ids, 0) for b in batches]) if packed else None,
            torch.cat([pad(b.segment_ids, -1) for b in batches]) if packed else None,
            sum(b.real_tokens for b in batches),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ChatBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return ChatBatch(move(self.input_ids), move(self.targets), move(self.position_ids),
                         move(self.segment_ids), self.real_tokens, _host_count(self))

    def target_count(self) -> int:
        """Targets that carry a loss (not IGNORE_INDEX)."""
        return _count(self)

    def pin_memory(self) -> ChatBatch:
        """A copy in page-locked host memory, whose copy to a GPU runs asynchronously."""
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return ChatBatch(pin(self.input_ids), pin(self.targets), pin(self.position_ids),
                         pin(self.segment_ids), self.real_tokens, _host_count(self))

@dataclass(frozen=True)
class PreferenceBatch(PaddedRows):
    """Preference pairs: `input_ids`, `targets` (2P, T), rows 0..P-1 the chosen sequences and rows
    P..2P-1 the rejected ones of the same pairs (TRL's concatenated layout: one forward for both),
    right-padded; targets are IGNORE_INDEX everywhere but the completion tokens. `ref_logps` (2P,)
    are the reference model's summed completion log-probs when they were computed ahead (else the
    objective computes them). `real_tokens` counts the positions that are not padding. `margins` (P,):
    each pair's required reward margin (a reward model's Bradley-Terry loss), when its records gave one."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    ref_logps: torch.Tensor | None = None
    real_tokens: int = 0
    margins: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.size(0) % 2:
            raise ValueError(f"a preference batch holds chosen and rejected rows: {self.input_ids.size(0)} "
                             "rows is odd")

    @classmethod
    def cat(cls, batches: list[PreferenceBatch]) -> PreferenceBatch:
        width = max(b.input_ids.size(1) for b in batches)
        pad = lambda t, v: torch.nn.functional.pad(t, (0, width - t.size(1)), value=v)  # noqa: E731

        def halves(get, value):
            parts = [pad(get(b), value) for b in batches]
            return torch.cat([p[: p.size(0) // 2] for p in parts] + [p[p.size(0) // 2 :] for p in parts])

        refs = None
        if all(b.ref_logps is not None for b in batches):
            refs = torch.cat([b.ref_logps[: b.pairs] for b in batches]
                             + [b.ref_logps[b.pairs :] for b in batches])
        margins = None
        if all(b.margins is not None for b in batches):
            margins = torch.cat([b.margins for b in batches])
        return cls(halves(lambda b: b.input_ids, 0), halves(lambda b: b.targets, IGNORE_INDEX), refs,
                   sum(b.real_tokens for b in batches), margins)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PreferenceBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return PreferenceBatch(move(self.input_ids), move(self.targets), move(self.ref_logps),
                               self.real_tokens, move(self.margins))

    @property
    def pairs(self) -> int:
        return self.input_ids.size(0) // 2

@dataclass(frozen=True)
class PromptBatch:
    """Prompts for RL: each one's token ids (its conversation rendered up to the assistant's turn),
    what its rewards are checked against (`info`: the record's task, answer, ...), and `seed`, which
    fixes the completions sampled for it (the loader derives it from its position, so a resumed run
    samples the same ones); `greedy` batches (an evaluation pass) get one greedy completion each.
    It stays on the host: the rollout builds the tensors where the model is."""

    prompts: tuple[tuple[int, ...], ...]
    info: tuple[dict, ...]
    seed: int = 0
    greedy: bool = False  # evaluation: one greedy completion per prompt

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PromptBatch:  # noqa: ARG002
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def rows(self) -> int:
        return len(self.prompts)


@dataclass(frozen=True)
class RolloutBatch(PaddedRows):
    """Sampled completions, scored: rows of prompt + completion, right-padded (`input_ids`, and
    `targets` holding the next token on completion positions only, IGNORE_INDEX elsewhere), in
    consecutive groups of `group_size` completions of one prompt. `advantages` (N,) one per row;
    `rewards` (N,) the scalar rewards they came from, `reward_parts` each reward function's;
    `old_logps` / `ref_logps` (N, T): the sampling policy's and the reference model's log-probs of
    the target tokens (0 elsewhere), or None (old: the policy that samples is the one trained, so the
    ratio is 1; ref: no KL penalty). PPO adds token-level `advantages` (N, T), `old_values` (N, T) (the
    value head's at sampling time) and `returns` (N, T). `iteration`: which of the updates on these
    completions this batch feeds (1 for freshly sampled ones, rl.iterations > 1 trains on them again;
    0 for an evaluation pass's greedy ones, which train nothing)."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    group_size: int
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    reward_parts: dict[str, torch.Tensor] | None = None
    real_tokens: int = 0
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    iteration: int = 1

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RolloutBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        parts = None if self.reward_parts is None else {k: move(v) for k, v in self.reward_parts.items()}
        return RolloutBatch(move(self.input_ids), move(self.targets), move(self.advantages),
                            move(self.rewards), self.group_size, move(self.old_logps),
                            move(self.ref_logps), parts, self.real_tokens, move(self.old_values),
                            move(self.returns), self.iteration)

    @property
    def completion_mask(self) -> torch.Tensor:
        return self.targets != IGNORE_INDEX

    def state(self) -> dict:
        """Host tensors and plain data only: what a checkpoint's rank file holds without pickle."""
        out: dict = {"group_size": self.group_size, "real_tokens": self.real_tokens,
                     "iteration": self.iteration}
        for name in _ROLLOUT_TENSORS:
            if (t := getattr(self, name)) is not None:
                out[name] = t.detach().cpu()
        if self.reward_parts is not None:
            out["reward_parts"] = {k: v.detach().cpu() for k, v in self.reward_parts.items()}
        return out

    @classmethod
    def from_state(cls, sd: dict) -> RolloutBatch:
        """The batch `state()` wrote; ValueError naming the field when the state does not describe one
        (a checkpoint from elsewhere, or broken)."""
        missing = [k for k in ("input_ids", "targets", "advantages", "rewards", "group_size") if k not in sd]
        if missing:
            raise ValueError(f"a saved rollout batch lacks {', '.join(missing)}")
        ids = sd["input_ids"]
        if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.dtype == torch.long):
            raise ValueError(f"a saved rollout batch's input_ids is {_described(ids)}, expected int64 (N, T)")
        n, width = ids.shape
        ints = {k: sd.get(k, d) for k, d in (("group_size", 1), ("real_tokens", 0), ("iteration", 1))}
        if any(type(v) is not int or v < 0 for v in ints.values()) or not ints["group_size"] \
                or ints["iteration"] < 1 or n % ints["group_size"]:
            raise ValueError(f"a saved rollout batch of {n} rows has group_size, real_tokens, iteration = "
                             f"{tuple(ints.values())}: expected a group size dividing the rows, counts >= 0")
        token_level = "returns" in sd  # PPO: advantages per token
        for name in _ROLLOUT_TENSORS:
            t = sd.get(name)
            if t is None or name == "input_ids":
                continue
            shape = (n,) if name == "rewards" or (name == "advantages" and not token_level) else (n, width)
            integer = name == "targets"
            if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shape
                    and (t.dtype == torch.long if integer else t.is_floating_point())):
                raise ValueError(f"a saved rollout batch's {name} is {_described(t)}, expected "
                                 f"{'int64' if integer else 'floating-point'} {shape}")
        parts = sd.get("reward_parts")
        if parts is not None:
            if not isinstance(parts, dict) or not all(
                    isinstance(k, str) and isinstance(v, torch.Tensor) and tuple(v.shape) == (n,)
                    and v.is_floating_point() for k, v in parts.items()):
                raise ValueError("a saved rollout batch's reward_parts is not a dict of floating-point "
                                 f"({n},) tensors by name")
        return cls(ids, sd["targets"], sd["advantages"], sd["rewards"], ints["group_size"],
                   sd.get("old_logps"), sd.get("ref_logps"), parts, ints["real_tokens"], sd.get("old_values"),
                   sd.get("returns"), ints["iteration"])


_ROLLOUT_TENSORS = ("input_ids", "targets", "advantages", "rewards", "old_logps", "ref_logps", "old_values",
                    "returns")


def _described(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__

@dataclass(frozen=True)
class UnpairedBatch(PaddedRows):
    """KTO's unpaired examples: `input_ids`, `targets` (2B, T), rows 0..B-1 the examples (prompt +
    completion, targets on the completion only) and rows B..2B-1 their mismatched twins (example i's
    prompt with example i-1's completion, as TRL's KTO builds them), whose log-probs estimate the KL
    reference point; right-padded. `desirable` (B,) bool: each example's label. `ref_logps` (2B,): the
    reference model's summed completion log-probs when computed ahead."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    desirable: torch.Tensor
    ref_logps: torch.Tensor | None = None
    real_tokens: int = 0

    def to(self, device: torch.device | str, non_blocking: bool = False) -> UnpairedBatch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return UnpairedBatch(move(self.input_ids), move(self.targets), move(self.desirable),
                             move(self.ref_logps), self.real_tokens)

    @property
    def examples(self) -> int:
        return self.desirable.numel()
