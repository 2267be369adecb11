"""A mixture of experts' checkpoint tensors in one form, whichever form the checkpoint has.

Checkpoints store a layer's experts either one tensor per expert and projection
(``mlp.experts.3.gate_proj.weight``; Mixtral's ``block_sparse_moe.experts.3.w1.weight``) or
stacked and fused as transformers 5 holds them (``mlp.experts.gate_up_proj`` [E, 2F, D],
``mlp.experts.down_proj`` [E, D, F]). ``ExpertTensors`` shows either as the stacked, unfused
``model.layers.N.mlp.experts.{gate,up,down}_proj`` ([E, F, D], [E, F, D], [E, D, F]: each expert's
HF [out, in]) and reads a slice of experts from the tensors behind it, so ``models.hf_tensors``
maps one name per projection, and a device's share reads only its own part.

gpt-oss stores its experts the other way round, [in, out] per expert, with gate and up
interleaved column by column (``gate_up_proj`` [E, D, 2F]: gate = [..., 0::2], up = [..., 1::2]),
and biases beside them (``gate_up_proj_bias`` [E, 2F], ``down_proj_bias`` [E, D]); with
``interleaved`` those are shown as the same stacked names, plus ``{gate,up}_proj_bias`` [E, F].
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from jaxengine.models.config import ModelConfig
from jaxengine.models.hf_tensors import Index, TensorSource, nemotron_name

INTERLEAVED_ARCHITECTURES = ("GptOssForCausalLM",)       # experts [in, out], gate and up interleaved

_MIXTRAL = [(re.compile(r"\.block_sparse_moe\."), ".mlp."), (re.compile(r"(\.experts\.\d+)\.w1\."), r"\1.gate_proj."),
            (re.compile(r"(\.experts\.\d+)\.w3\."), r"\1.up_proj."), (re.compile(r"(\.experts\.\d+)\.w2\."), r"\1.down_proj.")]
# one expert's weight, or (a checkpoint stored quantized, models.stored_quantization) its scales or offsets
_PER_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(:scale|:offset)?")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj")
_INTERLEAVED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj(_bias)?")
_DOWN = re.compile(r"model\.layers\.\d+\.mlp\.experts\.down_proj")


class ExpertTensors:
    """``source`` with its expert tensors shown stacked and unfused (see the module's docstring);
    other tensors pass through under their names (Mixtral's renamed to the common ones)."""

    def __init__(self, source: TensorSource, num_experts: int, interleaved: bool = False) -> None:
        """``interleaved``: gpt-oss's layout (see the module's docstring)."""
        # gpt-oss's own layout (a GGUF of it holds the common one; see models.gguf)
        interleaved = interleaved and any(_INTERLEAVED.fullmatch(common_name(n)) for n in source.names())
        self.source, self.num_experts, self.interleaved = source, num_experts, interleaved
        self._renamed: dict[str, str] = {}                       # our name -> the checkpoint's
        per_expert: dict[str, dict[int, str]] = defaultdict(dict)
        self._fused: dict[str, tuple[str, int]] = {}             # virtual name -> (fused tensor, half)
        self._transposed: dict[str, str] = {}                    # gpt-oss's down_proj, [E, F, D]
        for name in source.names():
            ours = common_name(name)
            if interleaved and (m := _INTERLEAVED.fullmatch(ours)):
                suffix = m.group(2) or ""
                self._fused[f"{m.group(1)}.gate_proj{suffix}"] = (name, 0)
                self._fused[f"{m.group(1)}.up_proj{suffix}"] = (name, 1)
            elif interleaved and _DOWN.fullmatch(ours):
                self._transposed[ours] = name
            elif m := _PER_EXPERT.fullmatch(ours):
                expert = int(m.group(2))
                if expert >= num_experts:
                    raise ValueError(f"tensor {name}: expert {expert}, but the config has {num_experts} experts")
                per_expert[f"{m.group(1)}.{m.group(3)}{m.group(4) or ''}"][expert] = name
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

    @classmethod
    def for_model(cls, source: TensorSource, cfg: ModelConfig) -> "ExpertTensors":
        return cls(source, cfg.num_experts, interleaved=cfg.architecture in INTERLEAVED_ARCHITECTURES)

    def describe(self, name: str) -> str:
        """``name`` as the checkpoint knows it, for errors (a shown tensor names the one behind it)."""
        if name in self._fused:
            fused, half = self._fused[name]
            return f"{fused} (its {('gate', 'up')[half]} half, seen as {name})"
        if name in self._transposed:
            return f"{self._transposed[name]} (transposed)"
        if name in self._per_expert:
            return f"{self._per_expert[name][0]} (and the other experts' {name.rsplit('.', 1)[-1]}, stacked)"
        return self._renamed.get(name, name)

    def names(self) -> Iterable[str]:
        return [*self._renamed, *self._per_expert, *self._fused, *self._transposed]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._per_expert:
            return (self.num_experts, *self.source.shape(self._per_expert[name][0]))
        if name in self._transposed:
            e, f, d = self.source.shape(self._transposed[name])
            return (e, d, f)
        if name in self._fused:
            shape = self.source.shape(self._fused[name][0])
            if self.interleaved:                     # [E, D, 2F] -> [E, F, D]; a bias [E, 2F] -> [E, F]
                return (shape[0], shape[-1] // 2, *shape[1:-1])
            e, two_f, d = shape
            return (e, two_f // 2, d)
        return self.source.shape(self._renamed[name])

    def read(self, name: str, index: Index) -> np.ndarray:
        if name in self._per_expert:
            names = self._per_expert[name][index[0]]
            return np.stack([self.source.read(n, tuple(index[1:])) for n in names])
        if name in self._transposed:
            e, d, f = index
            return self.source.read(self._transposed[name], (e, f, d)).transpose(0, 2, 1)
        if name in self._fused and self.interleaved:
            fused, half = self._fused[name]
            e, f, *d = index
            columns = slice(2 * f.start, 2 * f.stop)             # gate and up alternate column by column
            w = self.source.read(fused, (e, *d, columns))[..., half::2]
            return w.transpose(0, 2, 1) if d else w
        if name in self._fused:
            fused, half = self._fused[name]
            width = self.source.shape(fused)[1] // 2
            rows = slice(half * width + index[1].start, half * width + index[1].stop)
            return self.source.read(fused, (index[0], rows, index[2]))
        return self.source.read(self._renamed[name], index)


def common_name(name: str) -> str:
    """A checkpoint's tensor name in the common naming (Mixtral's experts and MLP renamed, and
    Nemotron-H's blocks)."""
    if name.startswith("backbone.") or ".mixer." in name:          # Nemotron-H's
        return nemotron_name(name)
    for pattern, replacement in _MIXTRAL:
        name = pattern.sub(replacement, name)
    return name
