"""profile_step --kernel-table's pure parts (benchmark/kernel_table.py) against hand counts: the bytes
model of a Qwen3-0.6B decode step, the kernel name -> op attribution, the exclusive times, the table and
the reading of a profile; the CLI's refusals without CUDA. The GPU test runs the whole table on an H200."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from minisgl.benchmark import kernel_table as kt
from minisgl.benchmark import profile_step
from minisgl.benchmark.offline import resolve_model
from minisgl.benchmark.roofline import model_bytes
from minisgl.models import ModelConfig
from minisgl.utils.hf import load_hf_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Qwen3-0.6B, by hand from its config.json
H, HQ, HKV, D, I, V, L = 1024, 16, 8, 128, 3072, 151936, 28
QWEN = kt.DecodeShape(
    hidden=H, heads=HQ, kv_heads=HKV, head_dim=D, intermediate=I, vocab=V, layers=L, qk_norm=True
)
MB = 1 << 20


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(load_hf_config(resolve_model(name)))


# ---- the shape ------------------------------------------------------------------------------------------
def test_the_shape_of_qwen3_0_6b_is_read_from_its_config():
    assert kt.DecodeShape.of(_config("qwen3-0.6b")) == QWEN


def test_a_mixture_of_experts_model_is_refused_naming_it():
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM has experts"):
        kt.DecodeShape.of(_config("qwen3-30b-a3b"))


# ---- the bytes model ------------------------------------------------------------------------------------
def test_qkv_bytes_at_batch_256_are_the_weights_plus_the_normed_rows_and_the_output():
    per_layer = 1024 * (16 + 8 + 8) * 128 * 2  # W: hidden x (q + k + v heads) x head_dim, bf16
    per_layer += 256 * 1024 * 2 + 256 * 4096 * 2  # cuBLAS reads the normed rows, writes q|k|v
    ops = kt.decode_step_bytes(QWEN, [600] * 256)
    assert ops["qkv proj"] == kt.OpBytes(28 * per_layer, 28)


def test_qkv_bytes_at_batch_1_count_the_fused_norm_and_residual():
    weight, x, norm_w, y = 1024 * 32 * 128 * 2, 1024 * 2, 1024 * 2, 4096 * 2
    first = weight + x + norm_w + y  # layer 0: no residual yet, h is x
    rest = first + 2 * 1024 * 2  # the residual read and h = x + residual written
    assert kt.decode_step_bytes(QWEN, [600])["qkv proj"] == kt.OpBytes(first + 27 * rest, 28)


def test_standalone_norms_and_silu_run_only_beside_cublas():
    big = kt.decode_step_bytes(QWEN, [600] * 256)
    # 27 pre-attention norms with a residual + 28 post-attention + the final; layer 0's has none
    with_res, without = 27 + 28 + 1, 1
    norm = with_res * (4 * 256 * 1024 * 2 + 1024 * 2) + without * (2 * 256 * 1024 * 2 + 1024 * 2)
    assert big["rms norm"] == kt.OpBytes(norm, 57)
    assert big["silu_and_mul"] == kt.OpBytes(28 * (256 * 6144 * 2 + 256 * 3072 * 2), 28)
    assert big["down proj"].bytes == 28 * (1024 * 3072 * 2 + 256 * 3072 * 2 + 256 * 1024 * 2)
    small = kt.decode_step_bytes(QWEN, [600] * 16)  # the Triton GEMM fuses both
    assert small["rms norm"] == kt.OpBytes(4 * 16 * 1024 * 2 + 1024 * 2, 1)  # the final norm alone
    assert small["silu_and_mul"] == kt.OpBytes(0, 0)
    assert small["down proj"].bytes == 28 * (1024 * 3072 * 2 + 16 * 6144 * 2 + 16 * 1024 * 2)


def test_attention_reads_every_key_once_at_one_split():
    lens = [600] * 200 + [700] * 56
    keys = 200 * 600 + 56 * 700
    kv = keys * 8 * 128 * 2 * 2  # K and V, kv heads x head_dim, bf16
    page_table = keys * 4
    q, new_kv, stored = 256 * 16 * 128 * 2, 2 * 256 * 8 * 128 * 2, 2 * 256 * 8 * 128 * 2
    rope, qk_norm, meta, out = 256 * 128 * 4, 2 * 128 * 2, 256 * 4 * 4, 256 * 16 * 128 * 2
    per_layer = kv + page_table + q + new_kv + stored + rope + qk_norm + meta + out
    ops = kt.decode_step_bytes(QWEN, lens, num_splits=1)
    assert ops["attention"] == kt.OpBytes(28 * per_layer, 28)
    assert ops["attn merge"] == kt.OpBytes(0, 0)


def test_split_kv_partials_go_to_the_merge_or_at_one_request_to_the_o_projection():
    # 600 keys over 8 splits of whole 64-key blocks: 75 -> 128 keys a split, 5 splits hold keys
    assert kt.used_splits(600, 8, 64) == 5
    assert kt.used_splits(640, 64, 64) == 10 and kt.used_splits(5000, 64, 64) == 40
    parts = 4 * 5 * 16 * (128 + 1) * 4  # 4 requests x 5 splits x heads x (partial output + lse), float32
    ops = kt.decode_step_bytes(QWEN, [600] * 4, num_splits=8)
    assert ops["attn merge"] == kt.OpBytes(28 * (parts + 4 * 16 * 128 * 2 + 4 * 4), 28)
    one = kt.decode_step_bytes(QWEN, [640], num_splits=64)
    assert one["attn merge"] == kt.OpBytes(0, 0)
    o_in = 10 * 16 * (128 + 1) * 4 + 4  # the GEMV reads the 10 splits' partials and the length
    assert one["o proj"] == kt.OpBytes(28 * (1024 * 2048 * 2 + o_in + 1024 * 2), 28)


def test_lm_head_and_argmax_move_the_logits_once_each():
    ops = kt.decode_step_bytes(QWEN, [600] * 256)
    assert ops["lm head"] == kt.OpBytes(151936 * 1024 * 2 + 256 * 1024 * 2 + 256 * 151936 * 2, 1)
    chunks = 19  # 151,936 over 8,192
    assert ops["argmax"] == kt.OpBytes(256 * 151936 * 2 + 2 * 256 * chunks * 8 + 256 * 4, 2)
    assert ops["embed"] == kt.OpBytes(256 * 4 + 2 * 256 * 1024 * 2, 1)


def test_the_weights_and_kv_add_up_to_the_rooflines_count():
    """The projections' weight bytes and the attention's K/V against benchmark/roofline.py's own count."""
    with open(os.path.join(resolve_model("qwen3-0.6b"), "config.json")) as f:
        roof = model_bytes(json.load(f))
    lens = [600] * 256
    ops = kt.decode_step_bytes(QWEN, lens)
    projs = ("qkv proj", "o proj", "gate_up proj", "down proj", "lm head")
    zero_rows = kt.decode_step_bytes(QWEN, [])  # no rows: what is left is the weights
    assert sum(zero_rows[p].bytes for p in projs) == roof["dense"]
    attention_kv = ops["attention"].bytes - kt.decode_step_bytes(QWEN, [0] * 256)["attention"].bytes
    assert attention_kv == sum(lens) * (roof["kv_token"] + 28 * 4)  # K/V and the page-table entries


