"""`dspark bench` (the side-by-side matrix) and `dspark bench decode` on a tiny random Llama with a random
DSpark drafter: every cell present and consistent, greedy DSpark identical to dspark without speculation,
plots written; HF transformers is the real one, loading the same checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark.bench.prompts import CODE_PROMPTS
from dspark.cli import main
from tests.conftest import write_tiny_checkpoint
from tests.spec.drafters import random_drafter

SHAREGPT_LIKE = ["Tell me a joke about cats.", "How do planes fly?", "Write a haiku about rain.",
                 "What is 2 + 2?", "Summarize the French revolution."]


def write_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE of 320 tokens (fits the tiny model's 512) with a chat template: ids 0-3 are
    <s>, </s> (the checkpoint's EOS), <pad>, <mask> (the drafter's mask token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CODE_PROMPTS + SHAREGPT_LIKE, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>", "<mask>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_checkpoint(root / "target", "llama", num_hidden_layers=4, seed=3)
    write_tiny_tokenizer(target)
    drafter = random_drafter(root / "drafter", target, target_layer_ids=[0, 2], block_size=4)
    source = root / "prompts.json"  # the format of dspark.train.data.export_prompt_split
    source.write_text(json.dumps({"train": [], "heldout": SHAREGPT_LIKE}))
    spec = json.dumps({"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3,
                       "confidence_scheduling": False})
    common = ["--model", str(target), "--device", "cpu", "--kv-cache-memory-gb", "0.02", "--speculative-config", spec]
    return root, common, source


def test_matrix_has_every_cell_consistent_speedups_lossless_greedy_and_plots(tiny, one_thread, capsys):
    root, common, source = tiny
    out, plots = root / "matrix.json", root / "plots"
    assert main(["bench", *common, "--top-p", "0", "--json", str(out)]) == 2
    assert "--top-p must be in (0, 1], got 0.0" in capsys.readouterr().err and not out.exists()
    rc = main(["bench", *common, "--batch-sizes", "1,2", "--max-tokens", "4", "--prompt-source", str(source),
               "--top-p", "0.9", "--json", str(out), "--plot-dir", str(plots)])
    assert rc == 0
    # the drafter passed by path drafts greedily (SpeculativeConfig's default) in the T=1 cells: said so
    assert 'draft_sample_method "greedy"' in capsys.readouterr().err
    res = json.loads(out.read_text())
    assert res["complete"] and res["hf_mode"] == "eager" and res["speculative_config"]["num_spec_tokens"] == 3
    assert res["top_p"] == 0.9  # the sampled cells' nucleus, every system alike
    cells = {(c["system"], c["batch_size"], c["prompt_set"], c["temperature"]): c for c in res["cells"]}
    want = {(s, b, ps, t) for s in ("hf", "dspark_plain", "dspark_spec") for b in (1, 2)
            for ps in ("sharegpt", "code") for t in (0.0, 1.0)}
    assert set(cells) == want and len(res["cells"]) == len(want)
    for (system, b, ps, t), c in cells.items():
        assert c["tok_s_total"] > 0 and c["tok_s_per_user"] > 0
        assert c["num_prompts"] == b  # the CPU default: B prompts per cell
        assert c["tok_s_total"] == pytest.approx(b * c["tok_s_per_user"])
        assert c["ms_per_step"] > 0
        if system == "dspark_spec":
            assert c["tau"] >= 1
            assert c["drafter_ms_per_step"] > 0
        else:
            assert c["tau"] is None
        if system == "hf":
            assert c["target_ms_per_step"] is None and c["speedup_vs_hf"] is None and c["speedup_vs_plain"] is None
        else:
            assert c["target_ms_per_step"] > 0
            assert c["target_ms_per_step"] + c["drafter_ms_per_step"] + c["host_ms_per_step"] == pytest.approx(
                c["ms_per_step"])
            assert c["host_ms_per_step_runs"] == [pytest.approx(c["host_ms_per_step"])]  # one timed call here
            hf = cells[("hf", b, ps, t)]
            assert c["speedup_vs_hf"] == pytest.approx(c["tok_s_total"] / hf["tok_s_total"])
        assert len(c["warmup_wall_s"]) == 1 and c["warmup_wall_s"][0] > 0  # --warmup's default: one untimed call
        if system == "dspark_spec":
            plain = cells[("dspark_plain", b, ps, t)]
            assert c["speedup_vs_plain"] == pytest.approx(c["tok_s_total"] / plain["tok_s_total"])
            if t == 0:  # lossless: greedy DSpark generates exactly what dspark does without speculation
                assert c["tokens_sha256"] == plain["tokens_sha256"]
    assert len(res["greedy_checks"]) == 4 and all(g["spec_identical_to_plain"] for g in res["greedy_checks"])
    assert res["prompt_sets"]["sharegpt"]["num_prompts"] == 2 and res["prompt_sets"]["code"]["num_prompts"] == 2
    pngs = sorted(p.name for p in plots.iterdir())
    assert pngs == ["tok_s_code_T0.png", "tok_s_code_T1.png", "tok_s_sharegpt_T0.png", "tok_s_sharegpt_T1.png"]
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_cells_run_several_prompts_at_concurrency_b(tiny, one_thread):
    """--cell-prompts 3: a batch-1 cell runs 3 prompts one at a time, a batch-2 cell 4 prompts (cycled
    through the 5-prompt set) two at a time: dspark through continuous batching (or in waves with
    --static-batches), HF in waves; rates count every prompt's tokens; greedy DSpark equals plain."""
    from dspark.bench.matrix import waves_of

    assert waves_of([[1], [2], [3]], 2, 3) == [[[1], [2]], [[3], [1]]]
    root, common, source = tiny
    for static in (False, True):
        out = root / f"cells{static}.json"
        assert main(["bench", *common, "--batch-sizes", "1,2", "--max-tokens", "3", "--temperatures", "0",
                     "--prompt-sets", "sharegpt", "--cell-prompts", "3", "--prompt-source", str(source),
                     "--json", str(out), *(["--static-batches"] if static else [])]) == 0
        res = json.loads(out.read_text())
        assert res["cell_prompts"] == {"1": 3, "2": 4} and res["prompt_sets"]["sharegpt"]["num_prompts"] == 4
        assert res["dspark_batching"] == ("waves" if static else "continuous")
        for c in res["cells"]:
            n = 3 if c["batch_size"] == 1 else 4
            assert c["num_prompts"] == n
            assert c["batching"] == ("waves" if static or c["system"] == "hf" else "continuous")
            assert c["tok_s_total"] == pytest.approx(n * 3 / c["wall_s"])
            assert c["tok_s_total"] == pytest.approx(c["batch_size"] * c["tok_s_per_user"])
            if c["system"] == "dspark_plain" and c["batch_size"] == 1:
                assert c["steps_per_run"] >= 9  # one request at a time: 3 prompts x 3 tokens, one per step
        assert all(g["spec_identical_to_plain"] and g["hf_identical_to_plain"] is not None
                   for g in res["greedy_checks"])


