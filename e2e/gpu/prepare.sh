#!/usr/bin/env bash
# Download, here (where PyPI answers), the wheels the GPU machine's image lacks, into .whl/ (git-ignored): the
# device machine reaches no registry, so they travel with the working tree (`carry: [".whl"]`) and e2e/gpu/run.sh
# installs them into a folder of their own (--target), leaving the image's torch, Triton and transformers as they are.
#
# The image (the device tool's KINDS.md): Python 3.12, torch 2.11 + CUDA 13, Triton 3.6, transformers 5.17,
# tokenizers, safetensors, aiohttp, prometheus-client, numpy, pyyaml, tqdm, ninja, accelerate, pytest, hypothesis.
# Missing for the engine and the checks: pydantic (+ its core and helpers), gguf, llguidance, and the openai client
# (+ its transport). Versions are the ones the project's tests pass with here; one version of each package.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  gguf==0.19.0 llguidance==1.9.1
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20
  anyio==4.16.0 h11==0.16.0
)
git check-ignore -q .whl/x.whl || { echo "prepare.sh: .whl/ must be git-ignored (see .gitignore)" >&2; exit 2; }
rm -rf .whl && mkdir -p .whl
PIP=(python3 -P -m pip)  # -P: the checkout's operator/ would shadow the stdlib module
[ -x .venv/bin/python ] && PIP=(.venv/bin/python -P -m pip)
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 -d .whl "${WHEELS[@]}"
ls -1 .whl
du -sh .whl
