"""Questions asked after the document was compressed (the "one document, many questions" flow): does each
cache still answer the planted facts of examples/document/ when it compressed the document without seeing
the question? Usage: PYTHONPATH=src .venv/bin/python scripts/doc_questions.py CHARS SPEC... (2 threads)."""
import sys, re, torch, kvshrink
torch.set_num_threads(2)
chars, specs = int(sys.argv[1]), sys.argv[2:]
model, tok = kvshrink.load_model()
text = open("examples/document/essays-8k.txt").read()
facts = [("What is the secret code for the vault?", "4817"),
         ("When is the meeting with Dana Whitfield?", "Thursday"),
         ("What is the name of the office cat?", "Pickle")]
# keep the text short: cut around the planted sentences so that all of them are inside CHARS characters
parts = [m.start() for m in re.finditer(r"secret code for the vault|meeting with Dana Whitfield|office cat is", text)]
keep = chars // len(parts)
doc = " ".join(text[max(0, p - keep // 2): p + keep // 2] for p in parts)
def ids_of(question=None):
    content = doc if question is None else doc + "\n\n" + question
    s = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=question is not None,
                                tokenize=False)
    return tok(s, return_tensors="pt", add_special_tokens=False).input_ids
prefix = ids_of()
# the prefix is the chat-formatted document up to the end of its text (the question continues the turn)
full_q = [ids_of(q) for q, _ in facts]
n = 0
while all(n < x.shape[1] for x in full_q + [prefix]) and all(x[0, n] == prefix[0, n] for x in full_q):
    n += 1
prefix = prefix[:, :n]
print("document tokens", n, flush=True)
for spec in specs:
    name, opts = kvshrink.parse_method_spec(spec)
    cache = kvshrink.make_cache(name, model, **opts)
    with torch.no_grad():
        model(input_ids=prefix, past_key_values=cache)
    got = []
    for (q, want), ids in zip(facts, full_q):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache.fork(),
                             max_new_tokens=20, do_sample=False)
        ans = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        got.append(want in ans)
        print(f"  {spec[:60]:60s} {want:9s} {'yes' if want in ans else 'no '}  {ans[:70]!r}", flush=True)
    print(f"{spec}: {sum(got)} of {len(got)} facts, ratio {cache.compression_ratio():.2f}x", flush=True)
