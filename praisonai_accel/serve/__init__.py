"""praisonai-accel serve: a trained model behind an OpenAI-compatible endpoint, on a well-kept engine (transformers
serve, llama.cpp's server, vLLM) that this package launches and supervises, never reimplements: `target.py` what the
TARGET is and which engine serves it, `model_view.py` the adapter merge cache and the directory an engine loads,
`engines.py` each engine's command line, `supervise.py` the engine's process group, its health and its stop."""
