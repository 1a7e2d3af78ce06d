"""A served endpoint as lm-eval's model: `local-chat-completions` (the server applies the run's chat template) or
`local-completions` (plain prompts), with the `model_args` lm-eval parses from `key=value,...`."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass
class EndpointModel:
    model: str  # lm-eval's registered model: local-chat-completions | local-completions
    model_args: dict
    apply_chat_template: bool  # local-chat-completions sends messages: lm-eval must build them

    def model_args_string(self) -> str:
        """`--model_args` as lm-eval's simple_parse_args_string reads it back (a value holding ',' or '=' cannot)."""
        for key, value in self.model_args.items():
            if any(c in str(value) for c in ",="):
                raise ConfigError(f"lm-eval model_args: {key}={value} holds ',' or '=', which --model_args cannot carry; "
                                 "pass model_args as a dict (lm_eval.simple_evaluate) instead")
        return ",".join(f"{key}={value}" for key, value in self.model_args.items())


def endpoint_model(base_url: str, name: str, chat: bool = True, tokenizer: str | None = None,
                   num_concurrent: int = 1, max_retries: int = 3, max_gen_toks: int | None = None) -> EndpointModel:
    """lm-eval's model for the `/v1` base URL serve printed and the model name it serves. Chat sends each task's
    prompt as messages the engine renders with the run's template; completions send the text as it is, tokenized by
    lm-eval only where `tokenizer` (a model directory or Hub id) is given, for tasks that count tokens."""
    base_url = base_url.rstrip("/")
    if not base_url.endswith("/v1"):
        raise ConfigError(f"endpoint {base_url}: give the /v1 base URL serve printed (http://HOST:PORT/v1)")
    args = {"model": name, "base_url": f"{base_url}/{'chat/completions' if chat else 'completions'}",
            "num_concurrent": num_concurrent, "max_retries": max_retries, "tokenized_requests": False}
    if max_gen_toks is not None:
        args["max_gen_toks"] = max_gen_toks
    if not chat:
        args.update({"tokenizer_backend": "huggingface", "tokenizer": tokenizer} if tokenizer
                    else {"tokenizer_backend": None})
    return EndpointModel("local-chat-completions" if chat else "local-completions", args, apply_chat_template=chat)
