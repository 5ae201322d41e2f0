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
- `local-chat-completions`, generation: the question as a chat, the answer generated greedily, its last
  number taken (lm-eval's regex filter) and scored by exact match.

The reference computes both from the model directory with transformers in float32: the accuracy from the
log-probabilities of the same token sequences (lm-eval's context / continuation split), and the answers
of greedy generation from the same chat prompts, item by item. Prints both, the items per second of the loglikelihood
run, and exits non-zero when they differ.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from typing import Any

TASK_LL = "minisgl_sums_ll"
TASK_GEN = "minisgl_sums_gen"
GEN_TOKENS = 12
NUMBER = r"(\d+)\.?$"  # the answer: the number the reply ends with (lm-eval's regex filter, first match)


def make_items(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n questions `a + b`, four distinct choices, the answer's place seeded; `chat` asks the same for the
    generation task."""
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
                "chat": f"What is {a} + {b}? Reply with the number only.",
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
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    with open(os.path.join(folder, f"{TASK_LL}.yaml"), "w") as f:
        f.write(
            f"task: {TASK_LL}\n{common}output_type: multiple_choice\n"
            'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
            "metric_list:\n  - metric: acc\n"
        )
    with open(os.path.join(folder, f"{TASK_GEN}.yaml"), "w") as f:
        f.write(
            f"task: {TASK_GEN}\n{common}output_type: generate_until\n"
            'doc_to_text: "{{chat}}"\ndoc_to_target: "{{choices[answer]}}"\n'
            # YAML's double quotes read \\n as a newline (single quotes would keep the backslash)
            f'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n'
            "  temperature: 0\n"
            "filter_list:\n  - name: number\n    filter:\n"
            f"      - function: regex\n        regex_pattern: '{NUMBER}'\n      - function: take_first\n"
            "metric_list:\n  - metric: exact_match\n"
        )


def run_lm_eval(base_url: str, model: str, folder: str, task: str, batch_size: int) -> dict[str, Any]:
    """lm-eval's results of `task` and its samples."""
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
        log_samples=True,
    )
    return {"results": out["results"][task], "samples": out["samples"][task]}


def _encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split: trailing spaces of the context move to the continuation, whose tokens are those of
    the whole text after the context's."""
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)
    return ctx, whole[len(ctx) :]


def hf_reference(model_dir: str, items: list[dict[str, Any]]) -> tuple[float, list[str]]:
    """The acc from float32 log-probabilities, and the greedy chat answers (cut at lm-eval's `until`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right, answers = 0, []
    with torch.no_grad():
        for item in items:
            scores = []
            for choice in item["choices"]:
                ctx, cont = _encode_pair(tok, item["question"], " " + choice)  # lm-eval's target delimiter
                logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
                scores.append(sum(float(logp[len(ctx) + i - 1, t]) for i, t in enumerate(cont)))
            right += int(max(range(len(scores)), key=scores.__getitem__) == item["answer"])
            chat = [{"role": "user", "content": item["chat"]}]
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
            out = model.generate(
                ids, max_new_tokens=GEN_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id
            )
            answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).split("\n")[0]
            found = re.findall(NUMBER, answer)
            answers.append(found[0] if found else "[invalid]")  # as lm-eval's regex filter
    return right / len(items), answers


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
        ll = run_lm_eval(a.base_url, a.model, folder, TASK_LL, a.batch_size)
        seconds = time.perf_counter() - t0
        gen = None if a.skip_generation else run_lm_eval(a.base_url, a.model, folder, TASK_GEN, 1)
    report: dict[str, Any] = {
        "items": a.items,
        "loglikelihood_requests": 4 * a.items,
        "lm_eval_acc": ll["results"]["acc,none"],
        "seconds": round(seconds, 1),
        "items_per_s": round(a.items / seconds, 2),
        "requests_per_s": round(4 * a.items / seconds, 2),
    }
    if gen is not None:
        report["lm_eval_exact_match"] = gen["results"]["exact_match,number"]
    ok = True
    if not a.skip_hf:
        from minisgl.models.resolve import resolve_model_path

        acc, answers = hf_reference(resolve_model_path(a.model_dir), items)
        report["hf_acc"] = acc
        ok = abs(acc - report["lm_eval_acc"]) < 1e-9
        if gen is not None:  # the same answers, item by item, and so the same exact match
            ours = {s["doc_id"]: s["filtered_resps"][0] for s in gen["samples"]}
            same = sum(ours[i] == answers[i] for i in range(len(items)))
            truth = [item["choices"][item["answer"]] for item in items]
            report["hf_exact_match"] = sum(x == t for x, t in zip(answers, truth)) / len(items)
            report["generations_equal_to_hf"] = f"{same}/{len(items)}"
            ok = ok and same == len(items)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
