"""Benchmarks (not tests): `python -m minisgl.benchmark.offline` for minisgl's offline workloads and
`python -m minisgl.benchmark.hf_peer` for the Hugging Face peers on the same workloads.

The workloads are those of the project's benchmark brief: one seeded generator of random token-id prompts
and output lengths (`offline.make_workload`), shared by both scripts."""
