# The cached-venv protocol shared by make_sglang_venv.sh and make_verl_venv.sh (sourced, not run).
# The caller sets NAME (its log prefix), VENV, PYTHON and CHECK (python code that must import in the venv).
# A venv is reused only when its `.complete` marker exists and CHECK passes; on failure the reason goes to
# "$VENV.failed" (tests read it to skip with it) and the exit status is 1; on success the venv's python is printed.

fail() {
  mkdir -p "$(dirname "$VENV")"
  printf '%s\n' "$1" > "$VENV.failed"
  echo "$NAME: $1" >&2
  exit 1
}

# Print the venv's python and exit when the cached one still passes CHECK; else start a fresh venv.
reuse_or_create() {
  if [[ -f "$VENV/.complete" ]] && "$VENV/bin/python" -W ignore -c "$CHECK" 2>/dev/null; then
    echo "$VENV/bin/python"
    exit 0
  fi
  rm -rf "$VENV" "$VENV.failed"
  mkdir -p "$(dirname "$VENV")"
  started=$SECONDS
  "$PYTHON" -m venv "$VENV" || fail "$PYTHON -m venv $VENV failed"
}

# Check the installed venv, mark it complete and print its python.
finish() {
  "$VENV/bin/python" -W ignore -c "$CHECK" || fail "$1"
  touch "$VENV/.complete"
  echo "$NAME: built $VENV in $((SECONDS - started)) s" >&2
  echo "$VENV/bin/python"
}
