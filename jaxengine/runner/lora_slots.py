"""LoRA adapters onto the device: which adapter sits in which of the model's slots, and the
copies kept in host memory.

A step's adapters must sit in the model's slots when it launches; the scheduler runs at most
``max_loras`` distinct adapters at once, so they always fit. A slot keeps its adapter until
another needs it (the least recently used goes). An adapter read from disk stays in host memory
(least recently used out past ``max_cpu_loras``), so one that left the device comes back
without reading the disk. Writing a slot replaces the values of the slot stacks
(``models.lora.LoRAWeights``) with arrays of the same shapes and shardings: nothing compiles
again once the writes are compiled at start-up.
"""
from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from jaxengine.config import LoRAConfig
from jaxengine.lora_request import LoRARequest
from jaxengine.models.config import ModelConfig
from jaxengine.models.lora import CONFIG_FILE, LoRAAdapter, load_adapter
from jaxengine.models.lora_weights import INPUT_GROUPS


@functools.cache
def _slot_writer(sharding) -> Callable:
    """stack [L, S, ...], slot, value [L, ...] -> the stack with that slot replaced, in the stack's
    own sharding (what the compiled steps take); one compile per stack shape."""
    return jax.jit(lambda stack, slot, value: stack.at[:, slot].set(value.astype(stack.dtype)),
                   out_shardings=sharding)


class LoRASlots:
    """The device slots and the host copies of one model's adapters. ``targets``: the modules
    the model has slots for (``models.lora.attach_lora``)."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, targets: tuple[str, ...]) -> None:
        self.config, self.model_config, self.targets = config, model_config, targets
        self.host: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()   # id -> adapter, LRU
        self.paths: dict[int, str] = {}                # id -> its folder
        # content digest -> slot, LRU: a slot holds weights, whatever name or id they came under
        self.slot_of: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.num_disk_reads = 0
        self.num_slot_writes = 0
        self.load_s = 0.0                              # time spent reading and writing adapters

    @property
    def num_slots(self) -> int:
        return self.config.max_loras

    # ---- host side ----
    def register(self, request: LoRARequest) -> LoRAAdapter:
        """Read (or find in host memory) the adapter of a new request; -> its weights and content
        digest, which the request keeps. A bad adapter is a ValueError naming the file and field,
        and changes nothing."""
        known = self.paths.get(request.lora_int_id)
        if known is not None and known != request.lora_path:
            raise ValueError(f"lora_request.lora_int_id: {request.lora_int_id} is already the adapter at {known}, "
                             f"not {request.lora_path}")
        return self._adapter(request.lora_int_id, request.lora_path)

    def forget(self, lora_int_id: int) -> None:
        """An adapter unloaded: its host copy goes, and its id may name other weights later. A
        request still running with it keeps the weights it came with (and their slot)."""
        self.host.pop(lora_int_id, None)
        self.paths.pop(lora_int_id, None)

    def _adapter(self, lora_int_id: int, path: str) -> LoRAAdapter:
        adapter = self.host.get(lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora_int_id)
            return adapter
        start = time.perf_counter()
        adapter = load_adapter(path, self.model_config, self.config.max_lora_rank)
        unserved = sorted(set(adapter.config.target_modules) - set(self.targets))
        if unserved:
            raise ValueError(f"{adapter.path / CONFIG_FILE}: target_modules: this model has no LoRA slots for "
                             f"{unserved} (a mixture of experts' experts take no adapter); "
                             f"served: {list(self.targets)}")
        self.num_disk_reads += 1
        self.load_s += time.perf_counter() - start
        self.host[lora_int_id], self.paths[lora_int_id] = adapter, path
        while len(self.host) > self.config.num_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    # ---- device side ----
    def activate(self, state: nnx.State, adapters: list[LoRAAdapter]) -> tuple[nnx.State, dict[str, int]]:
        """Put a step's adapters (the weights its requests keep; at most ``max_loras`` distinct)
        in slots; -> the model state with any slot written, and each adapter's slot by digest.
        Never reads the disk."""
        wanted = {a.digest: a for a in adapters}
        if len(wanted) > self.num_slots:
            raise RuntimeError(f"a step of {len(wanted)} adapters, {self.num_slots} slots (max_loras)")
        for digest, adapter in wanted.items():
            if digest in self.slot_of:
                self.slot_of.move_to_end(digest)
                continue
            slot = self._free_slot(wanted)
            state = self.write(state, slot, adapter)
            self.slot_of[digest] = slot
        return state, {d: self.slot_of[d] for d in wanted}

    def _free_slot(self, wanted: dict) -> int:
        """A slot no adapter holds, else the least recently used one not wanted by this step."""
        taken = set(self.slot_of.values())
        for slot in range(self.num_slots):
            if slot not in taken:
                return slot
        victim = next(i for i in self.slot_of if i not in wanted)
        return self.slot_of.pop(victim)

    def write(self, state: nnx.State, slot: int, adapter: LoRAAdapter | None) -> nnx.State:
        """``adapter``'s weights into slot ``slot`` of every stack (modules it does not adapt: zero;
        None: all zero)."""
        start = time.perf_counter()
        index = np.int32(slot)
        for path, variable in nnx.to_flat_state(state):
            if len(path) < 2 or path[-2] != "lora":
                continue
            stack = variable[...]
            variable[...] = _slot_writer(stack.sharding)(stack, index, slot_value(path[-1], stack.shape, adapter))
        self.num_slot_writes += 1
        self.load_s += time.perf_counter() - start
        return state

    @staticmethod
    def row_slots(adapters: list[LoRAAdapter | None], slot_of: dict[str, int]) -> np.ndarray:
        """Each row's slot (-1: the base model)."""
        return np.fromiter((-1 if a is None else slot_of[a.digest] for a in adapters), np.int32, len(adapters))


def slot_value(name: str, shape: tuple[int, ...], adapter: LoRAAdapter | None) -> np.ndarray:
    """What slot stack ``name`` (``a_<group>`` or ``b_<module>``, [L, S, ...]) holds of ``adapter``
    in one slot ([L, ...]): a group's A side by side, zero for a module it does not adapt."""
    value = np.zeros((shape[0], *shape[2:]), np.float32)
    if adapter is None:
        return value
    which, target = name.split("_", 1)
    if which == "b":
        pair = adapter.weights.get(target)
        return value if pair is None else pair[1]
    rank = adapter.weights[next(iter(adapter.weights))][0].shape[-1]
    for i, module in enumerate(INPUT_GROUPS[target]):
        if module in adapter.weights:
            value[..., i * rank:(i + 1) * rank] = adapter.weights[module][0]
    return value
