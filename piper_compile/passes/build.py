"""The initial training DAG: one COMPUTE node per segment, unplaced, not yet split."""
from __future__ import annotations

from piper_compile.capture.regions import region_label
from piper_compile.capture.segments import Segment
from piper_compile.ir.dag import Node, TrainingDAG, make_tags
from piper_compile.ir.ops import Segment as SegmentOp


def build_dag(segments: list[Segment], forward_only: bool = False) -> TrainingDAG:
    """COMPUTE nodes named ``F.PP1`` / ``B.PP1`` with the region tags plus ``PASS``."""
    dag = TrainingDAG()
    for seg in segments:
        if forward_only and seg.pass_ != "F":
            continue
        tags = make_tags({**dict(seg.region), "PASS": seg.pass_})
        label = str(seg.region[0][1]) if [k for k, _ in seg.region] == ["PP"] else region_label(seg.region)
        op = SegmentOp(seg.name, label, seg.loss or None, tuple(seg.grads) if seg.grads and not forward_only else (),
                       seg.boundary or None)
        dag.add(Node(seg.name, op, tags, (), "compute", seg.inputs, seg.outputs))
    dag.segments = {s.name: s for s in segments}
    return dag