def test_the_dispatch_rule_matches_the_kernels_own_fits():
    pytest.importorskip("triton")
    # the modules (the package's names argmax and gemm are the functions)
    argmax, gemm, gemv = (
        importlib.import_module(f"minisgl.kernel.triton.{m}") for m in ("argmax", "gemm", "gemv")
    )

    assert (kt.GEMM_MAX_ROWS, kt.GEMM_MAX_BYTES) == (gemm._GEMM_MAX_ROWS, gemm._GEMM_MAX_BYTES)
    assert kt.ARGMAX_BLOCK == argmax._ARGMAX_BLOCK
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024), (8, 100)):
        w = torch.empty(n, k, dtype=torch.bfloat16)
        for rows in (1, 2, 16, 17, 256):
            x = torch.empty(rows, k, dtype=torch.bfloat16)
            want = "gemv" if gemv.gemv_fits(x, w) else "gemm" if gemm.gemm_fits(x, w) else "cublas"
            assert kt.projection_path(rows, n, k, 2) == want, (rows, n, k)


# ---- kernel names -----------------------------------------------------------------------------------------
NAMES = {
    "_gemv_norm_kernel": "projection",
    "_gemv_merge_kernel": "projection",
    "_gemv_kernel": "projection",
    "_gemm_kernel": "projection",
    "nvjet_tst_128x64_64x8_1x2_h_bz_coopA_TNT": "projection",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
    "__5x_cublas": "projection",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)": (
        "projection"
    ),
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, false>"
    "(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16*)": "gemm helper",
    "_decode_split_kernel": "attention",
    "_decode_merge_kernel": "attn merge",
    "_rotary_kernel": "rotary / kv store",
    "_store_kv_kernel": "rotary / kv store",
    "_rms_norm_kernel": "rms norm",
    "_silu_and_mul_kernel": "silu_and_mul",
    "_argmax_part_kernel": "argmax",
    "_argmax_merge_kernel": "argmax",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
    "unsigned int, long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4>)": "argmax",
    "_stats_kernel": "sampling",
    "_draw_kernel": "sampling",
    "_gate_up_kernel": "moe",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, "
    "-2, true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>)": "embed",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::"
    "index_put_kernel_impl<at::native::OpaqueType<4> >(at::TensorIterator&)::{lambda(char*, char const*, "
    "long)#1}>(at::TensorIteratorBase&)::{lambda(int)#1}>(long, {lambda(int)#1})": "small ops",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<int>, "
    "std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<int>, std::array<char*, 2ul>)": (
        "small ops"
    ),
    "Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
    "Memset (Device)": "memcpy / memset",
    "some_new_kernel": "other",
}


