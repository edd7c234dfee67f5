"""Issue 59, query-key attribution (storylens why): on every family storylens reads (GPT-2, GPT-Neo with a local
block, Llama with grouped key/value heads and rotary positions, the native model; float64) the terms rebuild the
model's own attention within the bound rounding allows and add up to the contrast; a head whose key is made by one
earlier head alone puts the whole contrast on that pair; and the command writes what its schema accepts."""

import json

import pytest
import torch
from cli_lines import refuses_others_folders

from storylens.cli import main
from storylens.core.heads import Head
from storylens.core.schema import check_schema, schema
from storylens.data.names import name_vocabulary
from storylens.engine.encode import encode_stories
from storylens.lm import NativeLM
from storylens.looking.why import explain
from storylens.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("positions", ["prev", "first", "induction"])
def test_the_terms_rebuild_the_models_attention(tiny, corpus_split, positions):
    """Every story's rebuilt attention is the model's within the derived bound (checked inside every run: a
    wrong decomposition is refused), and the terms' means add up to the contrast's (float64 sums of a few hundred
    terms: 1e-9 of their sizes is a margin of thousands)."""
    stories = encode_stories(tiny, list(corpus_split.quiz[:3]), name_vocabulary(corpus_split.quiz[:3]))
    last = tiny.n_layer - 1
    for head in (Head(0, 1), Head(last, tiny.n_head - 1)):
        r = explain(tiny, head, stories, positions)
        assert r.gap <= r.bound and r.stories >= 1
        assert abs(float(r.mean.sum()) - r.total) <= 1e-9 * float(r.mean.abs().sum())
        assert r.writers[-1] == "bias" and len(r.writers) == r.mean.shape[0]
        if head.layer:
            assert f"L{head.layer}MLP" in r.writers and "L1H1" in r.writers


def test_a_key_made_by_one_head_puts_the_whole_contrast_on_that_pair(shipped_model, corpus_split):
    """A two-block native model in float64: block 2's head 1 has a constant query (its projection's bias alone)
    and keys read from 8 dimensions that only block 1's head 1 writes (the embeddings, the other heads and the
    MLPs write nothing there, and the key weights over them sum to 0 so the LayerNorm's centring brings nothing
    in): every term but (bias, L1H1) is 0, so the whole contrast sits on it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=64, n_layer=2, n_head=4, n_embd=32)).double().eval()
    with torch.no_grad():
        model.transformer.wte.weight[:, :8] = 0
        model.transformer.wpe.weight[:, :8] = 0
        first = model.transformer.h[0]
        first.attn.c_proj.weight.zero_()
        first.attn.c_proj.bias.zero_()
        first.attn.c_proj.weight[:8, :8] = torch.randn(8, 8, dtype=torch.float64)  # head 1 writes dims 0..7
        first.mlp.c_proj.weight.zero_()
        first.mlp.c_proj.bias.zero_()
        second = model.transformer.h[1]
        second.ln_1.bias.zero_()
        second.attn.query.weight.zero_()
        second.attn.query.bias.normal_()
        key = torch.randn(8, 8, dtype=torch.float64)
        key -= key.mean(0, keepdim=True)  # rows over dims 0..7 summing to 0
        second.attn.key.weight.zero_()
        second.attn.key.weight[:8, :8] = key.T  # head 1's key reads dims 0..7
        second.attn.key.bias.zero_()
    lm = NativeLM(model, shipped_model.tokenizer)
    stories = encode_stories(lm, list(corpus_split.quiz[:4]), frozenset())
    r = explain(lm, Head(1, 0), stories, "prev")
    at = (r.writers.index("bias"), r.writers.index("L1H1"))
    assert abs(float(r.mean[at]) - r.total) <= 1e-9 * abs(r.total) and abs(r.total) > 1e-3
    rest = r.mean.clone()
    rest[at] = 0
    assert float(rest.abs().max()) <= 1e-9 * abs(r.total)


def test_why_writes_its_files(tmp_path, capsys):
    """storylens why on the shipped model's name head: why.json as its schema says, why.csv one row per term
    (largest first), why.html naming the top term as a sentence; a head the model lacks is one line."""
    out = tmp_path / "why"
    assert main(["why", "--head", "L4H2", "--limit", "4", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "why.json").read_text())
    check_schema(doc, schema("why"), "why.json")
    W = len(doc["writers"])
    rows = (out / "why.csv").read_text().splitlines()
    assert len(rows) == 1 + W * W
    sizes = [abs(float(r.split(",")[2])) for r in rows[1:]]
    assert sizes == sorted(sizes, reverse=True)
    page = (out / "why.html").read_text()
    top = doc["top"][0]
    assert f"because {top['query']} on the query meets {top['key']} on the key" in page
    assert "http" not in page.split("<body>")[1].split("slw-data")[0]
    capsys.readouterr()
    assert main(["why", "--head", "L9H1", "--limit", "2", "--out", str(tmp_path / "bad"), "--no-progress"]) == 1
    assert capsys.readouterr().err.strip() == "storylens: error: why: L9H1: the model has 6 blocks of 4 heads"


def test_why_refuses_a_folder_another_command_wrote(tmp_path, corpus_split, capsys):
    """--out is never a score run's folder nor the model folder being read: one line, and the folder as it was."""
    refuses_others_folders(
        capsys, tmp_path, corpus_split.quiz, ["why", "--head", "L4H2", "--limit", "2", "--no-progress"]
    )


