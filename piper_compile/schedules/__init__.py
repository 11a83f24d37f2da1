"""Schedule builders: each returns ``order`` directives (one per rank), plus placements for virtual stages."""
from piper_compile.schedules.builders import (
    gpipe, interleaved_1f1b, one_f_one_b, round_robin, stage_sequence, v_shape, zb_h1,
)

__all__ = ["gpipe", "interleaved_1f1b", "one_f_one_b", "round_robin", "stage_sequence", "v_shape", "zb_h1"]