@pytest.mark.parametrize("name", list(NAMES))
def test_kernel_names_map_to_their_op(name):
    assert kt.kernel_kind(name) == NAMES[name]


def test_short_names_drop_templates_namespaces_and_parameters():
    assert kt.short_name("_gemv_norm_kernel") == "_gemv_norm_kernel"
    long_gather = "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long>(int)"
    assert kt.short_name(long_gather) == "indexSelectLargeIndex"
    cutlass = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(P)"
    assert (
        kt.short_name(cutlass, width=80)
        == "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8"
    )
    assert kt.short_name("x" * 60, width=20) == "x" * 17 + "..."


# ---- attribution ------------------------------------------------------------------------------------------
def _events(names: list[str], dur: float = 2.0) -> list[kt.DeviceEvent]:
    return [kt.DeviceEvent(n, 10.0 * i, dur) for i, n in enumerate(names)]


def _batch1_step(layers: int) -> list[str]:
    """A batch-1 decode step's activities in launch order (the decode graph at one request)."""
    layer = [
        "_gemv_norm_kernel",
        "_decode_split_kernel",
        "_gemv_merge_kernel",
        "_gemv_norm_kernel",
        "_gemv_kernel",
    ]
    return (
        ["Memcpy HtoD (Pinned -> Device)", "index_elementwise_kernel", "indexSelectLargeIndex"]
        + layer * layers
        + ["_rms_norm_kernel", "_gemv_kernel", "_argmax_part_kernel", "_argmax_merge_kernel"]
    )


