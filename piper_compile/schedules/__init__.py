"""Schedule builders: each returns ``order`` directives (one per rank), plus placements for virtual stages."""
from piper_compile.schedules.builders import (
    gpipe, interleaved_1f1b, one_f_one_b, round_robin, stage_sequence, v_shape, zb_h1,
)
from piper_compile.schedules.csv_format import read_csv, read_rows, to_rows, write_csv
from piper_compile.schedules.greedy import dualpipe_v, list_schedule, zbv

__all__ = ["dualpipe_v", "gpipe", "interleaved_1f1b", "list_schedule", "one_f_one_b", "read_csv", "read_rows",
           "round_robin", "stage_sequence", "to_rows", "v_shape", "write_csv", "zb_h1", "zbv"]
