"""W7: one user whose answers repeat much of the prompt (speculative decoding), on the CPU.

    python -m minisgl.benchmark.speculative                    # minisgl with n-gram speculation and without
    python -m minisgl.benchmark.speculative --rounds 3 \\
        --llama-server /tmp/llamacpp/build/bin/llama-server      # and llama.cpp with its n-gram speculation
    python -m minisgl.benchmark.speculative --num-speculative-tokens 4,8 --prompts 4

16 prompts (8 "repeat this code exactly, then add a docstring" over a 300-600-token Python function, 8
"correct the spelling" over a 300-600-token paragraph with misspelt words), built here from a fixed seed,
each through the default model's chat template; 256 output tokens each (EOS ignored), greedy, one request
at a time. Every round runs each system over all prompts in turn (rounds interleave the systems); a
system's figure is its output tokens over the wall time of its requests, prompt processing included.
minisgl's outputs with and without speculation must be identical. llama.cpp runs `llama-server` on the
same GGUF file with `--spec-type` (default ngram-simple) and receives the same token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
import urllib.request
from typing import Any

OUTPUT_TOKENS = 256

_NOUNS = ["order", "invoice", "sensor", "account", "shipment", "reading", "ticket", "record", "user", "event"]
_FIELDS = ["name", "amount", "status", "region", "price", "count", "owner", "weight", "score", "created"]
_VERBS = ["summarize", "normalize", "collect", "validate", "merge", "group", "filter", "rank"]

# statement blocks of a loop body (lines, indented when used); {a}, {b}: field names, {n}: a number, {x}: a noun
_BLOCKS = [
    ['key = item.get("{a}", "")', "if key in seen:", "    continue", "seen.add(key)"],
    ['value = float(item.get("{b}", 0))', "if value > limit:", "    value = limit", "total += value"],
    ['if item.get("{a}") is None:', "    skipped += 1", "    continue"],
    ['label = str(item.get("{a}", "unknown")).strip().lower()', "counts[label] = counts.get(label, 0) + 1"],
    ["if verbose:", "    print(f\"{x} {{index}}: {{item.get('{b}')}}\")"],
    [
        'bucket = groups.setdefault(item.get("{a}"), [])',
        "bucket.append(item)",
        "if len(bucket) > {n}:",
        "    bucket.pop(0)",
    ],
    [
        'ratio = item.get("{b}", 0) / max(1, item.get("{a}", 1))',
        "if ratio < {n} / 100:",
        "    low.append((index, ratio))",
    ],
    ['entry = {{"{a}": item.get("{a}"), "{b}": item.get("{b}"), "index": index}}', "result.append(entry)"],
    [
        "try:",
        '    stamp = int(item["{a}"])',
        "except (KeyError, TypeError, ValueError):",
        "    stamp = 0",
        "if stamp and stamp % {n} == 0:",
        '    counts["periodic"] = counts.get("periodic", 0) + 1',
    ],
    [
        'name = item.get("{b}") or ""',
        "if not isinstance(name, str):",
        "    name = str(name)",
        'if name.startswith("{x}_"):',
        '    name = name[len("{x}_") :]',
        'item["{b}"] = name',
    ],
    [
        "while len(result) > limit:",
        "    dropped = result.pop(0)",
        "    if verbose:",
        '        print("dropping", dropped.get("{a}"))',
    ],
]
_TAILS = [
    ['result.sort(key=lambda e: e.get("{b}") or 0, reverse=True)'],
    ["average = total / len(result) if result else 0.0"],
    ['summary = {{"total": total, "skipped": skipped, "groups": len(groups), "low": len(low)}}'],
    ["if verbose:", '    print(f"{x}: {{len(result)}} kept, {{skipped}} skipped")'],
]


def _indented(lines: list[str], depth: int, **fill: Any) -> str:
    return "".join(" " * depth + line.format(**fill) + "\n" for line in lines)


_SENTENCES = [
    "The library opens at nine in the morning and closes late on most weekdays.",
    "Our team spent the whole afternoon reviewing the quarterly report before the meeting.",
    "A small garden behind the house produces tomatoes, beans and several kinds of herbs.",
    "The train was delayed because of a signal failure near the central station.",
    "Many students prefer to study in groups when the examinations are approaching.",
    "The museum recently added a collection of paintings from the early twentieth century.",
    "She carefully measured the ingredients before mixing them in a large bowl.",
    "Heavy rain during the night flooded several streets in the lower part of town.",
    "The new software update improves performance and fixes a number of known problems.",
    "Local farmers sell fresh vegetables and bread at the market every Saturday.",
    "The committee agreed to postpone the decision until more information was available.",
    "He walked along the river every evening to clear his mind after work.",
    "The company announced that it would open two additional offices next year.",
    "Children in the village learn to swim in the lake during the summer holidays.",
    "The restaurant changed its menu to include more seasonal and regional dishes.",
    "Scientists measured the temperature of the ocean at different depths for a decade.",
    "The old bridge was closed for repairs after engineers found cracks in the supports.",
    "Visitors are asked to keep their tickets until the end of the guided tour.",
    "The orchestra rehearsed the symphony three times before the opening performance.",
    "A friendly neighbour offered to water the plants while we were travelling abroad.",
    "The report explains the results clearly and suggests several practical improvements.",
    "Most of the furniture in the office was replaced during the renovation last spring.",
    "The children built a tall tower of wooden blocks and then knocked it down laughing.",
    "Every member of the club receives a monthly newsletter with upcoming events.",
    "The mountain path becomes narrow and steep just before it reaches the summit.",
    "Our manager encouraged everyone to share their ideas during the weekly discussion.",
    "The bakery on the corner is famous for its bread and its delicious apple pastries.",
    "Several volunteers helped to clean the beach after the storm had passed.",
    "The teacher explained the difficult problem slowly so that everyone could follow.",
    "Traffic in the city centre is usually heavy between five and seven in the evening.",
    "The hotel offers comfortable rooms, a quiet garden and a generous breakfast.",
    "After a long discussion the neighbours finally agreed on the colour of the fence.",
]


def _code_prompt(rng: random.Random) -> str:
    """A Python function of some 40-80 lines, then the request to repeat it with a docstring."""
    noun, verb = rng.choice(_NOUNS), rng.choice(_VERBS)
    fill = {"x": noun, "n": rng.randint(3, 90)}
    lines = [
        f"def {verb}_{noun}s(items, limit={rng.randint(10, 500)}, verbose=False):\n",
        "    result = []\n    seen = set()\n    counts = {}\n    groups = {}\n    low = []\n",
        "    total = 0.0\n    skipped = 0\n",
        "    for index, item in enumerate(items):\n",
    ]
    for block in rng.sample(_BLOCKS, k=rng.randint(8, 11)):
        a, b = rng.sample(_FIELDS, 2)
        lines.append(_indented(block, 8, a=a, b=b, **fill))
    for tail in rng.sample(_TAILS, k=4):
        a, b = rng.sample(_FIELDS, 2)
        lines.append(_indented(tail, 4, a=a, b=b, **fill))
    lines.append("    return result\n")
    code = "".join(lines)
    return f"Repeat the following code exactly, then add a docstring:\n\n```python\n{code}```"


def _misspell(word: str, rng: random.Random) -> str:
    inner = [i for i in range(1, len(word) - 2) if word[i].isalpha() and word[i + 1].isalpha()]
    if len(word) < 5 or not inner:
        return word
    i = rng.choice(inner)
    return word[:i] + word[i + 1] + word[i] + word[i + 2 :]


def _spelling_prompt(rng: random.Random) -> str:
    """A paragraph of some 20-30 sentences, about one word in eight misspelt (two letters swapped)."""
    sentences = rng.sample(_SENTENCES, k=rng.randint(20, 30))
    words = " ".join(sentences).split(" ")
    text = " ".join(_misspell(w, rng) if rng.random() < 0.125 else w for w in words)
    return f"Correct the spelling in this text:\n\n{text}"


def w7_prompts(n: int = 16, seed: int = 0) -> list[str]:
    """W7's prompts: code and spelling alternating, from a fixed seed."""
    rng = random.Random(seed)
    return [_code_prompt(rng) if i % 2 == 0 else _spelling_prompt(rng) for i in range(n)]


