"""The fp8 guard's step in vLLM, once per engine step, whatever the attention backend.

vLLM has no per-step hook for plugins, and under full CUDA graphs no host code of the model runs
in a decode step. What does run on the worker's host every step is the input batch's refresh,
which calls ``update_state`` of every logits processor; vLLM builds the ones installed under the
``vllm.logits_processors`` entry point group into every generating engine. ``Fp8GuardStep`` is
one: it changes no logits and steps latentspeed's guards (``common_kernels.guard.step_all``), so
``LATENTSPEED_FP8_GUARD=raise`` stops the engine under vLLM's own attention backends too.

vLLM builds these processors only in its V1 model runner and without speculative decoding
(``steps_every_engine_step``); elsewhere latentspeed's attention backend steps the guard per decode
batch, and with another backend nothing reads it.
"""

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from common_kernels.guard import step_all


def steps_every_engine_step(vllm_config) -> bool:
    """Whether vLLM builds ``Fp8GuardStep`` for an engine of this config."""
    return vllm_config.speculative_config is None and not vllm_config.use_v2_model_runner


class Fp8GuardStep(LogitsProcessor):
    """Steps latentspeed's fp8 guards before each forward pass; leaves the logits as they are."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        step_all()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
