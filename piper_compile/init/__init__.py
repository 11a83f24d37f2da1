"""Initializing models built on the meta device where their pieces live: ``record.py`` writes each module's
init down as per-tensor programs, ``replay.py`` computes any piece of a tensor from them (and
``materialize``, the single-device reference), ``deferred.py`` swaps a model's meta tensors for
storage-less stand-ins and fills what each rank's plan holds at its first call."""
