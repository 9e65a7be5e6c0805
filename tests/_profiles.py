"""A synthetic calibration profile for tests: every price proportional, so a prediction
(and stage="auto"'s choice) depends on the traces and the prices only, not on the noise
of the machine the tests run on."""

from __future__ import annotations

from zeroshard.memory.traced import trace_step
from zeroshard.step_ops import StepOps
from zeroshard.timing.profile import Profile, machine


def synthetic_profile(path: str, *, model: str = "gpt2-tiny", batch: tuple[int, int] = (2, 32),
                      world: int = 2) -> Profile:
    gemm: set = set()
    att: set = set()
    for stage in (0, 3):
        r = trace_step(model, world_size=2, stage=stage, mixed_precision=None,
                       micro_batch=batch[0], seq_len=batch[1], collectives="gloo",
                       record_ops=True)
        ops = StepOps.from_dict(r.ops)
        gemm |= ops.gemm_shapes()
        att |= ops.attention_shapes()
    p = Profile(backend="gloo", world_size=world, threads=1, machine=machine())
    p.gemm = [[*k, 2.0 * k[0] * k[1] * k[2] * k[3] / 1e11] for k in sorted(gemm)]
    p.attention = [[*k, 1e-4] for k in sorted(att)]
    p.memory = {c: [[1.0, 1e-6], [1e9, 0.1]] for c in (
        "elementwise", "copy", "transcendental", "norm", "softmax", "reduction", "index")}
    p.optimizer_s_per_element = {"AdamW": 3e-9}
    p.first_touch_s_per_byte = 2.5e-10
    p.view_s = 1e-7
    p.collectives = {op: {"2": [[1e3, 2e-4], [1e9, 1.0]]}
                     for op in ("all_reduce", "reduce_scatter", "all_gather")}
    p.overlap = 0.1
    p.save(path)
    return p
