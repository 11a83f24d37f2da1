"""The initial training DAG: one COMPUTE node per segment, unplaced, not yet split."""
from __future__ import annotations

from piper_compile.capture.segments import Segment, region_label
from piper_compile.ir.dag import Kind, Node, TrainingDAG, make_tags


def build_dag(segments: list[Segment], forward_only: bool = False) -> TrainingDAG:
    """COMPUTE nodes named ``F.PP1`` / ``B.PP1`` with the region tags plus ``PASS``."""
    dag = TrainingDAG()
    for seg in segments:
        if forward_only and seg.pass_ != "F":
            continue
        tags = make_tags({**dict(seg.region), "PASS": seg.pass_})
        label = str(seg.region[0][1]) if [k for k, _ in seg.region] == ["PP"] else region_label(seg.region)
        attrs: dict[str, object] = {"segment": seg.name, "region_label": label}
        if seg.boundary:
            attrs["boundary"] = seg.boundary
        if seg.loss:
            attrs["loss"] = seg.loss
        if seg.grads and not forward_only:
            attrs["grads"] = tuple(seg.grads)
        dag.add(Node(seg.name, Kind.COMPUTE, tags, (), "compute", seg.inputs, seg.outputs,
                     tuple(sorted(attrs.items()))))
    dag.meta["segments"] = {s.name: s for s in segments}
    return dag
