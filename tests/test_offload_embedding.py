"""offload_embedding (models/host_embedding.py), in process:

- moving the model (`.to(device)`; the meta device stands in for a GPU here) leaves the embedding table and its
  buffers in host memory and sends its output where the rest went; a cast (`.to(bfloat16)`) is applied to the table
  on the host; a scaled embedding (Gemma 3's) keeps its scale and gives the plain model's output exactly;
- loaded by the worker's own loader (LoRA, gradient checkpointing, the reward head), the loss and every gradient
  equal those of the same model without it, and the merged state_dict still holds the table;
- DDP (gloo) is told to leave the table alone, and trains;
- a run may resume with it turned on or off (the same run);
- the rules: full fine-tuning, --fsdp (the flag and an accelerate config), a device_map, use_unsloth: true and an
  embedding tied to the LM head are refused in one line before launch (the last read from the model's own
  config.json, its outer config or its text config); a tie no config names is caught as the model loads; with
  use_unsloth: auto, transformers is chosen.
"""

from __future__ import annotations

import socket

import pytest
import torch

from praisonai_accel.checks import Situation, check_run
from praisonai_accel.config import ConfigError, parse_config
from praisonai_accel.models.host_embedding import HostResident, ddp_ignore_host_tensors, keep_on_host

from conftest import cli, write_config


def _llama_classifier():
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=1)
    return tf.LlamaForSequenceClassification(config)


def test_the_table_stays_on_the_host_when_the_model_moves():
    model = _llama_classifier()
    keep_on_host(model)
    model.to("meta")
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, HostResident) and isinstance(embedding, torch.nn.Embedding)
    assert embedding.weight.device.type == "cpu" and embedding.execution_device.type == "meta"
    others = {p.device.type for name, p in model.named_parameters() if "embed_tokens" not in name}
    assert others == {"meta"}
    assert next(model.parameters()).device.type == "meta" and model.device.type == "meta"  # the first is not the table
    assert embedding(torch.tensor([[1, 2]])).device.type == "meta"  # looked up here, sent where the model is


def test_a_scaled_embedding_keeps_its_scale_and_a_cast_happens_on_the_host():
    import transformers as tf

    config = tf.Gemma3TextConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16,
                                 pad_token_id=0)
    torch.manual_seed(0)
    plain = tf.Gemma3ForCausalLM(config).eval()
    torch.manual_seed(0)
    hosted = tf.Gemma3ForCausalLM(config).eval()
    keep_on_host(hosted.model)  # the decoder: Gemma ties its LM head, which the rule refuses for a causal LM
    plain.to(torch.bfloat16), hosted.to(torch.bfloat16)
    embedding = hosted.model.get_input_embeddings()
    assert embedding.weight.dtype == torch.bfloat16 and embedding.weight.device.type == "cpu"
    assert [b.device.type for b in embedding.buffers()] == ["cpu"]  # Gemma's embed_scale
    ids = torch.tensor([[5, 9, 17, 3]])
    assert torch.equal(embedding(ids), plain.model.get_input_embeddings()(ids))


def _worker_model(tiny_model, tmp_path, offload: bool):
    from praisonai_accel.data.vision_processor import ModelInputs
    from praisonai_accel.models.loading import Backend, load_model_and_tokenizer
    from praisonai_accel.runtime.distributed import DistEnv

    config = parse_config({"model_name": str(tiny_model), "method": "reward", "dataset": [{"name": "x.jsonl"}],
                           "output_dir": str(tmp_path / "out"), "lora_target_modules": ["q_proj", "v_proj", "up_proj"],
                           "use_gradient_checkpointing": True, "offload_embedding": offload})
    torch.manual_seed(0)
    model, tokenizer = load_model_and_tokenizer(config, DistEnv(), Backend("transformers"), False, False,
                                                ModelInputs(None))
    return model, tokenizer


