"""moezero.phases: forwards in phases, driven alone or interleaved; a module's hooks around its phases as
__call__ runs them, and a module __call__ would run otherwise run whole."""

import torch
from torch import nn

from moezero import phases


class Phased(nn.Module):
    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log

    def forward(self, x):
        return phases.run(self.forward_steps(x))

    def forward_steps(self, x):
        for phase in range(3):
            self.log.append((self.name, phase))
            yield
        return x + 1


def test_interleaved_generators_take_one_phase_each_in_turn():
    log = []
    results = phases.run_interleaved([Phased("a", log).forward_steps(1), Phased("b", log).forward_steps(10)])
    assert results == [2, 11]
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]


def test_a_modules_forward_hooks_run_around_its_phases():
    log = []
    module = Phased("a", log)
    module.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    module.register_forward_hook(lambda m, args, out: out * 100)
    assert phases.run(phases.module_steps(module, 3)) == 700 == module(3)


def test_a_module_call_would_run_otherwise_runs_whole():
    log = []
    hooked = Phased("kwargs", log)
    hooked.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    steps = phases.module_steps(hooked, 1)
    assert next(steps, "ended") == "ended" and log == [("kwargs", 0), ("kwargs", 1), ("kwargs", 2)]
    compiled = Phased("compiled", log)
    compiled.compile(backend="eager")
    assert next(phases.module_steps(compiled, 1), "ended") == "ended"
    assert phases.run(phases.module_steps(nn.Linear(2, 2), torch.ones(2))).shape == (2,)  # no forward_steps