def test_a_many_head_table_keeps_the_largest_writers_and_sums_the_rest():
    """Past SHOWN_WRITERS writers (a 30 x 9 model has about 300) why.html's table keeps the largest and one
    "other writers" row and column whose cells are the rest's exact sums (no error claimed there)."""
    from storylens.viz.why import SHOWN_WRITERS, shown_terms

    n = 40
    torch.manual_seed(0)
    mean = torch.randn(n, n, dtype=torch.float64)
    mean[3, :] *= 50  # writer 3 the largest by far
    doc = {"writers": [f"w{i}" for i in range(n)], "mean": mean.tolist(), "se": (mean.abs() / 10).tolist()}
    writers, means, ses = shown_terms(doc)
    assert len(writers) == SHOWN_WRITERS and "w3" in writers and writers[-1] == f"{n - SHOWN_WRITERS + 1} other writers"
    assert abs(sum(map(sum, means)) - float(mean.sum())) <= 1e-9 * float(mean.abs().sum())
    assert ses[-1][-1] is None and ses[0][0] is not None


def test_custom_pairs_that_are_the_previous_tokens_explain_as_prev_does(shipped_model, corpus_split, tmp_path, capsys):
    """--positions custom with a file naming each story's (q, q - 1) pairs gives the figures --positions prev
    gives (the same pairs, the same sums in the same order: equal); the file's mistakes are one line, exit 2,
    before the model loads."""
    from storylens.looking.why import read_pairs_at

    lm = NativeLM(shipped_model)
    stories = encode_stories(lm, corpus_split.quiz[:3], name_vocabulary(corpus_split.quiz))
    at = tmp_path / "at.jsonl"
    at.write_text("".join(json.dumps({"story": i + 1, "query": q, "key": q - 1}) + "\n"
                          for i, s in enumerate(stories) for q in range(1, len(s.ids))))  # fmt: skip
    prev = explain(lm, Head(4, 0), stories, "prev")
    custom = explain(lm, Head(4, 0), stories, "custom", at=read_pairs_at(at))
    assert torch.equal(prev.mean, custom.mean) and prev.pairs == custom.pairs and custom.positions == "custom"
    out = str(tmp_path / "w")
    cases = [
        (["--positions", "custom"], "--at FILE and --positions custom go together"),
        (["--at", str(at)], "--at FILE and --positions custom go together"),
        (["--positions", "custom", "--at", str(tmp_path / "none.jsonl")], "cannot be read as text"),
    ]
    bad = tmp_path / "bad.jsonl"
    for line, said in [('{"story": 1, "query": 3, "key": 4}', "0 <= key <= query"),
                       ('{"story": 1, "query": 2}', 'not a {"story": N, "query": Q, "key": K} object'),
                       ('{"story": 1.5, "query": 2, "key": 1}', "whole numbers")]:  # fmt: skip
        bad.write_text(line + "\n")
        capsys.readouterr()
        assert main(["why", "--head", "L5H1", "--positions", "custom", "--at", str(bad), "--out", out]) == 2
        assert said in capsys.readouterr().err and not (tmp_path / "w").exists()
    for extra, said in cases:
        capsys.readouterr()
        assert main(["why", "--head", "L5H1", *extra, "--out", out]) == 2, extra
        assert said in capsys.readouterr().err
    far = tmp_path / "far.jsonl"
    far.write_text('{"story": 9, "query": 2, "key": 1}\n')
    assert main(["why", "--head", "L5H1", "--positions", "custom", "--at", str(far), "--limit", "3", "--out", out]) == 2
    assert "story 9 asked; 3 quiz stories are read" in capsys.readouterr().err
    assert main(["why", "--head", "L5H1", "--positions", "custom", "--at", str(at), "--limit", "3", "--out", out,
                 "--no-progress"]) == 0  # fmt: skip
    doc = json.loads((tmp_path / "w" / "why.json").read_text())
    check_schema(doc, schema("why"), "why.json")
    assert doc["positions"] == "custom" and doc["pairs"] == prev.pairs


def test_a_term_within_two_errors_is_not_given_as_a_reason():
    """why.html's and the command's sentences claim a term as a reason only beyond two standard errors."""
    from storylens.viz.why import sentence

    doc = {"head": "L4H2", "positions": "name", "total": 2.0, "total_se": 0.1}
    strong = {"query": "L2H1", "key": "tok", "mean": 1.0, "se": 0.1, "share": 0.5}
    assert "finds the name keys because L2H1 on the query meets tok on the key" in sentence(doc, strong)
    for weak in ({**strong, "mean": 0.15}, {**strong, "se": None}):
        said = sentence(doc, weak)
        assert "because" not in said and "not told apart from 0" in said