def test_stop_at_eos_counts_the_tokens_generated(tiny, one_thread):
    """--stop-at-eos: requests end at their EOS; tok/s counts what was generated. The checkpoint is copied
    with half the vocabulary as EOS ids so the random model stops early, on both sides (dspark reads
    config.json, HF its generation config)."""
    import shutil

    root, common, source = tiny
    target = root / "target_eos"
    if not target.exists():
        shutil.copytree(common[1], target)
        for name in ("config.json", "generation_config.json"):
            f = target / name
            if f.exists():
                cfg = json.loads(f.read_text())
                cfg["eos_token_id"] = list(range(1, 257))
                f.write_text(json.dumps(cfg))
    out = root / "eos.json"
    args = ["bench", "--model", str(target), *common[2:], "--batch-sizes", "1,2", "--max-tokens", "8",
            "--temperatures", "0", "--prompt-sets", "sharegpt", "--cell-prompts", "2", "--prompt-source", str(source)]
    assert main([*args, "--stop-at-eos", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["stop_at_eos"] is True
    short = False
    for c in res["cells"]:
        assert 1 <= c["new_tokens"] <= c["num_prompts"] * 8
        assert c["tok_s_total"] == pytest.approx(c["new_tokens"] / c["wall_s"])
        short |= c["new_tokens"] < c["num_prompts"] * 8
    assert short  # some request met an EOS
    by = {(c["system"], c["batch_size"]): c["new_tokens"] for c in res["cells"]}
    for b in (1, 2):  # greedy: the same tokens, hence as many, on every side (HF included at fp32)
        assert by[("dspark_plain", b)] == by[("dspark_spec", b)] == by[("hf", b)]
    assert all(g["spec_identical_to_plain"] and g["hf_identical_to_plain"] for g in res["greedy_checks"])


def test_cli_bench_and_bench_decode(tiny, one_thread):
    root, common, _ = tiny
    out = root / "cli.json"
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "bench", *common, "--batch-sizes", "2",
                        "--temperatures", "0", "--prompt-sets", "code", "--max-tokens", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert "dspark + DSpark" in r.stdout and "HF eager" in r.stdout and "tau" in r.stdout
    res = json.loads(out.read_text())
    assert {c["system"] for c in res["cells"]} == {"hf", "dspark_plain", "dspark_spec"}
    assert res["greedy_checks"][0]["spec_identical_to_plain"] is True

    # the batch-1 greedy bench (docs/benchmarks.md's plain-decode figure): --no-spec runs dspark without the drafter
    dout = root / "decode.json"
    assert main(["bench", "decode", "--model", common[1], "--device", "cpu", "--max-tokens", "3", "--runs", "1",
                 "--no-spec", "--json", str(dout)]) == 0
    d = json.loads(dout.read_text())
    assert d["speculative_config"] is None and d["dspark_tok_s"] > 0 and d["hf_eager_tok_s"] > 0


def test_code_prompts_are_32_distinct_requests():
    assert len(CODE_PROMPTS) == 32 and len(set(CODE_PROMPTS)) == 32


def test_second_spec_configuration_side_by_side(tiny, one_thread, capsys):
    """--speculative-config-b: a second DSpark system in the same process, its keys over the first's;
    its cells get τ, speedup over the same plain cells and the greedy losslessness check."""
    root, common, source = tiny
    out = root / "spec_b.json"
    assert main(["bench", *common, "--no-hf", "--batch-sizes", "2", "--max-tokens", "4", "--temperatures", "0,1",
                 "--prompt-sets", "sharegpt", "--prompt-source", str(source), "--json", str(out),
                 "--speculative-config-b", '{"num_speculative_tokens": 2, "draft_sample_method": "probabilistic",'
                 ' "rejection_sample_method": "block"}']) == 0
    res = json.loads(out.read_text())
    assert res["speculative_config"]["num_spec_tokens"] == 3
    b = res["speculative_config_b"]
    assert b["num_spec_tokens"] == 2 and b["rejection_sample_method"] == "block" and b["model"] == res[
        "speculative_config"]["model"]  # the drafter comes from the first configuration
    cells = {(c["system"], c["temperature"]): c for c in res["cells"]}
    assert set(cells) == {(s, t) for s in ("dspark_plain", "dspark_spec", "dspark_spec_b") for t in (0.0, 1.0)}
    for t in (0.0, 1.0):
        c, plain = cells[("dspark_spec_b", t)], cells[("dspark_plain", t)]
        assert c["tau"] >= 1 and c["speedup_vs_plain"] == pytest.approx(c["tok_s_total"] / plain["tok_s_total"])
    assert cells[("dspark_spec_b", 0.0)]["tokens_sha256"] == cells[("dspark_plain", 0.0)]["tokens_sha256"]
    assert res["greedy_checks"][0]["spec_b_identical_to_plain"] is True
    assert "dspark + DSpark (b)" in capsys.readouterr().out

    # a bad second configuration is named before any engine loads
    assert main(["bench", *common, "--no-hf", "--speculative-config-b", "[1]", "--prompt-source", str(source)]) != 0
    assert "--speculative-config-b must be a JSON object" in capsys.readouterr().err


def test_greedy_share_makes_mixed_cells(tiny, one_thread, capsys):
    """--greedy-share: in the sampled cells a share of the requests decodes greedily (a mixed batch); their
    tokens are checked against plain decoding's like a greedy cell's (lossless), in continuous batching and
    in static waves; HF cannot mix and must be left out; the share must be in [0, 1)."""
    from dspark.bench.matrix import greedy_slots

    assert greedy_slots(4, 0.5) == [False, True, False, True] and not any(greedy_slots(3, 0.0))
    assert sum(greedy_slots(8, 0.25)) == 2
    root, common, source = tiny
    for extra in ([], ["--static-batches"]):
        out = root / f"mixed{len(extra)}.json"
        assert main(["bench", *common, "--no-hf", "--batch-sizes", "2", "--max-tokens", "4", "--temperatures", "1",
                     "--prompt-sets", "sharegpt", "--prompt-source", str(source), "--greedy-share", "0.5",
                     "--cell-prompts", "4", "--json", str(out), *extra]) == 0
        res = json.loads(out.read_text())
        assert res["greedy_share"] == 0.5
        cells = {c["system"]: c for c in res["cells"]}
        assert cells["dspark_spec"]["greedy_tokens_sha256"] == cells["dspark_plain"]["greedy_tokens_sha256"]
        assert cells["dspark_spec"]["tokens_sha256"] != cells["dspark_plain"]["tokens_sha256"]  # the sampled ones differ
        (check,) = res["greedy_checks"]
        assert check["greedy_requests_only"] and check["temperature"] == 1.0 and check["spec_identical_to_plain"] is True
    for bad, msg in ((["--no-hf", "--greedy-share", "1"], "--greedy-share must be in"),
                     (["--greedy-share", "0.5"], "--greedy-share needs --no-hf")):
        assert main(["bench", *common, "--prompt-source", str(source), *bad]) != 0
        assert msg in capsys.readouterr().err


def test_greedy_difference_note_says_what_a_difference_means_per_dtype():
    """A greedy spec-vs-plain difference: a bug in fp32, expected near-tie flips in half precision (with the
    switches that make outputs equal)."""
    from dspark.bench.matrix import greedy_difference_note

    assert "points at a bug" in greedy_difference_note("torch.float32")
    half = greedy_difference_note("torch.bfloat16")
    assert "near-tie" in half and "--batch-invariant" in half and "--invariant-attention" in half
    assert "bug" not in half
