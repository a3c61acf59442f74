# Sourced by .ci/main and .ci/test: a virtualenv with the pinned engine, outside the clone,
# reused across clones while the pins stay the same; the project itself is reinstalled each time.
set -euo pipefail
VLLM_PIN=0.26.0
TORCH_PIN=2.11.0
root=${LATENTSPEED_VENV_ROOT:-$HOME/.cache/latentspeed}
VENV=$root/venv-vllm-$VLLM_PIN-torch-$TORCH_PIN
python=
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3; do
  if "$candidate" -c 'import sys; assert sys.version_info >= (3, 10)' >/dev/null 2>&1; then python=$candidate; break; fi
done
[ -n "$python" ] || { echo "no Python >= 3.10 found" >&2; exit 1; }
if [ ! -f "$VENV/.ready" ]; then
  echo "== creating $VENV with $($python --version) (vllm==$VLLM_PIN, torch==$TORCH_PIN; several GB, once)"
  rm -rf "$VENV"
  "$python" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "vllm==$VLLM_PIN" "torch==$TORCH_PIN" \
    "setuptools>=77" "pytest>=8" "pytest-timeout>=2.3" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__ == '$VLLM_PIN' and torch.__version__.startswith('$TORCH_PIN')"
  touch "$VENV/.ready"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall . \
  2>&1 | grep -v "^WARNING: Location" || true
export PATH=$VENV/bin:$PATH
