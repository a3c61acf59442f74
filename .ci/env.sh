# Sourced by .ci/main and .ci/test as `source .ci/env.sh ENV` (vllm, sglang or quantize): a
# virtualenv with that environment's pins, outside the clone, reused across clones while the pins
# stay the same; the project itself is reinstalled into it each time. `quantize` is llm-compressor's
# environment: it pins a newer compressed-tensors than vLLM does.
set -euo pipefail
engine=${1:-vllm}
case $engine in
  vllm) pins=("vllm==0.26.0" "torch==2.11.0"); module=vllm ;;
  sglang) pins=("sglang==0.5.17" "torch==2.11.0"); module=sglang ;;
  quantize) pins=("llmcompressor==0.14.0" "torch==2.11.0"); module=llmcompressor ;;
  *) echo "unknown environment $engine" >&2; exit 2 ;;
esac
key=$(printf '%s-' "${pins[@]}" | tr -d '=' | sed 's/-$//')
root=${LATENTSPEED_VENV_ROOT:-$HOME/.cache/latentspeed}
VENV=$root/venv-$key
python=
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
  if "$candidate" -c 'import sys; assert sys.version_info >= (3, 10)' >/dev/null 2>&1; then python=$candidate; break; fi
done
[ -n "$python" ] || { echo "no Python >= 3.10 found" >&2; exit 1; }
if [ ! -f "$VENV/.ready" ]; then
  echo "== creating $VENV with $($python --version) (${pins[*]}; several GB, once)"
  rm -rf "$VENV"
  "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}" \
    "setuptools>=77" "pytest>=8" "pytest-timeout>=2.3" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import $module, torch; assert torch.__version__.startswith('2.11.0')"
  touch "$VENV/.ready"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall . \
  2>&1 | grep -v "^WARNING: Location" || true
export PATH=$VENV/bin:$PATH
