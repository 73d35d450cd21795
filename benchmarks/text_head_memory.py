"""The memory a text head at ImageNet's size needs: 1,000 class names x CLIP's 80 ImageNet
templates (80,000 prompts) encoded in chunks by ``tta_bench.text_head.class_embeddings``,
against the 300 MiB the chunked computation is held to. One call over every prompt would
hold ``[80000, 77, 4 x width]`` float MLP activations alone (3.2 GB at this tower's width of
32); in chunks of 256 prompts the process grows by what one chunk needs.

The text tower is a real open_clip ``CLIP`` with a small random text tower (width 32, one
layer, CLIP's 77-token context) and open_clip's ViT-B-32 tokenizer. Each repeat builds the
head with the on-disk cache off, under ``tta_bench.run.cost.PeakMemory`` (the RSS growth: the
kernel's high-water mark, reset at entry), and checks what it built: every encoder call at
most ``--chunk`` prompts, 80,000 in all; the first three classes equal to the unchunked
computation (one call over their 240 prompts) within 1e-5; and, with the cache on in a
temporary folder, a second build that encodes nothing and gives the identical head.

Usage::

    python benchmarks/text_head_memory.py [--repeats 3] [--chunk 256]

Prints the seconds and the RSS growth (median and range over the repeats) and whether the
growth stays within 300 MiB; exits 1 when it does not or a check fails. Run it on an idle
machine (``uptime``): the seconds are timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from tta_bench import text_head
from tta_bench.catalog import catalog
from tta_bench.run.cost import PeakMemory

BOUND_MIB = 300


def tiny_text_clip(seed: int = 1) -> torch.nn.Module:
    """An open_clip CLIP with a small random text tower at CLIP's 77-token context."""
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    torch.manual_seed(seed)
    vision = CLIPVisionCfg(layers=1, width=32, head_width=16, patch_size=16, image_size=32)
    text = CLIPTextCfg(context_length=77, width=32, heads=2, layers=1)
    return CLIP(embed_dim=32, vision_cfg=vision, text_cfg=text).eval()


def _recording() -> tuple[list[int], object]:
    """The batch sizes of every text-tower call (``text_head.encode_text_cut``), and the
    function it replaced."""
    calls: list[int] = []
    original = text_head.encode_text_cut

    def encode(clip: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        calls.append(int(tokens.shape[0]))
        return original(clip, tokens)

    text_head.encode_text_cut = encode
    return calls, original


def _unchunked(clip, tokenizer, classnames, templates) -> torch.Tensor:
    with torch.no_grad():
        feats = clip.encode_text(tokenizer([t.format(c) for c in classnames for t in templates]))
    feats = feats / feats.norm(dim=-1, keepdim=True)
    head = feats.view(len(classnames), len(templates), -1).mean(dim=1)
    return head / head.norm(dim=-1, keepdim=True)


def _build(model, tokenizer, names, templates, chunk: int, cache: bool):
    calls, original = _recording()
    try:
        with PeakMemory(torch.device("cpu")) as mem:
            start = time.perf_counter()
            head = text_head.class_embeddings(
                model, tokenizer, names, templates, chunk_size=chunk, cache=cache
            )
            seconds = time.perf_counter() - start
    finally:
        text_head.encode_text_cut = original
    return head, calls, seconds, mem.peak_bytes


def _fmt(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):.1f} {unit} ({min(values):.1f}-{max(values):.1f})"


def _positive(text: str) -> int:
    """An argparse type: an integer of at least 1 (exit 2 naming the value otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=_positive, default=3, help="builds timed (3)")
    parser.add_argument("--chunk", type=_positive, default=256, help="prompts a call (256)")
    args = parser.parse_args(argv)
    import open_clip

    tokenizer = open_clip.get_tokenizer("ViT-B-32")
    cat = catalog()
    names = list(cat["datasets"]["imagenet"]["classnames"])
    templates = list(cat["templates"]["clip-imagenet-80"]["templates"])
    assert (len(names), len(templates)) == (1000, 80)
    model = tiny_text_clip()
    failures: list[str] = []
    seconds, growth = [], []
    for _ in range(args.repeats):
        head, calls, s, peak = _build(model, tokenizer, names, templates, args.chunk, False)
        seconds.append(s)
        growth.append(peak / 2**20)
        if head.shape != (1000, 32) or not bool(torch.isfinite(head).all()):
            failures.append(f"head of shape {tuple(head.shape)}, or not finite")
        if max(calls) > args.chunk or sum(calls) != 80_000:
            failures.append(f"encoder calls of up to {max(calls)}, {sum(calls)} prompts in all")
    reference = _unchunked(model, tokenizer, names[:3], templates)
    if not torch.allclose(head[:3], reference, atol=1e-5, rtol=0):
        failures.append("the first three classes differ from the unchunked computation")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["TTA_BENCH_CACHE"] = folder
        first, _, _, _ = _build(model, tokenizer, names, templates, args.chunk, True)
        again, calls, _, _ = _build(model, tokenizer, names, templates, args.chunk, True)
        if calls or not torch.equal(again, first):
            failures.append(f"the cached head was encoded again ({sum(calls)} prompts)")
    within = max(growth) < BOUND_MIB
    print(f"1000 classes x 80 templates, chunks of {args.chunk}, {args.repeats} repeats")
    print(f"seconds:    {_fmt(seconds, 's')}")
    print(f"RSS growth: {_fmt(growth, 'MiB')}  (bound {BOUND_MIB} MiB: "
          f"{'within' if within else 'OVER'})")  # fmt: skip
    for failure in failures:
        print(f"check failed: {failure}")
    return 0 if within and not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
