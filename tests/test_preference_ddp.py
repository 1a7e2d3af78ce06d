"""The preference loss module under real DDP (2 CPU processes over gloo), LoRA, with non-reentrant gradient
checkpointing: the reference pass (adapter disabled) and the policy pass run inside one DDP forward, so
nothing is "marked ready twice" (TRL's DDP + PEFT failure), and 2 ranks x B pairs give the gradients of 1 x 2B."""

from __future__ import annotations

import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(model_dir: str, checkpointing: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from praisonai_accel.data import ensure_chat_template
    from test_preference_training import _config, _pairs
    from praisonai_accel.methods.preference import PreferenceLoss, PreferenceMethod

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ensure_chat_template(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    method = PreferenceMethod(_config())
    module = PreferenceLoss(model, _config(), chunked=True).train()
    return method, module, _pairs(tokenizer, method, count=4), tokenizer.pad_token_id


def _worker(rank: int, world: int, port: int, model_dir: str, checkpointing: bool, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        method, module, examples, pad = _setup(model_dir, checkpointing)
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        half = examples[rank * 2:(rank + 1) * 2]
        total = len(examples)
        for _ in range(2):  # two steps: a second forward/backward is where "marked ready twice" would appear
            ddp.zero_grad()
            loss_sum, _ = ddp(**method.collate(half, pad))
            (loss_sum * world / total).backward()  # DDP averages over ranks: the mean over all pairs
        grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
        if rank == 0:
            torch.save(grads, out)
    finally:
        dist.destroy_process_group()


def test_two_ranks_of_b_equal_one_of_2b(tiny_model, tmp_path):
    """With gradient checkpointing on the policy (the reference pass runs in eval mode, so without it): one test,
    since spawning two ranks costs most of a minute on a shared 2-core machine."""
    import torch.multiprocessing as mp

    checkpointing = True
    out = str(tmp_path / "grads.pt")
    mp.spawn(_worker, args=(2, _free_port(), str(tiny_model), checkpointing, out), nprocs=2, join=True)
    method, module, examples, pad = _setup(str(tiny_model), checkpointing)
    loss_sum, _ = module(**method.collate(examples, pad))
    (loss_sum / len(examples)).backward()
    ddp_grads = torch.load(out, weights_only=True)
    grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
    assert grads.keys() == ddp_grads.keys() and grads
    for name in grads:
        assert torch.allclose(grads[name], ddp_grads[name], atol=1e-6, rtol=1e-5), name
