"""offload_embedding (unsloth's name): under LoRA and QLoRA the input embedding table is frozen, and a step reads only
the rows of its own tokens. The table stays in host memory: the lookup runs on the CPU and only the rows it returns go
to the model's device. A 128k x 4096 table is 1 GB of GPU memory in bf16, 2 GB under QLoRA (peft upcasts it to fp32).

The module keeps its class's forward (a scaled embedding keeps its scale) and stays a registered parameter, so
state_dict, merging and saving see it as before; moving the model (`.to`, `.cuda`, accelerate's placement) leaves it
where it is and records where its output goes. DDP is told to leave it alone (`ddp_ignore_host_tensors`): it is
loaded the same on every rank and never changes.
"""

from __future__ import annotations

from typing import Any

_HOST_CLASSES: dict[type, type] = {}
HOST_ATTRIBUTE = "_praisonai_accel_host_resident"


class HostResident:
    """Mixed into the embedding's own class (`keep_on_host`): its tensors stay on the CPU."""

    execution_device: Any

    def _apply(self, fn, recurse=True):
        """What `fn` does to a tensor like the table where the model runs: its device is where the rest of the model
        is going; a cast (`.to(dtype)`, `.half()`) is applied to the table here, on the CPU."""
        import torch

        probe = torch.empty(0, dtype=self.weight.dtype, device=self.execution_device)
        target = fn(probe)
        self.execution_device = target.device
        if target.dtype != probe.dtype:
            for tensor in (*self.parameters(), *self.buffers()):
                if tensor.is_floating_point():
                    tensor.data = tensor.data.to(target.dtype)
        return self

    def forward(self, input_ids, *args, **kwargs):
        return super().forward(input_ids.to(self.weight.device), *args, **kwargs).to(self.execution_device)


def _host_class(cls: type) -> type:
    if issubclass(cls, HostResident):
        return cls
    if cls not in _HOST_CLASSES:
        _HOST_CLASSES[cls] = type(f"Host{cls.__name__}", (HostResident, cls), {"__module__": __name__})
    return _HOST_CLASSES[cls]


def keep_on_host(model) -> None:
    """Put `model`'s input embedding (and its buffers) in host memory for good; its output goes where the rest of
    the model is, now and after any later move. The model is loaded where it runs, as without the option (N ranks
    loading whole models into host memory first would need N copies there); the table leaves the GPU here."""
    import torch

    embedding = model.get_input_embeddings()
    own = {id(t) for t in embedding.parameters()}
    elsewhere = next((p.device for p in model.parameters() if id(p) not in own), torch.device("cpu"))
    for tensor in (*embedding.parameters(recurse=False), *embedding.buffers(recurse=False)):
        tensor.data = tensor.data.to("cpu")
    embedding.__class__ = _host_class(type(embedding))
    embedding.execution_device = elsewhere
    for name, module in list(model.named_modules()):  # last among its siblings: model.device and the code that asks
        if module is embedding and name:             # the first parameter where the model runs then get a GPU's
            parent, _, child = name.rpartition(".")
            children = model.get_submodule(parent)._modules
            children[child] = children.pop(child)
    for tensor in (*embedding.parameters(), *embedding.buffers()):
        setattr(tensor, HOST_ATTRIBUTE, True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the table's device copy: the model was loaded where it runs


def tied_message(model_name: str) -> str:
    return (f"offload_embedding: {model_name} ties its input embedding to the LM head, which every token's logits "
            "need on the GPU; remove offload_embedding")


def shares_output_head(model) -> bool:
    """The LM head holds the input embedding's table itself (tied): a move of the head would take it along."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    table = model.get_input_embeddings().weight
    return head is not None and any(p is table for p in head.parameters())


def ddp_ignore_host_tensors(module) -> list[str]:
    """Name `module`'s host-resident tensors to DDP, which would otherwise refuse parameters on two device types and
    broadcast them at start; returns the names."""
    names = [name for name, t in (*module.named_parameters(), *module.named_buffers()) if getattr(t, HOST_ATTRIBUTE,
                                                                                                     False)]
    if names:
        module._ddp_params_and_buffers_to_ignore = sorted(
            set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | set(names))
    return names
