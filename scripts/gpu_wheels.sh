#!/usr/bin/env bash
# Prepare, on a CPU machine with pip and a package index, the wheels that the lent GPU machine's image lacks
# (its image holds torch, triton, transformers and most of the rest, reaches no index: ../shared/STACK.md).
# They land in ./.whl (git-ignored), for Python 3.12 on x86-64 Linux, at requirements.txt's versions (the
# versions installed in .venv for what it does not pin); scripts/gpu_check.sh installs them there with
# --no-index. Usage: scripts/gpu_wheels.sh [folder]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
# What the engine, the server and the GPU check import that the image does not have, with their own needs
# the image lacks too (xgrammar, apache-tvm-ffi, pydantic-core, rpds-py and google-re2 are binary wheels; the
# rest pure Python).
names=(starlette uvicorn gguf xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection
       typing-extensions jsonschema jsonschema-specifications referencing rpds-py google-re2)
python=.venv/bin/python
[ -x "$python" ] || python=python3
pins=()
for name in "${names[@]}"; do
  pin=$(grep -i "^${name}==" requirements.txt || true)
  if [ -z "$pin" ]; then
    pin="$name==$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")" || {
      echo "gpu_wheels: $name is neither pinned in requirements.txt nor installed" >&2
      exit 1
    }
  fi
  pins+=("$pin")
done
mkdir -p "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
ls -1 "$dest"
du -sh "$dest"
