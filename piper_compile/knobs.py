"""Every ``PIPER_*`` environment variable piper reads, in one table.

Each knob says its type, its default, what it does, and so the error a bad value gets: code reads a knob
only through ``knob(name)`` (an unknown name is an internal error, so a knob cannot be read without being
listed here). README's knob table is generated from ``KNOBS`` (``python -m piper_compile knobs``) and a test
checks that the two agree. Options given to ``torch.compile`` win over the variables that default them
(``options.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from piper_compile.errors import PiperError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True, slots=True)
class Knob:
    """One environment variable: ``kind`` is ``flag``, ``int`` (whole number >= 0), ``float`` (> 0),
    ``choice`` (one of ``choices``) or ``text``; ``scope`` is ``run`` (a user's run) or ``testing`` (the test
    harness and benchmarks)."""

    name: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    scope: str = "run"

    def expected(self) -> str:
        return {"flag": "0 or 1", "int": "a whole number >= 0", "float": "a number > 0",
                "choice": " or ".join(repr(c) for c in self.choices), "text": "text"}[self.kind]

    def parse(self, text: str) -> Any:
        """The value of ``text``; a ``piper:`` error naming the variable, what it takes and what it does."""
        value = _parse(self.kind, text.strip(), self.choices)
        if value is None:
            raise PiperError(f"piper: {self.name} must be {self.expected()}, got {text!r} ({self.doc}; "
                             f"unset it for the default, {self.default!r})")
        return value


def _parse(kind: str, text: str, choices: tuple[str, ...]) -> Any:
    """The parsed value, or None when ``text`` is not one of ``kind``."""
    if kind == "flag":
        low = text.lower()
        return True if low in _TRUE else False if low in _FALSE else None
    if kind == "int":
        return int(text) if text.isdigit() else None
    if kind == "float":
        try:
            value = float(text)
        except ValueError:
            return None
        return value if value > 0 else None
    if kind == "choice":
        return text if text in choices else None
    return text


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("PIPER_DEBUG", "flag", False, "print the FX graph after every graph pass and the DAG after every DAG pass (to stderr)"),
    Knob("PIPER_SKIP_PASSES", "text", "", "comma-separated names of graph or DAG passes the pass drivers skip (debugging only)"),
    Knob("PIPER_TRACE", "text", "", "a directory: write a Chrome/Perfetto trace per rank of every step (pid = rank, tid = stream, SEND to RECV flows)"),
    Knob("PIPER_CODEGEN", "choice", "inductor", "default of options['codegen']: compile segments with "
         "Inductor, or run them as eager FX graphs", ("inductor", "eager")),
    Knob("PIPER_TIMEOUT", "float", 300.0, "default of options['timeout']: seconds before a stuck collective or "
         "receive fails the step"),
    Knob("PIPER_REMAT", "flag", True, "default of options['remat']: recompute cheap activations in the backward"),
    Knob("PIPER_OVERLAP_STREAMS", "flag", True, "default of options['overlap_streams']: CUDA overlap slots on "
         "two streams"),
    Knob("PIPER_CUDA_GRAPH", "flag", False, "default of options['cuda_graph']: on one GPU, replay the whole "
         "training step as one CUDA graph"),
    Knob("PIPER_LOCAL_BATCH_OPS", "flag", False, "default of options['local_batch_ops']: ops relating samples "
         "of the batch to each other (in-batch negatives, batch statistics) and losses that are not sums or "
         "means over it see each micro-batch's and replica's own samples instead of being refused where the "
         "batch is cut"),
    Knob("PIPER_REORDER_WINDOW", "int", 8, "default of options['reorder_window']: how many compute steps "
         "ahead the runtime may run while a step waits for its input; 0 keeps program order except for "
         "overlap slots"),
    Knob("PIPER_LOG_STATS", "int", 0, "default of options['log_stats']: log piper.stats's one-line metrics "
         "at INFO on the 'piper_compile.stats' logger every N training steps (0: never)"),
    Knob("PIPER_PEAK_TFLOPS", "float", 0.0, "the device's peak TFLOP/s that piper.stats computes MFU against "
         "(default: a table of common GPUs by name and dtype; on CPU a measured matmul peak)"),
    Knob("PIPER_HOST_STAGING", "choice", "auto", "CUDA tensors on gloo groups (ranks sharing a GPU) move through "
         "pinned host buffers ('auto'); 'always' stages CPU tensors too, so CPU tests run that path",
         ("auto", "always")),
    Knob("PIPER_TRITON_EXPERTS", "flag", True, "on CUDA, run the grouped SwiGLU experts (MoE) through piper's "
         "Triton kernels when triton is installed (0: the torch reference)"),
    Knob("PIPER_INDUCTOR_CACHE", "flag", True, "compile segments through Inductor's on-disk FX graph cache: "
         "ranks running the same segment take turns, so one compiles it and the others load it, and a second run "
         "loads every segment (0: every rank compiles everything)"),
    Knob("PIPER_FAST_LOAD", "choice", "auto", "on a warm run, load each compiled segment piece straight from the "
         "FX-graph-cache entry it came from last time (written down per piece, its inputs and the machine), skipping "
         "its re-trace and Inductor's hashing; any miss or error compiles as usual. Also skips Inductor's vector-ISA "
         "load probe (a child process per ISA) for a probe library that loaded before, and its preprocessing of the "
         "C++ prefix header (a g++ -E child per process) to name a precompiled header it named before. 'auto' is "
         "on from torch "
         "2.13, where the Inductor internals it uses are tested", choices=("auto", "on", "off")),
    Knob("PIPER_GC_WINDOW", "flag", True, "during a step's first call (trace, capture, planning, loading or "
         "compiling code), keep Python's garbage collector off the objects alive before it (gc.freeze) and collect "
         "the young generation every 10,000 allocations instead of 700, both undone at the end: its collections no "
         "longer walk the whole process; skipped where something else froze objects or the collector is off"),
    Knob("PIPER_CAPTURE_CACHE", "choice", "auto", "keep AOTAutograd's joint graph of each distinct model graph in "
         "Inductor's cache directory, so a second run loads it: 'turns' (ranks missing it wait while one exports "
         "it, then load it), 'each' (they export side by side, the first done writes it), 'auto' (turns unless "
         "the machine has two cores per rank, else each; off on torch older than 2.13, where its round trip is "
         "untested), 'off'", choices=("auto", "turns", "each", "off")),
    Knob("PIPER_FORWARD_CACHE", "choice", "auto", "piper.compile traces the model's forward with Dynamo's "
         "whole-graph capture itself and keeps the trace (guards, bytecode, Dynamo's graph) in Inductor's cache "
         "directory, so a warm run's first call loads it instead of tracing; every guard is checked on every call "
         "and a call whose guards fail compiles through Dynamo as a recompile. 'auto' is on from torch 2.13, "
         "where the Dynamo internals it uses are tested; 'off' traces through torch.compile's frame hook, "
         "every run", choices=("auto", "on", "off")),
    Knob("PIPER_REGIONAL", "flag", True, "regional compilation: a segment holding repeated blocks (the children "
         "of one ModuleList, like a transformer's layers) is compiled block by block, so identical blocks compile "
         "once (0: each segment is compiled as one graph)"),
    Knob("PIPER_NESTED_REGIONS", "choice", "auto", "piper.compile marks the blocks of a module list whose "
         "children are alike (a transformer's layers) as nested compile regions: Dynamo traces one block and "
         "AOTAutograd exports its forward and backward once, so capture does not grow with the layer count. 'auto' "
         "is on from torch 2.13 (where it is tested) unless shard_tensor rewrites the layers; 'off' traces every block", choices=("auto", "on", "off")),
    Knob("PIPER_FUSED_GRADS", "flag", True, "backward segments accumulate their parameter gradients into the "
         "gradient buffers themselves (the first micro-batch overwrites, later ones add, inside the compiled "
         "kernels) instead of returning them for the runtime to add (0: the runtime adds them)"),
    Knob("PIPER_PRECOMPILE", "flag", True, "compile every segment of a rank's program before its first step "
         "runs (from the segments' input shapes), so pipeline stages compile at the same time instead of one "
         "after the other (0: each segment compiles when it first runs)"),
    Knob("PIPER_FUSED_OPTIMIZER", "flag", True, "build piper's optimizer with fused=True where that is known "
         "to update like the default implementation"),
    Knob("PIPER_KEEP_HEAP", "flag", True, "on Linux CPU, tune glibc malloc so freed step memory is reused "
         "instead of returned to the OS"),
    Knob("PIPER_RANK_NETNS", "text", "", "comma-separated network namespace per rank that run_local enters "
         "(benchmarks/emulated_link.py --per-rank)", scope="testing"),
    Knob("PIPER_RANK_ADDRS", "text", "", "comma-separated address per rank, beside PIPER_RANK_NETNS",
         scope="testing"),
    Knob("PIPER_RANK_IFNAME", "text", "pl0", "the interface gloo uses inside a rank's namespace",
         scope="testing"),
    Knob("PIPER_FUZZ_EXAMPLES", "int", 6, "examples of the call-consistency fuzz (tests/dist/test_call_fuzz.py)",
         scope="testing"),
    Knob("PIPER_CRASH_TRIALS", "int", 25, "SIGKILL-during-save trials (tests/dist/test_checkpoint_atomic.py)",
         scope="testing"),
    Knob("PIPER_CRASH_SEED", "int", 18, "seed of those trials", scope="testing"),
)}


def knob(name: str) -> Any:
    """The value of environment variable ``name`` (its default when unset or empty)."""
    k = KNOBS.get(name)
    if k is None:
        raise KeyError(f"piper: internal: {name} is not a registered knob (add it to piper_compile/knobs.py)")
    text = os.environ.get(name, "")
    return k.default if text.strip() == "" else k.parse(text)


def markdown_table() -> str:
    """README's knob table."""
    rows = ["| variable | takes | default | what it does |", "| --- | --- | --- | --- |"]
    for scope in ("run", "testing"):
        for k in KNOBS.values():
            if k.scope == scope:
                default = "unset" if k.default in ("", None) else f"`{k.default!r}`" if k.kind != "flag" \
                    else f"`{int(k.default)}`"
                what = k.doc + (" -- tests and benchmarks only" if scope == "testing" else "")
                rows.append(f"| `{k.name}` | {k.expected()} | {default} | {what} |")
    return "\n".join(rows)
