# The PyTorch baseline of `make bench` (kept here from the project's shared/bench so a bench run is
# self-contained; the numbers seen with it are in docs/benchmarks.md).
# PyTorch baseline: HF transformers Qwen3-MoE (grouped_mm experts, SDPA attention, bf16, fused AdamW),
# Qwen3-30B-A3B layer shapes, LAYERS layers, one GPU, ACCUM micro-batches of BATCH sequences per optimizer step.  Prints tokens/s and model TFLOPS (6N + attention).
import torch, os, json
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
dev='cuda'; L=int(os.environ.get('LAYERS','8')); S=int(os.environ.get('SEQ','4096')); B=int(os.environ.get('BATCH','2'))
impl=os.environ.get('IMPL','grouped_mm'); ACC=int(os.environ.get('ACCUM','8'))
# layer shapes: Qwen3-30B-A3B by default; HIDDEN/MOE_I/HEADS/KV_HEADS select others (235B-A22B: 4096/1536/64/4)
H=int(os.environ.get('HIDDEN','2048')); I=int(os.environ.get('MOE_I','768')); E,K,V=128,8,151936
NH=int(os.environ.get('HEADS','32')); NKV=int(os.environ.get('KV_HEADS','4')); HD=128
cfg=Qwen3MoeConfig(vocab_size=V,hidden_size=H,intermediate_size=6144,moe_intermediate_size=I,num_hidden_layers=L,
  num_attention_heads=NH,num_key_value_heads=NKV,head_dim=HD,num_experts=E,num_experts_per_tok=K,norm_topk_prob=True,
  max_position_embeddings=S,rope_theta=1e6,output_router_logits=True,router_aux_loss_coef=0.001,tie_word_embeddings=False)
cfg._attn_implementation='sdpa'; cfg._experts_implementation=impl
m=Qwen3MoeForCausalLM(cfg).to(dev,torch.bfloat16)
opt=torch.optim.AdamW(m.parameters(),lr=1e-4,fused=True)
if os.environ.get('COMPILE','1')=='1': m=torch.compile(m)
ids=torch.randint(0,V,(B,S),device=dev)
def step():  # one optimizer step over ACC micro-batches of B sequences
    for _ in range(ACC):
        out=m(input_ids=ids,labels=ids); (out.loss/ACC).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): step()
torch.cuda.synchronize()
s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True); ts=[]
for _ in range(8):
    s.record(); step(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
ts.sort(); ms=ts[len(ts)//2]
attn_mm = H*NH*HD + 2*H*NKV*HD + NH*HD*H      # q,k,v,o
per_layer = attn_mm + H*E + K*3*H*I          # + router + active experts
n_mm = L*per_layer + V*H                     # + lm_head (embedding lookup excluded)
attn_flops = L * 3 * 2*2*(S/2)*NH*HD         # causal QK^T and PV, fwd+bwd = 3x fwd, per token
flops_tok = 6*n_mm + attn_flops
tok_s = ACC*B*S/ms*1e3
print(json.dumps({'impl':impl,'hidden':H,'layers':L,'seq':S,'batch':B,'accum':ACC,'compile':os.environ.get('COMPILE','1')=='1','step_ms':ms,'tok_s':tok_s,'gflop_per_tok':flops_tok/1e9,
  'model_tflops':flops_tok*tok_s/1e12,'peak_mem_gib':torch.cuda.max_memory_allocated()/2**30}))
