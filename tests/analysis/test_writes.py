"""Issue 59, what a head writes (storylens writes): on every family storylens reads (GPT-2, GPT-Neo, Llama with
grouped key/value heads, the native model; float64) each head's write toward the name, summed over every key,
is its output's direct logit attribution computed here from ``hook_z`` and the model's own unembedding, and the
part read from the name is the explicit sum over the name's earlier keys; the comparison ablates what it ranks,
on the shipped model, and the command writes what its schema accepts."""

import json

import torch
from cli_lines import refuses_others_folders

from storylens.cli import main
from storylens.core.schema import check_schema, schema
from storylens.data.names import name_vocabulary
from storylens.effects.writes import name_queries, write_scores
from storylens.engine.encode import encode_stories
from storylens.table.write_ablation import compare_writes, writes_document


def _final_norm(lm):
    from storylens.engine.readout import readout

    return readout(lm)


def _direct(lm, story):
    """Per name query of ``story``: ``(total [L, H], name [L, H])`` written toward the next token, from hook_z
    (every key) and from hook_pattern x hook_v over the name's earlier tokens, read out here from the model's
    unembedding and final norm (gain, centring, frozen scale) without storylens's readout helpers."""
    read = _final_norm(lm)
    got: dict = {"z": {}, "v": {}, "a": {}}

    def keep(kind):
        return lambda t, hook: got[kind].__setitem__(hook.layer, t.detach()[0])

    L = lm.n_layer
    hooks = [(f"blocks.{i}.attn.hook_z", keep("z")) for i in range(L)]
    hooks += [(f"blocks.{i}.attn.hook_v", keep("v")) for i in range(L)]
    hooks += [(f"blocks.{i}.attn.hook_pattern", keep("a")) for i in range(L)]
    x = {}
    handle = read.norm.register_forward_pre_hook(lambda m, args: x.update(x=args[0].detach()[0]))
    with lm.hooks(hooks), torch.no_grad():
        lm.forward(torch.tensor([story.ids]), record_attention=True)
    handle.remove()
    W = read.unembed.double()
    names = set(story.name_positions)
    out = []
    for t in name_queries(story):
        u = W[story.ids[t + 1]] - W.mean(0)  # the logit against the vocabulary's mean
        xt = x["x"][t]
        centre = read.kind == "layer"
        s = ((xt - xt.mean()) if centre else xt).pow(2).mean().add(read.eps).sqrt()

        def logit(o, centre=centre, s=s, u=u):
            o = o - o.mean() if centre else o
            return float((read.gain.detach().double() * o / s) @ u)

        total, name = (torch.zeros(L, lm.n_head, dtype=torch.float64) for _ in "tn")
        for layer in range(L):
            w_o = lm.head_output_weights(layer).detach()
            H, G = lm.n_head, got["v"][layer].shape[1]
            for h in range(H):
                total[layer, h] = logit(got["z"][layer][t, h] @ w_o[h])
                keys = [j for j in range(t + 1) if j in names]
                v = got["v"][layer][:, h // (H // G)]
                o = sum((got["a"][layer][h, t, j] * v[j] for j in keys), torch.zeros_like(v[0]))
                name[layer, h] = logit(o @ w_o[h])
        out.append((total, name))
    return out


def test_the_write_is_the_heads_direct_logit_attribution_and_the_name_part_its_name_keys(tiny, corpus_split):
    """float64: per story, the scores' sums over its queries equal the direct computation's (each a sum of a few
    hundred products of order one: 1e-9 leaves a margin of many thousand roundings)."""
    texts = list(corpus_split.quiz[:24])
    stories = [s for s in encode_stories(tiny, texts, name_vocabulary(texts)) if name_queries(s)][:3]
    assert stories, "no quiz story mentions its main character twice in the window"
    for story in stories:
        w = write_scores(tiny, [story])
        direct = _direct(tiny, story)
        n = len(direct)
        assert w.queries == n and w.stories == 1
        total = sum(d[0] for d in direct) / n
        name = sum(d[1] for d in direct) / n
        scale = float(total.abs().max()) + 1e-12
        assert torch.allclose(w.total, total.double(), atol=1e-9 * scale, rtol=0)
        assert torch.allclose(w.name, name.double(), atol=1e-9 * scale, rtol=0)
        assert float(w.name.abs().sum()) > 0


def test_ranking_by_what_heads_write_finds_heads_whose_removal_costs_the_name(shipped_model, corpus_split):
    """The shipped model over 60 quiz stories: each ranking's top heads are the ones ablated, the errors are real,
    and the heads that write most toward the name from the name cost the name when removed (beyond two errors);
    the document passes its schema."""
    from storylens.lm import NativeLM

    lm = NativeLM(shipped_model)
    texts = list(corpus_split.quiz[:60])
    stories = encode_stories(lm, texts, name_vocabulary(texts))
    r = compare_writes(lm, stories, ks=(1, 2))
    assert [h.label for h in r.cut("write", 2).heads] == [h.label for h in r.writes.top(2)]
    assert r.cut("mass", 1).heads[0] == max(
        ((layer, h) for layer in range(lm.n_layer) for h in range(lm.n_head)), key=lambda lh: r.name_mass[lh]
    )
    for k in (1, 2):
        c = r.cut("write", k)
        assert c.name_increase_se > 0 and c.name_increase > 2 * c.name_increase_se
    top = r.writes.top(1)[0]
    assert float(r.writes.name[top]) > 2 * float(r.writes.name_se[top])
    check_schema(writes_document(r, "shipped"), schema("writes"), "writes.json")


def test_the_command_writes_its_files_and_refuses_bad_k_before_loading(tmp_path, capsys):
    assert main(["writes", "--k", "0,2", "--out", str(tmp_path / "x"), "--model", str(tmp_path / "none")]) == 2
    assert "--k" in capsys.readouterr().err
    out = tmp_path / "w"
    assert main(["writes", "--limit", "30", "--k", "1", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "writes.json").read_text())
    check_schema(doc, schema("writes"), "writes.json")
    rows = (out / "writes.csv").read_text().splitlines()
    assert len(rows) == 1 + len(doc["heads"]) == 25
    assert (out / "writes.png").stat().st_size > 10_000 and (out / "writes.svg").exists()


def test_the_command_refuses_a_folder_another_command_wrote(tmp_path, corpus_split, capsys):
    """--out is never a score run's folder nor the model folder being read: one line, and the folder as it was."""
    refuses_others_folders(capsys, tmp_path, corpus_split.quiz, ["writes", "--limit", "2", "--no-progress"])
