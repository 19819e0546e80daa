"""MoE experts on torch_xla, transformers' batched_mm beside xla_shard's grouped matmuls (jax's Megablox kernel,
interpreted on a CPU), in one process.

    moe_experts.py grads DEVICES DIR ...   one forward and backward of each model directory with each: prints
                                           both losses and each parameter's largest gradient difference, relative
                                           to that gradient's largest entry (JSON, a line per directory)
    moe_experts.py modules DEVICES         the same for bare experts modules of both weight layouts
                                           (Qwen3-MoE's [experts, out, in], Aria's [experts, in, out]): output,
                                           and gradients of the tokens, routing weights and expert weights
    moe_experts.py train ARGS ...          `xla-shard train ARGS` with the grouped experts chosen, as on a TPU

With DEVICES > 1 the model runs under SPMD, every parameter split on its first dimension where it divides (as
FSDP lays them out) and the batch split over the devices.
"""

import json
import os
import sys

mode, rest = sys.argv[1], sys.argv[2:]
if mode == "train":
    from xla_shard import experts
    from xla_shard.cli import main

    experts.choose = lambda default, accelerator: experts.XLA_GMM if default is not None else default
    sys.argv = ["xla-shard", "train", *rest]
    sys.exit(main())

devices, directories = int(rest[0]), rest[1:]
os.environ.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from xla_shard import experts  # noqa: E402

experts.register()
mesh = None
if devices > 1:
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(devices), (devices,), ("fsdp",))
    xs.set_global_mesh(mesh)


def step(directory: str, implementation: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", use_cache=False)
    model.config._experts_implementation = implementation
    model.to(torch_xla.device())
    ids = torch.randint(0, model.config.vocab_size, (2 * devices, 32), generator=torch.Generator().manual_seed(0))
    ids = ids.to(torch_xla.device())
    if mesh is not None:
        for p in model.parameters():
            if p.shape[0] % devices == 0:
                xs.mark_sharding(p, mesh, ("fsdp",) + (None,) * (p.dim() - 1))
        xs.mark_sharding(ids, mesh, ("fsdp", None))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch_xla.sync()
    return loss.item(), {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}


def module_step(make, implementation: str) -> dict[str, torch.Tensor]:
    module = make()
    module.config._experts_implementation = implementation
    generator = torch.Generator().manual_seed(1)
    for p in module.parameters():
        p.data = torch.randn(p.shape, generator=generator) * 0.1
    tokens, experts = 8 * devices, module.gate_up_proj.shape[0]
    hidden = torch.randn(tokens, module.config.hidden_size, generator=generator)
    logits = torch.randn(tokens, experts, generator=generator)
    route, index = torch.topk(logits.softmax(-1), 2, dim=-1)
    module.to(torch_xla.device())
    hidden, route, index = (t.to(torch_xla.device()) for t in (hidden, route, index))
    hidden.requires_grad_(), route.requires_grad_()
    if mesh is not None:
        for t in (hidden, route, index):
            xs.mark_sharding(t, mesh, ("fsdp", None))
        for p in module.parameters():
            xs.mark_sharding(p, mesh, ("fsdp", None, None))
    out = module(hidden, index, route)
    (out * out).sum().backward()
    torch_xla.sync()
    return {"out": out.cpu(), "hidden": hidden.grad.cpu(), "route": route.grad.cpu(),
            **{name: p.grad.cpu() for name, p in module.named_parameters()}}


if mode == "modules":
    from transformers import AriaTextConfig, Qwen3MoeConfig
    from transformers.models.aria.modeling_aria import AriaExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    makers = {"Qwen3MoeExperts": lambda: Qwen3MoeExperts(Qwen3MoeConfig(
                  hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
              "AriaExperts": lambda: AriaExperts(AriaTextConfig(
                  hidden_size=64, intermediate_size=32, moe_num_experts=4, moe_topk=2, hidden_act="gelu"))}
    for name, make in makers.items():
        want, got = module_step(make, "batched_mm"), module_step(make, experts.XLA_GMM)
        worst = {key: ((got[key] - w).abs().max() / w.abs().max().clamp_min(1e-12)).item() for key, w in want.items()}
        print(json.dumps({"module": name, "worst": worst}), flush=True)
    sys.exit()

for directory in directories:
    (want, want_grads), (got, got_grads) = step(directory, "batched_mm"), step(directory, experts.XLA_GMM)
    worst = {name: ((got_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
             for name, g in want_grads.items()}
    print(json.dumps({"dir": directory, "losses": [want, got], "grads": sorted(want_grads) == sorted(got_grads),
                      "worst": max(worst.values()), "experts_grads": [n for n in worst if "experts" in n]}),
          flush=True)