def w7_token_ids(tokenizer: Any, n: int = 16) -> list[list[int]]:
    """The prompts through the chat template, as the service tokenizes them."""
    out = []
    for p in w7_prompts(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


# ---- systems ---------------------------------------------------------------------------------------
def run_minisgl(prompts: list[list[int]], options: dict[str, Any]) -> dict[str, Any]:
    """One LLM (built, warmed up, shut down here) over the prompts one at a time."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    llm = LLM(None, show_progress=False, **options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        llm.generate([list(range(100, 140))], SamplingParams(max_tokens=16, ignore_eos=True))  # warm-up
        before = llm.stats()
        seconds, outputs = 0.0, []
        for ids in prompts:
            t0 = time.perf_counter()
            outputs.append(llm.generate([ids], params)[0]["token_ids"])
            seconds += time.perf_counter() - t0
        after = llm.stats()
        return {
            "seconds": seconds,
            "outputs": outputs,
            "proposed": after.get("spec_proposed_tokens", 0) - before.get("spec_proposed_tokens", 0),
            "accepted": after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0),
            "verify_steps": after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0),
        }
    finally:
        llm.shutdown()


def _post(url: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_llama_server(
    binary: str, gguf: str, prompts: list[list[int]], threads: int, port: int, extra: list[str]
) -> dict[str, Any]:
    """llama-server on the same file, one slot, the prompts as token ids, greedy, one at a time."""
    cmd = [binary, "-m", gguf, "-t", str(threads), "-c", "4096", "-np", "1", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start: {' '.join(cmd)}")
            time.sleep(0.5)
        body = {
            "n_predict": OUTPUT_TOKENS,
            "temperature": 0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        _post(base + "/completion", {**body, "prompt": list(range(100, 140)), "n_predict": 16})  # warm-up
        seconds, outputs, proposed, accepted = 0.0, [], 0, 0
        for ids in prompts:
            t0 = time.perf_counter()
            r = _post(base + "/completion", {**body, "prompt": ids, "return_tokens": True})
            seconds += time.perf_counter() - t0
            outputs.append(r.get("tokens", []))
            t = r.get("timings", {})
            proposed += int(t.get("draft_n", 0))
            accepted += int(t.get("draft_n_accepted", 0))
        return {"seconds": seconds, "outputs": outputs, "proposed": proposed, "accepted": accepted}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _line(name: str, r: dict[str, Any], n_out: int) -> str:
    acc = ""
    if r.get("proposed"):
        acc = f", {r['accepted']}/{r['proposed']} proposals accepted ({r['accepted'] / r['proposed']:.0%})"
        if r.get("verify_steps"):
            acc += f", {r['verify_steps']} verify steps"
    return f"  {name}: {n_out / r['seconds']:.1f} tok/s ({n_out} tokens in {r['seconds']:.2f} s{acc})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1, help="rounds; each runs every system once, in turn")
    ap.add_argument("--prompts", type=int, default=16, help="the first N of the 16 prompts")
    ap.add_argument(
        "--num-speculative-tokens", default="8", help="minisgl's k; a comma-separated list runs each"
    )
    ap.add_argument("--speculative-ngram-max", type=int, default=4)
    ap.add_argument("--stored-dot", default="exact", help="minisgl's --stored-dot (exact, int8)")
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also run llama.cpp's llama-server")
    ap.add_argument(
        "--llama-spec",
        default="--spec-type ngram-simple",
        help="llama-server's speculation flags (default: %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=2, help="llama-server's -t")
    ap.add_argument("--port", type=int, default=18977)
    args = ap.parse_args(argv)

    from minisgl.models.resolve import default_model_path, resolve_model_path
    from minisgl.utils.hf import load_tokenizer

    gguf = default_model_path()
    tokenizer = load_tokenizer(resolve_model_path(None))
    prompts = w7_token_ids(tokenizer, 16)[: args.prompts]
    n_out = OUTPUT_TOKENS * len(prompts)
    lens = [len(p) for p in prompts]
    print(
        f"# W7: {len(prompts)} prompts of {min(lens)}..{max(lens)} tokens ({sum(lens)} in all), "
        f"{OUTPUT_TOKENS} output tokens each, greedy, one at a time; {gguf}"
    )
    ks = [int(k) for k in args.num_speculative_tokens.split(",")]
    base = {"stored_dot": args.stored_dot}
    systems: list[tuple[str, Any]] = [("minisgl", lambda: run_minisgl(prompts, base))]
    for k in ks:
        opts = dict(
            base,
            speculative="ngram",
            num_speculative_tokens=k,
            speculative_ngram_max=args.speculative_ngram_max,
        )
        systems.append((f"minisgl ngram k={k}", lambda o=opts: run_minisgl(prompts, o)))
    if args.llama_server:
        extra = args.llama_spec.split()
        systems.append(
            (
                "llama.cpp (no speculation)",
                lambda: run_llama_server(args.llama_server, gguf, prompts, args.threads, args.port, []),
            )
        )
        systems.append(
            (
                f"llama.cpp {args.llama_spec}",
                lambda: run_llama_server(args.llama_server, gguf, prompts, args.threads, args.port, extra),
            )
        )
    tok_s: dict[str, list[float]] = {name: [] for name, _ in systems}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1} ({time.strftime('%H:%M:%S')})", flush=True)
        results = {}
        for name, run in systems:
            r = run()
            results[name] = r
            tok_s[name].append(n_out / r["seconds"])
            print(_line(name, r, n_out), flush=True)
        ref = results["minisgl"]["outputs"]
        for name, r in results.items():
            same = sum(a == b for a, b in zip(ref, r["outputs"]))
            if name.startswith("minisgl ") and same != len(ref):
                raise RuntimeError(
                    f"{name}: {len(ref) - same} outputs differ from minisgl without speculation"
                )
            print(f"  {name}: {same}/{len(ref)} outputs identical to minisgl without speculation")
    print("# medians over rounds")
    plain = statistics.median(tok_s["minisgl"])
    for name, vals in tok_s.items():
        med = statistics.median(vals)
        print(f"  {name}: {med:.1f} tok/s, {med / plain:.2f}x minisgl without speculation")
    if args.llama_server:
        llama = statistics.median(tok_s[f"llama.cpp {args.llama_spec}"])
        for k in ks:
            med = statistics.median(tok_s[f"minisgl ngram k={k}"])
            print(f"  minisgl ngram k={k} / llama.cpp {args.llama_spec}: {med / llama:.2f}x")
    print(f"# {os.uname().nodename}, {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
