"""lm-evaluation-harness, unchanged, against a running service, checked against Hugging Face in float32.

    pip install lm-eval                                    # not a dependency of minisgl
    python -m minisgl --dtype float32 --served-model-name m &
    python -m minisgl.benchmark.lm_eval_check --base-url http://127.0.0.1:1919 --model m
    python -m minisgl.benchmark.lm_eval_check --base-url http://127.0.0.1:1919 --model m --items 1000 --skip-hf

Builds a small multiple-choice task from local JSON (`dataset_path: json`: sums of two numbers, four
choices each, seeded), then runs it through lm-eval's own clients:
- `local-completions`, loglikelihood: lm-eval sends each (context, choice) as token ids with `echo: true`,
  `logprobs: 1`, `max_tokens: 1`, reads the prompt's log-probabilities and scores `acc`. Its tokenizer is
  the server's own (`/tokenizer_info` and `/tokenize`, auto-detected).
- `local-chat-completions`, generation: the question as a chat, the answer generated greedily and scored
  by exact match.

The reference computes both from the model directory with transformers in float32: the accuracy from the
log-probabilities of the same token sequences (lm-eval's context / continuation split), and the exact match
from greedy generation of the same chat prompts. Prints both, the items per second of the loglikelihood
run, and exits non-zero when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

TASK_LL = "minisgl_sums_ll"
TASK_GEN = "minisgl_sums_gen"


def make_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n questions `a + b`, four distinct choices, the answer's place seeded."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        wrong = rng.sample([x for x in range(2, 81) if x != a + b], 3)
        choices = [str(x) for x in [a + b, *wrong]]
        rng.shuffle(choices)
        items.append(
            {
                "question": f"Question: what is {a} + {b}?\nAnswer:",
                "choices": choices,
                "answer": choices.index(str(a + b)),
            }
        )
    return items


def write_tasks(folder: str, items: list[dict[str, Any]]) -> None:
    """The dataset and the two task YAMLs (loglikelihood and generation) lm-eval reads from `folder`."""
    data = os.path.join(folder, "sums.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    common = (
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        'doc_to_text: "{{question}}"\n'
    )
    with open(os.path.join(folder, f"{TASK_LL}.yaml"), "w") as f:
        f.write(
            f"task: {TASK_LL}\n{common}output_type: multiple_choice\n"
            'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
            "metric_list:\n  - metric: acc\n"
        )
    with open(os.path.join(folder, f"{TASK_GEN}.yaml"), "w") as f:
        f.write(
            f"task: {TASK_GEN}\n{common}output_type: generate_until\n"
            'doc_to_target: "{{choices[answer]}}"\n'
            "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 6\n  do_sample: false\n  temperature: 0\n"
            "filter_list:\n  - name: strip\n    filter:\n      - function: strip_whitespace\n      - function: take_first\n"
            "metric_list:\n  - metric: exact_match\n"
        )


def run_lm_eval(
    base_url: str, model: str, folder: str, task: str, batch_size: int, limit: int | None
) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    chat = task == TASK_GEN
    api = "local-chat-completions" if chat else "local-completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    args = {"base_url": base_url + path, "model": model, "max_retries": 1, "num_concurrent": 1}
    if not chat:
        args["batch_size"] = batch_size  # lists of token-id prompts per request
    out = lm_eval.simple_evaluate(
        model=api,
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=folder),
        apply_chat_template=chat,
        limit=limit,
        log_samples=False,
    )
    return out["results"][task]


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context move to the continuation, whose tokens are those of
    the whole text after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def hf_reference(model_dir: str, items: list[dict[str, Any]]) -> tuple[float, float]:
    """(acc from float32 log-probabilities, exact match of greedy chat answers) over `items`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = exact = 0
    with torch.no_grad():
        for item in items:
            scores = []
            for choice in item["choices"]:
                ctx, cont = _encode_pair(tok, item["question"], " " + choice)  # lm-eval's target delimiter
                ids = torch.tensor([ctx + cont])
                logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
                scores.append(sum(float(logp[len(ctx) + i - 1, t]) for i, t in enumerate(cont)))
            right += int(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
            text = tok.apply_chat_template(
                [{"role": "user", "content": item["question"]}], tokenize=False, add_generation_prompt=True
            )
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
            answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            for stop in ("\n", "."):
                answer = answer.split(stop)[0]
            exact += int(answer.strip() == item["choices"][item["answer"]])
    return right / len(items), exact / len(items)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:1919")
    p.add_argument("--model", default="m", help="the served model name")
    p.add_argument(
        "--model-dir",
        default=None,
        help="the model directory for the HF reference (default: the embedded model)",
    )
    p.add_argument("--items", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="only run lm-eval and time it")
    p.add_argument("--skip-generation", action="store_true")
    a = p.parse_args(argv)
    items = make_items(a.items)
    with tempfile.TemporaryDirectory(prefix="minisgl-lm-eval-") as folder:
        write_tasks(folder, items)
        t0 = time.perf_counter()
        ll = run_lm_eval(a.base_url, a.model, folder, TASK_LL, a.batch_size, None)
        seconds = time.perf_counter() - t0
        gen = None if a.skip_generation else run_lm_eval(a.base_url, a.model, folder, TASK_GEN, 1, None)
    report: dict[str, Any] = {
        "items": a.items,
        "loglikelihood_requests": 4 * a.items,
        "lm_eval_acc": ll["acc,none"],
        "seconds": round(seconds, 1),
        "items_per_s": round(a.items / seconds, 2),
        "requests_per_s": round(4 * a.items / seconds, 2),
    }
    if gen is not None:
        report["lm_eval_exact_match"] = gen["exact_match,strip"]
    ok = True
    if not a.skip_hf:
        from minisgl.utils.hf import resolve_model_path

        acc, exact = hf_reference(resolve_model_path(a.model_dir), items)
        report["hf_acc"] = acc
        ok = abs(acc - report["lm_eval_acc"]) < 1e-9
        if gen is not None:
            report["hf_exact_match"] = exact
            ok = ok and abs(exact - report["lm_eval_exact_match"]) < 1e-9
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
