#!/bin/bash
# chat_tokenize.sh: strata tokenize on conversations beside its peer, Jinja's renderings as plain
# rows. Writes N "messages" rows (a system message and three exchanges of seeded random words),
# renders them with Jinja as transformers would (tests/reference/chat_template_reference.py),
# checks that strata's conversations give the plain rows' tokens token for token, then times
# ROUNDS rounds of each run, alternating.
#
# Usage: bench/chat_tokenize.sh [STRATA=build/bin/strata] [N=20000] [ROUNDS=3]
# Needs /usr/bin/python3 with python3-jinja2.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
strata=$(realpath "${1:-$here/build/bin/strata}")
n=${2:-20000}
rounds=${3:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
templates="$here/tests/data/chat_templates/families"
/usr/bin/python3 - "$n" "$templates/chatml.jinja" "$here/tests/reference" <<'PY'
import json, random, sys
sys.path.insert(0, sys.argv[3])
import chat_template_reference as ref
random.seed(1)
words = "the quick brown fox jumps over lazy dog model train token step loss rate".split()
say = lambda n: " ".join(random.choice(words) for _ in range(n))
template = ref.environment().from_string(open(sys.argv[2]).read())
with open("chat.jsonl", "w") as chat, open("plain.jsonl", "w") as plain:
    for _ in range(int(sys.argv[1])):
        messages = [{"role": "system", "content": "You are helpful."}]
        for _ in range(3):
            messages.append({"role": "user", "content": say(random.randint(5, 30))})
            messages.append({"role": "assistant", "content": say(random.randint(10, 60))})
        chat.write(json.dumps({"messages": messages}) + "\n")
        text, _ = ref.generation_spans(template.render(messages=messages, add_generation_prompt=False))
        plain.write(json.dumps({"text": text}) + "\n")
PY
run() { "$strata" tokenize "$@" >/dev/null; }
run --input plain.jsonl --output p.bin
run --input chat.jsonl --output a.bin --chat-template "$templates/chatml.jinja" --chat-loss all
run --input chat.jsonl --output r.bin --chat-template "$templates/chatml.jinja"
cmp -s <(tail -c +1025 a.bin) <(tail -c +1025 p.bin) || { echo "conversations differ from Jinja's renderings" >&2; exit 1; }
cmp -s a.bin r.bin || { echo "the replies run wrote other tokens" >&2; exit 1; }
[ -f r.bin.mask ] || { echo "the replies run wrote no mask" >&2; exit 1; }
echo "verified: $n conversations tokenize as Jinja's renderings of them, token for token"
t() { /usr/bin/time -f "%e s, peak %M KB" "$strata" tokenize "$@" 2>&1 >/dev/null | tail -1; }
for r in $(seq "$rounds"); do
  echo "round $r"
  echo "  plain rows of Jinja's renderings:      $(t --input plain.jsonl --output p.bin)"
  echo "  conversations, --chat-loss all:         $(t --input chat.jsonl --output a.bin --chat-template "$templates/chatml.jinja" --chat-loss all)"
  echo "  conversations, generation markers:      $(t --input chat.jsonl --output g.bin --chat-template "$templates/generation.jinja")"
  echo "  conversations, replies (turns before):  $(t --input chat.jsonl --output r.bin --chat-template "$templates/chatml.jinja")"
done
