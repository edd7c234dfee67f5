"""Shared fixtures for the viz tests: the shipped model and one real quiz story.

Nothing here hard-codes what the model computes: the shipped weights are replaced
as training goes on, so every test compares against a fresh forward pass.
"""

from __future__ import annotations

import os
import re
import shutil
from collections import Counter

import pytest
import torch

from storylens.core.errors import StorylensError
from storylens.data.stories import load_split
from storylens.model.hub import load_model
from storylens.model.tokenizer import encode_story
from storylens.viz.tokens import token_texts


@pytest.fixture(scope="session")
def model():
    return load_model()


@pytest.fixture(scope="session")
def quiz():
    try:
        return load_split().quiz
    except StorylensError as e:
        pytest.skip(f"TinyStories corpus not available: {e}")


def main_name(story: str, quiz: list[str]) -> str | None:
    """The lesson's crude main character: the most frequent capitalised word (at least
    two mentions) whose lowercase form appears nowhere in the quiz stories."""
    lower = set(re.findall(r"[a-z]+", " ".join(quiz)))
    words = re.findall(r"\b[A-Z][a-z]+\b", story)
    counts = Counter(w for w in words if w.lower() not in lower)
    best = [w for w, c in counts.most_common() if c >= 2]
    return best[0] if best else None


@pytest.fixture(scope="session")
def story(quiz):
    """The first quiz story that has a main character by the lesson's rule."""
    for s in quiz:
        name = main_name(s, quiz)
        if name:
            return s, name
    pytest.skip("no quiz story with a named main character")


@pytest.fixture(scope="session")
def story_run(model, story):
    """``(token ids, display tokens, attention [block, head, q, k] as float64 numpy, name positions)``."""
    text, name = story
    tok = model.tokenizer
    enc = encode_story(tok, text, window=model.config.block_size)
    with torch.no_grad():
        out = model(torch.tensor([enc.ids]), record_attention=True)
    att = torch.stack([a[0] for a in out.patterns]).double().numpy()
    tokens = token_texts(tok, enc.ids)
    names = [i for i, t in enumerate(tokens) if t.strip() == name]
    return enc.ids, tokens, att, names


# ---------------------------------------------------------------- a real headless browser

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REQUIRE = os.environ.get("STORYLENS_REQUIRE_BROWSER") == "1"


def _unavailable(reason: str):
    if REQUIRE:
        pytest.fail(f"{reason} (STORYLENS_REQUIRE_BROWSER=1)")
    pytest.skip(reason)


def _chromium_path() -> str | None:
    env = os.environ.get("STORYLENS_CHROMIUM")
    if env:
        return env if os.path.isfile(env) else None
    for name in ("chromium", "chromium-browser"):
        p = shutil.which(name)
        if p:
            return p
    return "/usr/bin/chromium" if os.path.isfile("/usr/bin/chromium") else None


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright==1.65.2; see tests/viz/BROWSER_SETUP.md)")
    exe = _chromium_path()
    if exe is None:
        _unavailable("chromium is not installed (apt-get install -y chromium; see tests/viz/BROWSER_SETUP.md)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=ARGS)
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    """A page that records script errors and refuses (and records) every network request."""
    ctx = browser.new_context(viewport={"width": 1200, "height": 900})
    pg = ctx.new_page()
    pg.errors, pg.requests = [], []
    pg.on("pageerror", lambda e: pg.errors.append(str(e)))
    pg.on("console", lambda m: pg.errors.append(m.text) if m.type == "error" else None)

    def guard(route):
        url = route.request.url
        if url.startswith(("file:", "data:", "about:")):
            route.continue_()
        else:
            pg.requests.append(url)
            route.abort()

    pg.route("**/*", guard)
    yield pg
    ctx.close()


# ---------------------------------------------------------------- a model of the shape people study


@pytest.fixture(scope="session")
def llama_30x9(model, tmp_path_factory):
    """A seeded random Llama-style transformers model of a real small model's shape (30 layers x
    9 heads, grouped key/value heads: 3; hidden 576; about 135M parameters, most in the blocks),
    saved with storylens's tokenizer: the views' sizes and legibility are tested on it."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=model.tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )
    cfg = transformers.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        vocab_size=model.tokenizer.get_vocab_size(),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.bos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    lm = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper queries and keys than the default init, so heads differ from an even spread
        for name, p in lm.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    folder = tmp_path_factory.mktemp("llama30x9")
    lm.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
