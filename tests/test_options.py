"""One definition per option: every field of `ServerArgs(SchedulerConfig(EngineConfig))` is a flag of
`python -m minisgl` (or marked as set by code), and the CLI, `LLM(**kw)` and the benchmark CLIs turn the same
option into the same config value, with the same range checks."""

from __future__ import annotations

import dataclasses
import gc
import re

import pytest
import torch

import minisgl.llm.llm as llm_module
from minisgl.benchmark import offline, profile_step
from minisgl.llm import LLM
from minisgl.scheduler.config import SchedulerConfig
from minisgl.service.args import DEFAULT_MODEL_NAME, ServerArgs, build_parser, parse_args
from minisgl.utils import options
from minisgl.utils.options import OptionError, flag, option

# fields the launcher fills in per process: never flags, still keywords of the configs
INTERNAL = {"tp_rank", "dist_init_method", "extra_eos_token_ids", "ipc_dir"}


class _Built(Exception):
    """Raised by the stand-in Scheduler once LLM has built its config."""


def llm_config(monkeypatch, *args, **kwargs) -> SchedulerConfig:
    """The SchedulerConfig `LLM(*args, **kwargs)` builds, without loading a model."""
    seen = {}

    def scheduler(config):
        seen["config"] = config
        raise _Built

    monkeypatch.setattr(llm_module, "Scheduler", scheduler)
    with pytest.raises(_Built):
        LLM(*args, **kwargs)
    return seen["config"]


def offline_configs(argv: list[str]) -> list[SchedulerConfig]:
    """The configs the offline benchmark runs for a command line, in order."""
    parser = offline.build_parser()
    return [options.build(SchedulerConfig, kw) for kw in offline.runs(parser.parse_args(argv), parser)]


def profile_config(argv: list[str]) -> SchedulerConfig:
    ns = profile_step.build_parser().parse_args(argv)
    return options.build(SchedulerConfig, profile_step.llm_options(ns))


def _listed(text: str, flag_name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag_name)}(?![\w-])", text) is not None


# ---- the fields are the flags ---------------------------------------------------------------------------
def test_every_field_is_an_option_or_one_the_launcher_sets():
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    assert fields - {f.name for f in options.options(ServerArgs)} == INTERNAL


def test_every_option_and_alias_is_a_flag_listed_in_help():
    text = build_parser().format_help()
    for f in options.options(ServerArgs):
        for name in (f.name, *options.spec_of(f).aliases):
            assert _listed(text, flag(name)), flag(name)


def test_help_lists_the_interface_and_readme_spellings():
    text = build_parser().format_help()
    for name in ("--model", "--port", "--tp", "--cache", "--cache-type", "--max-running-requests"):
        assert _listed(text, name), name
    for name in ("--num-pages", "--max-seq-len-override", "--attn", "--num-tokenizer", "--shell"):
        assert _listed(text, name), name


def test_the_benchmark_clis_add_every_option_of_the_scheduler_config():
    for parser in (offline.build_parser(), profile_step.build_parser()):
        text = parser.format_help()
        for f in options.options(SchedulerConfig):
            assert _listed(text, flag(f.name)), flag(f.name)


