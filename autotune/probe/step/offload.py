"""Where each state lives between phases, and the rollout engine's wake-up and sleep.

Offload moves params and optimizer state to host memory between phases, as verl's and EasyR1's
FSDP workers do (offload_fsdp_model / load_fsdp_model and the optimizer's twin): FSDP1's flat
shards move and FSDP is told, FSDP2's DTensor shards are re-read through `_apply`. The engine
wakes with the actor's weights gathered one tensor at a time (verl's FSDP sharding manager)
and sleeps after generating; a policy that generates itself loads its own params instead.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from autotune.probe.modeling.sharding import full_tensor, is_fsdp1, map_local, named_weights
from autotune.probe.step.state import StepState


class Offload(StepState):
    """Offload between phases and the engine's wake-up and sleep (module docstring)."""

    def _move(self, tensor: torch.Tensor, to_device: bool, pinned: bool = True
              ) -> torch.Tensor:
        """`tensor` on the device or in host memory (the meter says how each is held)."""
        on_host = self.meter.on_host(tensor)
        if to_device and on_host:
            self.host_offload_bytes -= tensor.numel() * tensor.element_size()
            return self.meter.to_device(tensor)
        if not to_device and not on_host:
            self.host_offload_bytes += tensor.numel() * tensor.element_size()
            return self.meter.to_host(tensor, pinned)
        return tensor

    def _place_module(self, module: torch.nn.Module, on_device: bool,
                      pinned: bool = True) -> None:
        if self.group is None or is_fsdp1(module):
            # FSDP1: each unit's flat shard moves and FSDP is told (EasyR1's and verl's
            # offload_fsdp_model: flat_param_to, then _local_shard = flat_param.data)
            for param in module.parameters():
                param.data = self._move(param.data, on_device, pinned)
                if hasattr(param, "_local_shard"):
                    param._local_shard = param.data
            return

        def place(tensor: torch.Tensor) -> torch.Tensor:  # FSDP: shards move, buffers stay
            if not hasattr(tensor, "_local_tensor"):
                return tensor
            return map_local(tensor, lambda local: self._move(local, on_device, pinned))

        module._apply(place)  # FSDP2's _apply re-reads every moved shard

    def _place_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      params_on_device: bool,
                      optimizer_on_device: bool) -> None:
        """A trained model's params and its optimizer's state, each where it is asked."""
        self._place_module(model, params_on_device)
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = map_local(value,
                                           lambda local: self._move(local, optimizer_on_device))
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)

    def _place_actor(self, params_on_device: bool, optimizer_on_device: bool) -> None:
        self._place_states(self.model, self.optimizer, params_on_device, optimizer_on_device)
        if self.ref_model is not None and self.config.ref_on_host:
            self._place_module(self.ref_model, False)
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)

    def _wake_engine(self) -> None:
        """Wake the engine and load the actor's weights (wherever they live); sharded, the
        actor's params come to the device, are gathered one tensor at a time (verl's FSDP
        sharding manager does the same) and go back where they were."""
        if self.config.actor_generates:  # it generates with the actor's params
            if self.config.offload_params:
                self._place_module(self.model, True)
            self.engine.wake(iter(()))
            return
        sharded_offload = self.group is not None and self.config.offload_params
        if sharded_offload:
            self._place_module(self.model, True)
        actor = dict(named_weights(self.model))

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name in self.engine.weight_names():
                whole = full_tensor(getattr(actor[name], "data", actor[name]))
                yield name, self.engine.part(name, whole)
                del whole

        self.engine.wake(weights())
        self.engine_weight_bytes = self.engine.held_weight_bytes()
        if sharded_offload:
            self._place_module(self.model, False)

    def _sleep_engine(self) -> None:
        self.engine.sleep()
        if self.config.actor_generates and self.config.offload_params:
            self._place_module(self.model, False)
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)
