"""One tensor-parallel training step (forward, cross entropy, backward, AdamW) of a small
Llama-style model on 2 and 4 ranks (processes, Gloo, CPU): PyTorch's
torch.distributed.tensor.parallel with torchtitan's plan, tensor parallel only ("tp") and
with sequence parallelism ("tp+sp"), and the whole model on one rank for scale ("plain").
The model, plan, sizes and timing mirror `tessera_peer tp` (examples/llama_model.h and
examples/llama_plan.h on Tessera's side).
    python3 bench/peer/dtensor_tp.py [--ranks 4] [--iters 20]
"""
import math

import peer_common as pc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

# The peer Llama (same in tessera_peer.cpp): 2 blocks, dim 128, 8 heads of 16, SwiGLU 384,
# vocabulary 1024, batch 8 x 64 tokens.
VOCAB, DIM, LAYERS, HEADS, FFN, SEQ, BATCH = 1024, 128, 2, 8, 384, 64, 8
HEAD_DIM = DIM // HEADS
EPS, THETA = 1e-5, 10000.0


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight


def apply_rotary(x, cos, sin):
    half = x.size(-1) // 2
    c = cos.view(1, cos.size(0), 1, half)
    s = sin.view(1, sin.size(0), 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x, cos, sin, mask):
        B, S = x.size(0), x.size(1)
        q = self.wq(x).view(B, S, -1, HEAD_DIM)
        k = self.wk(x).view(B, S, -1, HEAD_DIM)
        v = self.wv(x).view(B, S, -1, HEAD_DIM)
        q = apply_rotary(q, cos, sin).transpose(1, 2)
        k = apply_rotary(k, cos, sin).transpose(1, 2)
        v = v.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
        probs = torch.softmax(scores + mask, -1)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous()
        return self.wo(out.view(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x, cos, sin, mask):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        half = HEAD_DIM // 2
        inv_freq = THETA ** (-torch.arange(0, half, dtype=torch.double) * 2.0 / HEAD_DIM)
        angles = torch.outer(torch.arange(0, SEQ, dtype=torch.double), inv_freq)
        self.register_buffer("rope_cos", angles.cos().float())
        self.register_buffer("rope_sin", angles.sin().float())

    def forward(self, tokens):
        S = tokens.size(1)
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        mask = torch.full((S, S), float("-inf")).triu(1)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output(self.norm(h))


def model():
    torch.manual_seed(0)
    return Transformer()


def plan(sp):
    """torchtitan's apply_tp (llama3/parallelize.py), without loss parallel."""
    if not sp:
        p = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
             "output": ColwiseParallel(output_layouts=Replicate())}
    else:
        p = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
             "norm": SequenceParallel(),
             "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
             "layers.*.attention_norm": SequenceParallel(),
             "layers.*.attention": PrepareModuleInput(
                 input_layouts=(Shard(1), None, None, None),
                 desired_input_layouts=(Replicate(), None, None, None)),
             "layers.*.ffn_norm": SequenceParallel(),
             "layers.*.feed_forward": PrepareModuleInput(
                 input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    p.update({"layers.*.attention.wq": ColwiseParallel(),
              "layers.*.attention.wk": ColwiseParallel(),
              "layers.*.attention.wv": ColwiseParallel(),
              "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1) if sp else None),
              "layers.*.feed_forward.w1": ColwiseParallel(),
              "layers.*.feed_forward.w3": ColwiseParallel(),
              "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1) if sp else None)})
    return p


def timed(rank, world, variant, net, tokens, targets, iters):
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(net(tokens).reshape(-1, VOCAB), targets.reshape(-1))
        loss.backward()
        opt.step()

    step()  # optimizer state outside the timing
    counter = pc.ByteCounter()
    with counter, CommDebugMode() as cdm:
        step()
    us = pc.step_us(step, iters, dist.barrier)
    if rank == 0:
        pc.emit("tp", f"Llama step, {world} ranks", variant, us, bytes=counter.bytes,
                calls=cdm.get_total_counts(),
                collectives={str(k): v for k, v in cdm.get_comm_counts().items()})


def worker(rank, world, iters):
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 8, (BATCH, 1), generator=g)
    walk = (start + stride * torch.arange(SEQ + 1).view(1, -1)) % VOCAB
    tokens, targets = walk[:, :SEQ].contiguous(), walk[:, 1:].contiguous()

    timed(rank, world, "plain", model(), tokens, targets, iters)  # the whole model, no comm
    for sp in (False, True):
        net = parallelize_module(model(), mesh["tp"], plan(sp))
        timed(rank, world, "tp+sp" if sp else "tp", net, tokens, targets, iters)


if __name__ == "__main__":
    pc.multi_rank_main(worker)
