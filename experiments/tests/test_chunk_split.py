"""chunk_split cuts a prompt's prefill where it says and reports which cuts give which
tokens, against a fake engine whose greedy tokens depend on the first chunk."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest

EXP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, EXP)

import chunk_split

BUDGET = 256


def fake_engine(flip_cuts=range(100, 120), filler_off_by=0):
    """A one-token-per-byte (+BOS) engine with a BUDGET-token step: a prompt submitted
    after a filler of f tokens gets BUDGET - f tokens in its first step. Its tokens are
    the same for every cut except those in ``flip_cuts`` (a near-tie), where token 0
    stays and the rest change, as the differing PD output did."""
    calls = []

    def tokens(text, first_chunk):
        base = [int.from_bytes(hashlib.sha256(f"{text}:{i}".encode()).digest()[:2], "little")
                for i in range(4)]
        if first_chunk in flip_cuts:
            base[1:] = [t + 1 for t in base[1:]]
        return base

    def generate(texts, max_tokens):
        calls.append(list(texts))
        counts = [len(t) + 1 for t in texts]
        if len(texts) == 1:
            return [(counts[0], tokens(texts[0], None))]
        filler, prompt = counts
        filler += filler_off_by
        return [(filler, []), (prompt, tokens(texts[1], BUDGET - filler))]

    return generate, calls, tokens


def test_cuts_cover_every_step_and_the_last_token_alone():
    assert chunk_split.cuts(50, BUDGET, 16) == [16, 32, 48, 49]
    # a cut must leave room for a 2-token filler and the rest must fit one step
    assert chunk_split.cuts(300, BUDGET, 100) == [100, 200]
    assert max(chunk_split.cuts(1000, 1024, 1)) == 999
    # the second chunk (300 - s) must fit the next step beside the filler's token: s >= 45
    assert chunk_split.cuts(300, BUDGET, 1)[:2] == [45, 46]
    assert max(chunk_split.cuts(300, BUDGET, 1)) == BUDGET - 2
    with pytest.raises(ValueError):
        chunk_split.cuts(50, BUDGET, 0)


def test_the_load_prompts_are_the_harness_prompts():
    from pd_common import load_prompts

    prompts = load_prompts(64, 12, 3800)
    name = prompts[34].name
    assert chunk_split.load_prompt(name) == prompts[34].text
    with pytest.raises(ValueError):
        chunk_split.load_prompt("seq-34")


def test_a_sequence_seen_elsewhere_is_traced_to_the_cuts_that_give_it(tmp_path):
    generate, calls, tokens = fake_engine()
    text = chunk_split.load_prompt("load-001-180")
    normal, flipped = tokens(text, None), tokens(text, 104)
    assert normal[0] == flipped[0] and normal[1:] != flipped[1:]
    argv = ["--out", str(tmp_path), "--prompts", "load-001-180", "--budget", str(BUDGET),
            "--step", "4", "--alone-repeats", "2",
            "--known", "load-001-180=reference:" + ",".join(map(str, normal)),
            "--known", "load-001-180=pd:" + ",".join(map(str, flipped[:3])),
            "--known", "load-001-180=never:1,2,3"]
    assert chunk_split.main(argv, generate=generate) == 0
    report = (tmp_path / "chunk_split.txt").read_text()
    assert "2 distinct outputs" in report
    assert "known pd: reproduced by 100 104 108 112 116" in report
    assert "known never: reproduced by no run" in report
    saved = json.loads((tmp_path / "chunk_split.json").read_text())["results"][0]
    assert saved["num_tokens"] == 180 and len(saved["alone"]) == 2
    assert saved["by_cut"]["104"] == flipped and saved["by_cut"]["96"] == normal
    # every cut went in as [filler, prompt], the filler sized so the prompt got the cut
    cut_calls = [c for c in calls if len(c) == 2]
    assert len(cut_calls) == len(chunk_split.cuts(180, BUDGET, 4))
    assert {BUDGET - (len(f) + 1) for f, _ in cut_calls} == set(chunk_split.cuts(180, BUDGET, 4))


def test_a_filler_that_does_not_tokenize_to_its_size_stops_the_run(tmp_path):
    generate, _, _ = fake_engine(filler_off_by=1)
    with pytest.raises(RuntimeError, match="filler"):
        chunk_split.main(["--out", str(tmp_path), "--prompts", "load-001-180",
                          "--budget", str(BUDGET)], generate=generate)


def test_a_malformed_known_sequence_is_refused():
    with pytest.raises(SystemExit, match="NAME=label"):
        chunk_split.parse_known(["load-001-180:1,2"])
