# issue 49: prompts of 1..8 joined held-out TinyStories paragraphs (the ones after the 3000 trained on)
import json
paras = [p.strip() for p in open('/work/shared/data/corpora/tinystories_val_a.txt').read().split("\n\n") if p.strip()]
held = paras[3000:]
out = []
for i in range(96):
    k = 1 + i % 8
    start = (i * 7) % (len(held) - k)
    out.append({"question_id": f"ctx-{i}", "category": f"paragraphs-{k}", "turns": ["\n\n".join(held[start:start + k])]})
open('runs/lc_prompts.jsonl', 'w').write("".join(json.dumps(q) + "\n" for q in out))
