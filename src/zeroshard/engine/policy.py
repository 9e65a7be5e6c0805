"""The one place the stage number is interpreted.

[Note: stage policy]
ZeRO's stages differ only in *what* each rank keeps whole and *when* it communicates
(Rajbhandari et al. 2020, §5):

========  =================  =================  ===================  ====================
stage     optimizer state    gradients          parameters           gradient reduction
========  =================  =================  ===================  ====================
0         whole              whole (reduced)    whole                all-reduce
1         1/N slice          whole buffer       whole                reduce-scatter
2         1/N slice          1/N slice only     whole                reduce-scatter
3         1/N slice          1/N slice only     1/N, gathered/unit   reduce-scatter
========  =================  =================  ===================  ====================

After the optimizer step, stages 1-2 all-gather the updated weights; stage 3 keeps only
its slice and gathers per unit before that unit computes. The engine asks these
questions of a :class:`StagePolicy` and never compares stage numbers itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StagePolicy"]


@dataclass(frozen=True)
class StagePolicy:
    stage: int

    @property
    def shard_optimizer(self) -> bool:
        """Each rank steps only its 1/N slice of the fp32 master weights and moments."""
        return self.stage >= 1

    @property
    def keep_full_grads(self) -> bool:
        """A whole-model gradient buffer persists between backward and step."""
        return self.stage <= 1

    @property
    def shard_params(self) -> bool:
        """Parameters live as 1/N slices and are gathered per unit around its compute."""
        return self.stage >= 3

    @property
    def reduce_op(self) -> str:
        return "all_reduce" if self.stage == 0 else "reduce_scatter"

    @property
    def gather_after_step(self) -> bool:
        """Updated weight slices must be all-gathered so every rank has whole weights."""
        return self.stage in (1, 2)

    @property
    def units_by_module(self) -> bool:
        """Buckets follow module units (stage 3) rather than a byte budget."""
        return self.stage >= 3
