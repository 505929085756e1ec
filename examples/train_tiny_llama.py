#!/usr/bin/env python3
"""Trains a tiny Llama (2 layers, hidden 128, 4 heads, 2 KV heads, byte vocab
of 256, built from a config: nothing is downloaded) on a text that ships with
Debian, its attention running through a stria service. Prints the loss and
the time of every step.

    python examples/train_tiny_llama.py                   # attention through stria
    python examples/train_tiny_llama.py --attn sdpa       # PyTorch's SDPA
    python examples/train_tiny_llama.py --attn both       # both, side by side,
                                                          # checked within --tol,
                                                          # with the median step
                                                          # time ratio

The service is --coordinator or $STRIA_COORDINATOR; without either, the script
starts its own on this machine (a coordinator and --workers workers on
loopback, from the build tree: stria.local) and stops it at the end. Needs
torch and transformers.
"""

import argparse
import os
import statistics
import sys
import time

import torch

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0",
         "/usr/share/common-licenses/GPL-2", "/usr/share/common-licenses/LGPL-2.1"]


def load_text(path=None):
    """The training bytes: `path`, or the first Debian licence text found."""
    for p in [path] if path else TEXTS:
        if p and os.path.exists(p):
            with open(p, "rb") as f:
                return torch.tensor(list(f.read()), dtype=torch.long), p
    raise SystemExit(f"no text to train on: none of {', '.join(TEXTS)} exists (give --text)")


def make_model(attn, seed):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=4096)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)


def train(attn, data, steps, batch, seq, lr, seed, log=None):
    """Losses and times (seconds: forward, backward and optimizer step) of
    `steps` AdamW steps on random windows of `data` (the same windows and
    initial weights for every attention); log(step, loss, seconds) after
    each."""
    model = make_model(attn, seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    losses, times = [], []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq, (batch,), generator=g)
        ids = torch.stack([data[s:s + seq] for s in starts.tolist()])
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if log:
            log(step, losses[-1], times[-1])
    return losses, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", choices=["stria", "sdpa", "both"], default="stria")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", help="a text file to train on (default: a Debian licence)")
    ap.add_argument("--coordinator", help="HOST:PORT of a running service (default "
                    "$STRIA_COORDINATOR; without either, one is started here)")
    ap.add_argument("--workers", type=int, default=4,
                    help="workers of the service started here")
    ap.add_argument("--tol", type=float, default=1e-3,
                    help="with --attn both: largest relative loss difference per step")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the same arithmetic in every run
    data, path = load_text(args.text)
    print(f"training a tiny Llama on {path} ({len(data)} bytes), {args.steps} steps of "
          f"{args.batch} x {args.seq} tokens", flush=True)

    client = svc = None
    if args.attn in ("stria", "both"):
        import stria
        import stria.hf

        address = args.coordinator or os.environ.get("STRIA_COORDINATOR")
        if not address:
            from stria.local import LocalService

            svc = LocalService(args.workers)
            address = svc.address
            print(f"started a coordinator and {args.workers} workers at {address}", flush=True)
        client = stria.Client(address)
        stria.hf.register(client=client)
    try:
        kw = dict(data=data, steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr,
                  seed=args.seed)
        if args.attn != "both":
            _, times = train(args.attn, log=lambda s, l, t: print(
                f"step {s + 1:3d}  loss {l:.5f}  {t * 1e3:7.1f} ms", flush=True), **kw)
            print(f"median step {statistics.median(times) * 1e3:.1f} ms", flush=True)
            return 0
        ref, ref_times = train("sdpa", **kw)
        worst = 0.0
        print(f"{'':8}  {'loss stria':>10}  {'sdpa':>8}  {'':16}  {'ms stria':>9}  "
              f"{'sdpa':>7}", flush=True)

        def log(step, loss, secs):
            nonlocal worst
            d = abs(loss - ref[step]) / abs(ref[step])
            worst = max(worst, d)
            print(f"step {step + 1:3d}  {loss:10.5f}  {ref[step]:8.5f}  rel diff {d:.1e}  "
                  f"{secs * 1e3:9.1f}  {ref_times[step] * 1e3:7.1f}", flush=True)

        _, times = train("stria", log=log, **kw)
        ok = worst <= args.tol
        print(f"largest relative difference {worst:.1e} ({'within' if ok else 'OVER'} "
              f"{args.tol:g})", flush=True)
        ms, ref_ms = statistics.median(times) * 1e3, statistics.median(ref_times) * 1e3
        print(f"median step: stria {ms:.1f} ms, sdpa {ref_ms:.1f} ms, stria / sdpa "
              f"{ms / ref_ms:.2f}", flush=True)
        return 0 if ok else 1
    finally:
        if client is not None:
            client.close()
        if svc is not None:
            svc.stop()


if __name__ == "__main__":
    sys.exit(main())
