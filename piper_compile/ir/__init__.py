"""The global training DAG: every compute and communication step of one training step on every rank."""
from piper_compile.ir.dag import Kind, Node, TrainingDAG, format_tags, parse_dag

__all__ = ["Kind", "Node", "TrainingDAG", "format_tags", "parse_dag"]