# ---- the same option, the same value, from every front ----------------------------------------------------
SAME = [  # (flags, LLM keywords, field, value in the config)
    (["--model", "m/dir"], {"model_path": "m/dir"}, "model_path", "m/dir"),
    (["--model-path", "m/dir"], {"model": "m/dir"}, "model_path", "m/dir"),
    (["--dtype", "float32"], {"dtype": "float32"}, "dtype", torch.float32),
    (["--dtype", "bfloat16"], {"dtype": torch.bfloat16}, "dtype", torch.bfloat16),
    (["--dtype", "auto"], {"dtype": None}, "dtype", None),
    (["--device", "cpu"], {"device": "cpu"}, "device", "cpu"),
    (["--attn", "triton"], {"attn": "triton"}, "attn", "triton"),
    (["--load-format", "dummy"], {"load_format": "dummy"}, "load_format", "dummy"),
    (["--page-size", "16"], {"page_size": 16}, "page_size", 16),
    (["--num-pages", "2048"], {"num_page_override": 2048}, "num_pages", 2048),
    (["--num-page-override", "2048"], {"num_pages": 2048}, "num_pages", 2048),
    (["--max-seq-len-override", "512"], {"max_seq_len_override": 512}, "max_seq_len_override", 512),
    (["--max-seq-len", "512"], {"max_seq_len": 512}, "max_seq_len_override", 512),
    (["--max-running-requests", "8"], {"max_running_req": 8}, "max_running_req", 8),
    (["--max-running-req", "8"], {"max_running_requests": 8}, "max_running_req", 8),
    (["--max-prefill-length", "512"], {"max_prefill_length": 512}, "max_prefill_length", 512),
    (["--cuda-graph-max-bs", "0"], {"cuda_graph_max_bs": 0}, "cuda_graph_max_bs", 0),
    (["--cuda-graph-max-prefill", "0"], {"cuda_graph_max_prefill": 0}, "cuda_graph_max_prefill", 0),
    (["--mem-fraction", "0.5"], {"mem_fraction": 0.5}, "mem_fraction", 0.5),
    (["--cpu-kv-cache-bytes", "4096"], {"cpu_kv_cache_bytes": 4096}, "cpu_kv_cache_bytes", 4096),
    (["--no-show-progress"], {"show_progress": False}, "show_progress", False),
    (["--seed", "7"], {"seed": 7}, "seed", 7),
    (["--cache", "naive"], {"cache_type": "naive"}, "cache_type", "naive"),
    (["--cache-type", "naive"], {"cache": "naive"}, "cache_type", "naive"),
    (["--overlap", "off"], {"overlap": False}, "overlap", False),
    (["--reserve-ratio", "0.5"], {"reserve_ratio": 0.5}, "reserve_ratio", 0.5),
]


@pytest.mark.parametrize("argv,kwargs,name,value", SAME, ids=[" ".join(s[0]) for s in SAME])
def test_cli_llm_and_benchmarks_give_one_option_the_same_value(monkeypatch, argv, kwargs, name, value):
    assert getattr(parse_args(argv), name) == value
    assert getattr(llm_config(monkeypatch, **kwargs), name) == value
    [bench] = offline_configs(argv)
    assert getattr(bench, name) == value
    assert getattr(profile_config(argv), name) == value


def test_defaults_are_one_set_for_the_cli_and_llm(monkeypatch):
    cli, llm = parse_args([]), llm_config(monkeypatch)
    for f in options.options(SchedulerConfig):
        assert getattr(cli, f.name) == getattr(llm, f.name), f.name
    assert (cli.max_running_req, cli.page_size, cli.max_prefill_length, cli.cache_type) == (
        256,
        1,
        8192,
        "radix",
    )
    assert cli.dtype is None and cli.num_pages is None and cli.overlap is None


def test_the_shell_runs_one_request_unless_told_otherwise():
    assert parse_args(["--shell"]).max_running_req == 1
    assert parse_args(["--shell", "--max-running-requests", "4"]).max_running_req == 4
    assert parse_args([]).max_running_req == 256


def test_the_served_model_name_defaults_to_the_model_as_given():
    assert parse_args([]).served_model_name == DEFAULT_MODEL_NAME
    assert parse_args(["--model", "org/name/"]).served_model_name == "org/name"
    assert parse_args(["--model", "m", "--served-model-name", "x"]).served_model_name == "x"


def test_the_offline_benchmark_runs_every_cache_and_overlap_listed():
    runs = offline_configs(["--cache", "radix,naive", "--overlap", "on,off"])
    assert [(c.cache_type, c.overlap) for c in runs] == [
        ("radix", True),
        ("radix", False),
        ("naive", True),
        ("naive", False),
    ]
    [default] = offline_configs([])
    assert (default.cache_type, default.overlap, default.show_progress) == ("radix", True, False)


