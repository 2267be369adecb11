"""A mixture of experts' checkpoint tensors in one form, whichever form the checkpoint has.

Checkpoints store a layer's experts either one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``) or
stacked and fused as transformers 5 holds them (``mlp.experts.gate_up_proj`` [E, 2F, D],
``mlp.experts.down_proj`` [E, D, F]). ``ExpertTensors`` shows either as the stacked, unfused
``model.layers.N.mlp.experts.{gate,up,down}_proj`` ([E, F, D], [E, F, D], [E, D, F]: each expert's
HF [out, in]) and reads a slice of experts from the tensors behind it, so ``models.hf_tensors``
maps one name per projection, and a device's share reads only its own part.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from jaxengine.models.hf_tensors import Index, TensorSource

_MIXTRAL = [(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
            (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."), (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj.")]
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj")


class ExpertTensors:
    """``source`` with its expert tensors shown stacked and unfused (see the module's docstring);
    other tensors pass through under their names (Mixtral's renamed to the common ones)."""

    def __init__(self, source: TensorSource, num_experts: int) -> None:
        self.source, self.num_experts = source, num_experts
        self._renamed: dict[str, str] = {}                       # our name -> the checkpoint's
        per_expert: dict[str, dict[int, str]] = defaultdict(dict)
        self._fused: dict[str, tuple[str, int]] = {}             # virtual name -> (fused tensor, half)
        for name in source.names():
            ours = _common_name(name)
            if m := _PER_EXPERT.fullmatch(ours):
                expert = int(m.group(2))
                if expert >= num_experts:
                    raise ValueError(f"tensor {name}: expert {expert}, but the config has {num_experts} experts")
                per_expert[f"{m.group(1)}.{m.group(3)}"][expert] = name
            elif m := _FUSED.fullmatch(ours):
                self._fused[f"{m.group(1)}.gate_proj"] = (name, 0)
                self._fused[f"{m.group(1)}.up_proj"] = (name, 1)
            else:
                self._renamed[ours] = name
        self._per_expert = {}
        for stacked, experts in per_expert.items():
            if missing := [e for e in range(num_experts) if e not in experts]:
                present, name = next(iter(experts.items()))          # named as the checkpoint names them
                names = [name.replace(f".experts.{present}.", f".experts.{e}.") for e in missing]
                raise ValueError(f"checkpoint is missing tensors {names} ({num_experts} experts in the config)")
            self._per_expert[stacked] = names = [experts[e] for e in range(num_experts)]
            for n in names[1:]:
                if source.shape(n) != source.shape(names[0]):
                    raise ValueError(f"tensor {n}: shape {source.shape(n)}, expert 0's is {source.shape(names[0])}")
        for stacked, (name, _) in self._fused.items():
            if source.shape(name)[0] != num_experts:
                raise ValueError(f"tensor {name}: {source.shape(name)[0]} experts, the config has {num_experts}")

    def names(self) -> Iterable[str]:
        return [*self._renamed, *self._per_expert, *self._fused]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._per_expert:
            return (self.num_experts, *self.source.shape(self._per_expert[name][0]))
        if name in self._fused:
            e, two_f, d = self.source.shape(self._fused[name][0])
            return (e, two_f // 2, d)
        return self.source.shape(self._renamed[name])

    def read(self, name: str, index: Index) -> np.ndarray:
        if name in self._per_expert:
            names = self._per_expert[name][index[0]]
            return np.stack([self.source.read(n, tuple(index[1:])) for n in names])
        if name in self._fused:
            fused, half = self._fused[name]
            width = self.source.shape(fused)[1] // 2
            rows = slice(half * width + index[1].start, half * width + index[1].stop)
            return self.source.read(fused, (index[0], rows, index[2]))
        return self.source.read(self._renamed[name], index)


def _common_name(name: str) -> str:
    for pattern, replacement in _MIXTRAL:
        name = pattern.sub(replacement, name)
    return name
