"""Static report of the Triton-lowered Pallas kernels for Hopper, without a GPU: the Triton IR that
JAX's Pallas lowering hands to XLA, compiled to sm_90 machine code by the `triton` package's own
compiler, and read back with its cuobjdump: registers, local memory (spills), shared memory, and
the instructions that matter for a memory-bound kernel (128-bit loads, async copies, tensor-core
ops). XLA compiles the same IR with the Triton it bundles, so treat the figures as close leads.

    pip install --no-deps --target .triton triton==3.9.0      # once; a side folder, ignored by git
    python scripts/triton_report.py [--triton .triton] [--out report.md]

Layouts: the decode batch of scripts/bench_gpu.py (Llama-3-8B heads: 8 KV heads of 128, group 4,
pages of 16, bf16) at the block sizes that bench_gpu.py sweeps, and the Pallas KV write.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COMPILE = r"""
import json, pickle, subprocess, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
rows = []
for name, text, warps, stages in pickle.load(open(sys.argv[1], "rb")):
    path = Path(sys.argv[2]) / (name.replace(" ", "_").replace(",", "").replace("=", "") + ".ttir")
    path.write_text(text)
    try:
        kernel = triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
    except Exception as error:
        rows.append({"kernel": name, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        continue
    cubin = path.with_suffix(".cubin")
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run([bin_dir / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
    sass = subprocess.run([bin_dir / "cuobjdump", "--dump-sass", cubin], capture_output=True, text=True).stdout
    rows.append({"kernel": name, "usage": usage, "sass": sass, "shared_bytes": kernel.metadata.shared})
print(json.dumps(rows))
"""


def exported_triton_ir(fn, *args, **kwargs) -> list[tuple[str, int, int]]:
    """(Triton IR as text, num_warps, num_stages) of each Triton custom call in fn's CUDA lowering."""
    import jax
    from jax import export
    from jax._src.interpreters import mlir
    from jax._src.lib import triton as triton_lib
    from jax._src.lib.mlir import ir
    from jax.experimental.pallas import triton as pl_triton

    target = getattr(pl_triton, "CUSTOM_CALL_TARGET_NAME", "__gpu$xla.gpu.triton")
    exported = export.export(jax.jit(fn), platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(*args, **kwargs)
    found = []
    with mlir.make_ir_context() as context:
        triton_lib.dialect.register_dialect(context)

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        if child.operation.name == "stablehlo.custom_call" and \
                                target in str(child.attributes["call_target_name"]):
                            config = child.attributes["mhlo.backend_config"]
                            kernel = ir.Module.parse(bytes(ir.StringAttr(config["ir"]).value_bytes))
                            found.append((kernel.operation.get_asm(enable_debug_info=False),
                                          ir.IntegerAttr(config["num_warps"]).value,
                                          ir.IntegerAttr(config["num_stages"]).value))
                        walk(child.operation)

        walk(ir.Module.parse(exported.mlir_module()).operation)
    return found


def kernels() -> list[tuple[str, str, int, int]]:
    import jax.numpy as jnp

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_gpu import attention_batch, triton_sizes
    from jaxengine.kernels.paged_attention.kernel import paged_attention_pallas
    from jaxengine.kernels.paged_attention.kv_write import write_kv_pallas

    heads = (8, 4, 128)
    q, k, v, md, _ = attention_batch([(2047, 1)] * 8, 16, *heads, jnp.bfloat16)
    out = []
    for sizes in triton_sizes(heads):
        label = f"attention pages={sizes.pages_per_block} warps={sizes.num_warps} stages={sizes.num_stages}"
        attention = functools.partial(paged_attention_pallas, scale=0.088, interpret=False, sizes=sizes)
        out += [(label, *found) for found in exported_triton_ir(attention, q, k, v, md)]
    new = jnp.zeros((q.shape[0], heads[0], heads[2]), jnp.bfloat16)
    write = functools.partial(write_kv_pallas, k=new, v=new, interpret=False)
    out += [("kv write", *found) for found in exported_triton_ir(write, k, v, slot_mapping=md.slot_mapping)]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| kernel | registers | local (spills) | shared bytes | 128-bit loads | async copies (LDGSTS) | HMMA "
             "| HGMMA |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['kernel']} | error: {row['error']} |||||||")
            continue
        usage = dict(re.findall(r"(REG|LOCAL):(\d+)", row["usage"]))
        sass = row["sass"]
        counts = [len(re.findall(pattern, sass)) for pattern in (r"LDG\.E\.128", r"LDGSTS", r"\bHMMA", r"HGMMA")]
        lines.append(f"| {row['kernel']} | {usage.get('REG')} | {usage.get('LOCAL')} | {row['shared_bytes']} | "
                     + " | ".join(map(str, counts)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton", default=".triton", help="folder holding the triton package (pip --target)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        blob = Path(work) / "kernels.pkl"
        blob.write_bytes(pickle.dumps(kernels()))
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.triton), "TRITON_DEFAULT_FP_FUSION": "1"}
        done = subprocess.run([sys.executable, "-c", COMPILE, blob, work], env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"compiling with triton failed (is it in {args.triton}?):\n{done.stderr[-2000:]}")
        text = table(json.loads(done.stdout))
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
