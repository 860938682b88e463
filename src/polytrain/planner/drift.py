"""A profile against this host's speed now: the figures a drift moves, and the profile rescaled.

[Note: host drift]
A shared host does not keep one speed. On the 2-core VM (2026-11-26) calibrations minutes apart
read the fp32 matmul at 157-162 GFLOP/s, bf16 at 1,106 and an operator call at 4.7-4.9 us, and
then, for 20-odd minutes with low spreads, 122-128, 434-462 and 8.6-9.1 us; a benchmark run at
normal speed on a profile taken in the slow minutes measured every layout 20-50% below its price
(gpt tiny dp1 +42%). The figures do not move together (bf16 2.4x, an operator call 1.8x, fp32
1.3x), so one matmul timed before and after a run (what the planner benchmark did first) can
read 1.03x while a layout is priced 20% high.

So a calibration also times a few short *speed figures*, one per family of the profile's numbers
(`SPEED_FIGURES`: `measure.host.speed_rounds`), in timing rounds beside its matmul rounds, so at
the moments its compute figures were measured, and keeps them (`HostProfile.speed`); how far
the host moved while it measured (the rounds' spread, and a sample at its end against them) is
the spread "host speed during calibration", and past `DRIFT_LIMIT` the command says so. (A first
version kept the median of eight samples spread over the whole calibration: at 17:05 the VM ran
at full speed for the first minute, where the matmul figures were measured, and slow after; the
median described the slow part and would have rescaled the profile the wrong way.) Before a run is held against its prediction (`polytrain plan --validate`,
`benchmarks/planner`) the figures are timed again, and the profile is *rescaled* to the host's
speed now: each family's figures by its figure's ratio (`rescaled`). Collectives and the wire's
figures are not rescaled: the speed figures time no communication, and a gloo call's latency
on this VM is set by wake-ups, not by the core's speed.

The families (what each figure stands for):
- "matmul fp32": fp32 matmul and Linear rates of one process alone, and attention's kernels;
- "matmul fp32, all cores": the same matmul on every core at once stands for what several
  processes get together: the fp32 rates with more than one process computing, and the
  shared-core slowdown (a step with N processes against one alone) moves by the ratio of the
  one-core to the all-core figure. Not by the one-core figure alone: on 2026-11-26 at 17:20 a
  profile taken in slow minutes, rescaled by the one-core figures (1.2-1.6x), priced gpt tiny's
  one-process step right (+32% -> +4%) and every multi-process layout 10-24% low, where the
  profile as calibrated had priced them within 2-17%: the speed lost and won in those minutes
  was mostly a lone process's;
- "matmul half": bf16 (and fp16) matmul rates;
- "operator": seconds of per-call Python and dispatch: an operator call, the loop's own Python,
  FSDP2's hooks, DTensor's dispatch, the pipeline runtime's per action and per flush, the
  per-tensor part of the end of a step;
- "copy": memory bandwidth, elementwise kernels, the per-byte part of the end of a step.
A ratio says how fast the host is now against the profile (0.8: a fifth slower).
"""

from __future__ import annotations

import math
from dataclasses import replace

from polytrain.planner.types import HostProfile

__all__ = [
    "DRIFT_LIMIT",
    "SPEED_FIGURES",
    "SPEED_SPREAD",
    "describe",
    "drifted",
    "rescaled",
    "speed_ratios",
]

SPEED_FIGURES: tuple[str, ...] = (
    "matmul fp32",
    "matmul fp32, all cores",
    "matmul half",
    "operator",
    "copy",
)
DRIFT_LIMIT = 0.15  # a figure more than this far from its profile's value has drifted
SPEED_SPREAD = "host speed during calibration"  # `HostProfile.spread`'s key for it


def speed_ratios(saved: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Per speed figure in both (each a rate: higher is faster), how fast the host is now
    against ``saved``; a figure missing or not positive on either side is left out."""
    return {
        name: now[name] / saved[name]
        for name in SPEED_FIGURES
        if name in saved
        and name in now
        and saved[name] > 0
        and now[name] > 0
        and math.isfinite(now[name] / saved[name])
    }


def drifted(ratios: dict[str, float], limit: float = DRIFT_LIMIT) -> list[str]:
    """The figures whose ratio is more than ``limit`` from 1, in `SPEED_FIGURES` order."""
    return [name for name, r in ratios.items() if abs(r - 1.0) > limit]


def describe(ratios: dict[str, float]) -> str:
    """``"matmul fp32 0.81x, operator 1.32x"``; ``"not measured"`` for no ratios."""
    return ", ".join(f"{name} {r:.2f}x" for name, r in ratios.items()) or "not measured"


def rescaled(profile: HostProfile, ratios: dict[str, float]) -> HostProfile:
    """``profile`` at the speed ``ratios`` says the host runs at now ([Note: host drift]): each
    family's rates multiplied, its seconds divided, by its figure's ratio; a family without a
    ratio, and the collectives, as they were. ``ratios`` empty: ``profile`` itself."""
    if not ratios:
        return profile
    fp32 = ratios.get("matmul fp32", 1.0)
    cores = ratios.get("matmul fp32, all cores", fp32)
    half = ratios.get("matmul half", 1.0)
    op = ratios.get("operator", 1.0)
    copy = ratios.get("copy", 1.0)

    def dtype_scale(dtype: str) -> float:
        return fp32 if dtype == "fp32" else half

    return replace(
        profile,
        matmul_flops={d: v * dtype_scale(d) for d, v in profile.matmul_flops.items()},
        matmul_by_size={
            d: {n: v * dtype_scale(d) for n, v in sizes.items()}
            for d, sizes in profile.matmul_by_size.items()
        },
        matmul_concurrent={
            n: v * (fp32 if n <= 1 else cores) for n, v in profile.matmul_concurrent.items()
        },
        # a step with n at once took s x one alone's: one alone is now fp32 x as fast, n at once
        # cores x ([Note: shared cores, measured on a step] in measure/contention.py)
        step_slowdown={n: s * fp32 / cores for n, s in profile.step_slowdown.items()},
        gemm_by_size={n: v * fp32 for n, v in profile.gemm_by_size.items()},
        attention_rates={k: (f * fp32, b * fp32) for k, (f, b) in profile.attention_rates.items()},
        mem_bw=profile.mem_bw * copy,
        elementwise_s={k: v / copy for k, v in profile.elementwise_s.items()},
        step_costs={k: (t / op, b / copy) for k, (t, b) in profile.step_costs.items()},
        op_s=profile.op_s / op,
        loop_step_s=profile.loop_step_s / op,
        loop_microbatch_s=profile.loop_microbatch_s / op,
        fsdp_unit_s={k: v / op for k, v in profile.fsdp_unit_s.items()},
        fsdp_tensor_s={k: v / op for k, v in profile.fsdp_tensor_s.items()},
        tp_module_s=profile.tp_module_s / op,
        pipe_action_s={k: v / op for k, v in profile.pipe_action_s.items()},
        pipe_flush_s={k: v / op for k, v in profile.pipe_flush_s.items()},
        speed={k: v * ratios.get(k, 1.0) for k, v in profile.speed.items()},
    )
