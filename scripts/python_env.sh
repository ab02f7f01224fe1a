# Sourced by test.sh and main_job.sh: the virtual environment .cache/venv with the pinned
# Python packages of requirements-test.txt (torch, megatron-core, pytest, build tools) and
# requirements-deepspeed.txt.
# Defines VENV and PIP.
VENV=.cache/venv
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  python3 -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PIP=("$VENV/bin/python" -m pip --quiet)
echo "== installing the pinned Python packages (requirements-test.txt)"
"${PIP[@]}" install -r requirements-test.txt
echo "== installing DeepSpeed (requirements-deepspeed.txt)"
DS_BUILD_OPS=0 "${PIP[@]}" install --no-build-isolation -r requirements-deepspeed.txt
