"""explore.html without a browser: ``storylens score`` writes it (with and without examples), what it
embeds decodes to exactly heads.json and examples.json, story text cannot break out of its script, and
bad input is refused."""

from __future__ import annotations

import json
import re

import pytest

from storylens.cli import main
from storylens.data.stories import EOT
from storylens.looking.example_store import PER_STORY
from storylens.viz.explorer import WEIGHT_SCALE, explorer_html, write_explorer_for

KEPT = ("story", "query", "value", "key", "key_weight", "tokens", "query_at", "weights")  # as examples.json has them
DATA = re.compile(r'<script type="application/json" id="sle-[0-9a-f]+-data">(.*?)</script>', re.S)


def embedded(page: str) -> dict:
    found = DATA.findall(page)
    assert len(found) == 1  # the data, embedded once
    return json.loads(found[0])


def decoded(data: dict, at: int, detector: str) -> list[dict]:
    """One head's examples for one detector as examples.json writes them (but key_tokens: its key only,
    and the key's window only where the key lies before the query's window)."""
    ex = data["examples"]
    head = ex["heads"][at]
    out = []
    for site, value in head["top"][detector]:
        story, query, query_at, key, key_weight, key_token, tokens, weights, key_window = head["sites"][site]
        near_key = None
        if key_window is not None:
            key_at, key_tokens, key_weights = key_window
            near_key = {
                "key_at": key_at,
                "key_tokens": [ex["tokens"][t] for t in key_tokens],
                "key_weights": [w / WEIGHT_SCALE for w in key_weights],
            }
        out.append(
            {
                "story": story,
                "query": query,
                "value": value,
                "key": key,
                "key_weight": key_weight,
                "key_token": ex["tokens"][key_token],
                "tokens": [ex["tokens"][t] for t in tokens],
                "query_at": query_at,
                "weights": [w / WEIGHT_SCALE for w in weights],
                "near_key": near_key,
            }
        )
    return out


def _near_key(x: dict) -> dict | None:
    """What the page keeps of an example's key window: all of it where the key lies before the query's window."""
    if x["key"] >= x["query"] - x["query_at"]:
        return None
    return {k: x[k] for k in ("key_at", "key_tokens", "key_weights")}


@pytest.fixture(scope="module")
def stories_file(quiz, tmp_path_factory):
    path = tmp_path_factory.mktemp("explorer") / "stories.txt"
    path.write_text("".join(f"{s}\n{EOT}\n" for s in quiz[:6]), encoding="utf-8")
    return path


def test_score_writes_explore_html_with_the_runs_examples(stories_file, tmp_path):
    out = tmp_path / "run"
    assert main(["score", "--stories", str(stories_file), "--out", str(out), "--no-progress"]) == 0
    page = (out / "explore.html").read_text(encoding="utf-8")
    assert "default-src 'none'" in page and "connect-src 'none'" in page  # the widget's no-network policy
    assert "explore.html" in json.loads((out / ".storylens.json").read_text())["files"]
    heads = json.loads((out / "heads.json").read_text())["heads"]
    examples = json.loads((out / "examples.json").read_text())
    data = embedded(page)
    assert data["columns"] == list(heads[0]) and data["rows"] == [list(h.values()) for h in heads]
    assert data["shape"] == [6, 4] and data["meta"]["examples"] == "8 per head and detector"
    assert data["examples"]["detectors"] == examples["detectors"] and data["examples"]["k"] == 8
    assert examples["per_story"] == data["examples"]["perStory"] == PER_STORY
    outside = 0
    for at, head in enumerate(examples["heads"]):
        for detector, kept in head["examples"].items():
            want = [
                {**{k: x[k] for k in KEPT}, "key_token": x["key_tokens"][x["key_at"]], "near_key": _near_key(x)}
                for x in kept
            ]
            assert decoded(data, at, detector) == want, (head["label"], detector)
            # spread: at most PER_STORY of one story, so 6 stories fill all 8
            stories = [x["story"] for x in kept]
            assert len(kept) == 8 and max(stories.count(s) for s in stories) <= PER_STORY
            for x in kept:  # the most-attended key is always shown, with its weight
                shown = x["weights"] if _near_key(x) is None else x["key_weights"]
                at_key = x["key"] - (x["query"] - x["query_at"]) if _near_key(x) is None else x["key_at"]
                assert shown[at_key] == round(x["key_weight"], 4)
                outside += _near_key(x) is not None
    assert outside > 0  # keys before the query's window happen on the real model
    # each (story, query) a head keeps once, whatever the number of its detectors that keep it
    sites = [tuple(s[:2]) for h in data["examples"]["heads"] for s in h["sites"]]
    per_head = [[tuple(s[:2]) for s in h["sites"]] for h in data["examples"]["heads"]]
    assert all(len(set(p)) == len(p) for p in per_head) and len(sites) < 24 * 7 * 8


def test_without_examples_the_page_has_the_table_only(stories_file, tmp_path):
    out = tmp_path / "bare"
    assert main(["score", "--stories", str(stories_file), "--out", str(out), "--no-progress", "--examples", "0"]) == 0
    assert not (out / "examples.json").exists()
    data = embedded((out / "explore.html").read_text(encoding="utf-8"))
    assert data["examples"] is None and len(data["rows"]) == 24
    assert data["meta"]["examples"] == "not kept (--examples 0)"
    # the call storylens report makes: the same page from the same folder
    again = write_explorer_for(out, title=data["title"], meta=data["meta"])
    assert embedded(again.read_text(encoding="utf-8")) == data


def _one_head(token: str) -> tuple[list[dict], dict]:
    heads = [{"label": "L1H1", "block": 1, "head": 1, "prev_token": float("nan"), "dormant": False}]
    example = {
        "story": 0,
        "query": 1,
        "value": 0.5,
        "key": 0,
        "key_weight": 0.5,
        "tokens": ["<eot>", token],
        "query_at": 1,
        "key_tokens": ["<eot>", token],
        "key_at": 0,
        "weights": [0.5, 0.5],
    }
    examples = {
        "k": 1,
        "detectors": ["prev_token"],
        "heads": [{"label": "L1H1", "examples": {"prev_token": [example]}}],
    }
    return heads, examples


def test_story_text_stays_data():
    evil = "</script><script>alert(1)</script><!--"
    heads, examples = _one_head(evil)
    page = explorer_html(heads, examples, title="</title><b>x", meta={"source": "<i>s</i>"})
    assert evil not in page and "</title><b>" not in page and "<i>s</i>" not in page
    data = embedded(page)
    assert evil in data["examples"]["tokens"] and data["meta"] == {"source": "<i>s</i>"}
    assert data["rows"][0][3] is None  # NaN: n/a, never invalid JSON


def test_bad_input_is_refused():
    heads, examples = _one_head("x")
    with pytest.raises(ValueError, match="no heads"):
        explorer_html([], None, title="t", meta={})
    with pytest.raises(ValueError, match="needs label, block, head"):
        explorer_html([{"label": "L1H1", "prev_token": 0.1}], None, title="t", meta={})
    with pytest.raises(ValueError, match="once each"):
        explorer_html(heads + heads, None, title="t", meta={})
    del examples["heads"][0]["examples"]["prev_token"][0]["weights"]
    with pytest.raises(ValueError, match=r"not what examples.json holds \(KeyError: 'weights'\)"):
        explorer_html(heads, examples, title="t", meta={})
