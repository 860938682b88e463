"""Which rank holds which pipeline stage: one stage per rank, looped, or V-shaped placement.

Interleaved 1F1B (Narayanan et al. SC'21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM") cuts the model into ``p * v`` stages and places them round-robin
("loop"); ZBV (Qi et al. ICLR 2024, "Zero Bubble Pipeline Parallelism") places two stages per
rank in a V, so that the first and the last stage share rank 0. ``p = 3``::

    stage        0 1 2 3 4 5
    loop, v = 2  0 1 2 0 1 2      rank r holds stages r, r + p, r + 2p, ...
    v,    v = 2  0 1 2 2 1 0      rank r holds stages r and 2p - 1 - r

[Note: stages and ranks] An action's ``stage_index`` is a *virtual* stage in ``0 .. p*v - 1``,
numbered in model order (stage ``s`` feeds stage ``s + 1``); the schedule's keys are ranks. A
`StageMap` connects the two. With ``stages_per_rank = 1`` (the default) stage ``s`` is rank
``s``, which is every GPipe, 1F1B and PipeDream schedule. Two consecutive stages on the *same*
rank (the tip of the V, or every stage when ``p = 1``) exchange their tensors locally: `lower`
adds no send or receive between them ([Note: local hand-off] in `lowering`).

`validate` takes the map it checks against (default: one stage per rank) and never guesses it;
`lower`, `simulate` and `render` read it off the schedule (`StageMap.infer`) unless given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from polytrain.errors import ScheduleError
from polytrain.pipeline.schedule.action import Action

__all__ = ["StageMap", "StageStyle"]

StageStyle = Literal["loop", "v"]
_STYLES = ("loop", "v")


@dataclass(frozen=True)
class StageMap:
    """Placement of ``num_ranks * stages_per_rank`` virtual stages on ``num_ranks`` ranks."""

    num_ranks: int
    """Pipeline ranks ``p`` (``parallel.pp``)."""
    stages_per_rank: int = 1
    """Virtual stages (model chunks) per rank ``v``; 1 for one stage per rank."""
    style: StageStyle = "loop"
    """``"loop"``: stage ``s`` on rank ``s % p``; ``"v"``: chunk ``c = s // p`` on rank
    ``s % p`` when ``c`` is even and ``p - 1 - s % p`` when odd (torch's "v" style, which
    ZBV uses with two chunks)."""

    def __post_init__(self) -> None:
        for name, field in (("num_ranks", "parallel.pp"), ("stages_per_rank", "virtual_stages")):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(
                    f"StageMap.{name} = {value!r}: expected an integer >= 1; set {field} to 1 "
                    "or more"
                )
        if self.style not in _STYLES:
            raise ScheduleError(
                f"StageMap.style = {self.style!r}: expected one of {', '.join(_STYLES)}"
            )

    @property
    def num_stages(self) -> int:
        """Virtual stages in the whole pipeline: ``p * v``."""
        return self.num_ranks * self.stages_per_rank

    def rank_of(self, stage_index: int) -> int:
        """The rank that holds stage ``stage_index``."""
        ranks = self._ranks
        if type(stage_index) is int and 0 <= stage_index < len(ranks):  # the planner's hot path
            return ranks[stage_index]
        self._check_stage(stage_index)  # raises; an int subclass (not bool) passes on
        return ranks[stage_index]

    @cached_property
    def _ranks(self) -> tuple[int, ...]:
        """Each stage's rank, in stage order (the placement the class docstring draws)."""
        out = []
        for stage_index in range(self.num_stages):
            chunk, position = divmod(stage_index, self.num_ranks)
            flipped = self.style == "v" and chunk % 2 == 1
            out.append(self.num_ranks - 1 - position if flipped else position)
        return tuple(out)

    def chunk_of(self, stage_index: int) -> int:
        """Which of its rank's stages ``stage_index`` is, ``0 .. v - 1`` in model order."""
        self._check_stage(stage_index)
        return stage_index // self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """Stages of ``rank`` in model order (its chunk 0 first)."""
        if not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ScheduleError(
                f"rank = {rank!r}: expected an integer in 0..{self.num_ranks - 1} for a "
                f"pipeline of {self.num_ranks} ranks"
            )
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def is_local(self, stage_index: int, peer_stage: int) -> bool:
        """True when both stages live on one rank: their tensors pass without p2p."""
        return self.rank_of(stage_index) == self.rank_of(peer_stage)

    def describe(self) -> str:
        """Short form for messages: ``"4 ranks x 2 stages (v)"``."""
        if self.stages_per_rank == 1:
            return f"{self.num_ranks} ranks, one stage each"
        return f"{self.num_ranks} ranks x {self.stages_per_rank} stages ({self.style})"

    @classmethod
    def infer(cls, schedule: Mapping[int, Sequence[Action | None]]) -> StageMap:
        """The map a generated schedule was made for, read off its stage indices.

        Ranks must be ``0 .. p-1``; the number of stages is one more than the largest
        ``stage_index``; the loop style is tried before the V style (they agree when ``v`` or
        ``p`` is 1). Raises `ScheduleError` when no map places every action on its rank.
        """
        ranks = sorted(schedule)
        if not ranks or ranks != list(range(len(ranks))):
            raise ScheduleError(f"schedule has ranks {ranks}: expected ranks 0..p-1 (p >= 1)")
        num_ranks = len(ranks)
        held = {r: {a.stage_index for a in schedule[r] if a is not None} for r in ranks}
        top = max((s for stages in held.values() for s in stages), default=num_ranks - 1)
        per_rank = max(1, -(-(top + 1) // num_ranks))
        for style in _STYLES:
            candidate = cls(num_ranks, per_rank, style)  # type: ignore[arg-type]
            if all(candidate.rank_of(s) == r for r, stages in held.items() for s in stages):
                return candidate
        raise ScheduleError(
            "schedule places its stages on ranks no stage map explains (ranks -> stages: "
            + "; ".join(f"{r}: {sorted(held[r])}" for r in ranks)
            + "): expected stage s on rank s % p (loop) or in a V; pass stage_map explicitly"
        )

    def _check_stage(self, stage_index: int) -> None:
        if (
            not isinstance(stage_index, int)
            or isinstance(stage_index, bool)
            or not 0 <= stage_index < self.num_stages
        ):
            raise ScheduleError(
                f"stage_index = {stage_index!r}: expected an integer in "
                f"0..{self.num_stages - 1} for {self.describe()}"
            )