def test_projections_are_labelled_by_their_position_in_each_step():
    names = _batch1_step(2) * 3  # three steps of a 2-layer model
    labels = kt.attribute(_events(names), layers=2)
    step = labels[: len(names) // 3]
    assert labels == step * 3
    layer = ["qkv proj", "attention", "o proj", "gate_up proj", "down proj"]
    assert step == [
        "memcpy / memset",
        "small ops",
        "embed",
        *layer,
        *layer,
        "rms norm",
        "lm head",
        "argmax",
        "argmax",
    ]


def test_a_split_k_reduction_joins_the_gemm_before_it():
    gemm, reduce = "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "cublasLt::splitKreduce_kernel"
    layer = [
        gemm,
        "_decode_split_kernel",
        gemm,
        "_rms_norm_kernel",
        gemm,
        "_silu_and_mul_kernel",
        gemm,
        reduce,
    ]
    names = ["_rms_norm_kernel", *layer, "_rms_norm_kernel", gemm, reduce, "_argmax_part_kernel"]
    labels = kt.attribute(_events(names), layers=1)
    assert labels[8] == "down proj" and labels[11] == "lm head"
    assert labels[1::2][:4] == ["qkv proj", "o proj", "gate_up proj", "down proj"]


def test_projections_whose_count_gives_no_positions_share_one_row():
    names = ["_gemv_kernel"] * 7  # not a whole number of 4 * 1 + 1 projections a step
    assert set(kt.attribute(_events(names), layers=1)) == {"projections"}
    rows = kt.build_rows(_events(names), 1, 1, kt.decode_step_bytes(QWEN, [10]))
    assert [r.op for r in rows] == ["projections"]
    ops = kt.decode_step_bytes(QWEN, [10])
    want = sum(ops[p].bytes for p in ("qkv proj", "o proj", "gate_up proj", "down proj", "lm head"))
    assert rows[0].bytes == want


def test_exclusive_times_count_overlapping_spans_once():
    ev = [
        kt.DeviceEvent("a", 0, 10),
        kt.DeviceEvent("b", 5, 10),
        kt.DeviceEvent("c", 6, 2),
        kt.DeviceEvent("d", 30, 1),
    ]
    assert kt.exclusive_times(ev) == [10, 5, 0, 1]  # b: 15 - 10; c inside a and b; d after a gap


# ---- the table --------------------------------------------------------------------------------------------
def _two_step_table() -> kt.Table:
    names = _batch1_step(L)
    events = _events(names * 2, dur=4.0)
    model = kt.decode_step_bytes(QWEN, [600])
    rows = kt.build_rows(events, 2, L, model)
    return kt.Table("test", rows, bandwidth=4e12, wall_us=2000.0)


def test_rows_are_per_step_with_the_models_bytes_and_floor():
    table = _two_step_table()
    by_op = {r.op: r for r in table.rows}
    assert list(by_op) == [op for op in kt.OPS if op in by_op]  # launch order
    qkv = by_op["qkv proj"]
    assert (qkv.launches, qkv.us, qkv.exclusive_us) == (28, 28 * 4.0, 28 * 4.0)
    want = kt.decode_step_bytes(QWEN, [600])["qkv proj"].bytes
    assert qkv.bytes == want and qkv.floor_us(4e12) == pytest.approx(want / 4e12 * 1e6)
    assert by_op["memcpy / memset"].bytes is None and by_op["memcpy / memset"].floor_us(4e12) is None
    t = table.totals()
    n = len(_batch1_step(L))
    assert t["launches"] == n and t["busy_us"] == pytest.approx(n * 4.0)
    assert t["gap_us"] == pytest.approx(2000.0 - n * 4.0)


def test_the_markdown_table_has_every_row_totals_and_flags_launch_mismatches():
    table = _two_step_table()
    text = kt.markdown(table)
    lines = text.splitlines()
    assert lines[2].startswith("| op | kernels | launches | us / step |")
    assert sum(line.startswith("| ") for line in lines) == 2 + len(table.rows) + 1
    assert "| **total** |" in text and "gaps between kernels" in text
    assert "(model:" not in text  # every modelled launch count matched
    table.rows[0].model_launches = 3  # small ops' launches are not modelled: give them a count to disagree
    assert "(model: 3)" in kt.markdown(table)
    back = json.loads(kt.to_json([table]))
    assert back[0]["title"] == "test" and len(back[0]["rows"]) == len(table.rows)


def test_kb_mb_gb_units():
    assert [kt.fmt_bytes(n) for n in (None, 12, 1_500, 8_388_608, 2_400_000_000)] == [
        "?", "12 B", "1.50 KB", "8.39 MB", "2.40 GB",
    ]  # fmt: skip


# ---- reading a profile ------------------------------------------------------------------------------------
def test_device_activities_are_read_from_a_kineto_trace():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1.0, "dur": 3.0},
            {"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "ts": 20.5, "dur": 2.5},
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy DtoH (Device -> Pinned)",
                "ts": 30.0,
                "dur": 1.0,
            },
            {"ph": "X", "cat": "Kernel", "name": "_rms_norm_kernel", "ts": 10.0, "dur": 1.5},
            {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 40.0, "dur": 0.5},
            {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "ts": 0.0, "dur": 50.0},
            {"ph": "s", "cat": "ac2g", "name": "ac2g", "ts": 1.0, "id": 7},
            {"ph": "M", "name": "process_name", "args": {"name": "python"}},
        ]
    }
    events = kt.events_from_trace(trace)
    assert [(e.name, e.start, e.dur) for e in events] == [
        ("_rms_norm_kernel", 10.0, 1.5),
        ("_gemv_kernel", 20.5, 2.5),
        ("Memcpy DtoH (Device -> Pinned)", 30.0, 1.0),
        ("Memset (Device)", 40.0, 0.5),
    ]


def test_a_cpu_profile_holds_no_device_activity(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64).add_(1)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    assert kt.events_from_trace(json.loads(path.read_text())) == []
    assert kt.events_from_function_events(prof.events()) == []


# ---- the command line -------------------------------------------------------------------------------------
def _run_profile_step(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "minisgl.benchmark.profile_step", *argv]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_batch_lists_parse_and_need_the_kernel_table():
    assert profile_step._sizes("1,256") == [1, 256] and profile_step._sizes("8") == [8]
    assert profile_step.build_parser().parse_args([]).batch == [256]
    r = _run_profile_step("--batch", "1,256")
    assert r.returncode == 2 and "a list of batch sizes needs --kernel-table" in r.stderr
    r = _run_profile_step("--batch", "0", "--kernel-table")
    assert r.returncode == 2 and "batch sizes must be >= 1" in r.stderr


