#!/usr/bin/env python3
"""Does where vLLM splits a prompt into prefill chunks change its greedy tokens?

Why: the load harness compares every PD output under concurrent traffic with one run of
one instance (the reference), token for token, batch-invariant kernels on
(``VLLM_BATCH_INVARIANT=1``). Two of its findings do not fit a transport fault:

- 2026-11-26 (eighth session), push mode with client aborts, P and D on one GPU: one
  output of 285 (``load-034-1167``) had the reference's token 0 and different tokens
  from token 1 on, once in five repeats; a traced rerun of eight repeats gave the
  reference's tokens every time;
- the reference itself gave ``load-063-704`` different tokens in two runs of the same
  tree, release and settings.

Batch invariance makes a step's numbers independent of which other requests share the
step, not of where a long prompt is cut into chunks: under load, a prompt's first chunk
is whatever the step's token budget had left (``--max-num-batched-tokens``), so it
changes from run to run in the reference and in P alike. This experiment fixes the cut:
one vLLM engine (the load harness's settings: eager, block size 16, seed 0, no prefix
cache, batch-invariant kernels) generates each prompt alone, then beside a filler prompt
of ``budget - s`` tokens submitted first, so that the scheduler gives the prompt exactly
``s`` tokens in its first step and the rest in the next. It records the greedy tokens per
cut and groups the cuts by the tokens they gave. ``--known NAME=label:t0,t1,...`` names
token sequences seen elsewhere (the reference's, the differing PD output), so the table
says which cuts reproduce which.

If a cut reproduces the differing PD output token for token, that output is the model's
own greedy answer for a prefill cut where P's load cut it, not bytes moved wrongly: a
transport fault would not land on another cut's exact 16 tokens.

On the GPU host (~1-2 min with the tiny model)::

    CUDA_VISIBLE_DEVICES=0 python3 experiments/chunk_split.py --model /tmp/tiny \\
        --out $OUT/chunks --prompts load-034-1167,load-063-704 \\
        --known 'load-034-1167=pd-push:30958,24499,6716,...'

Writes ``OUT/chunk_split.json`` and prints one table per prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pd_common import load_prompt as harness_prompt, make_prompt_text  # noqa: E402

FILLER_SEED = 91000
NAME = re.compile(r"load-(\d{3})-(\d+)$")

# generate(prompt texts in submission order, max_tokens) -> (prompt token counts, greedy
# token ids) per prompt, in the same order
Generate = Callable[[Sequence[str], int], list[tuple[int, list[int]]]]


def load_prompt(name: str) -> str:
    """The load harness's prompt ``load-III-N`` (pd_common.load_prompts' text)."""
    m = NAME.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a load prompt name (load-III-N)")
    return harness_prompt(int(m.group(1)), int(m.group(2))).text


def cuts(num_tokens: int, budget: int, step: int) -> list[int]:
    """First-chunk sizes to try: every ``step`` tokens, and the last token alone (the cut
    a decode instance makes when it computes the prompt's last token itself). A cut needs
    a filler of at least 2 tokens (BOS + one byte) and leaves the rest for one step."""
    if step < 1:
        raise ValueError("step must be >= 1")
    wanted = set(range(step, num_tokens, step)) | {num_tokens - 1}
    return sorted(s for s in wanted
                  if 1 <= s < num_tokens and budget - s >= 2 and num_tokens - s <= budget - 1)


@dataclass
class PromptResult:
    name: str
    num_tokens: int
    alone: list[list[int]] = field(default_factory=list)  # one per repeat
    by_cut: dict[int, list[int]] = field(default_factory=dict)

    def groups(self) -> list[tuple[list[int], list[str]]]:
        """Distinct token sequences, most frequent first, each with what gave it
        ("alone#r" or the cut)."""
        seen: dict[tuple[int, ...], list[str]] = {}
        for r, toks in enumerate(self.alone):
            seen.setdefault(tuple(toks), []).append(f"alone#{r}")
        for s, toks in sorted(self.by_cut.items()):
            seen.setdefault(tuple(toks), []).append(str(s))
        return sorted(((list(k), v) for k, v in seen.items()), key=lambda kv: -len(kv[1]))


def run_prompt(generate: Generate, name: str, text: str, budget: int, step: int,
               max_tokens: int, alone_repeats: int) -> PromptResult:
    n_alone, _ = generate([text], max_tokens)[0]
    result = PromptResult(name, n_alone)
    for _ in range(alone_repeats):
        result.alone.append(generate([text], max_tokens)[0][1])
    for s in cuts(n_alone, budget, step):
        filler = make_prompt_text(budget - s, seed=FILLER_SEED + s)
        (n_filler, _), (n_prompt, toks) = generate([filler, text], max_tokens)
        if n_filler != budget - s or n_prompt != n_alone:
            raise RuntimeError(f"{name}: cut {s} wanted a {budget - s}-token filler, got "
                               f"{n_filler} (prompt {n_prompt} tokens)")
        result.by_cut[s] = toks
    return result


def parse_known(items: Sequence[str]) -> dict[str, dict[str, list[int]]]:
    """``NAME=label:t0,t1,...`` -> {NAME: {label: tokens}}."""
    out: dict[str, dict[str, list[int]]] = {}
    for item in items:
        try:
            name, rest = item.split("=", 1)
            label, toks = rest.split(":", 1)
            out.setdefault(name, {})[label] = [int(t) for t in toks.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--known {item!r}: expected NAME=label:t0,t1,...") from None
    return out


def label_of(tokens: list[int], known: dict[str, list[int]]) -> str:
    """The labels of ``known`` that ``tokens`` equal (a known sequence may be shorter:
    a prefix match counts)."""
    hits = [label for label, seq in known.items() if seq and tokens[:len(seq)] == seq]
    return ",".join(hits) or "-"


def _span(cut_labels: list[str]) -> str:
    if len(cut_labels) <= 12:
        return " ".join(cut_labels)
    return " ".join(cut_labels[:6]) + f" ... ({len(cut_labels) - 12} more) ... " + \
        " ".join(cut_labels[-6:])


def report(results: list[PromptResult], known: dict[str, dict[str, list[int]]]) -> str:
    lines = []
    for r in results:
        groups = r.groups()
        lines.append(f"{r.name} ({r.num_tokens} tokens): {len(groups)} distinct outputs "
                     f"over {len(r.alone)} runs alone and {len(r.by_cut)} cuts")
        for toks, where in groups:
            lines.append(f"  {len(where):4d}x  known={label_of(toks, known.get(r.name, {})):12s}"
                         f" tokens {','.join(map(str, toks[:6]))},...  from: {_span(where)}")
        for label, seq in known.get(r.name, {}).items():
            hit = [w for toks, where in groups if toks[:len(seq)] == seq for w in where]
            lines.append(f"  known {label}: " + (f"reproduced by {_span(hit)}" if hit
                                                else "reproduced by no run"))
    return "\n".join(lines)


def vllm_generate(args) -> Generate:
    os.environ.setdefault("VLLM_BATCH_INVARIANT", "1")
    from pd_servers import COMMON_VLLM_ENV, model_runner_env

    # the servers' settings: no flashinfer on the GPU host, the model runner they get
    for key, value in {**COMMON_VLLM_ENV, **model_runner_env()}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, enforce_eager=True, block_size=16, seed=0,
              enable_prefix_caching=False, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.budget, max_num_seqs=8,
              gpu_memory_utilization=args.gpu_memory_utilization)

    def generate(texts: Sequence[str], max_tokens: int) -> list[tuple[int, list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(list(texts), params, use_tqdm=False)
        return [(len(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]

    return generate


def main(argv: Sequence[str] | None = None, generate: Generate | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="/tmp/tiny")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="load-034-1167,load-063-704")
    ap.add_argument("--known", action="append", default=[],
                    help="NAME=label:t0,t1,... a token sequence seen elsewhere")
    ap.add_argument("--budget", type=int, default=2048,
                    help="--max-num-batched-tokens of the engine (default 2048)")
    ap.add_argument("--step", type=int, default=8, help="try a first chunk every STEP tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--alone-repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    args = ap.parse_args(argv)
    known = parse_known(args.known)
    names = [n for n in args.prompts.split(",") if n]
    texts = {n: load_prompt(n) for n in names}
    t0 = time.time()
    generate = generate or vllm_generate(args)
    results = [run_prompt(generate, n, texts[n], args.budget, args.step, args.max_tokens,
                          args.alone_repeats) for n in names]
    text = report(results, known)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_split.txt").write_text(text + "\n")
    (out / "chunk_split.json").write_text(json.dumps({
        "argv": list(argv) if argv is not None else sys.argv[1:],
        "seconds": round(time.time() - t0, 1),
        "known": known,
        "results": [{"name": r.name, "num_tokens": r.num_tokens, "alone": r.alone,
                     "by_cut": {str(k): v for k, v in r.by_cut.items()}} for r in results],
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
