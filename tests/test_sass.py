"""The offline SASS report of the decode attention kernel (benchmark/sass.py): compiled for Hopper with
Triton's own ptxas, no GPU needed. Its counts are checked against a hand count of the tile's work."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from minisgl.benchmark import sass

pytestmark = pytest.mark.skipif(
    not all(os.path.exists(sass._tool(t)) for t in ("ptxas", "cuobjdump")),
    reason="this Triton has no NVIDIA tools",
)


def _report(kv_dtype: str, block_n: int, warps: int) -> dict:
    """The report, from a fresh interpreter: tests of other files may have set TRITON_INTERPRET=1, under which
    Triton defines no compilable kernels."""
    code = (
        "import json, sys; from minisgl.benchmark import sass; "
        f"r = sass.report(sass.compile_decode({kv_dtype!r}, {block_n}, {warps}, 3)); "
        "json.dump({'mmas': r.mmas, 'registers': r.registers, 'shared': r.shared_bytes, "
        "'loaded': r.global_bytes}, sys.stdout)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("kv_dtype, value_bytes", [("bf16", 2), ("fp8_e4m3", 1)])
@pytest.mark.parametrize("block_n, warps", [(32, 1), (64, 4)])
def test_the_key_loop_runs_the_tiles_mmas_and_loads_each_key_once(kv_dtype, value_bytes, block_n, warps):
    """One iteration over block_n keys: q [16, 128] K^T and P [16, block_n] V in m16n8k16 MMAs, split over
    the warps: 16/16 x block_n/8 x 128/16 + 16/16 x 128/8 x block_n/16 = 2 block_n MMAs, each warp's share
    per thread; K and V (block_n x 128 values each) loaded once across the program's threads, plus the
    keys' page-table slots."""
    r = _report(kv_dtype, block_n, warps)
    assert r["mmas"] == 2 * block_n // warps
    kv_bytes = 2 * block_n * 128 * value_bytes // (32 * warps)
    assert kv_bytes <= r["loaded"] < kv_bytes + 64
    assert 0 < r["registers"] <= 255 and r["shared"] > 0
