"""Schedule builders: each returns ``order`` directives (one per rank), plus placements for virtual stages."""
from piper_compile.schedules.builders import (
    gpipe, interleaved_1f1b, one_f_one_b, round_robin, stage_sequence, v_shape, zb_h1,
)
from piper_compile.schedules.greedy import dualpipe_v, list_schedule, zbv

__all__ = ["dualpipe_v", "gpipe", "interleaved_1f1b", "list_schedule", "one_f_one_b", "round_robin",
           "stage_sequence", "v_shape", "zb_h1", "zbv"]
