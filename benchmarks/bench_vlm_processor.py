"""Host memory per sample and VLM processor throughput, with and without the per-uid cache.

    .venv/bin/python benchmarks/bench_vlm_processor.py --prompts 16 --n 8

One RL step's prompts: ``--prompts`` prompts with one JPEG image each (``--image-size``
pixels square, encoded bytes as in the parquet layout), each repeated ``--n`` times for
the rollouts. Every setting runs in a fresh process, so its RSS growth is its own:

- ``no cache``: every rollout row is processed on its own (a pipeline that repeats raw
  samples before processing);
- ``cache (content hash)``: the processor caches by a digest of prompt and media;
- ``cache (keys)``: samples carry a stable key (``"train/<row>"``), nothing is hashed;

each with ``keep_raw_media`` off and on. "Retained" counts the bytes the prompt Batch keeps
alive (tensor storages counted once, plus the raw media it references); "RSS" is the growth
of the process's resident memory over the encode call. Pass 2 encodes the same prompts
again, as the next epoch would. Throughput is samples per CPU-second on one thread (the
machine is shared, so wall time would measure other jobs too), the median over
``--repeats`` passes (pass 1 with an emptied cache each time); memory is measured on the
first pass.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import subprocess
import sys
import tempfile
import time

import numpy as np

SETTINGS = [  # (label, cache_size, keyed)
    ("no cache", 0, False),
    ("cache (content hash)", 4096, False),
    ("cache (keys)", 4096, True),
]


def jpeg(rng: np.random.Generator, size: int) -> bytes:
    """A smooth random photo-like image as JPEG bytes."""
    from PIL import Image

    small = rng.integers(0, 255, (size // 16, size // 16, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((size, size), Image.BICUBIC).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def retained_bytes(batch) -> int:
    """Bytes kept alive by the Batch: tensor storages once each, plus referenced raw media."""
    import torch

    seen: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()

    for t in batch.tensors.values():
        add(t)
    for mm in batch["multi_modal_inputs"]:
        for t in mm.values():
            add(t)
    raw = {}
    if "multi_modal_data" in batch:
        for media in batch["multi_modal_data"]:
            for item in media["image"]:
                raw[id(item)] = len(item)
    return sum(seen.values()) + sum(raw.values())


def timed(fn, *args) -> tuple[object, float]:
    """``fn(*args)`` and the CPU seconds this process spent on it (robust to other jobs' load)."""
    start = time.process_time()
    out = fn(*args)
    return out, time.process_time() - start


def run_one(args: argparse.Namespace) -> dict:
    import psutil
    import torch

    torch.set_num_threads(1)  # one core: CPU seconds = seconds on an idle core

    from mmrl.config import DataConfig
    from mmrl.models.tiny_vlm import build_tiny_qwen2_vl
    from mmrl.processors import VisionProcessor, VisionSample, chat_prompt

    cache_size, keyed = SETTINGS[args.setting][1:]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_qwen2_vl(tmp, max_pixels=args.image_size**2, min_pixels=56 * 56)
        cfg = DataConfig(
            max_prompt_length=args.max_prompt_length,
            cache_size=cache_size,
            keep_raw_media=args.keep_raw_media,
        )
        proc = VisionProcessor.from_pretrained(path, cfg)
    rng = np.random.default_rng(0)
    prompt = chat_prompt(
        proc.processor, "<image>How many red shapes are there? Answer in <answer></answer>."
    )
    images = [jpeg(rng, args.image_size) for _ in range(args.prompts)]
    samples = [
        VisionSample(prompt, [img], key=f"train/{i}" if keyed else None)
        for i, img in enumerate(images)
        for _ in range(args.n)
    ]
    proc.encode(samples[:1])  # warm-up (first call imports and allocates)
    proc.clear_cache()
    gc.collect()
    rss0 = psutil.Process().memory_info().rss
    batch, first = timed(proc.encode, samples)
    gc.collect()
    rss = psutil.Process().memory_info().rss - rss0
    pass2 = [timed(proc.encode, samples)[1] for _ in range(args.repeats)]
    pass1 = [first]
    for _ in range(args.repeats - 1):  # more cold passes, each with an empty cache
        proc.clear_cache()
        pass1.append(timed(proc.encode, samples)[1])
    pass1, pass2 = float(np.median(pass1)), float(np.median(pass2))
    n = len(samples)
    return {
        "setting": SETTINGS[args.setting][0],
        "keep_raw_media": args.keep_raw_media,
        "samples": n,
        "pass1_samples_per_cpu_s": n / pass1,
        "pass2_samples_per_cpu_s": n / pass2,
        "retained_kib_per_sample": retained_bytes(batch) / n / 1024,
        "rss_kib_per_sample": rss / n / 1024,
        "jpeg_kib": float(np.mean([len(x) for x in images])) / 1024,
        "pixel_values_kib": batch["multi_modal_inputs"][0]["pixel_values"].numel() * 4 / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--max-prompt-length", type=int, default=384)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed passes; the median is reported"
    )
    parser.add_argument("--setting", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep-raw-media", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting is not None:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for setting in range(len(SETTINGS)):
        for keep in (False, True):
            cmd = [
                sys.executable,
                __file__,
                "--setting",
                str(setting),
                "--prompts",
                str(args.prompts),
                "--n",
                str(args.n),
                "--image-size",
                str(args.image_size),
                "--max-prompt-length",
                str(args.max_prompt_length),
                "--repeats",
                str(args.repeats),
                *(["--keep-raw-media"] if keep else []),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(
                f"done: {rows[-1]['setting']}, keep_raw_media={keep}", file=sys.stderr, flush=True
            )
    r0 = rows[0]
    print(
        f"\n{args.prompts} prompts x {args.n} rollouts = {r0['samples']} samples; one "
        f"{args.image_size}x"
        f"{args.image_size} JPEG per prompt ({r0['jpeg_kib']:.0f} KiB), pixel_values "
        f"{r0['pixel_values_kib']:.0f} KiB per image\n"
    )
    print(
        "| setting | keep_raw_media | samples/s, pass 1 | samples/s, pass 2 | retained KiB/sample "
        "| RSS growth KiB/sample |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setting']} | {str(r['keep_raw_media']).lower()} | "
            f"{r['pass1_samples_per_cpu_s']:.0f} | "
            f"{r['pass2_samples_per_cpu_s']:.0f} | {r['retained_kib_per_sample']:.0f} | "
            f"{r['rss_kib_per_sample']:.0f} |"
        )


if __name__ == "__main__":
    main()
