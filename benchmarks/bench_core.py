"""Core benchmarks, measured side by side in one run on this machine.

    python benchmarks/bench_core.py [--repeats 3]

1. forward over the 200 quiz stories: explicit path (record_attention=True) vs fused kernel;
2. generating 200 tokens: KV cache vs recomputing everything each step;
3. training tokens/s: fp32 vs bf16 autocast (same model, same batches).
Each pair is timed in alternation, best of --repeats, so machine noise hits both sides.
"""

import argparse
import time

import torch

from storylens.data import load_split
from storylens.hub import load_model
from storylens.model import GPT
from storylens.tokenizer import encode_story


def best_of(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=3)
    args = ap.parse_args()
    model = load_model()
    tok = model.tokenizer
    quiz = [torch.tensor([encode_story(tok, s).ids]) for s in load_split().quiz]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    @torch.no_grad()
    def forward(record):
        for idx in quiz:
            model(idx, record_attention=record)

    rows = []
    fused = best_of(lambda: forward(False), args.repeats)
    explicit = best_of(lambda: forward(True), args.repeats)
    rows.append(("quiz forward (200 stories)", "fused", fused, "explicit", explicit))

    prompt = torch.tensor([[0]])

    def gen(cache):
        for _ in model.generate_stream(prompt, 200, temperature=1.0, generator=torch.Generator().manual_seed(0),
                                       use_kv_cache=cache):
            pass

    cached = best_of(lambda: gen(True), args.repeats)
    full = best_of(lambda: gen(False), args.repeats)
    rows.append(("generate 200 tokens", "kv cache", cached, "recompute", full))

    train_model = GPT(model.config)
    train_model.load_state_dict(model.state_dict())
    train_model.train()
    opt = torch.optim.AdamW(train_model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (16, 256), generator=g)

    def train_steps(bf16):
        for _ in range(args.train_steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = train_model(x, x).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

    tokens = args.train_steps * x.numel()
    fp32 = best_of(lambda: train_steps(False), 1 if args.repeats < 2 else 2)
    bf16 = best_of(lambda: train_steps(True), 1)
    print()
    print(f"{'what':28} {'A':>10} {'seconds':>9} {'B':>10} {'seconds':>9} {'B / A':>7}")
    for what, a, ta, b, tb in rows:
        print(f"{what:28} {a:>10} {ta:9.3f} {b:>10} {tb:9.3f} {tb / ta:7.2f}x")
    print(f"{'training tokens/s':28} {'fp32':>10} {tokens / fp32:9.0f} {'bf16':>10} {tokens / bf16:9.0f} "
          f"{fp32 / bf16:7.2f}x")


if __name__ == "__main__":
    main()