def test_the_step_profile_keeps_its_defaults_and_lets_options_override_them():
    base = profile_config([])
    assert (base.dtype, base.load_format) == (torch.bfloat16, "dummy")
    assert base.model_path == offline.resolve_model("qwen3-0.6b")
    parser = profile_step.build_parser()
    given = profile_step.llm_options(parser.parse_args(["--max-running-req", "3"]), max_running_req=64)
    left_out = profile_step.llm_options(parser.parse_args([]), max_running_req=64)
    assert (given["max_running_req"], left_out["max_running_req"]) == (3, 64)


# ---- refusals ----------------------------------------------------------------------------------------------
def test_an_unknown_keyword_is_refused_naming_it(monkeypatch):
    with pytest.raises(TypeError, match="'bogus'"):
        LLM(bogus=1)
    with pytest.raises(TypeError, match="'max_runing_req'.*did you mean 'max_running_req'"):
        LLM(max_runing_req=8)
    with pytest.raises(TypeError, match="'port'"):  # a service option is not an LLM one
        LLM(port=1919)
    with pytest.raises(TypeError, match="num_page_override.*num_pages"):  # one option, two spellings
        LLM(num_pages=8, num_page_override=16)


RANGED = [f for f in options.options(ServerArgs) if options.spec_of(f).min is not None]


@pytest.mark.parametrize("f", RANGED, ids=[f.name for f in RANGED])
def test_range_checks_refuse_a_value_below_the_minimum_everywhere(monkeypatch, capsys, f):
    low = int(options.spec_of(f).min) - 1
    with pytest.raises(SystemExit):
        parse_args([flag(f.name), str(low)])
    assert f"{flag(f.name)} must be " in capsys.readouterr().err
    if f.name in {g.name for g in options.options(SchedulerConfig)}:
        with pytest.raises(ValueError, match=f"^{f.name} must be >= "):
            llm_config(monkeypatch, **{f.name: low})
        with pytest.raises(SystemExit):
            offline_configs([flag(f.name), str(low)])
        assert f"{flag(f.name)} must be >= " in capsys.readouterr().err


def test_the_port_must_be_a_port_and_the_dtype_a_known_one(monkeypatch, capsys):
    for port in ("0", "65536"):
        with pytest.raises(SystemExit):
            parse_args(["--port", port])
        assert f"--port must be in 1..65535, got {port}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "float8"])
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(OptionError, match="^dtype must be one of auto, float32, bfloat16, float16"):
        llm_config(monkeypatch, dtype="float8")


# ---- the generic module: one field is one option ----------------------------------------------------------
def test_a_new_field_is_a_flag_a_keyword_and_checked():
    @dataclasses.dataclass
    class Config:
        page_size: int = option(1, help="tokens per page", min=1, aliases=["page"])
        mode: str = option("a", help="a or b", choices=["a", "b"])

        def __post_init__(self) -> None:
            options.check(self)

    import argparse

    parser = argparse.ArgumentParser()
    options.add_flags(parser, Config)
    assert options.build(Config, options.given(parser.parse_args(["--page", "4"]), Config)).page_size == 4
    assert options.build(Config, {"page": 4}) == Config(page_size=4)
    with pytest.raises(OptionError, match="page_size must be >= 1, got 0"):
        Config(page_size=0)
    with pytest.raises(OptionError, match="mode must be one of a, b"):
        Config(mode="c")


# ---- the book's quickstart ---------------------------------------------------------------------------------
def test_the_books_quickstart_keywords_build_that_engine(tiny_model_dirs):
    llm = LLM(
        tiny_model_dirs["llama"],
        dtype=torch.float32,
        max_running_req=8,
        num_page_override=2048,
        max_seq_len_override=512,
    )
    try:
        engine = llm.scheduler.engine
        assert (engine.dtype, engine.num_pages, engine.max_seq_len) == (torch.float32, 2048, 512)
        assert llm.scheduler.table.capacity == 8
    finally:
        llm.shutdown()
        gc.collect()
