"""Schedule builders: each returns ``order`` directives (one per stage) in the JSON vocabulary."""
from piper_compile.schedules.builders import gpipe, one_f_one_b, stage_sequence

__all__ = ["gpipe", "one_f_one_b", "stage_sequence"]
