# HF transformers generate() decode tokens/s on the same model, for docs/benchmarks.md.
import sys, time, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.bfloat16).cuda().eval()
for batch in (1, 64):
    ids = torch.randint(0, m.config.vocab_size, (batch, 32), device="cuda")
    m.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
    torch.cuda.synchronize(); t = time.time()
    m.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64, pad_token_id=0)
    torch.cuda.synchronize(); dt = time.time() - t
    print(f"hf generate batch {batch}: {batch*64/dt:.1f} tokens/s ({dt/64*1e3:.2f} ms/step incl. prefill)")
