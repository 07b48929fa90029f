#!/usr/bin/env bash
# Self-test of check_stream.mjs: the fixtures must pass with ai@6 and ai@7,
# and a few broken variants of the sample stream must be rejected.
set -euo pipefail
cd "$(dirname "$0")"

if [ ! -d node_modules ]; then
  npm ci --no-audit --no-fund
fi

pass=0
fail=0
sample=fixtures/sample_stream.txt

expect() { # expect <ok|fail> <ai6|ai7> <name> <stream file>
  local want=$1 ver=$2 name=$3 file=$4 out rc=0
  out=$(node check_stream.mjs "$ver" < "$file") || rc=$?
  if { [ "$want" = ok ] && [ $rc -eq 0 ]; } || { [ "$want" = fail ] && [ $rc -eq 1 ]; }; then
    pass=$((pass + 1)); echo "PASS $ver $name (rc=$rc)"
  else
    fail=$((fail + 1)); echo "FAIL $ver $name (rc=$rc, wanted $want): ${out:0:400}"
  fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# Broken variants (each must be rejected by both versions).
sed 's/"providerExecuted":true/"providerExecuted":null/' "$sample" > "$tmp/null_field.txt"
sed 's/"finishReason":"stop"/"finishReason":"interrupted"/' "$sample" > "$tmp/interrupted.txt"
sed 's/{"type":"finish-step"}/{"type":"reset-step"}/' "$sample" > "$tmp/reset_step.txt"
sed 's/"toolCallId":"q1"/"toolCallId":"c1"/g' "$sample" > "$tmp/dup_tool_call.txt"
sed 's/{"type":"text-delta"/{"type":"bogus-chunk"/' "$sample" > "$tmp/unknown_type.txt"
grep -v '^data: \[DONE\]$' "$sample" > "$tmp/no_done.txt"
{ printf 'data: [DONE]\n\n'; cat "$sample"; } > "$tmp/early_done.txt"
sed '/"type":"start-step"/,$!d' "$sample" > "$tmp/no_start.txt"

for ver in ai6 ai7; do
  expect ok "$ver" sample "$sample"
  expect ok "$ver" error fixtures/error_stream.txt
  for f in "$tmp"/*.txt; do
    expect fail "$ver" "broken:$(basename "$f" .txt)" "$f"
  done
done

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