def test_the_kernel_table_without_cuda_says_it_needs_cuda():
    r = _run_profile_step("--batch", "1,256", "--kernel-table")
    assert (
        r.returncode == 1
        and "--kernel-table profiles the kernels of a GPU decode step: it needs CUDA" in r.stderr
    )


@pytest.mark.gpu
def test_the_kernel_table_on_a_gpu_attributes_every_kernel(tmp_path):
    """On the GPU host: batch 1 (GEMV path) and 8 (Triton GEMM, split-KV merge) of Qwen3-0.6B shapes, every
    projection labelled by position and every modelled op launching what the model says."""
    out = tmp_path / "kt.json"
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "minisgl.benchmark.profile_step", "--batch", "1,8", "--context", "300"]
    cmd += ["--steps", "10", "--kernel-table", "--json", str(out)]
    r = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    tables = json.loads(out.read_text())
    assert [t["batch"] for t in tables] == [1, 8] and all(t["graphed"] for t in tables)
    for t in tables:
        ops = {row["op"]: row for row in t["rows"]}
        assert "projections" not in ops and "other" not in ops, t["first_step"]
        for op in ("qkv proj", "o proj", "gate_up proj", "down proj", "attention"):
            assert ops[op]["launches"] == pytest.approx(28), (op, t["first_step"])
        for row in t["rows"]:  # cuBLAS may add a split-K reduction: the model counts the GEMMs
            if row["model_launches"] is not None:
                main = row["launches"] - row["helper_launches"]
                assert main == pytest.approx(row["model_launches"]), (row, t["first_step"])
        assert 0 < t["totals"]["busy_us"] <= t["totals"]["wall_us"] * 1.2


def test_profile_ranges_are_read_and_select_the_activities_inside_them(tmp_path):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("kernel_table batch 8"):
            torch.ones(64).add_(1)
        with record_function("unrelated"):
            torch.ones(64).add_(1)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    windows = kt.windows_from_trace(json.loads(path.read_text()), "kernel_table batch ")
    assert list(windows) == ["kernel_table batch 8"]
    start, end = windows["kernel_table batch 8"]
    assert end > start
    assert list(kt.windows_from_function_events(prof.events(), "kernel_table batch ")) == [
        "kernel_table batch 8"
    ]
    events = [kt.DeviceEvent("a", 1.0, 5.0), kt.DeviceEvent("b", 10.0, 1.0), kt.DeviceEvent("c", 20.0, 1.0)]
    assert [ev.name for ev in kt.in_window(events, (10.0, 20.0))] == ["b", "c"]


def test_kernel_tables_run_their_steady_states_in_one_session_on_a_cpu(tiny_model_dirs, tmp_path):
    """The whole flow but the device activity (a CPU profile has none): per batch size the steady decode
    state timed without the profiler, then its profiled steps in one session, served by the (emulated)
    decode graph, the bytes model at the padded size, the requests run to their end; JSON written."""
    from helpers import make_llm

    out = tmp_path / "tables.json"
    argv = ["--batch", "3,1", "--context", "12", "--steps", "2", "--kernel-table", "--json", str(out)]
    args = profile_step.build_parser().parse_args(argv)
    with make_llm(tiny_model_dirs["qwen3"], max_running_req=4, cuda_graph_max_bs=4, num_pages=256) as llm:
        engine = llm.scheduler.engine
        shape = kt.DecodeShape.of(engine.model_config, engine.dtype.itemsize, engine.kv_dtype.itemsize)
        tables = profile_step.emit_kernel_tables(llm, args, shape, 1e12)
        assert not llm.scheduler.has_work and not llm.scheduler.reqs
    assert [t.rows for t in tables] == [[], []] and all(t.wall_us > 0 for t in tables)
    assert [(t.meta["batch"], t.meta["padded"], t.meta["graphed"]) for t in tables] == [
        (3, 4, True),
        (1, 1, True),
    ]
    # 12-token prompts, then 5 warm-up decode steps of one key each: the first profiled step attends
    # 12 + 5 + 1 keys (its own new one too), one more each step after
    assert tables[0].meta["mean_keys"] == 12 + 5 + 1 + (profile_step.PROFILE_STEPS - 1) / 2
    assert "batch 3 (graph of 4)" in tables[0].title
    assert [t["batch"] for t in json.loads(out.read_text())] == [3, 1]


