"""FX helpers shared by capture and codegen."""
from __future__ import annotations

import torch
from torch import fx


def graph_module(root: torch.nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """``fx.GraphModule(root, graph)`` whose Python code is generated on first use (a call, ``.code``,
    pickling) rather than at once: piper builds a module per segment and per regional piece, and a warm
    start loads most of them from Inductor's cache without ever running their Python code (32 layers:
    ~80 modules, ~0.4 s of code generation per rank)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # a torch without lazy graph modules: generate the code now
        return fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)
