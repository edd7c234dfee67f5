"""The test tiers: what ``pytest -m "not slow"`` leaves out and why, and which files pytest-xdist
runs on one worker. tests/conftest.py marks the tests from these; the docs' "Tests" section (docs/development.md) lists
SLOW (tests/test_newcomer.py checks it)."""

# ``pytest -m "not slow"``: the inner loop. These are marked slow, each for the reason given (the
# docs' "Tests" section, docs/development.md, lists them; tests/test_newcomer.py checks it names every one).
SLOW = {  # the order the workers take them in: the longest first, as far as I could tell (no per-file timing is kept)
    "tests/faults/": "kills real storylens processes (report, export-hf, train) at every publish step",
    "tests/test_wheel.py": "builds the wheel and installs it, torch included, in a fresh virtual environment",
    "tests/viz/test_report_scale_browser.py": "a report on a 30 x 9-head Llama (135 M parameters) in Chromium",
    "tests/test_lm.py": "three transformers families, float64 references, reports in subprocesses",
    "tests/test_train.py": "trains real runs in subprocesses, kills and resumes them",
    "tests/test_any_model_notebook.py": "executes the practitioner's notebook, every cell, on a Llama it saves (~1 min)",
    "tests/test_notebook.py": "executes the lesson notebook, every cell, in a Jupyter kernel",
    "tests/test_timeline.py": "trains real runs with their head timeline in subprocesses",
    "tests/viz/test_explorer_browser.py": "a real headless Chromium, and a 30 x 9-head Llama (135 M parameters)",
    "tests/viz/test_pages_browser.py": "a real headless Chromium over a full report",
    "tests/test_long_stories.py": "a report and scores on stories longer than the window",
    "tests/analysis/test_crosscheck.py": "boots TransformerLens on the export and runs the whole quiz through it",
    "tests/test_ray_robust.py": "starts real local Rays, kills actors, holds a dead address",
    "tests/test_ray.py": "starts a real local Ray and its actors",
    "tests/test_report.py": "storylens report end to end over the whole quiz (a 40 s report), every file and section of it",
    "tests/test_score.py": "storylens score over every corpus format, and a killed run resumed, each over the quiz",
    "tests/test_tooling.py": "mypy and ruff over the whole package",
    "tests/viz/test_viz_browser.py": "a real headless Chromium",
    "tests/test_syncs.py": "scores the quiz's first 48 stories four times over, counting every synchronising call",
    "tests/analysis/test_why.py": "four model families' attention rebuilt from its terms, story by story, in float64",
    "tests/analysis/test_writes.py": "four families' writes in float64, and the shipped model ablated by both rankings",
    "tests/analysis/test_weights.py": "five model families' weights, every pair's composition formed in float64",
}


# With pytest-xdist (``-n 2 --dist loadgroup``, the README's command): a file's tests run on one worker,
# so its module fixtures are built once, and the files that start Ray run on the same worker, one after
# the other (two local Rays at once on two cores would only wait on each other).
ONE_WORKER = {
    "tests/test_ray.py": "ray",
    "tests/test_ray_robust.py": "ray",
    "tests/test_checkpoint_bounds.py": "checkpoints",
}  # its killed --causal run built once, not per worker
