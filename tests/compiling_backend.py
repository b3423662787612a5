"""Backends for tests/test_time_table.py: the numpy backend as if it compiled each new
LayerNorm input shape (a 0.05 s sleep, counted as compile time), and one whose
compile_seconds() raises."""

from __future__ import annotations

import time

from normspec.impls.numpy_ref import NumpyBackend

COMPILE_S = 0.05


class CompilingBackend(NumpyBackend):
    name = "numpy_compiling"

    def __init__(self):
        super().__init__()
        self.shapes: set = set()
        self.spent = 0.0

    def layer_norm(self, x, *args, **kwargs):
        if x.shape not in self.shapes:
            self.shapes.add(x.shape)
            time.sleep(COMPILE_S)
            self.spent += COMPILE_S
        return super().layer_norm(x, *args, **kwargs)

    def compile_seconds(self) -> float:
        return self.spent


class BrokenCounter(NumpyBackend):
    name = "numpy_broken_counter"

    def compile_seconds(self) -> float:
        raise RuntimeError("no timer here")


def make_backend():
    return CompilingBackend()


def make_broken_counter():
    return BrokenCounter()
