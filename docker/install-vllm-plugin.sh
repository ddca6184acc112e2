#!/usr/bin/env bash
# Install kvgate's vLLM plugin into the Python environment that runs vLLM.
#
#   docker/install-vllm-plugin.sh [--python PYTHON] [--editable] [SOURCE]
#
# SOURCE   a kvgate checkout (a directory holding pyproject.toml) or a kvgate wheel
#          (kvgate-*.whl, built with `python3 -m pip wheel --no-deps -w dist .`);
#          default: the checkout this script is in.
# PYTHON   the interpreter of the vLLM environment (default: python3 on PATH), the one
#          that runs `python -m vllm.entrypoints.openai.api_server` or `vllm serve`.
# --editable  install the checkout in development mode (the real-vLLM tests do).
#
# The plugin needs nothing but vLLM, so kvgate is installed without its dependencies
# (`pip install --no-deps`): the proxy's (aiohttp, uvloop, ...) stay out of vLLM's
# environment. The script then checks, from an empty directory with `python -I`, that
# the installed entry points load and that this vLLM is a release the plugin supports,
# and exits 1 saying what is wrong otherwise. Start vLLM with VLLM_PLUGINS=kvgate.
#
# The same script installs the plugin in docker/vllm.Dockerfile and in the real-vLLM
# test environment (tests/vllm_plugin/vllm_harness.py).
set -euo pipefail

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

python=python3
editable=()
source=""
while (($#)); do
  case "$1" in
    --python) python="${2:?--python needs the path of the vLLM python}"; shift 2 ;;
    --python=*) python="${1#--python=}"; shift ;;
    --editable) editable=(-e); shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "install-vllm-plugin: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [[ -z "$source" ]] || { echo "install-vllm-plugin: one SOURCE only (see --help)" >&2; exit 2; }
       source="$1"; shift ;;
  esac
done
if [[ -z "$source" ]]; then
  source="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fi

if ! command -v "$python" >/dev/null 2>&1; then
  echo "install-vllm-plugin: $python not found; pass --python /path/to/the/vllm/environment/bin/python" >&2
  exit 2
fi
if ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
  echo "install-vllm-plugin: $python has no vLLM; pass --python with the interpreter of the environment that runs vLLM" >&2
  exit 2
fi
if [[ -d "$source" ]]; then
  [[ -f "$source/pyproject.toml" ]] || { echo "install-vllm-plugin: $source is not a kvgate checkout (no pyproject.toml)" >&2; exit 2; }
  source="$(cd "$source" && pwd)"
elif [[ "$source" == *.whl && -f "$source" ]]; then
  [[ ${#editable[@]} -eq 0 ]] || { echo "install-vllm-plugin: --editable needs a checkout, not a wheel" >&2; exit 2; }
  source="$(cd "$(dirname "$source")" && pwd)/$(basename "$source")"
else
  echo "install-vllm-plugin: $source is neither a checkout directory nor a .whl file" >&2
  exit 2
fi

# --force-reinstall: a wheel of the same version as an installed kvgate replaces it.
"$python" -m pip install --no-deps --force-reinstall --quiet "${editable[@]}" "$source"

# The check runs where only what is installed can answer: not the checkout's directory
# (whose kvgate.egg-info and folders would), and with -I (no PYTHON* variables).
check_dir="$(mktemp -d)"
trap 'rm -rf "$check_dir"' EXIT
(cd "$check_dir" && env -u PYTHONPATH "$python" -I -m kvgate.vllm_plugin.support)
