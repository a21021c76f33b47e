# shellcheck shell=bash
# The environment of the one-machine stacks (dev.sh, cluster.sh), sourced before either starts anything:
# the interpreter (PYTHON, else python or python3), no proxy from the environment (loopback servers must never be
# reached through one) and nothing fetched online (tiny models are built offline).
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
unset http_proxy https_proxy HTTP_PROXY HTTPS_PROXY all_proxy ALL_PROXY
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 NO_COLOR=1