def test_step_trace_table_reads_phases_in_microseconds_at_the_traces_own_clock():
    """profile_step --step-trace's report on hand-made clock readings: 2 GHz (from the blocks' clock64 /
    globaltimer pairs), per stage phases of 1, 2, 0.5 and 3 or 5 us; a block that recorded no attention
    points is left out of that stage; torch's median takes the lower middle of an even count."""
    from minisgl.benchmark.profile_step import stage_table

    ghz, us = 2.0, 2000  # cycles a microsecond
    stages = torch.zeros(1, 2, 2, 5, 5, dtype=torch.int64)
    for b, compute in ((0, 3.0), (1, 5.0)):
        t = 1000 + b * 7
        for layer in range(2):
            for st in range(5):
                for p, d in enumerate((0.0, 1.0, 2.0, 0.5, compute)):
                    t += int(d * us)
                    stages[0, b, layer, st, p] = t
    stages[0, 1, :, 1, 2:4] = 0  # block 1 has no attention work item
    tail = torch.tensor(
        [[[1000, 500, 1000 + int(ghz * 10_000), 10_500], [5000, 600, 5000 + int(ghz * 9_000), 9_600]]]
    )
    lines = stage_table(stages, tail, context=600)
    assert lines[0] == (
        "one-kernel decode step, batch 1, 600 keys, 2 layers, 2 blocks: kernel 10.0 us (median of 1 steps, "
        "globaltimer), SM clock 2.00 GHz"
    )
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[3:8]}
    assert rows["qkv"] == "| qkv | 1.00 / 1.00 | 2.00 / 2.00 | 0.50 / 0.50 | 3.00 / 5.00 | 6.50 |"
    assert rows["attention"] == "| attention | 1.00 / 1.00 | 2.00 / 2.00 | 0.50 / 0.50 | 3.00 / 3.00 | 6.50 |"
    assert lines[-1] == "a layer, start to start: p50 32.50 us, p90 41.50 us"


def test_step_trace_table_sets_each_stage_against_its_bytes_at_the_bandwidth():
    """With a layer's bytes per stage and a bandwidth the report adds bytes, floor and the floor's share
    of the stage's p50 (hand-made readings as above: every stage 6.5 us, a layer 32.5 us at p50)."""
    from minisgl.benchmark.profile_step import stage_table

    us = 2000
    stages = torch.zeros(1, 1, 2, 5, 5, dtype=torch.int64)
    t = 1000
    for layer in range(2):
        for st in range(5):
            for p, d in enumerate((0.0, 1.0, 2.0, 0.5, 3.0)):
                t += int(d * us)
                stages[0, 0, layer, st, p] = t
    tail = torch.tensor([[[1000, 500, 1000 + 2 * 40_000, 40_500]]])
    lines = stage_table(stages, tail, 600, (2000, 1000, 500, 4000, 1500), 1e9)
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[3:8]}
    assert lines[1].endswith("| stage p50 us | bytes | floor us | of floor |")
    assert rows["qkv"].endswith("| 6.50 | 2.00 KB | 2.00 | 31% |")
    assert rows["gate_up"].endswith("| 6.50 | 4.00 KB | 4.00 | 62% |")
    assert rows["o"].endswith("| 6.50 | 500 B | 0.50 | 8% |")
    assert lines[-1] == (
        "a layer's bytes 9.00 KB: 9.00 us at 0.00 TB/s, 28% of a layer's p50; the layers' 18.00 KB: "
        "18.0 us, 45% of the kernel"
    )


def test_step_stage_bytes_of_qwen3_0_6b_by_hand():
    """A layer of Qwen3-0.6B (hidden 1024, 16 x 128 q heads, 8 KV heads, intermediate 3072, bf16) at 601
    keys: the weights with their norms, and attention's K and V rows (8 x 128 x 2 B each) with a 4-byte
    page-table entry a key, the new K and V stored, and the q / k norm weights."""
    from minisgl.benchmark.kernel_table import DecodeShape, step_stage_bytes

    shape = DecodeShape(1024, 16, 8, 128, 3072, 151936, 28, qk_norm=True)
    assert step_stage_bytes(shape, 601) == (
        4096 * 1024 * 2 + 2048,
        601 * (2048 + 2048 + 4) + 4096 + 512,
        1024 * 2048 * 2,
        6144 * 1024 * 2 + 2048,
        1024 * 3072 * 2,
    )
