"""Compile the split-KV decode attention kernel for a GPU architecture without a GPU (Triton's own ptxas)
and report what one iteration of its key loop executes: registers, spills, shared memory, the instruction
mix of the loop, its tensor-core MMAs and the bytes each thread loads from global memory per iteration.

python -m minisgl.benchmark.sass [--kv-dtype bf16,fp8_e4m3] [--tiles 32:1:3,64:4:3] [--arch 90] [--direct]
Arguments are typed as the engine launches the kernel for Qwen3-0.6B heads in a decode graph: bf16 queries
rotated inside the kernel (q/k norm and rotary fused), head_dim 128, integer arguments divisible by 16
where the engine's are (the launcher specialises them), several splits (--direct: one split, the output
written in place). The counts are static: they show where a kernel spends instructions and registers
(what bounds its occupancy), not its time."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minisgl.kernel.triton import attention

KV_TYPES = {"bf16": "bf16", "fp8_e4m3": "fp8e4nv"}
SIXTEEN = ("D", "HALF")  # integer arguments whose values (128, 64) are multiples of 16
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_WIDTH = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


@dataclass
class LoopReport:
    registers: int
    stack_bytes: int  # spills to local memory
    shared_bytes: int
    loop: Counter  # mnemonic -> count in one iteration of the key loop
    global_bytes: int  # bytes one thread loads from global memory (LDG / LDGSTS) per iteration

    @property
    def instructions(self) -> int:
        return sum(self.loop.values())

    @property
    def mmas(self) -> int:
        """Tensor-core MMAs (m16n8k16, any input type) in one iteration."""
        return sum(n for op, n in self.loop.items() if op.startswith("HMMA.16816"))


def _signature(kv: str, direct: bool) -> tuple[dict, dict, dict]:
    fn = attention._decode_split_kernel
    pointers = {
        "q_ptr": "bf16",
        "k_cache_ptr": kv,
        "v_cache_ptr": kv,
        "page_table_ptr": "i32",
        "table_idx_ptr": "i32",
        "seq_lens_ptr": "i32",
        "mid_o_ptr": "bf16" if direct else "fp32",
        "mid_lse_ptr": "fp32",
        "k_ptr": "bf16",
        "v_ptr": "bf16",
        "loc_ptr": "i64",
        "pos_ptr": "i64",
        "cache_ptr": "fp32",
        "qw_ptr": "bf16",
        "kw_ptr": "bf16",
    }
    sig, constants = {}, {}
    for name in fn.arg_names:
        if name in pointers:
            sig[name] = "*" + pointers[name]
        elif name in ("scale_log2", "eps"):
            sig[name] = "fp32"
        elif fn.params[fn.arg_names.index(name)].is_constexpr:
            sig[name] = "constexpr"
        else:
            sig[name] = "i32"
    if direct:  # one split: no log-sum-exps
        for name in ("mid_lse_ptr", "stride_lb", "stride_lh"):
            sig[name], constants[name] = "constexpr", None
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name] != "constexpr"
        and (sig[name].startswith("*") or name.startswith("stride") or name in SIXTEEN)
    }
    return sig, constants, aligned


def compile_decode(
    kv_dtype: str, block_n: int, warps: int, stages: int, arch: int = 90, direct: bool = False
):
    """The compiled decode kernel (Triton's CompiledKernel) for a pool of kv_dtype and the given tile."""
    fn = attention._decode_split_kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise TypeError(
            "the kernels were defined for Triton's interpreter (TRITON_INTERPRET=1): nothing to compile"
        )
    kv = KV_TYPES[kv_dtype]
    sig, constants, aligned = _signature(kv, direct)
    constants.update(
        BLOCK_H=16,
        BLOCK_N=block_n,
        BLOCK_D=128,
        PRECISION="tf32",
        DOT=tl.float16 if kv == "fp8e4nv" else None,
        PDL=True,
    )
    src = ASTSource(fn, sig, {(fn.arg_names.index(k),): v for k, v in constants.items()}, aligned)
    return triton.compile(
        src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages}
    )


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def report(kernel) -> LoopReport:
    """Registers, spills and shared memory of a compiled kernel, and the instruction mix of its key loop:
    the backward branch whose body holds the most MMAs."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True, check=True
        )
        usage = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True, check=True
        )
    code = [(int(a, 16), text) for a, text in _LINE.findall(sass.stdout)]
    best: list[str] = []
    for addr, text in code:
        branch = re.search(r"BRA (0x[0-9a-f]+)", text)
        if branch and int(branch[1], 16) < addr:
            body = [t for a, t in code if int(branch[1], 16) <= a <= addr]
            if sum("HMMA" in t for t in body) > sum("HMMA" in t for t in best):
                best = body
    loop: Counter = Counter()
    loaded = 0
    for text in best:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        loop[op] += 1
        if op.startswith(("LDG", "LDGSTS")):
            loaded += next((w for s, w in _WIDTH.items() if f".{s}" in op), 4)
    regs = int(re.search(r"REG:(\d+)", usage.stdout)[1])
    stack = int(re.search(r"STACK:(\d+)", usage.stdout)[1])
    return LoopReport(regs, stack, kernel.metadata.shared, loop, loaded)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="bf16,fp8_e4m3", help="comma-separated pool dtypes: bf16, fp8_e4m3")
    ap.add_argument("--tiles", default="32:1:3,64:4:3", help="comma-separated BLOCK_N:warps:stages")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--direct", action="store_true", help="one split: the kernel writes the output")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}")
    for kv in args.kv_dtype.split(","):
        for tile in args.tiles.split(","):
            block_n, warps, stages = (int(x) for x in tile.split(":"))
            r = report(compile_decode(kv, block_n, warps, stages, args.arch, args.direct))
            mix = ", ".join(f"{op} {n}" for op, n in r.loop.most_common(10))
            print(
                f"{kv} pool, BLOCK_N {block_n}, {warps} warps, {stages} stages: {r.registers} registers, "
                f"{r.stack_bytes} B of stack, {r.shared_bytes} B shared; a loop iteration: {r.instructions} "
                f"instructions a thread for {r.global_bytes} B loaded, {r.mmas} "
                f"MMAs; most frequent: {mix}",
                flush=True,
            )


if __name__ == "__main__":
    main()
