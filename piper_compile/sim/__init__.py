"""Simulator and traces: cost models, a discrete-event simulation of every rank's program (step time,
bubble, peak memory), Chrome/Perfetto traces (simulated and real, ``PIPER_TRACE=dir``) and schedule
grid pictures.

    plan = piper.plan(model, *batch, directives=..., world_size=4)
    result = simulate_plan(plan, UniformCost(f=1, b=2))
    write_trace(result, "sim.json"); draw_grid(result, "grid.svg")
"""
from piper_compile.sim.cost import CostModel, FlopCost, MeasuredCost, UniformCost
from piper_compile.sim.grid import draw_grid, grid_svg
from piper_compile.sim.simulate import SimResult, simulate, simulate_plan
from piper_compile.sim.trace import Span, merge_traces, read_spans, write_trace

__all__ = ["CostModel", "FlopCost", "MeasuredCost", "SimResult", "Span", "UniformCost", "draw_grid", "grid_svg",
           "merge_traces", "read_spans", "simulate", "simulate_plan", "write_trace"]
