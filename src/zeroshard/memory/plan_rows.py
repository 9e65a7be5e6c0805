"""What a plan is made of: one row per (N, stage, policy) and the setup rows are priced
under. Shared by the planner (planner.py), which builds rows, and the recommender
(recommend.py), which picks among them; neither imports the other's types."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from zeroshard.engine.policy import StagePolicy
from zeroshard.memory import analytic
from zeroshard.models.config import ModelConfig

__all__ = ["PlanRow", "Setup"]


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """One (N, stage, policy[, hybrid]) estimate. Bytes are per device; times per step."""

    gpus: int
    stage: int
    activation_checkpointing: str
    params_bytes: int
    grads_bytes: int
    optim_bytes: int
    """Optimizer state on the device: 0 when it is offloaded (see ``host_bytes``)."""
    model_state_bytes: int
    activation_bytes: int
    buffer_bytes: int
    total_bytes: int
    usable_bytes: int
    fits: bool
    comm_bytes_per_step: int
    comm_time_s: float
    exposed_comm_time_s: float
    compute_time_s: float
    step_time_s: float
    tokens_per_s: float
    break_even_tokens: float
    predicted_step_s: float | None = None
    """``plan --profile``: the step predicted from this row's trace priced by a
    calibration profile (zeroshard.timing); None without one."""
    hybrid: str | None = None
    """"R x G": shard over the G devices of a node, replicate over R nodes; None: plain."""
    cross_node_bytes_per_step: int = 0
    """Logical bytes per device crossing nodes: all of them on several nodes without
    hybrid sharding, the replicate all-reduce (2Ψ·grad_bytes/G) with it, 0 on one node."""
    cross_node_time_s: float = 0.0
    secondary: int | None = None
    """Stage 3 with ``reshard_after_forward=k`` (ZeRO++'s hpZ, k = the devices per node):
    backward's all-gather stays inside the node; None: plain."""
    zeropp: bool = False
    """With ``secondary``: also int8 weight all-gathers and int4 two-hop gradients
    (``quantize_weights="int8", quantize_grads="int4"``, error feedback off)."""
    offload: bool = False
    """Optimizer state and step on the host (stages 1-3 with ``offload=True``)."""
    offload_params: bool = False
    """Stage 3 with offload="optimizer+params": the weight slices on the host too."""
    host_bytes: int = 0
    """Host memory per device for what is offloaded (× ranks per node per host)."""
    offload_time_s: float = 0.0
    """PCIe copies (gradient slice down, weight slice up) + host optimizer step, in
    ``step_time_s`` (not overlapped)."""
    peak_moment: str | None = None
    """The moment of the step whose bytes are ``total_bytes``, with ``buffer_bytes`` its
    buffers then. Stage 3: "loss's backward", "backward begins", "end of the blocks'
    backward", "root's reduction" or "optimizer step" ([Note: stage-3 peak] in
    stage3_buffers.py); stages 0-2: "backward begins", "backward ends" or "optimizer
    step" ([Note: the step's moments, stages 0-2] in planner.py)."""
    traced_model_state_bytes: int | None = None
    """Model state of a traced step (memory/traced.py, ``plan --traced``); else None."""
    traced_peak_bytes: int | None = None
    """Peak total of a traced step on the device, transients included; None unless traced."""
    traced_host_bytes: int | None = None
    """Offloaded rows: peak host memory of a traced step; None otherwise."""
    tp: int = 1
    """Tensor-parallel degree: ``gpus`` = dp × tp, ZeRO shards over dp = gpus / tp, and
    every byte above is one rank's (see [Note: tensor parallelism, planned] in
    planner.py)."""
    tp_comm_bytes_per_step: int = 0
    """Logical bytes of the tp collectives per rank and step ([Note: tp collectives,
    priced] in tensor_parallel.py); ``comm_bytes_per_step`` holds the dp ones."""
    tp_comm_time_s: float = 0.0
    """Their time, all exposed (each feeds the next op), in ``step_time_s``."""



@dataclass(frozen=True, kw_only=True)
class Setup:
    """Everything a row needs that does not vary with (N, stage, policy)."""

    cfg: ModelConfig
    recipe: analytic.Recipe
    psi: int
    seq_len: int
    micro_batch: int
    usable: int
    mfu: float
    peak_flops: float
    intra_GBps: float
    inter_GBps: float
    gpus_per_node: int | None
    offload: bool
    offload_params: bool
    pcie_GBps: float
    host_GBps: float
    host_mem: int | None
    bucket_bytes: int
    prefetch: int
    act: dict[str, int]
    """Activation bytes per policy (same at every stage: no sharding touches them)."""
    act_late: dict[str, int]
    """Per policy, those still alive at the end of stage 3's blocks' backward (see
    [Note: stage-3 peak] in stage3_buffers.py)."""
    act_head: dict[str, int]
    """Per policy, the head's saved activations (the final norm's, the LM head's input,
    the loss's), freed by the head's backward before the first block's."""
    act_saved: dict[str, int]
    """Per policy, what forward saved (``act`` less backward's recompute working set)."""
    loss_grads: dict[str, int]
    """Per policy, the two fp32 gradients the loss's backward makes (see [Note: stage-3
    peak])."""
    layer_bytes: int
    """One block's 16-bit weights + gradients + activations at micro-batch 1."""
    stage3: analytic.Stage3Buffers
    """Stage 3's gathered units and unit gradients (see [Note: stage-3 buffers])."""
    tp: int = 1
    """Tensor-parallel degree. ``psi``, ``act``, ``layer_bytes``, ``stage3`` and
    ``parts`` are then one tp rank's, and the ``n`` the methods below take is a device
    count, of which n / tp ranks shard the state."""
    parts: tuple[int, int, int] | None = None
    """(block, root, head) parameters of one rank; None: the model's own."""
    given_act: int | None = None
    """``plan --activations``: activations and buffers per device as given, in place of
    the computed ones (see [Note: a given activation budget] in planner.py)."""
    full_grad_bucket_bytes: int = 0
    """Stages 0-1's bucket (they keep the whole gradient, so their default is twice
    stage 2's, ``auto_bucket_bytes(keep_full_grads=True)``); 0: ``bucket_bytes``."""

    def moments(self, *, n: int, stage: int, policy: str, state: analytic.ModelState,
                buffers: int, offload: bool = False) -> list[tuple[str, int, int]]:
        """Stages 0-2's moments of a step, (name, total, its buffers) — see [Note: the
        step's moments, stages 0-2] in planner.py: backward begins (every activation, no
        gradient yet: the loss's two fp32 gradients beside what forward saved, or the
        recompute working set), backward ends (every gradient, the activations freed) and
        the optimizer step."""
        act = max(self.act[policy], self.act_saved[policy] + self.loss_grads[policy])
        step = self.step_moment(n=n, stage=stage, state=state, offload=offload)
        return [("backward begins", state.params + state.optim + act + buffers, buffers),
                ("backward ends", state.total + buffers, buffers),
                ("optimizer step", step, step - state.total)]

    def step_moment(self, *, n: int, stage: int, state: analytic.ModelState,
                    offload: bool = False) -> int:
        """Stages 0-2 at the optimizer step (see [Note: the step's moments, stages 0-2]):
        the model state, the fp32 copies of the gradients the masters step with, and
        stages 1-2's gathered buffer of the weights' refresh, one bucket at a time."""
        r, policy, dp = self.recipe, StagePolicy(stage), self.dp(n)
        copies = 0
        if not offload and r.grad_bytes < 4:  # fp32 masters, 16-bit gradients
            copies = 4 * (math.ceil(self.psi / dp) if policy.shard_optimizer else self.psi)
        gathered = 0
        if policy.gather_after_step and dp > 1:
            bucket = self.bucket_bytes
            if policy.keep_full_grads and self.full_grad_bucket_bytes:
                bucket = self.full_grad_bucket_bytes
            largest = math.ceil(self.cfg.largest_param() / self.tp)
            gathered = r.param_bytes * min(max(bucket // r.grad_bytes, largest), self.psi)
        return state.total + copies + gathered

    def dp(self, n: int) -> int:
        """Ranks the ZeRO state is sharded over on ``n`` devices."""
        return max(1, n // self.tp)

    def _parts(self) -> tuple[int, int, int]:
        if self.parts is not None:
            return self.parts
        cfg = self.cfg
        return analytic.block_params(cfg), analytic.root_params(cfg), analytic.head_params(cfg)

    def device_state(self, *, n: int, stage: int, offload: bool = False,
                     offload_params: bool = False) -> analytic.ModelState:
        """The model state a row keeps on the device (its ``state`` column), sharded over
        ``n``: with ``offload`` the optimizer state moves to the host, and so do the
        gradient slices at stages 2-3; with ``offload_params`` (stage 3) the weight
        slices too."""
        state = analytic.model_state_bytes(self.psi, stage=stage, n=self.dp(n),
                                           recipe=self.recipe)
        if offload:  # a whole gradient buffer (stage 1) stays on the device
            state = replace(state, optim=0,
                            grads=state.grads if StagePolicy(stage).keep_full_grads else 0)
        if offload_params:
            state = replace(state, params=0)
        return state

    def stage3_moments(self, *, n: int, policy: str, offload: bool = False,
                       prefetch: int | None = None,
                       secondary: int = 0) -> tuple[analytic.Stage3Moment, ...]:
        """Stage 3's moments of a step sharded over ``n`` devices (see [Note: stage-3
        peak] in stage3_buffers.py); ``prefetch``: another than the plan's; ``secondary``:
        k of a secondary shard (0: none)."""
        cfg = self.cfg
        block, root, head = self._parts()
        return analytic.stage3_moments(
            block=block, blocks=cfg.n_layers, root=root, head=head, n=self.dp(n),
            activations=self.act[policy], late_activations=self.act_late[policy],
            head_activations=self.act_head[policy], saved_activations=self.act_saved[policy],
            loss_gradients=self.loss_grads[policy],
            prefetch=self.prefetch if prefetch is None else prefetch, recipe=self.recipe,
            offload=offload, secondary=secondary)

    def stage3_peak(self, *, n: int, policy: str, offload: bool = False,
                    offload_params: bool = False,
                    secondary: int = 0) -> tuple[int, analytic.Stage3Moment]:
        """A stage-3 step's peak on the device, sharded over ``n``, and the moment that
        sets it (see [Note: stage-3 peak] in stage3_buffers.py): the weight and optimizer-state
        shards (those not offloaded) beside that moment's gradient slices, activations and
        buffers."""
        state = self.device_state(n=n, stage=3, offload=offload, offload_params=offload_params)
        peak = max(self.stage3_moments(n=n, policy=policy, offload=offload,
                                       secondary=secondary), key=lambda m: m.total)
        return state.params + state.optim + peak.total, peak

    def stage3_floor(self, *, policy: str, prefetch: int | None = None,
                     ) -> tuple[int, analytic.Stage3Moment]:
        """What a stage-3 peak falls towards as N grows, and never reaches, and the moment
        that holds it: the largest moment's activations and buffers, which no N shrinks
        (shards and gradient slices go to 0; the optimizer step's fp32 copies are 1/N)."""
        fixed = [m for m in self.stage3_moments(n=1, policy=policy, prefetch=prefetch)
                 if m.name != "optimizer step"]
        m = max(fixed, key=lambda m: m.activations + m.buffers)
        return m.activations + m.buffers, m

    @property
    def unit(self) -> int:
        """Largest stage-3 unit, a block or the root (everything outside the blocks): the
        gather priced as exposed at the start of forward and of backward."""
        block = self._parts()[0]
        return max(block, self.psi - self.cfg.n_layers * block)

    def nodes(self, n: int) -> int:
        g = self.gpus_per_node
        return n // g if g and n > g else 1