def test_through_the_workers_loader_the_loss_and_gradients_are_the_models_own(tiny_model, tmp_path):
    outs = {}
    for offload in (False, True):
        model, tokenizer = _worker_model(tiny_model, tmp_path, offload)
        assert isinstance(model.get_input_embeddings(), HostResident) == offload
        ids = torch.tensor([[5, 9, 17, 3, 8], [7, 7, 2, 0, 0]])
        model.train()
        logits = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        (logits[0] - logits[1]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        learning = [n for n in grads if "lora_B" in n or "score" in n]  # lora_A's are 0 while B starts at 0
        assert learning and all(grads[n].abs().sum() > 0 for n in learning)
        merged = model.merge_and_unload().state_dict()
        outs[offload] = logits.detach(), grads, merged
    assert torch.equal(outs[False][0], outs[True][0])
    assert outs[False][1].keys() == outs[True][1].keys()
    assert all(torch.equal(outs[False][1][n], outs[True][1][n]) for n in outs[False][1])
    assert outs[False][2].keys() == outs[True][2].keys() and "model.embed_tokens.weight" in outs[True][2]
    assert torch.equal(outs[False][2]["model.embed_tokens.weight"], outs[True][2]["model.embed_tokens.weight"])


def test_ddp_leaves_the_table_alone_and_trains(tiny_model, tmp_path, monkeypatch):
    from torch.nn.parallel import DistributedDataParallel

    model, _ = _worker_model(tiny_model, tmp_path, True)
    names = ddp_ignore_host_tensors(model)
    assert names == ["base_model.model.model.embed_tokens.weight"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        assert set(names) <= ddp.parameters_to_ignore
        assert all(getattr(p, "_praisonai_accel_host_resident", False) is False for p in ddp._module_parameters)
        ids = torch.tensor([[5, 9, 17, 3, 8]])
        ddp(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    finally:
        torch.distributed.destroy_process_group()


def _situation(tmp_path, phase="launch", model_config=None, distributed_type=None, **keys):
    config = parse_config({"model_name": "m", "dataset": [{"name": "x.jsonl"}], "output_dir": str(tmp_path / "o"),
                           "offload_embedding": True, **keys})
    return Situation(config, 1, phase, sees_files=False, model_config=model_config, distributed_type=distributed_type)


@pytest.mark.parametrize("keys,distributed_type,says", [
    ({"finetune_type": "full"}, None, "the embedding trains under finetune_type: full"),
    ({}, "FSDP", "FSDP shards the embedding"),
    ({"device_map": "auto"}, None, "device_map places the model itself"),
    ({"use_unsloth": True}, None, "unsloth places the model itself"),
])
def test_what_it_cannot_keep_on_the_host_is_named(tmp_path, keys, distributed_type, says):
    with pytest.raises(ConfigError, match=says):
        check_run(_situation(tmp_path, distributed_type=distributed_type, **keys))
    check_run(_situation(tmp_path, method="reward"))  # the reward head: no LM head to share the table


def test_a_tie_is_found_in_the_outer_config_or_the_model_and_unsloth_is_not_chosen(tmp_path):
    """transformers 5 ties a vision-language model by its outer config, whose text config may say otherwise
    (Mistral 3's: True outside, False inside); a model tied where no config says so is caught as it loads."""
    import transformers as tf

    from praisonai_accel.data.vision_processor import ModelInputs
    from praisonai_accel.models.host_embedding import shares_output_head
    from praisonai_accel.models.loading import choose_backend
    from praisonai_accel.runtime.distributed import DistEnv

    outer = tf.Mistral3Config()
    assert outer.tie_word_embeddings and not outer.get_text_config().tie_word_embeddings
    with pytest.raises(ConfigError, match="ties its input embedding to the LM head"):
        check_run(_situation(tmp_path, model_config=outer))
    small = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    assert shares_output_head(tf.LlamaForCausalLM(tf.LlamaConfig(**small, tie_word_embeddings=True)))
    assert not shares_output_head(tf.LlamaForCausalLM(tf.LlamaConfig(**small, tie_word_embeddings=False)))
    assert not shares_output_head(_llama_classifier())
    backend = choose_backend(_situation(tmp_path).config, DistEnv(), True, ModelInputs(None))
    assert (backend.name, backend.reason) == ("transformers", "offload_embedding")  # unsloth would move it back


def test_a_run_may_resume_with_it_turned_on_or_off(tmp_path):
    """Where the table is kept changes neither the loss nor the gradients: the same run (as chunked_loss)."""
    on, off = _situation(tmp_path).config, _situation(tmp_path, offload_embedding=False).config
    assert on.offload_embedding and not off.offload_embedding
    assert on.run_fingerprint() == off.run_fingerprint() and on.fingerprint() != off.fingerprint()


def test_a_tied_lm_head_is_refused_before_launch_and_fsdp_through_either_flag(tiny_model, tmp_path):
    import transformers as tf

    tied = tmp_path / "tied"
    model = tf.AutoModelForCausalLM.from_pretrained(str(tiny_model), tie_word_embeddings=True)
    model.save_pretrained(tied)
    tf.AutoTokenizer.from_pretrained(str(tiny_model)).save_pretrained(tied)
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    config = write_config(tmp_path, tied, data, offload_embedding=True)
    result = cli("train", str(config), "--cpu", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: offload_embedding: {tied} ties its input embedding to the LM head, which every token's logits need "
        "on the GPU; remove offload_embedding")
    untied = write_config(tmp_path, tiny_model, data, offload_embedding=True)
    assert cli("train", str(untied), "--cpu", "--dry-run").returncode == 0
    fsdp = cli("train", str(untied), "--cpu", "--num-processes", "2", "--fsdp", "--dry-run")
    assert fsdp.returncode == 2 and "offload_embedding: FSDP shards the embedding" in fsdp.stderr
    accelerate_config = tmp_path / "fsdp.yaml"
    accelerate_config.write_text("distributed_type: FSDP\nnum_processes: 2\nnum_machines: 1\nuse_cpu: true\n")
    via_file = cli("train", str(untied), "--accelerate-config", str(accelerate_config), "--dry-run")
    assert via_file.returncode == 2 and "offload_embedding: FSDP shards the embedding" in via_file.stderr
