"""``kvtier bench vlm-chat``: a multi-turn chat that resends its image every round, against the same
chat without the image (kvtier.LLM, one process, the same engine options).

Each of ``--clients`` conversations starts with its own image (random pixels) and a question;
every round appends an answer and a new question of ``--turn-length`` characters and sends the
whole history again, image included. Per round: TTFT (a one-token generate of every client's
history together, best of ``--repeat`` is not taken: each round is timed once, as a chat would
see it) with the image and without it, their ratio, the tokens served from cache, and how many
images the vision tower encoded (once per conversation when the encoder cache keeps them).

Defaults use the ``llava-1.5-7b-shape`` preset with dummy bf16 weights on ``--device cuda``
(``llava-tiny`` on CPU; ``--model`` for a checkpoint).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.engine.config import EngineConfig

ENGINE_OPTIONS = ("device", "dtype", "load_format", "max_model_len", "num_device_blocks", "num_host_blocks", "encoder_cache_size")


def _ttft(llm: Any, prompts: list, device: str) -> tuple[float, list]:
    import kvtier

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, kvtier.SamplingParams(max_tokens=1, ignore_eos=True))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> int:
    import kvtier
    from kvtier.model import PRESETS, ModelConfig, init_model
    from kvtier.model.tokenizer import IMAGE_TOKEN

    ap = argparse.ArgumentParser(
        prog="kvtier bench vlm-chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None, help="checkpoint directory or preset (default: by device, above)")
    ap.add_argument("--clients", type=int, default=4, help="conversations, each with its image (default 4)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per conversation (default 4)")
    ap.add_argument("--turn-length", type=int, default=200, help="characters of each question and answer (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    EngineConfig.add_flags(
        ap.add_argument_group("engine options (as kvtier serve's)"), only=ENGINE_OPTIONS, defaults={"device": "cuda"}
    )
    args = ap.parse_args(argv)
    config = EngineConfig.from_args(args, only=ENGINE_OPTIONS)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("kvtier bench vlm-chat --device cuda needs a CUDA GPU; none is visible (--device cpu runs on CPU)")
    model = args.model or ("llava-1.5-7b-shape" if args.device.startswith("cuda") else "llava-tiny")
    tmp = None
    path = Path(model)
    if model in PRESETS and not path.exists():
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-")
        dummy = PRESETS[model]["dtype"] == "bfloat16"
        path = init_model(model, tmp.name, config_only=dummy)
        if dummy:
            config = replace(config, load_format="dummy")
    vision = ModelConfig.from_hf_dir(path).vision
    if vision is None:
        raise SystemExit(f"{model} is not a vision-language model")
    rng = np.random.default_rng(args.seed)
    side = vision.image_size
    images = [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(args.clients)]
    words = "abcdefghijklmnopqrstuvwxyz "

    def turn() -> str:
        return "".join(rng.choice(list(words), args.turn_length))

    turns = [[turn() for _ in range(2 * args.rounds)] for _ in range(args.clients)]
    results: dict[str, Any] = {"model": model, "device": args.device, "clients": args.clients, "rounds": []}
    with kvtier.LLM(path, config) as llm:
        _ttft(
            llm,
            [{"prompt": f"{IMAGE_TOKEN} warm up", "images": [_pil(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))]}],
            args.device,
        )
        encoder = llm.runner.encoder
        assert encoder is not None
        encoded_before = encoder.num_images_encoded
        for r in range(args.rounds):
            history = ["".join(t[: 2 * r + 1]) for t in turns]
            with_images = [{"prompt": f"{IMAGE_TOKEN}\n{h}", "images": [_pil(img)]} for h, img in zip(history, images)]
            plain = [f"(no image)\n{h}" for h in history]
            t_img, outs_img = _ttft(llm, with_images, args.device)
            t_txt, outs_txt = _ttft(llm, plain, args.device)
            row = {
                "round": r + 1,
                "ttft_s_with_image": t_img,
                "ttft_s_without": t_txt,
                "ratio": t_img / t_txt,
                "cached_tokens_with_image": sum(o.num_cached_tokens for o in outs_img),
                "cached_tokens_without": sum(o.num_cached_tokens for o in outs_txt),
                "images_encoded": encoder.num_images_encoded - encoded_before,
            }
            results["rounds"].append(row)
            print(
                f"round {r + 1}: TTFT {t_img * 1e3:.1f} ms with the image, {t_txt * 1e3:.1f} ms without "
                f"({row['ratio']:.2f}x); cached {row['cached_tokens_with_image']} vs {row['cached_tokens_without']} "
                f"tokens; images encoded so far {row['images_encoded']} (of {args.clients} conversations)",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if tmp is not None:
        tmp.cleanup()
    return 0


def _pil(pixels: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(pixels)


if __name__ == "__main__":
    raise SystemExit(main())
