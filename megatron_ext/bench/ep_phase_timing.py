"""Timing of the EP layer benchmark: stamps on the compute stream (Clock: CUDA events, or host
wall time on CPU), the whole layer step (time_layer), and the token dispatcher's six methods,
forward and backward (PhaseTimer: stamps at each method's entry and exit, and identity autograd
nodes that stamp when a gradient passes a method's outputs and inputs).
"""

from __future__ import annotations

import time

import torch

DISPATCH_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess")
COMBINE_METHODS = ("combine_preprocess", "token_combine", "combine_postprocess")


class Clock:
    """Timestamps on the compute stream (CUDA events) or, on CPU, host wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def time_layer(step, clock: Clock, iters: int) -> list[float]:
    """Per-iteration ms of `step` (events recorded back to back, no sync inside the window)."""
    stamps = []
    for _ in range(iters):
        start = clock.stamp()
        step()
        stamps.append((start, clock.stamp()))
    clock.synchronize()
    return [clock.ms(s, e) for s, e in stamps]


class _BackwardMark(torch.autograd.Function):
    """Identity; calls `on_backward` when the gradient passes through."""

    @staticmethod
    def forward(ctx, x, on_backward):
        ctx.on_backward = on_backward
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_backward()
        return grad, None


class PhaseTimer:
    """Times the token dispatcher's six methods, forward and backward, per iteration.

    Installed as instance attributes over the dispatcher's methods (removed by `uninstall`), so
    MoELayer's own calls go through it; the layer is otherwise untouched.
    """

    def __init__(self, dispatcher, clock: Clock):
        self.dispatcher = dispatcher
        self.clock = clock
        self.iteration = 0
        self.forward_log: list[tuple[int, str, object, object]] = []
        self.backward_log: list[tuple[int, str, str, object]] = []
        self.step_log: list[tuple[object, object]] = []  # whole fwd+bwd of each timed iteration
        for name in DISPATCH_METHODS + COMBINE_METHODS:
            setattr(dispatcher, name, self._wrap(name, getattr(type(dispatcher), name).__get__(dispatcher)))

    def uninstall(self) -> None:
        for name in DISPATCH_METHODS + COMBINE_METHODS:
            if name in vars(self.dispatcher):
                delattr(self.dispatcher, name)

    def _wrap(self, name, method):
        def timed(*args, **kwargs):
            args = tuple(self._mark(arg, name, "end") for arg in args)
            start = self.clock.stamp()
            out = method(*args, **kwargs)
            end = self.clock.stamp()
            self.forward_log.append((self.iteration, name, start, end))
            if isinstance(out, tuple):
                return tuple(self._mark(item, name, "start") for item in out)
            return self._mark(out, name, "start")
        return timed

    def _mark(self, value, name: str, kind: str):
        """Backward of a method starts when a gradient reaches one of its outputs ("start") and
        ends when the gradient leaves one of its inputs ("end")."""
        if not (torch.is_tensor(value) and value.requires_grad and value.is_floating_point()):
            return value
        iteration = self.iteration

        def record():
            self.backward_log.append((iteration, name, kind, self.clock.stamp()))
        return _BackwardMark.apply(value, record)

    def time_step(self, step) -> None:
        """One timed iteration: `step()` (forward+backward) with its own start and end stamps."""
        start = self.clock.stamp()
        step()
        self.step_log.append((start, self.clock.stamp()))
        self.iteration += 1

    def per_iteration(self) -> list[dict[str, float]]:
        """[{method_fwd: ms, method_bwd: ms, dispatch_fwd, ..., dispatch_combine: ms, layer: ms}]
        per iteration; `layer` is that iteration's whole step (dispatch_combine is part of it)."""
        self.clock.synchronize()
        rows = []
        for iteration in range(self.iteration):
            row = {"layer": self.clock.ms(*self.step_log[iteration])} if iteration < len(self.step_log) else {}
            for name in DISPATCH_METHODS + COMBINE_METHODS:
                row[f"{name}_fwd"] = sum(self.clock.ms(s, e) for i, n, s, e in self.forward_log
                                         if i == iteration and n == name)
                marks = [(kind, stamp) for i, n, kind, stamp in self.backward_log if i == iteration and n == name]
                row[f"{name}_bwd"] = self._backward_ms(marks)
            for phase, names in (("dispatch", DISPATCH_METHODS), ("combine", COMBINE_METHODS)):
                for leg in ("fwd", "bwd"):
                    row[f"{phase}_{leg}"] = sum(row[f"{n}_{leg}"] for n in names)
            row["dispatch_combine"] = sum(row[f"{p}_{leg}"] for p in ("dispatch", "combine") for leg in ("fwd", "bwd"))
            rows.append(row)
        return rows

    def _backward_ms(self, marks) -> float:
        """Sum of the stretches during which some gradient is inside the method: opened by the
        first "start" mark, closed when as many "end" marks have fired (ends with nothing open,
        e.g. a second input's gradient produced by the same node, add nothing)."""
        total, open_at, inside = 0.0, None, 0
        for kind, stamp in marks:
            if kind == "start":
                if inside == 0:
                    open_at = stamp
                inside += 1
            elif inside > 0:
                inside -= 1
                if inside == 0:
                    total += self.clock.ms(open_at, stamp)
        return total


def time_phases(layer, step, clock: Clock, iters: int) -> list[dict[str, float]]:
    timer = PhaseTimer(layer.token_dispatcher, clock)
    try:
        for _ in range(iters):
            timer.time_step(step)
        return timer.per_iteration()
    finally:
        timer.uninstall()
