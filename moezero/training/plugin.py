"""The seam through which features above training (quantization-aware training, ...) join a run.

A factory gets the freshly built model before the optimizer exists (so it may reparametrize weights), with
the run's ParallelGroups (at --pipeline-model-parallel-size > 1: the rank's StageModel and its PipelineGroups,
the stage's groups in `.stage`), and returns a plug-in, or None when its feature is off. The run then drives
the plug-in:

    on_step_end(steps)       after every iteration, with the number of optimizer steps taken (a skipped
                             step, an fp16 overflow, is not one); also once after a resume from a
                             checkpoint that holds no state of this plug-in
    scalars()                {TensorBoard tag: value} at every log step (called on every rank: may be a
                             collective)
    state_dict() / load_state_dict(state)   saved in and restored from checkpoints under its name
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Protocol

from torch import nn


class TrainingPlugin(Protocol):
    def on_step_end(self, iteration: int) -> None: ...

    def scalars(self) -> Dict[str, float]: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...


# (model, groups: ParallelGroups or, at pp > 1, PipelineGroups, configs)
PluginFactory = Callable[[nn.Module, Any, Any], Optional[TrainingPlugin]]


def attach_plugins(
    factories: Mapping[str, PluginFactory], model: nn.Module, groups: Any, configs: Any
) -> Dict[str, TrainingPlugin]:
    """{name: plug-in} of the factories whose feature is on, in the factories' order."""
    plugins = {name: factory(model, groups, configs) for name, factory in factories.items()}
    return {name: plugin for name, plugin in plugins.items() if plugin is not None}
