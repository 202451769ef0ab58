# HF transformers generate() on the same model, for docs/benchmarks.md.
#   python3 bench/hf_generate.py MODEL_DIR                 decode tokens/s, batch 1 and 64, 32-token prompts
#   python3 bench/hf_generate.py MODEL_DIR --prefill 2048  batch-1 time to the first token of a 2,048-token
#                                                           prompt (generate() with max_new_tokens=1), median of 5
import argparse, statistics, time, torch
from transformers import AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--prefill", type=int, default=0, help="time a batch-1 prefill of this many prompt tokens instead")
args = ap.parse_args()
m = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).cuda().eval()

if args.prefill:
    ids = torch.randint(0, m.config.vocab_size, (1, args.prefill), device="cuda")
    times = []
    for i in range(7):
        torch.cuda.synchronize(); t = time.time()
        m.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        if i >= 2: times.append(time.time() - t)  # two warm-up runs
    print(f"hf generate prefill batch 1, {args.prefill} prompt tokens: {statistics.median(times)*1e3:.2f} ms "
          f"to the first token (median of {len(times)})")
else:
    for batch in (1, 64):
        ids = torch.randint(0, m.config.vocab_size, (batch, 32), device="cuda")
        m.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)
        torch.cuda.synchronize(); t = time.time()
        m.generate(ids, max_new_tokens=64, do_sample=False, min_new_tokens=64, pad_token_id=0)
        torch.cuda.synchronize(); dt = time.time() - t
        print(f"hf generate batch {batch}: {batch*64/dt:.1f} tokens/s ({dt/64*1e3:.2f} ms/step incl. prefill)")
